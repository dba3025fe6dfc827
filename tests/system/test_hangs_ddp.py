"""Hangs in real DDP jobs: ``torchrun --standalone --nproc-per-node 3`` runs a gloo job on CPU whose loop is
instrumented with ``shmstat.torch.instrument`` (tests/kit/programs/ddp_faults.py), beside ``shmstat collect --job``
with a short ``--hang-after``, as docs/guides/torchrun.md tells a user; faults are injected into the training
script. A rank stuck in a section by a sleep, by SIGSTOP or on a lock another thread holds is named within
``--hang-after`` + 5 s with its section, the others' (``allreduce``) and its process state, once; the hang resolves
when the rank goes on, and the job ends whole. A clean job with noisy steps raises no straggler and no hang (a
short form here, the 10-minute one marked ``slow``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from kit.procs import REPO, collector_env, read_jsonl, start_collector
from kit.support import wait_for

from shmstat.shm.phase import read_phase
from shmstat.shm.segment import Segment

HANG_AFTER = 2
RANKS = 3
SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "ddp_faults.py")


class Job:
    """A collector for ``job`` and a torchrun job of :data:`RANKS` ranks beside it (its variables: ``env``)."""

    def __init__(self, job: str, tmp: str, hang_after: float, **env: str | int) -> None:
        self.job, self.tmp = job, tmp
        self.events = os.path.join(tmp, "events.jsonl")
        self.collector = start_collector(job, "--hang-after", str(hang_after), "--status-interval", "0",
                                         "--events", f"jsonl:{self.events}")  # the default output: compact
        run_env = collector_env()
        run_env.update({k: str(v) for k, v in env.items()}, SHMSTAT_JOB=job, OUT_DIR=tmp)
        self.torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), SCRIPT],
            env=run_env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = ""
        self.lines: str | None = None

    def named(self, name: str) -> list[dict]:
        """The collector's events ``name`` so far."""
        return [e for e in read_jsonl(self.events) if e["name"] == name]

    def file(self, name: str, timeout_s: float = 120) -> dict:
        """``$OUT_DIR/name`` (a JSON object the job writes), once it exists."""
        path = os.path.join(self.tmp, name)
        wait_for(lambda: os.path.exists(path) or self.torchrun.poll() is not None, timeout_s, 0.02, what=path)
        assert os.path.exists(path), self.finish()
        with open(path) as f:
            return json.load(f)

    def finish(self, timeout_s: float = 180) -> str:
        """Wait for torchrun, stop the collector; the collector's console output (torchrun's in :attr:`output`)."""
        if self.lines is not None:
            return self.lines
        try:
            self.output, _ = self.torchrun.communicate(timeout=timeout_s)
        finally:
            if self.torchrun.poll() is None:
                self.torchrun.kill()
                self.output, _ = self.torchrun.communicate()
            _, self.lines = self.collector.finish()
        return self.lines

    def ended_whole(self, steps: int) -> None:
        """torchrun exited 0 and every rank trained every step."""
        assert self.torchrun.returncode == 0, self.output
        for r in range(RANKS):
            assert self.file(f"rank{r}.json", 1)["steps"] == steps


def _hang_named(run: Job, section: str, status: str) -> dict:
    """The fault's rank, named in one ``shmstat.hang`` within ``--hang-after`` + 5 s of its fault, in ``section``
    with ``status``, the others in ``allreduce``: the event's data."""
    fault = run.file("fault.json")
    events = wait_for(lambda: run.named("shmstat.hang"), HANG_AFTER + 5 + 2, 0.02, what="shmstat.hang")
    seen = time.time()
    (event,) = events
    data = event["data"]
    assert event["timestamp"] - fault["at"] <= HANG_AFTER + 5 and seen - fault["at"] <= HANG_AFTER + 5 + 1, data
    r, others = fault["rank"], ",".join(str(o) for o in range(RANKS) if o != fault["rank"])
    assert fault["section"] == section
    assert re.fullmatch(rf"hang: job {run.job}: ranks {others} in allreduce for \d+ s; rank {r} in {section} for "
                        rf"\d+ s \(pid {fault['pid']}, {status}, \d+% CPU\)", data["line"]), data
    assert (data["suspects"], data[f"rank.{r}.section"], data[f"rank.{r}.status"], data[f"rank.{r}.pid"]) == \
        (str(r), section, status, fault["pid"])
    return data


def _resolves(run: Job, line: str) -> None:
    """The hang resolves (progress) once the rank went on; the job ends whole, with one hang line."""
    resumed = run.file("resumed.json", 30)
    wait_for(lambda: run.named("shmstat.hang.resolved"), 10, 0.02, what="shmstat.hang.resolved")
    (resolved,) = run.named("shmstat.hang.resolved")
    assert resolved["data"]["reason"] == "progress" and resolved["timestamp"] >= resumed["at"] - 0.5, resolved
    out = run.finish()
    run.ended_whole(30)
    assert len(run.named("shmstat.hang")) == 1 and len(run.named("shmstat.hang.resolved")) == 1
    assert [ln for ln in out.splitlines() if "hang:" in ln] == [ln for ln in out.splitlines() if line in ln], out
    assert len([ln for ln in out.splitlines() if "hang:" in ln]) == 1, out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_ddp_rank_sleeping_in_its_data_loader_is_named_and_the_hang_resolves_when_the_sleep_ends(job, tmp_path,
                                                                                                   workers):
    """With ``workers`` DataLoader processes the sleep is in one of them: the rank waits for it in ``data``."""
    run = Job(job, str(tmp_path), HANG_AFTER, STEPS=30, FAULT="sleep", FAULT_RANK=1, FAULT_STEP=10,
              FAULT_SECTION="data", SLEEP_S=HANG_AFTER + 5 + 4, WORKERS=workers)
    try:
        data = _hang_named(run, "data", "sleeping")
        _resolves(run, data["line"])
    finally:
        run.finish()


