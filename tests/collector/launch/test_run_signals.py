"""``shmstat run`` under signals, as torchrun's agent: the signal received is forwarded (SIGINT stays SIGINT, so a
script's ``except KeyboardInterrupt: save()`` runs), then SIGTERM and SIGKILL follow after the grace period; the
exit status is 128 + the signal's number; no process of the job is left, and nothing of it in /dev/shm or the
runtime directory once every window was emitted."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest
from kit.procs import REPO, default_signals, read_jsonl
from kit.support import unique_job, wait_for

from shmstat.shm.runtime import ingest_endpoint, lock_path, publish_endpoint, segment_name
from shmstat.shm.segment import Segment

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "signal_rank.py")


def left_behind(job: str) -> list[str]:
    """The job's files still in /dev/shm and the runtime directory."""
    paths = ["/dev/shm" + segment_name(job), lock_path(job),
             ingest_endpoint(job).removeprefix("ipc://"), publish_endpoint(job).removeprefix("ipc://")]
    return [p for p in paths if os.path.exists(p)]


def start_run(job: str, tmp_path, nproc: int, *extra: str, mode: str = "save") -> subprocess.Popen:
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, MODE=mode)
    return subprocess.Popen(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", str(nproc),
         "--monitor-interval", "0.05", "--grace-ms", "10", *extra, SCRIPT],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)


def pids_of(tmp_path, nproc: int) -> list[int]:
    pids = []
    for r in range(nproc):
        with open(tmp_path / f"pids-{r}") as f:
            pids += [int(line) for line in f if line.strip()]
    return pids


def running(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie waiting for a non-reaping parent is gone for this purpose)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """Wait for ``shmstat run`` to exit and return its status and output; a run that does not end fails the
    test (its ranks hold its pipes: the caller's :func:`cleanup` kills them)."""
    try:
        proc.wait(timeout)
        out, err = proc.communicate(timeout=timeout)  # EOF only once every rank closed the pipes too
    except subprocess.TimeoutExpired:
        raise AssertionError("shmstat run or one of its ranks did not end") from None
    return proc.returncode, out, err


def cleanup(job: str, run: subprocess.Popen, pids: list[int]) -> None:
    """Kill what a failed test left running (the run, then every process it started) and remove the job."""
    if run.poll() is None:
        run.kill()
    for pid in running(pids):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.communicate(timeout=10)
    Segment.unlink(job)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_the_signal_received_reaches_the_ranks_which_save_and_every_sample_is_emitted(tmp_path, sig, status):
    job = unique_job("sig")
    out = str(tmp_path / "m.jsonl")
    run = start_run(job, tmp_path, 2, "--handler", f"*=jsonl:{out}", "--stop-grace", "30")
    pids: list[int] = []
    try:
        wait_for(lambda: all(os.path.exists(tmp_path / f"ready-{r}") for r in range(2)), 60, what="both ranks")
        pids = pids_of(tmp_path, 2)
        run.send_signal(sig)
        code, _out, err = finish(run)
        assert code == status, err
        name = signal.Signals(sig).name
        saved = {}
        for r in range(2):
            with open(tmp_path / f"saved-{r}") as f:
                got, added = f.read().split()
            assert got == name, f"rank {r} got {got}, not the {name} shmstat run received"
            saved[r] = int(added)
        assert f"interrupted by {name}; sent the workers {name};" in err, err  # the ranks ended on the first
        assert running(pids) == []
        assert left_behind(job) == [], "every window was emitted: nothing of the job is left"
        rows = read_jsonl(out)
        merged = sum(r["value"] for r in rows if r["name"] == "work.count" and r["rank"] is None)
        per_rank = {k: sum(r["value"] for r in rows if r["name"] == "work.count" and r["rank"] == k) for k in range(2)}
        assert per_rank == saved and merged == sum(saved.values())  # every sample a rank added, counted once
    finally:
        cleanup(job, run, pids)


def test_a_rank_ignoring_sigint_and_sigterm_is_killed_with_its_children(tmp_path):
    job = unique_job("stub")
    run = start_run(job, tmp_path, 2, "--stop-grace", "0.5", "--handler", "*=null", mode="stubborn")
    pids: list[int] = []
    try:
        wait_for(lambda: all(os.path.exists(tmp_path / f"ready-{r}") for r in range(2)), 60, what="both ranks")
        pids = pids_of(tmp_path, 2)
        assert len(pids) == 6  # two ranks, each with a child in its group and a grandchild in a session of its own
        run.send_signal(signal.SIGINT)
        code, _out, err = finish(run)
        assert code == 130, err
        assert "sent the workers SIGINT, then SIGTERM, then SIGKILL" in err, err
        for r in range(2):
            with open(tmp_path / f"got-{r}") as f:
                assert f.read().split() == ["SIGINT", "SIGTERM"]
        assert running(pids) == [], "a rank, its child or its grandchild outlived shmstat run"
        assert left_behind(job) == []
    finally:
        cleanup(job, run, pids)


