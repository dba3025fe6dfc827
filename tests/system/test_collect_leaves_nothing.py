"""``shmstat collect --job J`` removes J's segment and lock file when it stops (SIGINT or SIGTERM) and no process
of J lives, every window emitted — also for a job id nobody ever used (a typo): nothing it made is left in
/dev/shm or the runtime directory. A job still running keeps its segment, and the collector says why in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
from kit.procs import (
    REPO,
    CollectorProc,
    assert_rank_workers_reconcile,
    default_signals,
    rank_worker,
    read_jsonl,
    spawn,
    start_collector,
)
from kit.support import unique_job, wait_for

from shmstat.shm import layout as L
from shmstat.shm.runtime import ingest_endpoint, lock_path, publish_endpoint, segment_name
from shmstat.shm.segment import Segment


def left_behind(job: str) -> list[str]:
    """The job's files still in /dev/shm and the runtime directory."""
    paths = ["/dev/shm" + segment_name(job), lock_path(job),
             ingest_endpoint(job).removeprefix("ipc://"), publish_endpoint(job).removeprefix("ipc://")]
    return [p for p in paths if os.path.exists(p)]


def start(job: str, *args: str) -> CollectorProc:
    """``shmstat collect --job job`` once it serves."""
    return start_collector(job, "--grace-ms", "10", *args, timeout_s=60)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_job_nobody_ever_ran_leaves_nothing(tmp_path, sig):
    job = unique_job("typo")
    coll = start(job, "--handler", "*=null")
    try:
        assert os.path.exists("/dev/shm" + segment_name(job))  # the collector made it, waiting for ranks
        assert coll.stop(sig, 30) == 0
        assert left_behind(job) == []
        assert "kept" not in "\n".join(coll.lines)
    finally:
        if coll.proc.poll() is None:
            coll.proc.kill()
        Segment.unlink(job)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_finished_job_is_emitted_whole_then_removed(tmp_path, sig):
    job = unique_job("done")
    out = str(tmp_path / "m.jsonl")
    coll = start(job, "--handler", f"*=jsonl:{out}")
    try:
        ranks = [spawn(rank_worker, job, r, 2, 0.5, 100, str(tmp_path / f"r{r}.json")) for r in range(2)]
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        assert coll.stop(sig, 30) == 0
        assert_rank_workers_reconcile(read_jsonl(out), tmp_path, 2)
        assert left_behind(job) == []
    finally:
        if coll.proc.poll() is None:
            coll.proc.kill()
        Segment.unlink(job)


def test_a_job_still_running_keeps_its_segment_and_the_collector_says_why(tmp_path):
    job = unique_job("live")
    coll = start(job, "--handler", "*=null")
    ready = str(tmp_path / "ready")
    rank = spawn(rank_worker, job, 0, 1, 60.0, 100, str(tmp_path / "r0.json"), None, 0, ready)
    try:
        wait_for(lambda: os.path.exists(ready), 60, what="the rank adding")
        assert coll.stop(signal.SIGTERM, 30) == 0
        assert os.path.exists("/dev/shm" + segment_name(job))  # its open windows wait for the next collector
        said = [line for line in coll.lines if "kept" in line]
        assert said == [f"shmstat collector: job {job}'s segment kept: the open windows of rank 0, still running "
                        f"(inspect: shmstat top --job {job}; remove: shmstat clean {job})"]
    finally:
        if coll.proc.poll() is None:
            coll.proc.kill()
        rank.kill()
        rank.join(10)
        Segment.unlink(job)


# ------------------------------------------------------------------------------ failed starts and every way out


