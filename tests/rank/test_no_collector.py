"""Telemetry never takes the job down, and a job nobody collects leaves nothing behind.

Real rank processes configured by the environment (as torchrun's are), real fork and spawn workers, real shared
memory, no collector unless said: the rank API (Stat, add, log_event, put_metric, @prof) never raises because of
telemetry's own state (full rank, writer, stat and percentile tables; the segment removed mid-run); what cannot
be written is dropped and counted exactly where ``shmstat ls`` reads it; the job warns once; the last process
of a job no collector serves removes its segment and lock file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from kit.procs import REPO, start_collector
from kit.support import unique_job

from shmstat.shm.segment import Segment

_TAKEOVER = "no collector emitted the windows of the workers that exited"


def _run(job: str, scenario: str, *args: int, env: dict[str, str] | None = None,
         timeout: float = 600) -> tuple[dict, str]:
    """Run one scenario of tests/kit/degrade.py as a rank of ``job``; (its JSON result, its stderr)."""
    full = dict(os.environ, SHMSTAT_JOB=job, SHMSTAT_RANK="0", SHMSTAT_UNCOLLECTED_WARNING_S="3600",
                PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    full.update(env or {})
    r = subprocess.run([sys.executable, "-m", "kit.degrade", scenario, *map(str, args)], env=full, cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _leftovers(job: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"shmstat.{job}"))


@pytest.fixture
def job_id():
    job = unique_job("nc")
    yield job
    Segment.unlink(job)


def _epochs(job: str, n_epochs: int) -> None:
    workers, k = 8, 5
    t0 = time.monotonic()
    got, err = _run(job, "epochs", n_epochs, workers, k)
    took = time.monotonic() - t0
    assert got["codes"] == [0]  # every worker exited cleanly: none raised
    assert got["size0"] == got["size1"]  # the segment never grows
    assert got["rss_end"] - got["rss_warm"] < 4 * 2**20, got  # the rank's memory stays flat
    # every sample is either still in the table (unemitted) or counted as dropped when its entry was taken over
    assert got["dropped"] + got["held"] == got["added"] == n_epochs * workers * k, got
    assert got["dropped"] > 0
    assert err.count(_TAKEOVER) == 1, err  # one warning for the whole job, not one per worker
    assert "run 'shmstat collect' on the node" in err
    assert _leftovers(job) == []  # the rank was the job's last process: segment and lock file removed
    print(f"{n_epochs} epochs x {workers} workers: {took:.1f} s")


def test_fork_workers_every_epoch_without_a_collector_never_exhaust_the_table(job_id):
    """The short form (120 epochs x 8 workers: the 63 writer entries are taken over ~15 times each)."""
    _epochs(job_id, 120)


@pytest.mark.slow
def test_1000_epochs_of_8_fork_workers_without_a_collector(job_id):
    _epochs(job_id, 1000)


def test_a_rank_that_does_not_fit_the_table_uses_the_whole_api_everywhere_without_raising(job_id):
    n, threads = 50, 4
    got, err = _run(job_id, "api_everywhere", n, threads,
                    env={"SHMSTAT_MAX_RANKS": "2", "SHMSTAT_LOCAL_RANK": "5"})
    assert got["codes"] == [0, 0]
    # main, the threads, the fork and the spawn child: two Stats of n samples each, all dropped and counted
    st = got["stats"]
    assert st["header_dropped"] == 2 * n * (1 + threads + 2), st
    assert st["ranks_refused"] == 2  # the rank and its spawn child (the fork child shares its parent's state)
    assert st["rank_dropped"] == 0
    assert err.count("does not fit the 2 entries") == 1, err
    assert "SHMSTAT_MAX_RANKS=" in err


def test_full_writer_table_drops_and_counts_the_samples_of_the_workers_left_out(job_id):
    workers, n = 4, 30
    got, err = _run(job_id, "live_workers", workers, n, env={"SHMSTAT_MAX_RANKS": "3"})
    assert got["codes"] == [0] * workers
    st = got["stats"]
    assert st["writers_refused"] == 2  # 2 writer entries for 4 live workers
    assert st["rank_dropped"] == 2 * n, st
    assert err.count("all 3 entries are held by live processes") == 1, err
    assert "SHMSTAT_MAX_RANKS=6" in err
    assert _leftovers(job_id) == []


def test_full_stat_and_percentile_tables_drop_and_count(job_id, backend):
    n, threads = 40, 3
    got, err = _run(job_id, "api_everywhere", n, threads,
                    env={"SHMSTAT_MAX_STATS": "2", "SHMSTAT_MAX_PERCENTILE_STATS": "0"})
    assert got["codes"] == [0, 0]
    st = got["stats"]
    # the plain Stat fits every process's table; the percentile one fits none: its samples are all dropped
    assert st["rank_dropped"] == n * (1 + threads + 2), st
    assert st["stats_refused"] == 3  # the rank (threads share its writer), the fork and the spawn worker
    assert err.count("gets no slot") == 1, err
    assert "SHMSTAT_MAX_PERCENTILE_STATS=16" in err


def test_the_segment_removed_mid_run_stops_nothing_and_leaves_nothing(job_id):
    n, threads = 20, 2
    got, err = _run(job_id, "removed", n, threads)
    assert got["codes"] == [0, 0]
    # after the removal is noticed every sample of this rank's processes is dropped and counted in its mapping:
    # the two Stats of the rank, its threads and its fork child (n each), then n more to the first Stat; the
    # spawn child, a new process, made a segment of its own and removed it when it exited
    assert got["after"] == 2 * n * (1 + threads + 1) + n, got
    assert err.count("was removed from /dev/shm while the job runs") == 1, err
    assert _leftovers(job_id) == []


def test_workers_of_a_job_whose_segment_was_removed_warn_once_and_count_every_sample(job_id):
    n, workers = 25, 3
    got, err = _run(job_id, "removed_with_workers", n, workers)
    assert got["codes"] == [0] * (2 * workers)
    # the rank's Stat created after the removal and those of the workers alive across it: dropped and counted in
    # the rank's entry of the orphaned mapping, which they all share
    assert got["rank"] == n * (1 + workers), got
    assert min(got["across"]) >= n, got
    # workers started after it do not make the segment again (their samples would go where no one reads them and
    # be removed at their exit, uncounted): every sample dropped and counted in the worker
    assert got["late"] == [n] * workers and not got["late_made_it"], got
    assert err.count("was removed from /dev/shm while the job runs") == 1, err  # one for the job, not per worker
    assert _leftovers(job_id) == []


def test_an_unusable_lock_file_mid_run_stops_nothing(job_id):
    n, threads = 20, 2
    got, err = _run(job_id, "lock_unusable", n, threads)
    assert got["codes"] == [0, 0]
    st = got["stats"]
    # new Stats of the rank, its threads and its fork child cannot take the lock: dropped and counted without it
    # (the spawn child cannot attach at all and stays in-process); the slot taken before keeps working
    assert st["rank_dropped"] == st["process_dropped"] == 2 * n * (1 + threads + 1), st
    assert st["writers_refused"] == 1  # the fork child
    assert "lock file" in err


def test_workers_that_log_events_without_a_collector_exit_at_once(job_id):
    """No collector serves the job: a worker that logged an event and put a metric exits without waiting out
    the publisher's linger (2 s) for an acknowledgement no one will send; what it held is counted as dropped."""
    got, _err = _run(job_id, "event_epochs", 3, 4)
    assert got["codes"] == [0]
    # each epoch starts 4 fork workers and joins them: one waiting out the linger makes it last >= 2 s, every
    # time; the fastest epoch is compared, so a loaded machine does not make it flake
    assert min(got["took"]) < 1.0, got["took"]