def test_a_second_ctrl_c_cuts_the_grace_period_short(tmp_path):
    job = unique_job("insist")
    run = start_run(job, tmp_path, 1, "--stop-grace", "3600", "--handler", "*=null", mode="stubborn")
    pids: list[int] = []
    try:
        wait_for(lambda: os.path.exists(tmp_path / "ready-0"), 60, what="the rank")
        pids = pids_of(tmp_path, 1)
        got = tmp_path / "got-0"
        for expected in (["SIGINT"], ["SIGINT", "SIGTERM"]):
            run.send_signal(signal.SIGINT)
            wait_for(lambda e=expected: got.exists() and got.read_text().split() == e, 30, what=f"{expected}")
        run.send_signal(signal.SIGINT)  # the third: SIGKILL now, not after an hour
        code, _out, err = finish(run)
        assert code == 130 and "SIGINT, then SIGTERM, then SIGKILL" in err, err
        assert running(pids) == []
    finally:
        cleanup(job, run, pids)


def test_a_signal_before_the_ranks_start_ends_the_run_with_its_status(tmp_path):
    job = unique_job("early")
    run = start_run(job, tmp_path, 2, "--handler", "*=null")
    try:
        wait_for(lambda: os.path.exists("/dev/shm" + segment_name(job)), 60, what="the collector's segment")
        run.send_signal(signal.SIGTERM)
        code, _out, err = finish(run)
        assert code == 143, err
        assert "Traceback" not in err
        wait_for(lambda: not left_behind(job), 10, what="nothing left")
    finally:
        pids = pids_of(tmp_path, 2) if all((tmp_path / f"pids-{r}").exists() for r in range(2)) else []
        cleanup(job, run, pids)


def test_a_signal_ignored_when_run_started_stays_ignored_as_under_nohup(tmp_path):
    job = unique_job("nohup")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, MODE="save")
    run = subprocess.Popen(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "1", "--monitor-interval",
         "0.05", "--handler", "*=null", SCRIPT], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    pids: list[int] = []
    try:
        wait_for(lambda: os.path.exists(tmp_path / "ready-0"), 60, what="the rank")
        pids = pids_of(tmp_path, 1)
        run.send_signal(signal.SIGHUP)  # ignored, as nohup asked; had it counted, the run would end with 129
        run.send_signal(signal.SIGINT)
        code, _out, err = finish(run)
        assert code == 130 and "interrupted by SIGINT" in err, err
        assert (tmp_path / "saved-0").read_text().split()[0] == "SIGINT"
        assert running(pids) == [] and left_behind(job) == []
    finally:
        cleanup(job, run, pids)


def marked(mark: str) -> list[int]:
    """The live (not zombie) processes of this user whose environment carries ``SHMSTAT_TEST_MARK=mark``."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.uids().real == os.getuid() and proc.environ().get("SHMSTAT_TEST_MARK") == mark \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
    return found


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "end", "failure"])
def test_the_launcher_owns_every_process_of_the_job_daemons_included(tmp_path, how):
    """A rank that starts ``setsid sleep 600 &`` and a double-forked helper in a session of its own: both reparent
    away from the rank at once, yet neither outlives ``shmstat run``, whether it stops by SIGINT, by SIGTERM, at the
    ranks' normal end or after a rank failed (the launcher is their subreaper, signals and reaps them)."""
    job = unique_job("daemons")
    mark = f"{job}-{how}"
    signalled = how.startswith("SIG")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=REPO, SHMSTAT_TEST_MARK=mark,
               MODE="daemons" if signalled else "daemons-exit", EXIT_CODE="3" if how == "failure" else "0")
    run = subprocess.Popen(
        [sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2", "--monitor-interval",
         "0.05", "--grace-ms", "10", "--stop-grace", "5", "--handler", "*=null", SCRIPT],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    daemons: list[int] = []
    try:
        wait_for(lambda: all(os.path.exists(tmp_path / f"ready-{r}") for r in range(2)), 60, what="both ranks")
        for r in range(2):
            daemons += [int(p) for p in (tmp_path / f"daemons-{r}").read_text().split()]
        assert len(daemons) == 4
        if signalled:
            assert len(marked(mark)) >= 6, "the ranks and their daemons run, marked"
            run.send_signal(getattr(signal, how))
        try:
            code = run.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"shmstat run did not end; job processes: {marked(mark)}") from None
        assert code == {"SIGINT": 130, "SIGTERM": 143, "end": 0, "failure": 3}[how]
        assert marked(mark) == [], "a process of the job outlived shmstat run"
        assert running(daemons) == []
        _, err = run.communicate(timeout=10)  # nothing of the job holds its pipes any more
        assert "Traceback" not in err, err
        wait_for(lambda: not left_behind(job), 10, what="nothing of the job left")
    finally:
        if run.poll() is None:
            run.kill()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.communicate(timeout=10)
        Segment.unlink(job)
