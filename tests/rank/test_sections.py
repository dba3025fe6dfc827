"""Sections (``shmstat.section``) and the phase word they write: each section's durations in a Stat of group
``section`` (in-process and in a job's real segment), threads, nesting, the decorator, the wait flag in the
descriptor, the window setting, the name rule, CUDA refused without CUDA; the phase word of a rank, of a forked
worker, of a rank SIGKILLed inside a section (and at random points of its writes: never torn), the same on the C
and pure-Python paths."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from kit.procs import REPO
from kit.support import wait_for

import shmstat
from shmstat import _backend
from shmstat.errors import ConfigError
from shmstat.job._state import STATE, rebind_sections
from shmstat.shm import layout as L
from shmstat.shm.phase import read_phase
from shmstat.shm.segment import Segment


def _counts(seg: Segment, local_ranks: list[int]) -> dict[str, tuple[int, float, int, int]]:
    """``{section name: (samples, sum, flags, window_ms)}`` of the ``section`` stats the given entries hold
    (every bank: the tests' windows are long, so all samples are in the ring)."""
    out: dict[str, tuple[int, float, int, int]] = {}
    for lr in local_ranks:
        for desc in seg.descriptors(lr):
            if desc.group != "section":
                continue
            n, total = 0, 0.0
            for b in range(seg.geometry.banks):
                snap = seg.read_bank(lr, desc.index, b)
                n += snap.count
                total += snap.sum
            old = out.get(desc.name, (0, 0.0, desc.flags, desc.window_ms))
            out[desc.name] = (old[0] + n, old[1] + total, desc.flags, desc.window_ms)
    return out


def _segment() -> Segment:
    att = STATE.attachment
    assert att is not None
    return att.segment


def test_a_section_logs_its_durations_in_ms_in_process_as_a_stat_of_group_section():
    assert shmstat.init(section_window_s=0.05) is None  # no job: in-process, as torch.monitor
    seen: list[dict] = []
    shmstat.register_event_handler(lambda e: seen.append(dict(e.data)))
    load = shmstat.section("load")
    for _ in range(3):
        with load:
            time.sleep(0.01)
    time.sleep(0.06)  # the window ended: the next enter/exit logs it (torch.monitor's lazy closing)
    with load:
        pass
    windows = [d for d in seen if "load.count" in d]  # the three may straddle a window's end: one or two windows
    assert {frozenset(d) for d in windows} == {
        frozenset({"load.count", "load.sum", "load.mean", "load.max", "load.p50", "load.p99"})}
    assert sum(d["load.count"] for d in windows) == 3 and sum(d["load.sum"] for d in windows) >= 30.0  # ms
    assert min(d["load.max"] for d in windows) >= 10.0


def test_threads_nesting_and_the_decorator_reconcile_in_a_job_and_a_wait_section_is_flagged(job):
    shmstat.init(job, rank=0, world_size=1, publish=False, section_window_s=60)
    outer = shmstat.section("step")

    @shmstat.section("collective", wait=True)
    def collective() -> None:
        with shmstat.section("inner"):
            pass

    def worker() -> None:
        for _ in range(300):
            with outer:
                collective()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = _counts(_segment(), [0])
    assert {name: c[0] for name, c in counts.items()} == {"step": 1200, "collective": 1200, "inner": 1200}
    assert counts["collective"][2] & L.FLAG_WAIT and not counts["step"][2] & L.FLAG_WAIT
    assert {c[3] for c in counts.values()} == {60_000}
    phase = read_phase(_segment(), 0)
    assert phase is not None and phase.section is None and phase.depth == 0  # every section left


@shmstat.section("module_level")
def _module_level(x: int, y: int = 1) -> int:
    """Adds."""
    return x + y


def test_a_decorated_generator_times_each_item_and_a_coroutine_its_awaits(job):
    """A decorated generator function (a data loader's) gives a sample per item it yields, each inside the
    section, its end none; values sent and exceptions thrown in reach it. A decorated ``async def`` is timed from
    its start to its result, across its awaits, while other coroutines of the thread enter and leave theirs."""
    import asyncio

    shmstat.init(job, rank=0, world_size=1, publish=False, section_window_s=60)
    seg = _segment()

    @shmstat.section("batches")
    def batches(n: int):
        for i in range(n):
            assert (read_phase(seg, 0).section, read_phase(seg, 0).depth) == ("batches", 2)
            time.sleep(0.002)
            got = yield i
            if got is not None:
                yield ("got", got)
        return "done"

    with shmstat.section("epoch"):
        assert list(batches(3)) == [0, 1, 2]
        assert read_phase(seg, 0).section == "epoch"  # between items: not in the section
        gen = batches(2)
        assert next(gen) == 0 and gen.send("x") == ("got", "x")
        with pytest.raises(KeyError):
            gen.throw(KeyError("in"))
        gen = batches(5)
        next(gen)
        gen.close()
    assert _counts(seg, [0])["batches"][:1] == (3 + 2 + 1 + 1,)  # items yielded (and the step that raised)
    assert _counts(seg, [0])["batches"][1] >= 5 * 2  # five steps slept 2 ms inside the section (not the send, throw)

    @shmstat.section("fetch")
    async def fetch(delay: float) -> float:
        await asyncio.sleep(delay)
        return delay

    async def both() -> list[float]:
        return list(await asyncio.gather(fetch(0.05), fetch(0.02)))

    assert asyncio.run(both()) == [0.05, 0.02]
    n, total, *_ = _counts(seg, [0])["fetch"]
    assert n == 2 and total >= 70, total  # the awaits inside: 50 + 20 ms at least
    assert read_phase(seg, 0).depth == 0


def test_a_decorated_function_keeps_its_name_binds_as_a_method_and_counts_a_call_that_raises(job):
    """On this process's path (the C wrapper where the extension is built): what ``functools.wraps`` gives a
    function, method binding (plain, static, class), a sample per call (one that raises too, the exception
    going through unchanged) and the phase word back to the enclosing section after each."""
    shmstat.init(job, rank=0, world_size=1, publish=False, section_window_s=60)
    seg = _segment()

    class Model:
        scale = 10

        @shmstat.section("forward")
        def forward(self, x: int, *, bias: int = 0) -> int:
            """The forward pass."""
            assert (read_phase(seg, 0).section, read_phase(seg, 0).depth) == ("forward", 2)
            return x * self.scale + bias

        @staticmethod
        @shmstat.section("forward")
        def plain(x: int) -> int:
            return x

        @classmethod
        @shmstat.section("forward")
        def scaled(cls, x: int) -> int:
            return x * cls.scale

    @shmstat.section("fail")
    def fail(exc: BaseException) -> None:
        raise exc

    model = Model()
    with shmstat.section("step"):
        assert model.forward(2, bias=1) == 21 and Model.forward(model, 3) == 30
        assert Model.plain(4) == 4 and model.scaled(5) == 50
        bound = model.forward
        assert bound(1) == 10 and bound.__self__ is model
        for exc in (ValueError("boom"), KeyboardInterrupt()):
            with pytest.raises(type(exc)) as caught:
                fail(exc)
            assert caught.value is exc and read_phase(seg, 0).section == "step"
        assert _module_level(2) == 3 and _module_level(2, y=5) == 7
    assert (Model.forward.__name__, Model.forward.__qualname__, Model.forward.__doc__) == (
        "forward", Model.forward.__wrapped__.__qualname__, "The forward pass.")
    assert Model.forward.__module__ == __name__ and "bias" in str(inspect.signature(Model.forward))
    assert pickle.loads(pickle.dumps(_module_level)) is _module_level  # by reference, as a function
    assert "module_level" in repr(_module_level)
    counts = _counts(seg, [0])
    assert {name: c[0] for name, c in counts.items()} == {"step": 1, "forward": 5, "fail": 2, "module_level": 2}
    assert read_phase(seg, 0).section is None


class _Stop(BaseException):
    """Not an Exception: a handler raising it is not caught (as KeyboardInterrupt is not), so the exit raises."""


def test_an_error_the_exit_raises_is_chained_to_the_function_s_as_after_a_with():
    """A window that ends at a call's exit is logged there; a handler that raises a BaseException makes the exit
    raise: after a call that raised, the exit's error carries the function's as its context, as a ``with`` does."""
    shmstat.init(section_window_s=0.001)  # no job: in-process, windows logged to the handlers
    handled = []

    def stop(event: shmstat.Event) -> None:
        handled.append(sys.exc_info()[1])  # what the exit runs under
        raise _Stop(sorted(event.data))

    handle = shmstat.register_event_handler(stop)

    def boom() -> None:
        raise ValueError("in the function")

    try:
        for form in ("decorated", "with"):
            sec = shmstat.section(f"chained_{form}")
            call = sec(boom) if form == "decorated" else None
            with sec:
                pass  # the first sample opens a window
            time.sleep(0.005)  # ... which ends before the next exit
            with pytest.raises(_Stop) as caught:
                if call is not None:
                    call()
                else:
                    with sec:
                        boom()
            context = caught.value.__context__
            assert isinstance(context, ValueError) and str(context) == "in the function", form
            assert handled.pop() is context, form
            assert caught.value.args[0][0] == f"chained_{form}.count"
    finally:
        shmstat.unregister_event_handler(handle)


def test_the_section_window_comes_from_the_environment_and_init_overrides_it(job, monkeypatch):
    monkeypatch.setenv("SHMSTAT_SECTION_WINDOW_S", "0.25")
    shmstat.init(job, rank=0, world_size=1, publish=False)
    with shmstat.section("a"):
        pass
    assert _counts(_segment(), [0])["a"][3] == 250
    shmstat.init(job, rank=0, world_size=1, publish=False, section_window_s=2)
    with shmstat.section("b"):
        pass
    assert _counts(_segment(), [0])["b"][3] == 2000
    monkeypatch.setenv("SHMSTAT_SECTION_WINDOW_S", "soon")
    STATE.section_window_s = None
    rebind_sections()
    with pytest.raises(ConfigError, match="SHMSTAT_SECTION_WINDOW_S"), shmstat.section("c"):
        pass
    with pytest.raises(ConfigError, match="section_window_s"):
        shmstat.init(section_window_s=0)


@pytest.mark.parametrize("name", ["", "a\nb", "x" * 81])
def test_a_section_name_follows_the_name_rule(name):
    with pytest.raises(ConfigError, match="section name"):
        shmstat.section(name)


def test_cuda_sections_are_refused_in_one_sentence_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (tests/rank/test_sections_gpu.py times it)")
    with pytest.raises(ConfigError, match="asks for cuda=True but CUDA is not available"):
        shmstat.section("fwd", cuda=True)


def test_the_phase_word_follows_the_innermost_section_and_counts_steps(job):
    shmstat.init(job, rank=0, world_size=1, publish=False)
    seg = _segment()
    before = time.time_ns()
    with shmstat.section("step"):
        with shmstat.section("allreduce", wait=True):
            inner = read_phase(seg, 0)
        outer = read_phase(seg, 0)
        shmstat.advance_step()
        stepped = read_phase(seg, 0)
    left = read_phase(seg, 0)
    assert inner is not None and (inner.section, inner.wait, inner.depth, inner.step) == ("allreduce", True, 2, 0)
    assert outer is not None and (outer.section, outer.wait, outer.depth) == ("step", False, 1)
    assert before <= outer.since_ns <= inner.since_ns <= time.time_ns() + 10**9  # wall clock (monotonic + offset)
    assert stepped is not None and (stepped.section, stepped.step, stepped.since_ns) == ("step", 1, outer.since_ns)
    assert left is not None and (left.section, left.depth, left.step) == (None, 0, 1)


_RANK = """
import os, sys, time, json
import shmstat
job, mode = sys.argv[1], sys.argv[2]
shmstat.init(job, rank=1, local_rank=1, world_size=2, publish=False, section_window_s=60)
names = ["data", "forward", "backward"]
if mode == "stuck":
    with shmstat.section("step"):
        with shmstat.section("data"):
            print("inside", flush=True)
            time.sleep(600)
elif mode == "churn":
    from shmstat.writer import sections
    secs = [shmstat.section(n) for n in names]
    with secs[0]:
        c_path = sections._fast is not None and sections.section.__enter__ is sections._fast.SectionCore.__enter__
        print("inside", "c" if c_path else "python", flush=True)
    while True:  # a step counted at each depth: the time (and a kill's moment) shared by the three sections
        with secs[0]:
            shmstat.advance_step()
            with secs[1]:
                shmstat.advance_step()
                with secs[2]:
                    shmstat.advance_step()
elif mode == "worker":
    with shmstat.section("step"):
        pid = os.fork()
        if pid == 0:
            with shmstat.section("load"):
                print("child", os.getpid(), flush=True)
                time.sleep(600)
        time.sleep(600)
elif mode == "trace":
    from shmstat.job._state import STATE
    from shmstat.shm.layout_codec import read_phase_seq, read_phase_word
    from shmstat.shm.phase import read_phase
    from shmstat.writer import sections
    seg = STATE.attachment.segment
    out, raw = [], []
    def snap():
        p = read_phase(seg, 1)
        out.append([p.section, p.wait, p.depth, p.step])
        raw.append([read_phase_seq(seg.buf, seg.geometry, 1), *read_phase_word(seg.buf, seg.geometry, 1)])
    for _ in range(3):
        with shmstat.section("data"):
            snap()
        with shmstat.section("step"):
            with shmstat.section("allreduce", wait=True):
                snap()
            snap()
            shmstat.advance_step()
            snap()
        snap()
    @shmstat.section("load")
    def load(n, *, twice=False):
        snap()
        return n * (2 if twice else 1)
    class Model:
        @shmstat.section("forward")
        def forward(self, x):
            snap()
            return x + 1
    @shmstat.section("fail")
    def fail():
        snap()
        raise ValueError("in the section")
    @shmstat.section("produce")
    def produce():
        snap()  # runs at the first next(), inside the section (the call that made the generator is not timed)
        yield 1
    decorated = []
    with shmstat.section("step"):
        decorated.append(load(3, twice=True))
        decorated.append(Model().forward(4))
        try:
            fail()
        except ValueError as exc:
            decorated.append(str(exc))
        snap()
        gen = produce()
        snap()
        decorated.append(next(gen))
    snap()
    c_path = sections._fast is not None and sections.section.__enter__ is sections._fast.SectionCore.__enter__
    print(json.dumps({"phases": out, "raw": raw, "c_path": c_path, "decorated": decorated,
                      "wrapper": type(load).__name__}), flush=True)
elif mode == "ddp_trace":
    import tempfile
    import torch
    import torch.distributed as dist
    import shmstat.torch
    from shmstat.job._state import STATE
    from shmstat.shm.layout_codec import read_phase_seq, read_phase_word
    from shmstat.shm.phase import read_phase
    from shmstat.writer import sections
    seg = STATE.attachment.segment
    out, raw = [], []
    def snap(where):
        p = read_phase(seg, 1)
        out.append([where, p.section, p.wait, p.depth, p.step])
        raw.append([read_phase_seq(seg.buf, seg.geometry, 1), *read_phase_word(seg.buf, seg.geometry, 1)])
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
        def forward(self, x):
            snap("forward")
            return self.layer(x)
    def batches():
        for i in range(3):
            snap("data")
            yield torch.ones(2, 4) * i
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    net = Net()
    net.layer.weight.register_hook(lambda g: snap("grad"))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = shmstat.torch.instrument(model, optimizer=opt, loader=batches())
    opt.register_step_pre_hook(lambda *a: snap("optimizer"))
    for x in handle.loader:
        loss = model(x).sum()
        snap("loss")
        opt.zero_grad()
        loss.backward()
        snap("backward done")
        opt.step()
        snap("stepped")
    handle.remove()
    dist.destroy_process_group()
    c_path = sections._fast is not None and sections.section.__enter__ is sections._fast.SectionCore.__enter__
    print(json.dumps({"phases": out, "raw": raw, "c_path": c_path}), flush=True)
"""


def _start(job: str, mode: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _RANK, job, mode], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=env)