@pytest.fixture
def taken_port():
    """A loopback TCP port something else listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.path.join(REPO, "tests")),
                          timeout=60, **kw)


_FAILED_STARTS = {
    "port in use": ("--prometheus", "127.0.0.1:{port}"),
    "bad handler": ("--handler", "*=tests_no_such_module:Handler"),
    "bad events spec": ("--events", "nosuchsink:{tmp}/e"),
    "full /dev/shm": ("--max-ranks", "4096", "--max-stats", "65536", "--banks", "64"),
}


@pytest.mark.parametrize("command", ["collect --job", "run"])
@pytest.mark.parametrize("failure", list(_FAILED_STARTS))
def test_a_failed_start_says_why_in_one_line_and_leaves_nothing(tmp_path, taken_port, command, failure):
    job = unique_job("nostart")
    if failure == "full /dev/shm":
        st = os.statvfs("/dev/shm")
        if L.Geometry(4096, 65536, 64).total_size <= 2 * st.f_blocks * st.f_frsize:
            pytest.skip("/dev/shm is too large to exceed with the largest geometry")
    extra = [a.format(port=taken_port, tmp=tmp_path) for a in _FAILED_STARTS[failure]]
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    argv = (["collect", "--job", job, *extra] if command == "collect --job"
            else ["run", "--job", job, *extra, str(script)])
    r = _cli(*argv, "--ready-file", str(tmp_path / "ready"))
    try:
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("shmstat: error: "), r.stderr
        assert left_behind(job) == [] and not (tmp_path / "ready").exists()
    finally:
        Segment.unlink(job)


def test_a_node_collector_that_cannot_start_leaves_nothing(tmp_path, taken_port):
    jobs = [unique_job("node-nostart") for _ in range(2)]
    r = _cli("collect", *[a for j in jobs for a in ("--job", j)], "--prometheus", f"127.0.0.1:{taken_port}",
             "--ready-file", str(tmp_path / "ready"))
    try:
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert [p for j in jobs for p in left_behind(j)] == [] and not (tmp_path / "ready").exists()
    finally:
        for j in jobs:
            Segment.unlink(j)


def _start_piped(argv: list[str], tmp_path) -> subprocess.Popen:
    """``argv`` with stdout and stderr into one pipe, as ``... 2>&1 | tee log``, in a process group of its own (as
    a shell's job); returns once it serves (its ready file exists). Not shmstat.testing.start_collector: the test
    owns the pipe as ``tee`` would (it closes it, or reads it to the end, after signalling the group), and ``argv``
    may be ``run`` (the launcher) as well as ``collect``."""
    env = dict(os.environ, PYTHONPATH=REPO, OUT_DIR=str(tmp_path), MODE="save")
    ready = tmp_path / "collector.json"
    proc = subprocess.Popen([sys.executable, "-m", "collector", argv[0], "--ready-file", str(ready), *argv[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env, process_group=0,
                            preexec_fn=default_signals)
    wait_for(lambda: ready.exists() or proc.poll() is not None, 60, what="its ready file")
    assert proc.poll() is None, f"it ended before serving (exit status {proc.returncode})"
    return proc


_SIGNAL_RANK = os.path.join(REPO, "tests", "kit", "programs", "signal_rank.py")


@pytest.mark.parametrize("command", ["collect --job", "collect", "run"])
@pytest.mark.parametrize("how", ["SIGINT, reader gone", "SIGINT, reader reading", "SIGHUP"])
def test_every_way_out_through_a_pipe_leaves_nothing(tmp_path, command, how):
    """``... 2>&1 | tee log`` then Ctrl-C (the whole group gets SIGINT: tee dies, so every later write meets a
    closed pipe), the same with the reader still there, and SIGHUP (the terminal closed): every process ends and
    nothing of the job is left once every window was emitted."""
    job = unique_job("piped")
    common = ["--grace-ms", "10", "--handler", "*=console", "--status-interval", "0.2"]
    if command == "run":
        argv = ["run", "--job", job, "--nproc-per-node", "1", "--monitor-interval", "0.05", *common, _SIGNAL_RANK]
    elif command == "collect --job":
        argv = ["collect", "--job", job, *common]
    else:
        argv = ["collect", "--job", job, "--job", unique_job("piped-other"), *common]
    proc = _start_piped(argv, tmp_path)
    rank = None
    try:
        if command == "run":
            wait_for(lambda: (tmp_path / "ready-0").exists(), 60, what="the rank")
        else:
            ready = str(tmp_path / "ready")
            rank = spawn(rank_worker, job, 0, 1, 0.6, 100, str(tmp_path / "r0.json"), None, 0, ready)
            wait_for(lambda: os.path.exists(ready), 60, what="the rank adding")
            rank.join(60)
            assert rank.exitcode == 0
        assert proc.stdout is not None
        if how == "SIGINT, reader gone":
            proc.stdout.close()  # tee died of the same Ctrl-C
        sig = signal.SIGHUP if how == "SIGHUP" else signal.SIGINT
        os.killpg(proc.pid, sig)
        if how != "SIGINT, reader gone":
            proc.stdout.read()  # EOF once every process of the job closed the pipe
        code = proc.wait(60)
        if command == "run":
            assert code == 128 + sig
        else:
            assert code == 0
        wait_for(lambda: not left_behind(job), 10, what="nothing of the job left")
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()
        if rank is not None and rank.is_alive():
            rank.kill()
        Segment.unlink(job)
