"""The cause of a straggler (collector.daemon.cause), end to end: real ``torchrun`` DDP jobs on CPU (gloo, three
ranks, ``shmstat.torch.instrument``) with a fault injected into one rank's training script
(tests/kit/programs/why_slow.py), served by a real collector; its events, its console and every window's scores."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

import pytest
from kit.procs import REPO, collector_env, read_jsonl, start_collector
from kit.support import wait_for

from collector.daemon.cause import STEP_STAT
from collector.daemon.straggler import DEFAULT_THRESHOLD

pytest.importorskip("torch", reason="the jobs are real torchrun DDP jobs (pip install torch==2.13.0)")

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "why_slow.py")
RANKS, SLOW, STEPS = 3, 1, 120


def _steps_emitted(path: str) -> int:
    """Optimizer steps counted in the merged windows written so far (each rank's last window ends the job)."""
    return int(sum(r["value"] for r in read_jsonl(path) if r["rank"] is None and r["name"] == "optimizer.count"))


def _run(job: str, tmp: str, **fault: str) -> tuple[list[dict], list[dict], list[dict], str]:
    """Run the job under a collector: (its straggler events, its score rows, its section rows, its console)."""
    coll = start_collector(job, "--status-interval", "0", "--grace-ms", "10", "--events", f"jsonl:{tmp}/events.jsonl",
                           "--handler", f"shmstat=jsonl:{tmp}/scores.jsonl", "--handler",
                           f"section=kit.handlers.saying_jsonl:SayingJsonl,path={tmp}/sections.jsonl")
    env = collector_env()
    env.update(SHMSTAT_JOB=job, SHMSTAT_SECTION_WINDOW_S="0.5", SLOW_RANK=str(SLOW), STEPS=str(STEPS), **fault)
    try:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(RANKS), "--monitor-interval", "0.1", SCRIPT], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(lambda: _steps_emitted(f"{tmp}/sections.jsonl") == RANKS * STEPS, timeout_s=30)
    finally:
        _, out = coll.finish()
    events = [e["data"] for e in read_jsonl(f"{tmp}/events.jsonl") if e["name"] == "shmstat.straggler"]
    scores = [r for r in read_jsonl(f"{tmp}/scores.jsonl") if r["name"].startswith("straggler.score.")]
    return events, scores, read_jsonl(f"{tmp}/sections.jsonl"), out


def _per_step(sections: list[dict]) -> dict[int, dict[str, float]]:
    """Each rank's ms per step in each section over the whole job (steps: its ``optimizer`` count)."""
    total: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in sections:
        if r["rank"] is not None:
            name, agg = r["name"].rsplit(".", 1)
            total[r["rank"]][f"{name}.{agg}"] += r["value"]
    return {rank: {k[:-4]: v / t["optimizer.count"] for k, v in t.items() if k.endswith(".sum")}
            for rank, t in total.items()}


def _check_named(events: list[dict], scores: list[dict], sections: list[dict], out: str, section: str) -> None:
    assert events and {e["rank"] for e in events} == {SLOW}, events  # the slow rank, and only it
    for e in events:
        assert e["cause_section"] == section and e["cause_excess_ms"] > 0, e
        assert e["cause_wait_section"] == "allreduce" and e["cause_wait_ms"] < e["cause_wait_median_ms"], e
        assert e["cause"].startswith(f"its {section} takes "), e
    lines = [ln for ln in out.splitlines() if "straggler:" in ln]
    assert len(lines) == len(events) and all(f"\u2014 its {section} takes" in ln and
                                             "it waits least in allreduce" in ln for ln in lines), out
    healthy = [s for s in scores if s["rank"] != SLOW]
    assert healthy and all(s["value"] >= DEFAULT_THRESHOLD for s in healthy), \
        [s for s in healthy if s["value"] < DEFAULT_THRESHOLD]  # no healthy rank flagged, in any window
    assert not [s for s in scores if s["name"].endswith("/allreduce")]  # a wait is never scored
    steps = _per_step(sections)
    waits = {rank: s["allreduce"] for rank, s in steps.items()}
    assert min(waits, key=waits.__getitem__) == SLOW  # the healthy ranks wait longest, and are not flagged
    assert any(s["name"] == f"straggler.score.section/{STEP_STAT}" for s in scores)


def test_a_rank_whose_data_loading_is_slowed_2x_is_named_with_data(job, tmp_path):
    events, scores, sections, out = _run(job, str(tmp_path), SLOW_DATA="2")
    _check_named(events, scores, sections, out, "data")


def test_a_rank_whose_forward_is_slowed_1_5x_in_ddp_is_named_with_forward_and_no_healthy_rank_is_flagged(
        job, tmp_path):
    events, scores, sections, out = _run(job, str(tmp_path), SLOW_FORWARD="1.5")
    steps = {rank: sum(s.values()) for rank, s in _per_step(sections).items()}
    assert max(steps.values()) < 1.05 * min(steps.values()), steps  # DDP: every rank's step takes as long
    _check_named(events, scores, sections, out, "forward")
