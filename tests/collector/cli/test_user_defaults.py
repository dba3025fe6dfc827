"""What a new user reads (issue 33): each case runs the real ``shmstat`` command and checks what it prints.

torchrun's single-node flags are taken and its multi-node ones refused in one sentence; the default output
names a straggler; the collector's own group reaches a sink only when asked for by name; count-only stats get no
straggler score; a node collector keeps notes off stdout and shows short job ids; a second node collector refuses
at once; every user error is one short sentence; every option has help; ``ls`` says what it counts; ``subscribe``
prints items as objects shaped as the events jsonl and fails for a job that never appears.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
from kit.procs import REPO, rank_worker, read_jsonl, spawn, start_collector
from kit.support import unique_job, wait_for

from collector.cli import command as cli
from collector.daemon.node_lock import NodeLock
from shmstat.shm.segment import Segment

ENV = dict(os.environ, PYTHONPATH=REPO)
SHORT = 160  # the longest a user's one sentence may be


def _shmstat(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=env or ENV, cwd=REPO, timeout=timeout)


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _error(done: subprocess.CompletedProcess[str], prefix: str = "shmstat: error: ") -> str:
    """The one error sentence of a refused command (after its prefix)."""
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith(prefix), done.stderr
    return lines[-1][len(prefix):]


# -- the parser ----------------------------------------------------------------------------------------------------

def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_and_argument_of_every_subcommand_has_help():
    missing = [(name, action.option_strings or action.dest) for name, parser in _subcommands().items()
               for action in parser._actions if not action.help or action.help == argparse.SUPPRESS]
    assert missing == []
    verbose = {name: next(a.help for a in p._actions if "--verbose" in a.option_strings)
               for name, p in _subcommands().items()}
    assert all("collector" not in verbose[name] for name in ("ls", "top", "subscribe", "keys")), verbose


def test_run_takes_torchruns_single_node_flags(tmp_path):
    script = _script(tmp_path, "print('rank ran')\n")
    done = _shmstat("run", "--standalone", "--nnodes", "1:1", "--nproc_per_node", "1", "--status-interval", "0",
                    script)
    assert done.returncode == 0, done.stderr
    assert "rank ran" in done.stdout


@pytest.mark.parametrize("flags, says", [
    (("--nnodes", "2"), "argument --nnodes: shmstat run runs one node"),
    (("--rdzv-endpoint", "host:29400"), "--rdzv-endpoint is torchrun's rendezvous"),
    (("--node_rank", "1"), "--node_rank is torchrun's rendezvous"),
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
])
def test_run_refuses_other_flags_in_one_sentence_with_what_to_use(tmp_path, flags, says):
    done = _shmstat("run", "--nproc-per-node", "2", *flags, "train.py")
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr  # the sentence alone, no screenful of usage (issue 44)
    sentence = _error(done, "shmstat run: error: ")
    assert sentence.startswith(says) and len(sentence) < SHORT, sentence
    if "unrecognized" not in says:
        assert "for more use torchrun with a node collector (see docs/guides/torchrun.md)" in sentence
        assert os.path.exists(os.path.join(REPO, "docs", "guides", "torchrun.md"))


# -- what run and collect print ------------------------------------------------------------------------------------

SLOW_RANK = """
    import os, time
    import shmstat
    from shmstat import Aggregation as A

    rank = int(os.environ["RANK"])
    step = shmstat.Stat("step_ms", [A.COUNT, A.MEAN], 0.1, group="train")
    items = shmstat.Stat("items", [A.COUNT], 0.1, group="train")
    end = time.time() + {seconds}
    while time.time() < end:
        step.add(20.0 if rank == 1 else 10.0)
        for _ in range(1 if rank == 1 else 3):
            items.add(1.0)
        time.sleep(0.002)
    shmstat.shutdown()