def test_a_two_rank_job_without_a_collector_leaves_nothing(job_id):
    env = dict(os.environ, SHMSTAT_JOB=job_id, SHMSTAT_WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    procs = [subprocess.Popen([sys.executable, "-m", "kit.degrade", "simple", "1000"],
                              env=dict(env, SHMSTAT_RANK=str(r)), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _out, errs = p.communicate(timeout=120)
        assert p.returncode == 0, errs
    assert _leftovers(job_id) == []


def test_the_last_process_of_a_job_nobody_collects_says_how_many_samples_it_removes(job_id):
    """The samples no collector emitted go with the segment: the exit says how many, once (a torchrun rank done
    before the node's collector was up lost 2,000 samples and said only "1 events ... no collector took")."""
    got, err = _run(job_id, "simple", 1234)
    assert got == {"ok": True}
    assert _leftovers(job_id) == []
    assert err.count("1234 samples no collector emitted") == 1, err


def test_ranks_leave_the_segment_of_a_job_a_collector_serves(job_id):
    coll = start_collector(job_id, "--handler", "*=null", "--status-interval", "0")
    try:
        got, _err = _run(job_id, "simple", 100)
        assert got == {"ok": True}
        assert f"shmstat.{job_id}" in _leftovers(job_id)  # the collector's to remove, not the rank's
    finally:
        coll.stop()


def test_workers_exiting_before_their_rank_leave_its_segment(job_id):
    got, _err = _run(job_id, "workers_exit_first", 10)
    assert got["codes"] == [0, 0]
    assert got["still_there"]
    assert _leftovers(job_id) == []  # removed by the rank, the last process


def test_ls_and_the_collector_show_what_was_dropped(job, tmp_path):
    from kit.procs import read_jsonl

    import shmstat
    from shmstat import Aggregation as A

    shmstat.init(job, rank=0, publish=False, max_stats=1)
    shmstat.Stat("fits", [A.COUNT], 1.0).add(1.0)
    dropped = shmstat.Stat("no-room", [A.COUNT], 1.0)
    for _ in range(7):
        dropped.add(1.0)
    assert shmstat.stats().dropped_samples == 7
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ls = subprocess.run([sys.executable, "-m", "collector", "ls"], capture_output=True, text=True, env=env,
                        cwd=REPO, timeout=60)
    row = next(line for line in ls.stdout.splitlines() if line.startswith(job))
    assert "DROPPED" in ls.stdout and row.split()[5] == "7", ls.stdout
    assert "no room for 0 rank(s), 0 worker(s), 1 stat(s)" in row
    out = str(tmp_path / "m.jsonl")  # the collector's own group, asked for by name
    coll = start_collector(job, "--handler", f"shmstat=jsonl:{out}", "--status-interval", "0")
    coll.stop()
    rows = read_jsonl(out)
    assert [r["value"] for r in rows if r["name"] == "collector.samples_dropped"][-1] == 7
    assert [r["value"] for r in rows if r["name"] == "collector.no_room_stats"][-1] == 1
