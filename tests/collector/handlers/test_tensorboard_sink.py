"""The collector's ``tensorboard:DIR`` handler, read back with TensorBoard's own EventAccumulator, and handler
SPECs with arguments (``pkg.module:Class,key=value``): built with typed values, or refused in one sentence."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import stat
import subprocess
import sys
from collections import defaultdict

import pytest
from kit.procs import REPO, load_counts, rank_worker, read_jsonl, spawn, start_collector
from kit.support import small_tmpfs, wait_for

from collector.handlers.specs import build_handler
from elastic.metrics import MetricData, StatMetricData
from shmstat.errors import ConfigError

WINDOW_MS = 50
needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="the tensorboard package is not installed (pip install 'shmstat[tensorboard]'; the test extra has it)",
)


def _read_scalars(logdir: str) -> dict[str, list[tuple[int, float, float]]]:
    """``{tag: [(step, wall_time, value), ...]}`` of every scalar in ``logdir``, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(logdir, size_guidance={TENSORS: 0})  # 0: keep every point, no sampling
    acc.Reload()
    return {tag: [(e.step, e.wall_time, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()[TENSORS]}


def _by_step(points: list[tuple[int, float, float]]) -> dict[int, float]:
    steps = [p[0] for p in points]
    assert len(steps) == len(set(steps)), "a window written twice"
    return {step: value for step, _, value in points}


def _created_ns(job: str) -> int:
    """When the job's segment was created (its header), read while the segment exists."""
    from shmstat.shm import layout_codec
    from shmstat.shm.runtime import segment_name

    with open("/dev/shm" + segment_name(job), "rb") as f:
        return layout_codec.read_header(memoryview(f.read(4096))).created_ns


@needs_tensorboard
def test_two_ranks_reconcile_exactly_in_tensorboard_with_steps_since_the_job_start_across_a_restart(job, tmp_path):
    logdir = tmp_path / "tb"
    args = ("--handler", f"train=tensorboard:{logdir}", "--grace-ms", "10", "--status-interval", "0")
    coll = start_collector(job, *args, "--banks", "64")  # it makes the segment: the job starts now
    procs = [spawn(rank_worker, job, r, 2, 1.2, WINDOW_MS, str(tmp_path / f"r{r}.json")) for r in range(2)]
    origin_file = logdir / job / "shmstat-origin.json"
    wait_for(origin_file.exists, 20, what="the first pass written")
    created_ns = _created_ns(job)
    assert coll.stop() == 0  # the ranks go on: a second collector takes the job over, writing the same DIR
    coll = start_collector(job, *args)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert coll.stop() == 0
    assert stat.S_IMODE(os.stat(logdir).st_mode) == 0o700
    assert json.loads(origin_file.read_text()) == {"job": job, "origin_ns": created_ns}
    assert len([n for n in os.listdir(logdir / job) if n.startswith("events.out.tfevents.")]) == 2
    scalars = _read_scalars(str(logdir / job))  # one directory per job
    tallies = {r: load_counts(str(tmp_path / f"r{r}.json")) for r in range(2)}
    window_s, window_ns = WINDOW_MS / 1000, WINDOW_MS * 1_000_000
    first = created_ns // window_ns  # the window holding the job's start is step 0, whichever collector wrote
    want_merged: dict[int, int] = defaultdict(int)
    for rank, tally in tallies.items():
        want = {round(start / window_s) - first: n for start, n in tally.items()}
        got = _by_step(scalars[f"rank{rank}/train/steps.count"])  # a step written twice fails here
        assert {s: v for s, v in got.items() if v} == want, f"rank {rank}: a window missing, extra or miscounted"
        sums = _by_step(scalars[f"rank{rank}/train/steps.sum"])
        assert all(sums[s] == (rank + 1) * n for s, n in want.items())
        for s, n in want.items():
            want_merged[s] += n
    merged = scalars["train/steps.count"]
    assert {s: v for s, v in _by_step(merged).items() if v} == want_merged
    assert sum(v for _, _, v in merged) == sum(sum(t.values()) for t in tallies.values())
    assert len(want_merged) >= 10  # several windows
    for tag, points in scalars.items():
        assert tag.startswith(("train/", "rank0/train/", "rank1/train/")), tag
        steps = [step for step, _, _ in points]
        assert steps == sorted(steps) and steps[0] >= 0, (tag, steps[:3])  # time in the job, never back
        # wall time = the window's end, exactly as the collector computes it
        assert all(wall == (first + step + 1) * window_ns / 1e9 for step, wall, _ in points), tag


@needs_tensorboard
def test_rows_without_window_nonfinite_values_and_jobs(tmp_path):
    handler = build_handler(f"tensorboard:{tmp_path / 'tb'}")

    def window_row(value, rank=None, job="a", index=7):
        return StatMetricData(0.0, "g", "lat.max", value, rank=rank, window_start=index * 0.25,
                              window_end=(index + 1) * 0.25, job=job)

    handler.emit(window_row(1.5))
    handler.emit(window_row(2.5, rank=3))
    handler.emit(window_row(4.0, job="b", index=8))
    for bad in (math.nan, math.inf, -math.inf, 1e300):
        handler.emit(window_row(bad))
    handler.emit(window_row("fast"))
    for i in range(3):  # put metrics: no window, counted steps, their own time
        handler.emit(StatMetricData(100.0 + i, "g", "loss", float(i), rank=1, window_start=None, window_end=None,
                                    job="a"))
    handler.emit(MetricData(200.0, "g", "plain", 5))  # a torchelastic row: no job, no rank, no window
    handler.emit(window_row(5.0, index=9))  # two windows after job a's first
    handler.start_job("c", int(4.6 * 1e9))  # job c said when it started: its steps count from there
    handler.emit(window_row(6.0, job="c", index=20))
    handler.flush()
    handler.close()
    assert (handler.written, handler.skipped_nonfinite, handler.skipped_not_numeric) == (9, 4, 1)
    a = _read_scalars(str(tmp_path / "tb" / "a"))  # no job start given: steps from the first window seen
    assert a == {"g/lat.max": [(0, 2.0, 1.5), (2, 2.5, 5.0)], "rank3/g/lat.max": [(0, 2.0, 2.5)]}
    # put metrics: a run of their own, so a put "lat.max" could never be the stat's "g/lat.max"
    assert _read_scalars(str(tmp_path / "tb" / "a" / "metrics")) == {
        "rank1/g/loss": [(0, 100.0, 0.0), (1, 101.0, 1.0), (2, 102.0, 2.0)]}
    assert _read_scalars(str(tmp_path / "tb" / "b")) == {"g/lat.max": [(0, 2.25, 4.0)]}
    assert _read_scalars(str(tmp_path / "tb" / "c")) == {"g/lat.max": [(2, 5.25, 6.0)]}  # 4.6 s is in window 18
    assert json.loads((tmp_path / "tb" / "a" / "shmstat-origin.json").read_text()) == {
        "job": "a", "origin_ns": int(7 * 0.25 * 1e9)}
    top = [n for n in os.listdir(tmp_path / "tb") if n.startswith("events.out.tfevents.")]
    assert len(top) == 1  # the row naming no job went to DIR itself
    assert _read_scalars(str(tmp_path / "tb"))["g/plain"] == [(0, 200.0, 5.0)]
    # a handler made anew over the same DIR (a restarted collector) goes on with each job's kept origin
    again = build_handler(f"tensorboard:{tmp_path / 'tb2'}")
    os.makedirs(tmp_path / "tb2" / "a", mode=0o700)
    (tmp_path / "tb2" / "a" / "shmstat-origin.json").write_text(json.dumps({"job": "a", "origin_ns": 0}))
    again.start_job("a", int(1e9))  # the job's start as this collector sees it: the kept origin wins
    again.emit(window_row(1.0, index=7))
    again.close()
    assert _read_scalars(str(tmp_path / "tb2" / "a")) == {"g/lat.max": [(7, 2.0, 1.0)]}
    os.makedirs(tmp_path / "tb3" / "a", mode=0o700)  # an origin file that is not one is replaced, nothing else
    (tmp_path / "tb3" / "a" / "shmstat-origin.json").write_text('["not", "an origin"]')
    third = build_handler(f"tensorboard:{tmp_path / 'tb3'}")
    third.emit(window_row(1.0, index=7))
    third.close()
    assert _read_scalars(str(tmp_path / "tb3" / "a")) == {"g/lat.max": [(0, 2.0, 1.0)]}
    assert json.loads((tmp_path / "tb3" / "a" / "shmstat-origin.json").read_text())["origin_ns"] == int(1.75e9)


def test_without_tensorboard_the_spec_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard.summary", None)  # what an environment without it does
    with pytest.raises(ConfigError, match=r"pip install 'shmstat\[tensorboard\]'"):
        build_handler(f"tensorboard:{tmp_path / 'tb'}")
    assert not (tmp_path / "tb").exists()


def test_a_user_class_is_built_with_typed_spec_arguments(job, tmp_path):
    out = tmp_path / "configured.jsonl"
    spec = (f"kit.handlers.args:Configured,path={out},every=2,scale=0.5,enabled=false,"
            'label="a,b=c",tags=[1,"x"],note=null')
    coll = start_collector(job, "--handler", f"train={spec}", "--grace-ms", "10")
    p = spawn(rank_worker, job, 0, 1, 0.2, WINDOW_MS, str(tmp_path / "r0.json"))
    p.join(60)
    assert p.exitcode == 0
    assert coll.stop() == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {
        "args": {"path": str(out), "every": 2, "scale": 0.5, "enabled": False, "label": "a,b=c", "tags": [1, "x"],
                 "note": None},
        "types": {"path": "str", "every": "int", "scale": "float", "enabled": "bool", "label": "str",
                  "tags": "list", "note": "NoneType"},
    }
    assert lines[-1] == {"closed": True}
    counts = [row for row in lines[1:-1] if row["name"] == "steps.count" and row["rank"] == 0]
    assert sum(row["value"] for row in counts) == 0.5 * sum(load_counts(str(tmp_path / "r0.json")).values())


def test_spec_argument_values_and_plain_strings():
    from collector.handlers.specs import parse_spec_kwargs

    assert parse_spec_kwargs("s", 'a=1,b=-2.5e3,c=true,d=null,e="x,y=z",f=/tmp/p q,g=[1,2],h={"k": [3]},i=') == {
        "a": 1, "b": -2500.0, "c": True, "d": None, "e": "x,y=z", "f": "/tmp/p q", "g": [1, 2], "h": {"k": [3]},
        "i": "",
    }


def _collect_with(job: str, spec: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    return subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--handler", f"train={spec}"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)


@pytest.mark.parametrize("spec, says", [
    ("nope", "unknown handler kind 'nope'"),
    ("no_such_module_xyz:Thing", "unknown handler kind 'no_such_module_xyz' in 'no_such_module_xyz:Thing' (no module"),
    ("no_such_pkg_xyz.mod:Thing", "cannot import module 'no_such_pkg_xyz.mod'"),
    ("kit.handlers.args:Missing", "has no class 'Missing'"),
    ("kit.handlers.args:NotAHandler", "is not a MetricHandler subclass"),
    ("kit.handlers.args:Configured,path=/tmp/x,colour=1", "unexpected keyword argument 'colour'"),
    ("kit.handlers.args:Configured", "missing a required argument: 'path'"),
    ("kit.handlers.args:Configured,path=/tmp/x,path=/tmp/y", "gives 'path' twice"),
    ("kit.handlers.args:Configured,1x=2", "is not key=value"),
    ("kit.handlers.args:Configured,path=/tmp/x,", "is not key=value"),
    ("kit.handlers.args:Configured,path=a=b", "write it as a JSON string"),
    ('kit.handlers.args:Configured,path="/tmp/x', "unclosed string"),
    ("kit.handlers.args:Refuses,limit=3", "ValueError: limit 3 is too low raise it"),
    ("tensorboard:", "needs a directory"),
    ("tensorboard:/proc/no/such/dir", "cannot create the tensorboard directory"),
])
def test_a_bad_spec_is_one_sentence_and_exit_2(job, spec, says):
    done = _collect_with(job, spec)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmstat: error: ") and says in lines[0], done.stderr
    assert not [n for n in os.listdir("/dev/shm") if job in n], "a bad spec left something in /dev/shm"


def test_window_step_is_exact_at_todays_unix_times():
    import time

    from collector.handlers.tensorboard_sink import _window_step

    now_ns = time.time_ns()
    origin_ns = now_ns - 123_456_789_012  # a job started two minutes ago, off any window boundary
    for window_ms in (1, 7, 50, 1000, 3_600_000):
        window_ns = window_ms * 1_000_000
        first = now_ns // window_ns
        for index in range(first - 3, first + 4):
            start_ns = index * window_ns
            # what the collector puts in a row: float seconds of whole-ns bounds
            bounds = (start_ns / 1e9, (start_ns + window_ns) / 1e9)
            assert _window_step(*bounds, 0) == index, (window_ms, index)
            assert _window_step(*bounds, origin_ns) == index - origin_ns // window_ns, (window_ms, index)
    assert _window_step(None, None, 0) is None


@needs_tensorboard
def test_the_agents_metrics_have_a_run_of_their_own_and_nothing_lands_at_the_root(job, tmp_path):
    logdir = tmp_path / "tb"
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, STEPS="20")
    done = subprocess.run(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2", "--monitor-interval",
         "0.05", "--handler", f"*=tensorboard:{logdir}", "--handler", "shmstat=null", "--grace-ms", "10",
         os.path.join(REPO, "tests", "kit", "programs", "elastic_job.py")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(logdir)) == [job]  # no stray event file at the root of DIR
    assert stat.S_IMODE(os.stat(logdir / job / "agent").st_mode) == 0o700
    agent = _read_scalars(str(logdir / job / "agent"))
    assert {"torchelastic/workers.default.run_total", "torchelastic/workers.default.run_success_no_retries",
            "torchelastic/Agent._start_workers.success"} <= set(agent)
    assert all(tag.startswith("torchelastic/") for tag in agent)
    assert [v for _, _, v in agent["torchelastic/workers.default.run_total"]] == [1.0]
    ranks = _read_scalars(str(logdir / job))  # the job's own run: its ranks' windows only
    assert not [tag for tag in ranks if tag.startswith("torchelastic/")]
    assert sum(v for _, _, v in ranks["train/step_ms.count"]) == 2 * 20
    put = _read_scalars(str(logdir / job / "metrics"))  # what the ranks put, in a run of its own
    assert not [tag for tag in ranks if tag.endswith("train_step.success")]
    successes = [tag for tag in put if tag.endswith("train_step.success")]
    assert sorted(successes) == ["rank0/trainer/__main__.train_step.success",
                                 "rank1/trainer/__main__.train_step.success"]
    assert all(len(put[tag]) == 20 for tag in successes)


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 64 KiB (mounting needs root: skipped otherwise)."""
    with small_tmpfs(tmp_path / "small", "64k") as where:
        yield where


@needs_tensorboard
@pytest.mark.parametrize("room", ["some", "none"])
def test_a_full_disk_is_one_line_and_counted_not_the_writer_threads_traceback(job, tmp_path, small_disk, room):
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if room == "some":
            os.write(fd, b"f" * (48 * 1024))  # room for the first event file's records only
        else:  # not even for the event file's first record, written as its writer is made
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"f" * 1024)
    finally:
        os.close(fd)
    usage = tmp_path / "usage.jsonl"
    coll = start_collector(job, "--handler", f"train=tensorboard:{small_disk / 'tb'}", "--handler",
                           f"shmstat=jsonl:{usage}", "--grace-ms", "10", "--status-interval", "0")
    try:
        p = spawn(rank_worker, job, 0, 1, 3.0, WINDOW_MS, str(tmp_path / "r0.json"))

        def errors() -> float:
            values = [r["value"] for r in read_jsonl(str(usage)) if r["name"] == "collector.handler_errors"]
            return values[-1] if values else 0

        wait_for(lambda: errors() > 0, 60, 0.05, what="the tensorboard handler failing on the full disk")
        p.join(60)
        assert p.exitcode == 0
    finally:
        assert coll.stop() == 0
    full = [line for line in coll.lines if "No space left on device" in line]
    assert len(full) == 1 and "TensorboardMetricHandler" in full[0] and "counted" in full[0], coll.lines
    assert not [line for line in coll.lines if "Traceback" in line or "Exception in thread" in line], coll.lines
    assert errors() > 0
