"""The cause of a straggler (collector.daemon.cause), end to end: real ``torchrun`` DDP jobs on CPU (gloo, three
ranks, ``shmstat.torch.instrument``) with a fault injected into one rank's training script
(tests/kit/programs/why_slow.py), served by a real collector; its events, its console and every window's scores."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest
from kit.procs import REPO, collector_env, read_jsonl, start_collector
from kit.support import wait_for

from collector.cli.report import load_report
from collector.daemon.cause import STEP_STAT, SectionTimes, attribute, step_figures, summed
from collector.daemon.straggler import DEFAULT_THRESHOLD

pytest.importorskip("torch", reason="the jobs are real torchrun DDP jobs (pip install torch==2.13.0)")

SCRIPT = os.path.join(REPO, "tests", "kit", "programs", "why_slow.py")
RANKS, SLOW, STEPS = 3, 1, 120


def _steps_emitted(path: str) -> int:
    """Optimizer steps counted in the merged windows written so far (each rank's last window ends the job)."""
    return int(sum(r["value"] for r in read_jsonl(path)
                   if r["group"] == "section" and r["rank"] is None and r["name"] == "optimizer.count"))


def _run(job: str, tmp: str, **fault: str) -> tuple[list[dict], list[dict], list[dict], str]:
    """Run the job under a collector: (its straggler events, its score rows, its section rows, its console); its
    rows are in ``tmp/rows.jsonl`` (the scores apart), its events in ``tmp/events.jsonl``."""
    rows = f"{tmp}/rows.jsonl"
    coll = start_collector(job, "--status-interval", "0", "--grace-ms", "10", "--events", f"jsonl:{tmp}/events.jsonl",
                           "--handler", f"*=kit.handlers.saying_jsonl:SayingJsonl,path={rows}",
                           "--handler", f"shmstat=jsonl:{tmp}/scores.jsonl")  # the collector's own: every score
    env = collector_env()
    env.update(SHMSTAT_JOB=job, SHMSTAT_SECTION_WINDOW_S="0.5", SLOW_RANK=str(SLOW), STEPS=str(STEPS), **fault)
    try:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(RANKS), "--monitor-interval", "0.1", SCRIPT], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(lambda: _steps_emitted(rows) == RANKS * STEPS, timeout_s=30)
    finally:
        _, out = coll.finish()
    events = [e["data"] for e in read_jsonl(f"{tmp}/events.jsonl") if e["name"] == "shmstat.straggler"]
    scores = [r for r in read_jsonl(f"{tmp}/scores.jsonl") if r["name"].startswith("straggler.score.")]
    return events, scores, [r for r in read_jsonl(rows) if r["group"] == "section"], out


def _per_step(sections: list[dict]) -> dict[int, dict[str, float]]:
    """Each rank's ms per step in each section over the whole job (steps: its ``optimizer`` count)."""
    total: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in sections:
        if r["rank"] is not None:
            name, agg = r["name"].rsplit(".", 1)
            total[r["rank"]][f"{name}.{agg}"] += r["value"]
    return {rank: {k[:-4]: v / t["optimizer.count"] for k, v in t.items() if k.endswith(".sum")}
            for rank, t in total.items()}