def test_a_rank_sigkilled_inside_a_section_leaves_a_readable_phase_naming_it(job):
    shmstat.init(job, rank=0, world_size=2, publish=False)  # the segment, as this node's rank 0
    seg = _segment()
    proc = _start(job, "stuck")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "inside"
        alive = read_phase(seg, 1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        dead = read_phase(seg, 1)
    finally:
        proc.kill()
        proc.wait()
    assert alive is not None and (alive.section, alive.depth) == ("data", 2)
    assert dead == alive


KILLS = 30


def test_a_rank_sigkilled_at_random_points_of_its_phase_writes_never_leaves_a_torn_word(job, backend):
    """On each path: a rank churning through nested sections (a phase write every few microseconds) is SIGKILLed
    at :data:`KILLS` random moments; each time the word it leaves reads at once, and its section and depth agree."""
    shmstat.init(job, rank=0, world_size=2, publish=False)
    seg = _segment()
    depth_of = {None: 0, "data": 1, "forward": 2, "backward": 3}
    moments = random.Random(KILLS)
    seen = set()
    for _ in range(KILLS):
        proc = _start(job, "churn")
        try:
            assert proc.stdout is not None and proc.stdout.readline().split() == ["inside", backend]
            time.sleep(moments.uniform(0, 0.02))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
            proc.wait()
        phase = read_phase(seg, 1, retries=1)  # nobody writes it any more: the first read is whole
        assert phase is not None and phase.section in depth_of and phase.depth == depth_of[phase.section], phase
        assert abs(phase.since_ns - time.time_ns()) < 60 * 10**9 and phase.step >= 0
        seen.add(phase.section)
    assert len(seen) >= 2, seen  # the kills fell at different moments of the churn


def test_a_forked_worker_writes_its_phase_in_its_own_entry_and_its_samples_for_its_rank(job):
    shmstat.init(job, rank=0, world_size=2, publish=False)
    seg = _segment()
    proc = _start(job, "worker")
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline().split()[1])
        entries = {info.pid: info for info in seg.ranks()}
        assert entries[child].writer_of == 2  # a writer of local rank 1
        worker = read_phase(seg, entries[child].local_rank)
        rank = wait_for(lambda: read_phase(seg, 1), 10, what="the rank's phase")
    finally:
        proc.kill()
        proc.wait()
        os.kill(child, signal.SIGKILL)
    assert worker is not None and (worker.section, worker.depth) == ("load", 2)  # its stack came with the fork
    assert (rank.section, rank.depth) == ("step", 1)