"""


def test_the_default_output_names_the_straggler_and_only_timed_stats_are_scored(tmp_path):
    own = str(tmp_path / "own.jsonl")
    script = _script(tmp_path, SLOW_RANK.format(seconds=2.0))
    done = _shmstat("run", "--nproc-per-node", "3", "--handler", f"shmstat=jsonl:{own}", "--grace-ms", "10",
                    "--status-interval", "0", script)
    assert done.returncode == 0, done.stderr
    flagged = [line for line in done.stdout.splitlines() if "straggler: rank 1 on train/step_ms scores 0.50" in line]
    assert len(flagged) == 1, done.stdout
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d(\.\d{3})?\] straggler: rank 1 on train/step_ms scores 0\.50 \(its 20 "
                        r"against a median of 10\) for 3 windows", flagged[0]), flagged[0]
    assert "shmstat run:" not in done.stdout  # notes are on stderr
    scored = {r["name"] for r in read_jsonl(own) if r["name"].startswith("straggler.score.")}
    assert scored == {"straggler.score.train/step_ms"}  # items asked only for COUNT: no score


def test_the_demo_names_its_straggler_through_its_table_handler():
    """The demo's table is a torchelastic handler (the collector wraps it in an adapter); its straggler line must
    still be printed: rank 1 is 1.6x slower on purpose."""
    done = _shmstat("demo", "--seconds", "3")
    assert done.returncode == 0, done.stderr
    flagged = [line for line in done.stdout.splitlines() if "straggler: rank 1 on demo/step_ms" in line]
    assert flagged, done.stdout


def test_the_collectors_own_group_reaches_a_sink_when_named_or_by_star(tmp_path):
    rows, own = str(tmp_path / "rows.jsonl"), str(tmp_path / "own.jsonl")
    script = _script(tmp_path, SLOW_RANK.format(seconds=1.5))
    done = _shmstat("run", "--nproc-per-node", "1", "--handler", f"train=jsonl:{rows}", "--grace-ms", "10",
                    "--status-interval", "0", script)
    assert done.returncode == 0, done.stderr
    groups = {r["group"] for r in read_jsonl(rows)}
    assert groups == {"train"}, groups  # the collector's own group goes nowhere unless asked for
    star = str(tmp_path / "star.jsonl")
    done = _shmstat("run", "--nproc-per-node", "1", "--handler", f"*=jsonl:{star}", "--grace-ms", "10",
                    "--status-interval", "0", script)
    assert done.returncode == 0, done.stderr
    groups = {r["group"] for r in read_jsonl(star)}
    assert "train" in groups and "shmstat" in groups, groups  # '*': every group, the collector's too
    done = _shmstat("run", "--nproc-per-node", "1", "--handler", f"*=jsonl:{rows}", "--handler",
                    f"shmstat=jsonl:{own}", "--grace-ms", "10", "--status-interval", "0", script)
    assert done.returncode == 0, done.stderr
    assert any(r["name"] == "collector.windows_emitted" for r in read_jsonl(own))


def test_a_node_collector_prints_data_on_stdout_notes_on_stderr_and_short_job_ids(tmp_path):
    common = f"defaults-{uuid.uuid4().hex[:8]}-"  # two jobs sharing their first 17 characters
    jobs = [common + "a" + uuid.uuid4().hex[:20], common + "b" + uuid.uuid4().hex[:20]]
    coll = start_collector(None, "--job", jobs[0], "--job", jobs[1], "--grace-ms", "10", "--status-interval", "0",
                           "--prometheus", "127.0.0.1:0", env=ENV)
    try:
        for job in jobs:
            coll.lines_seen(f"job {job} picked up", 60)
        ranks = [spawn(rank_worker, job, 0, 1, 0.5, 100, str(tmp_path / f"r{i}.json")) for i, job in enumerate(jobs)]
        for p in ranks:
            p.join(60)
            assert p.exitcode == 0
        code, out = coll.finish(signal.SIGTERM, 60)
    finally:
        if coll.proc.poll() is None:
            coll.stop(signal.SIGKILL)
        for job in jobs:
            Segment.unlink(job)
    assert code == 0
    notes = "\n".join(coll.lines)
    assert "Prometheus endpoint" in notes and "shmstat collector: node pid" in notes
    assert "shmstat collector" not in out and "Prometheus" not in out  # stdout: data only
    shown = {job: job[: len(common) + 1] for job in jobs}
    for job in jobs:
        assert f"job {job} picked up (shown as {shown[job]})" in notes
    windows = [line for line in out.splitlines() if "train/steps" in line]
    assert windows and all(line.split()[1] in shown.values() for line in windows), out
    assert not any(job in out for job in jobs)  # never the whole id


def test_a_second_node_collector_refuses_at_once_naming_the_first(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = dict(ENV, SHMSTAT_RUNTIME_DIR=str(runtime))
    (runtime / "node-collector.lock").write_text("999999999\n")  # left by a dead one: blocks nothing
    old = os.environ.get("SHMSTAT_RUNTIME_DIR")
    os.environ["SHMSTAT_RUNTIME_DIR"] = str(runtime)
    try:
        held = NodeLock.take()  # this process serves as the first node collector
    finally:
        if old is None:
            del os.environ["SHMSTAT_RUNTIME_DIR"]
        else:
            os.environ["SHMSTAT_RUNTIME_DIR"] = old
    try:
        done = _shmstat("collect", "--handler", "*=null", "--status-interval", "0", env=env, timeout=60)
    finally:
        held.release()
    assert done.returncode == 2 and done.stdout == ""
    sentence = _error(done)
    assert sentence.startswith(f"a node collector (pid {os.getpid()}) already serves every job") and len(
        sentence) < SHORT, sentence


# -- errors --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["jsnl:x", "jsnl:/tmp/x"])
def test_a_mistyped_handler_kind_is_the_same_sentence_however_the_rest_reads(job, spec):
    sentence = _error(_shmstat("collect", "--job", job, "--handler", f"*={spec}"))
    assert sentence.startswith(f"unknown handler kind 'jsnl' in '{spec}'") and len(sentence) < SHORT, sentence
    assert sentence.endswith("use compact, console, null, jsonl:PATH, tensorboard:DIR, otlp:ENDPOINT or "
                             "pkg.module:Class")


def test_a_bad_name_is_one_short_sentence_naming_the_rules_page(tmp_path):
    done = _shmstat("run", "--role", "a\tb" * 40, "--status-interval", "0", _script(tmp_path, "pass\n"))
    assert done.returncode == 2
    sentence = _error(done)
    assert "(the name rule: see docs/reference/name-rule.md)" in sentence and len(sentence) < SHORT, sentence
    assert os.path.exists(os.path.join(REPO, "docs", "reference", "name-rule.md"))


def test_a_window_under_the_rings_shortest_is_taken_without_a_word(tmp_path):
    script = _script(tmp_path, """
        import shmstat
        stat = shmstat.Stat("fast", [shmstat.Aggregation.COUNT], 0.01, group="train")
        stat.add(1.0)
        print("taken")
        shmstat.shutdown()
    """)
    done = _shmstat("run", "--status-interval", "0", script)
    assert done.returncode == 0, done.stderr
    assert "taken" in done.stdout and "window_size" not in done.stdout + done.stderr


def test_subscribing_to_a_job_that_never_appears_fails_with_one_sentence():
    done = _shmstat("subscribe", "--job", unique_job("nosuch"), "--timeout", "0.5")
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert "did not appear on this node before the timeout" in line and len(line) < SHORT, line


# -- ls and subscribe ----------------------------------------------------------------------------------------------

WORKERS_RANK = """
    import multiprocessing as mp, os, time
    import shmstat

    def worker(stop):
        s = shmstat.Stat("loaded", [shmstat.Aggregation.COUNT], 0.1, group="train")
        while not os.path.exists(stop):
            s.add(1.0)
            time.sleep(0.01)

    if __name__ == "__main__":
        stop, ready = os.environ["STOP"], os.environ["READY"]
        s = shmstat.Stat("steps", [shmstat.Aggregation.COUNT], 0.1, group="train")
        s.add(1.0)
        ctx = mp.get_context("spawn")  # as DataLoader workers: they inherit the rank's environment
        kids = [ctx.Process(target=worker, args=(stop,)) for _ in range(2)]
        for k in kids:
            k.start()
        deadline = time.time() + 60
        while not os.path.exists(stop) and time.time() < deadline:
            time.sleep(0.01)
            if not os.path.exists(ready):
                open(ready, "w").close()
        for k in kids:
            k.join()
        shmstat.shutdown()