def test_a_sigstopped_ddp_rank_is_named_stopped_in_its_forward_and_the_hang_resolves_on_sigcont(job, tmp_path):
    run = Job(job, str(tmp_path), HANG_AFTER, STEPS=30, FAULT="stop", FAULT_RANK=2, FAULT_STEP=10,
              FAULT_SECTION="forward")
    pid = None
    try:
        pid = run.file("fault.json")["pid"]
        data = _hang_named(run, "forward", "stopped")
        assert data["rank.2.cpu_percent"] == 0
        os.kill(pid, signal.SIGCONT)
        _resolves(run, data["line"])
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        run.finish()


def _stop_in(job: str, local_rank: int, section: str) -> int:
    """SIGSTOP the rank of ``local_rank`` (once it counted a few steps) at a moment it is in ``section``, from
    outside, as an operator or a neighbour's OOM-killer would: its pid, once stopped there."""
    seg = wait_for(lambda: _segment(job), 120, 0.05, what=f"the segment of {job}")
    try:
        wait_for(lambda: (p := read_phase(seg, local_rank)) is not None and p.step >= 5, 120, 0.01, what="5 steps")
        pid = seg.rank(local_rank).pid
        proc = psutil.Process(pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            phase = read_phase(seg, local_rank)
            if phase is None or phase.section != section:
                time.sleep(0.0005)
                continue
            os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: proc.status() == psutil.STATUS_STOPPED, 10, 0.001, what="stopped")
            phase = read_phase(seg, local_rank)  # stopped: its word holds still
            if phase is not None and phase.section == section:
                return pid
            os.kill(pid, signal.SIGCONT)
        raise AssertionError(f"local rank {local_rank} not seen in {section} within 60 s")
    finally:
        seg.close()


def _segment(job: str) -> Segment | None:
    try:
        return Segment.open(job, create=False)
    except Exception:
        return None


def test_a_ddp_rank_sigstopped_inside_its_allreduce_is_named_stopped_not_another_nodes(job, tmp_path):
    """The stopped rank waits in ``allreduce`` as the others do: its state, not its section, makes it the one."""
    run = Job(job, str(tmp_path), HANG_AFTER, STEPS=300, STEP_MS=5, NOISE_MS=10)
    pid = None
    try:
        pid = _stop_in(job, 1, "allreduce")
        stopped_at = time.time()
        events = wait_for(lambda: run.named("shmstat.hang"), HANG_AFTER + 5 + 2, 0.02, what="shmstat.hang")
        data = events[0]["data"]
        assert events[0]["timestamp"] - stopped_at <= HANG_AFTER + 5, data
        assert re.fullmatch(rf"hang: job {job}: ranks 0,2 in allreduce for \d+ s; rank 1 in allreduce for \d+ s "
                            rf"\(pid {pid}, stopped, 0% CPU\)", data["line"]), data
        assert (data["suspects"], data["rank.1.status"], data["elsewhere"]) == ("1", "stopped", False), data
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: run.named("shmstat.hang.resolved"), 10, 0.02, what="shmstat.hang.resolved")
        out = run.finish()
        run.ended_whole(300)
        assert len(run.named("shmstat.hang")) == 1 and len(run.named("shmstat.hang.resolved")) == 1
        assert len([ln for ln in out.splitlines() if "hang:" in ln]) == 1, out
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        run.finish()


def test_a_ddp_rank_blocked_on_a_lock_is_named_and_the_hang_resolves_when_the_lock_is_released(job, tmp_path):
    run = Job(job, str(tmp_path), HANG_AFTER, STEPS=30, FAULT="lock", FAULT_RANK=0, FAULT_STEP=10,
              FAULT_SECTION="forward")
    release = os.path.join(str(tmp_path), "release")
    try:
        data = _hang_named(run, "forward", "sleeping")
        open(release, "w").close()
        _resolves(run, data["line"])
    finally:
        open(release, "w").close()
        run.finish()


def _clean(job: str, tmp: str, steps: int) -> None:
    """A clean job with noisy steps: no straggler, no hang, on no surface; every step counted."""
    run = Job(job, tmp, 3, STEPS=steps, STEP_MS=20, NOISE_MS=20)
    try:
        out = run.finish(timeout_s=max(180, steps))
    finally:
        run.finish()
    run.ended_whole(steps)
    names = {e["name"] for e in read_jsonl(run.events)}
    assert not names & {"shmstat.hang", "shmstat.straggler"}, [e for e in read_jsonl(run.events)
                                                              if e["name"].startswith("shmstat.")]
    assert not [ln for ln in out.splitlines() if "straggler" in ln or "hang" in ln], out
    # every optimizer step of every rank in the default output's windows (a step of the DataLoader's end is none)
    assert sum(int(n) for n in re.findall(r"section/optimizer +count=(\d+) ", out)) == RANKS * steps, out


def test_a_clean_ddp_job_with_noisy_steps_raises_no_straggler_and_no_hang(job, tmp_path):
    _clean(job, str(tmp_path), 300)


@pytest.mark.slow
def test_a_clean_ddp_job_with_noisy_steps_raises_no_straggler_and_no_hang_for_10_minutes(job, tmp_path):
    _clean(job, str(tmp_path), int(os.environ.get("SHMSTAT_CLEAN_STEPS", "12000")))