def _same_instants(raw: list[list[int]]) -> list[int]:
    """Each snapshot's since_ns as the index of the first snapshot with the same since_ns: which writes kept the
    instant of an earlier one (a parent section's enter) is part of the bytes; the instants themselves are not."""
    first: dict[int, int] = {}
    return [first.setdefault(since, i) for i, (_, _, since, _) in enumerate(raw)]


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_the_c_and_pure_python_paths_write_the_same_phase_words(job):
    shmstat.init(job, rank=0, world_size=2, publish=False)
    seg = _segment()
    traces, samples, before = [], [], _counts(seg, [1])
    for pure in ("0", "1"):
        env = dict(os.environ, SHMSTAT_PURE_PYTHON=pure)
        proc = _start(job, "trace", env)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        traces.append(json.loads(out))
        after = _counts(seg, [1])  # the second process of the entry goes on in the first's slots: the difference
        samples.append({name: n - before.get(name, (0,))[0] for name, (n, *_) in after.items()})
        before = after
    c, py = traces
    assert (c["c_path"], py["c_path"]) == (True, False)  # each ran its own path
    assert (c["wrapper"], py["wrapper"]) == ("SectionFunction", "function")  # the decorator's too
    assert c["phases"] == py["phases"]
    assert c["phases"][:5] == [["data", False, 1, 0], ["allreduce", True, 2, 0], ["step", False, 1, 0],
                               ["step", False, 1, 1], [None, False, 0, 1]]
    assert c["phases"][15:] == [["load", False, 2, 3], ["forward", False, 2, 3], ["fail", False, 2, 3],
                                ["step", False, 1, 3], ["step", False, 1, 3], ["produce", False, 2, 3],
                                [None, False, 0, 3]]  # a decorated generator function times its generator's steps
    assert c["decorated"] == py["decorated"] == [6, 5, "in the section", 1]
    assert samples[0] == samples[1] == {"data": 3, "step": 4, "allreduce": 3, "load": 1, "forward": 1, "fail": 1,
                                        "produce": 1}
    # the same words, steps and sequence numbers, byte for byte (the second rank process of one entry goes on from
    # the sequence the first left: the same number of writes, so a constant difference)
    assert [r[1] for r in c["raw"]] == [r[1] for r in py["raw"]]
    assert [r[3] for r in c["raw"]] == [r[3] for r in py["raw"]]
    assert len({p[0] - q[0] for p, q in zip(py["raw"], c["raw"], strict=True)}) == 1
    assert _same_instants(c["raw"]) == _same_instants(py["raw"])


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_an_instrumented_ddp_loop_writes_the_same_phase_words_on_the_c_and_pure_python_paths(job):
    """The same program on both paths: a DDP model (gloo, one rank) under ``shmstat.torch.instrument``, its words
    read at each point of its steps (the all-reduce's section is left in gloo's callback: another thread)."""
    pytest.importorskip("torch")
    shmstat.init(job, rank=0, world_size=2, publish=False)
    traces = []
    for pure in ("0", "1"):
        proc = _start(job, "ddp_trace", dict(os.environ, SHMSTAT_PURE_PYTHON=pure))
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        traces.append(json.loads(out.splitlines()[-1]))
    c, py = traces
    assert (c["c_path"], py["c_path"]) == (True, False)
    assert c["phases"] == py["phases"]
    assert c["phases"][:7] == [["data", "data", False, 1, 0], ["forward", "forward", False, 1, 0],
                               ["loss", None, False, 0, 0], ["grad", "backward", False, 1, 0],
                               ["backward done", None, False, 0, 0], ["optimizer", "optimizer", False, 1, 0],
                               ["stepped", None, False, 0, 1]]
    assert [r[1] for r in c["raw"]] == [r[1] for r in py["raw"]]
    assert [r[3] for r in c["raw"]] == [r[3] for r in py["raw"]]
    # the writes between two looks (the all-reduce's enter and exit among them): as many on both paths
    assert len({p[0] - q[0] for p, q in zip(py["raw"], c["raw"], strict=True)}) == 1
    assert _same_instants(c["raw"]) == _same_instants(py["raw"])


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_the_c_phase_writer_writes_the_bytes_of_the_python_one(job):
    from shmstat._fastpath import PhaseWriter as CPhaseWriter

    from shmstat.shm.layout_codec import read_phase_seq, read_phase_word
    from shmstat.shm.phase import PhaseWriter

    shmstat.init(job, rank=0, world_size=3, publish=False)
    seg = _segment()
    for lr in (1, 2):  # two entries of the segment, as two rank processes would hold them
        seg.buf[seg.geometry.rank_offset(lr) + L.R_STATE : seg.geometry.rank_offset(lr) + L.R_STATE + 8] = \
            int(L.RankState.ACTIVE).to_bytes(8, "little")
    py, c = PhaseWriter(seg, 1), CPhaseWriter(seg.buf, seg.geometry.rank_offset(2))
    base = time.monotonic_ns()
    calls = [("enter", 3, 1, base), ("enter", 7, 2, base + 5), ("step",), ("enter", 3, 1, base),
             ("enter", 0, 0, base + 9), ("step",), ("step",), ("enter", 2**32 - 1, 2**32 - 1, base + 11)]
    seqs, offsets = [], set()
    for call in calls:
        for writer in (py, c):
            getattr(writer, call[0])(*call[1:])
        py_word, c_word = (read_phase_word(seg.buf, seg.geometry, lr) for lr in (1, 2))
        assert py_word is not None and c_word is not None
        assert (py_word[0], py_word[2]) == (c_word[0], c_word[2])  # word and step
        offsets.add(c_word[1] - py_word[1])  # since: mono_ns + each writer's one reading of the wall clock's offset
        seqs.append((read_phase_seq(seg.buf, seg.geometry, 1), read_phase_seq(seg.buf, seg.geometry, 2)))
    assert len(offsets) == 1 and abs(offsets.pop()) < 10**9
    assert seqs == [(s, s) for s in range(4, 4 + 2 * len(calls), 2)]  # 2: each writer's first "outside" word
    copies = []
    for lr in (1, 2):  # both copies of each entry, byte for byte apart from since_ns
        off = seg.geometry.rank_offset(lr) + L.R_PHASE
        raw = bytes(seg.buf[off : off + 2 * L.PHASE_COPY_SIZE])
        copies.append((raw[:8], raw[16:32], raw[40:48]))
    assert copies[0] == copies[1]