"""


def test_ls_counts_ranks_and_their_worker_processes_in_columns_of_their_own(tmp_path):
    job = unique_job("ls")
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    run = subprocess.Popen([sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2",
                            "--handler", "*=null", "--status-interval", "0", _script(tmp_path, WORKERS_RANK)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env=dict(ENV, STOP=str(stop), READY=str(ready)))
    try:
        def listed() -> str | None:
            out = _shmstat("ls").stdout
            line = next((x for x in out.splitlines() if x.startswith(job)), "")
            return out if line.split()[1:3] == ["2/2", "4/4"] else None
        out = wait_for(listed, 90, 0.2, what="ls to see 2 ranks and 4 workers")
    finally:
        stop.touch()
        _, err = run.communicate(timeout=90)
    assert run.returncode == 0, err
    assert out.splitlines()[0].split() == ["JOB", "RANKS", "WRITERS", "COLLECTOR", "SIZE", "DROPPED"]
    assert "RANKS and WRITERS: alive/registered" in out.splitlines()[-1]  # what the columns count, without --help


EVENTS_RANK = """
    import datetime, os, time
    import shmstat

    time.sleep(1.0)  # the subscriber is connected by now
    for i in range(5):
        shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {"i": i, "x": float("nan") if i == 2 else i}))
    shmstat.shutdown()