def _check_named(tmp: str, events: list[dict], scores: list[dict], sections: list[dict], out: str,
                 section: str) -> None:
    assert events and {e["rank"] for e in events} == {SLOW}, events  # the slow rank, and only it
    for e in events:
        assert e["cause_section"] == section and e["cause_excess_ms"] > 0, e
        # the corroboration, when the rank waited least in those windows (on a loaded box a healthy rank the OS left
        # waiting may wait less in one of them: seen once in 10 runs); over the whole job it waits least (below)
        if "cause_wait_section" in e:
            assert e["cause_wait_section"] == "allreduce" and e["cause_wait_ms"] < e["cause_wait_median_ms"], e
        assert e["cause"].startswith(f"its {section} takes "), e
    lines = [ln for ln in out.splitlines() if "straggler:" in ln]
    assert len(lines) == len(events) and all(f"\u2014 its {section} takes" in ln for ln in lines), out
    assert sum("it waits least in allreduce" in ln for ln in lines) == sum("cause_wait_section" in e for e in events)
    # no healthy rank is flagged (above: no event, no line, over the whole run), nor slow on the section that carries
    # the fault in any window (in one window a healthy rank may be slow on another section or on its step on a
    # loaded box: a 0.1 ms backward taking 0.2, a step of a rank the OS left waiting; seen at load 30 on 2 cores.
    # That is no flag: the rank is not slow for 3 windows in a row)
    healthy = [s for s in scores if s["rank"] != SLOW and s["name"] == f"straggler.score.section/{section}"]
    assert healthy and all(s["value"] >= DEFAULT_THRESHOLD for s in healthy), \
        [s for s in healthy if s["value"] < DEFAULT_THRESHOLD]
    assert not [s for s in scores if s["name"].endswith("/allreduce")]  # a wait is never scored
    steps = _per_step(sections)
    waits = {rank: s["allreduce"] for rank, s in steps.items()}
    assert min(waits, key=waits.__getitem__) == SLOW  # the healthy ranks wait longest, and are not flagged
    assert any(s["name"] == f"straggler.score.section/{STEP_STAT}" for s in scores)
    # the report's sentence of the rank on the faulted section (a window of it may also be slow on another section
    # on a loaded box: that sentence names the cause of that window)
    said = [g for g in load_report(f"{tmp}/rows.jsonl").stragglers()
            if g.rank == SLOW and g.stat == f"section/{section}"]
    if not all(g.cause and g.cause.startswith(f"its {section} takes ") for g in said):
        shutil.copy(f"{tmp}/rows.jsonl", f"/tmp/cause-{os.path.basename(tmp)}.jsonl")
    assert said and all(g.cause and g.cause.startswith(f"its {section} takes ") and
                        f"\u2014 {g.cause}" in g.sentence(DEFAULT_THRESHOLD) for g in said), said  # the same cause


def test_a_rank_whose_data_loading_is_slowed_2x_is_named_with_data(job, tmp_path):
    events, scores, sections, out = _run(job, str(tmp_path), SLOW_DATA="2")
    _check_named(str(tmp_path), events, scores, sections, out, "data")


def test_a_rank_whose_forward_is_slowed_1_5x_in_ddp_is_named_with_forward_and_no_healthy_rank_is_flagged(
        job, tmp_path):
    events, scores, sections, out = _run(job, str(tmp_path), SLOW_FORWARD="1.5")
    steps = {rank: sum(s.values()) for rank, s in _per_step(sections).items()}
    assert max(steps.values()) < 1.05 * min(steps.values()), steps  # DDP: every rank's step takes as long
    _check_named(str(tmp_path), events, scores, sections, out, "forward")


def _times(**ms: tuple[float, int]) -> dict[str, SectionTimes]:
    return {name: SectionTimes(total, n, name == "allreduce") for name, (total, n) in ms.items()}


def test_the_cause_is_the_section_with_the_largest_excess_per_step_corroborated_by_the_shortest_wait():
    ranks = {r: _times(data=(50.0, 10), forward=(200.0, 10), optimizer=(5.0, 10), allreduce=(220.0, 10))
             for r in (0, 2)}
    ranks[1] = _times(data=(52.0, 10), forward=(410.0, 10), optimizer=(6.0, 10), allreduce=(20.0, 10))
    cause = attribute(ranks, 1)
    assert cause is not None and cause.sentence() == (
        "its forward takes 41 ms against a median of 20 (+21 ms a step), and it waits least in allreduce (2 ms "
        "against 22)")
    assert cause.fields()["cause_section"] == "forward" and cause.fields()["cause_excess_ms"] == 21.0
    assert step_figures(ranks) == pytest.approx({0: 25.5, 1: 46.8, 2: 25.5})  # waits excepted
    assert attribute(ranks, 0) is None or attribute(ranks, 0).wait_section is None  # a healthy rank waits long
    assert attribute(summed([ranks, ranks]), 1) == cause  # windows summed: the same times per step


def test_a_rank_with_no_section_over_the_median_has_no_cause_and_a_rank_that_does_not_wait_least_no_wait_clause():
    ranks = {0: _times(forward=(100.0, 5), allreduce=(10.0, 5)), 1: _times(forward=(100.0, 5), allreduce=(50.0, 5)),
             2: _times(forward=(150.0, 5), allreduce=(30.0, 5))}
    assert attribute(ranks, 0) is None and attribute(ranks, 1) is None
    cause = attribute(ranks, 2)
    assert cause is not None and cause.wait_section is None and "waits" not in cause.sentence()
    assert attribute({0: _times(forward=(1.0, 1))}, 0) is None  # one rank: no median to compare with