def test_sections_cost_little_enough_to_time_every_step():
    """Not a benchmark (scripts/bench.py --only calls is): a guard that enter+exit stays in microseconds."""
    s = shmstat.section("guard")
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        with s:
            pass
    assert (time.perf_counter() - t0) / n < 200e-6


_NEW_THREAD_STATES = """
import ctypes
import shmstat
from shmstat._fastpath import thread_stack
api = ctypes.pythonapi
api.PyInterpreterState_Get.restype = ctypes.c_void_p
api.PyThreadState_New.restype, api.PyThreadState_New.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
api.PyThreadState_Swap.restype, api.PyThreadState_Swap.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
api.PyThreadState_Clear.argtypes = api.PyThreadState_Delete.argtypes = [ctypes.c_void_p]
interp, sec, stale = api.PyInterpreterState_Get(), shmstat.section("callback"), 0
for i in range(300):
    state = api.PyThreadState_New(interp)  # what PyGILState_Ensure makes for a C thread's callback
    old = api.PyThreadState_Swap(state)
    stale += len(thread_stack()) != 0  # a new thread state's stack is empty
    with sec:
        pass
    sec.__enter__()  # left open when the thread state goes, as a callback that raised
    api.PyThreadState_Swap(old)
    api.PyThreadState_Clear(state)
    api.PyThreadState_Delete(state)
print("stale", stale)
"""


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_a_new_thread_state_on_the_same_os_thread_gets_its_own_section_stack():
    """gloo's and NCCL's callback threads get a new thread state per callback (DDP's all-reduce section is left
    there): the C path remembered this thread's stack by its dict's address, which a new dict may take, and handed
    the freed stack back (a segmentation fault here before)."""
    proc = subprocess.run([sys.executable, "-c", _NEW_THREAD_STATES], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert (proc.returncode, proc.stdout.split()) == (0, ["stale", "0"]), proc.stderr[-2000:]