"""


def test_subscribe_prints_each_event_as_the_events_jsonl_writes_it(tmp_path):
    job, kept = unique_job("sub"), str(tmp_path / "events.jsonl")
    sub = subprocess.Popen([sys.executable, "-m", "collector", "subscribe", "--job", job, "--topic", "event/tick"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    try:
        done = _shmstat("run", "--job", job, "--nproc-per-node", "2", "--events", f"jsonl:{kept}",
                        "--handler", "*=null", "--status-interval", "0", _script(tmp_path, EVENTS_RANK))
        assert done.returncode == 0, done.stderr
        out, err = sub.communicate(timeout=60)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.communicate()
    assert sub.returncode == 0, err
    import json

    printed = [item for line in out.splitlines() for item in json.loads(line)["items"]]
    written = [r for r in read_jsonl(kept) if r.get("name") == "tick"]
    assert {r.pop("node") for r in written} == {socket.gethostname()}  # the file's lines name the node that wrote them
    key = lambda r: (r["rank"], r["seq"])  # noqa: E731
    assert len(written) == 10 and sorted(printed, key=key) == sorted(written, key=key)
    assert {"name", "job", "rank", "timestamp", "data", "seq", "pid", "incarnation"} == set(printed[0])


WAITING_RANKS = """
    import os, time
    import shmstat

    rank = int(os.environ["RANK"])
    shmstat.init(section_window_s=0.1)
    end = time.time() + 1.5
    while time.time() < end:
        with shmstat.section("compute"):
            time.sleep(0.006 if rank == 1 else 0.002)
        with shmstat.section("allreduce", wait=True):  # the fast ranks wait for rank 1, as in a DDP step
            time.sleep(0.001 if rank == 1 else 0.005)
    shmstat.shutdown()
"""


def test_a_wait_sections_rows_say_so_and_no_surface_flags_the_ranks_that_wait_longest(tmp_path):
    """In a synchronous job the healthy ranks wait longest in the collective: a wait section's jsonl rows carry
    ``"wait": true`` and neither the collector nor the report (from the rows alone) flags a rank on it, while the
    slow rank's compute section is flagged."""

    from collector.cli.report import load_report

    rows, own = str(tmp_path / "rows.jsonl"), str(tmp_path / "own.jsonl")
    script = _script(tmp_path, WAITING_RANKS)
    done = _shmstat("run", "--nproc-per-node", "3", "--handler", f"section=jsonl:{rows}", "--handler",
                    f"shmstat=jsonl:{own}", "--grace-ms", "10", "--status-interval", "0", script)
    assert done.returncode == 0, done.stderr
    scores = read_jsonl(own)
    slow = {r["rank"] for r in scores if r["name"] == "straggler.score.section/compute" and r["value"] < 0.75}
    assert slow == {1}, scores  # the collector scores the slow rank's compute, and only it
    assert not [r for r in scores if r["name"] == "straggler.score.section/allreduce"]  # never the wait
    lines = read_jsonl(rows)
    waits = [r for r in lines if r["name"].startswith("allreduce.")]
    assert waits and all(r.get("wait") is True for r in waits)
    assert not any(r.get("wait") for r in lines if r["name"].startswith("compute."))
    report = load_report(rows)
    assert report.stats[("section", "allreduce")].wait and report.stats[("section", "allreduce")].score_grid() == {}
    named = {(s.stat, s.rank) for s in report.stragglers()}
    assert ("section/compute", 1) in named and not any("allreduce" in stat for stat, _ in named), named
