"""shmstat.testing, the pytest plugin users test their distributed code with, used the way they would: real
rank processes (functions and scripts), a real collector, exact reconciliation, waits that fail with what was
seen, and nothing left in /dev/shm or the runtime directory after a failed, interrupted or killed run."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _plugin_ranks import counting_rank, failing_rank, mp_rank
from _procs import REPO
from _support import wait_for

from shmstat.segment import Segment, pid_alive
from shmstat.testing import ShmstatJob

RANKS_MODULE = os.path.join(REPO, "tests", "_plugin_ranks.py")


def test_function_ranks_reconcile_exactly_with_metrics_and_events(shmstat_job):
    shmstat_job.run_ranks(counting_rank, 3, args=(1500,))
    rows = shmstat_job.wait_for_rows("step_ms", "count", total=4500)
    assert all(r.group == "train" and r.merged for r in rows)
    assert shmstat_job.per_rank("step_ms") == {0: 1500, 1: 1500, 2: 1500}
    assert shmstat_job.merged("step_ms", "sum") == 1500 * (1 + 2 + 3)
    events = shmstat_job.wait_for_event("ckpt.saved", count=3)
    assert sorted((e.rank, e.data["rank"]) for e in events) == [(0, 0), (1, 1), (2, 2)]
    metrics = shmstat_job.wait_for_metric("loss", count=3)
    assert sorted((m.rank, m.value) for m in metrics) == [(0, 0), (1, 10), (2, 20)]


def test_script_ranks_join_through_the_environment(shmstat_job):
    results = shmstat_job.run_ranks([sys.executable, RANKS_MODULE], 2, args=(700,))
    assert [r.exitcode for r in results] == [0, 0]
    shmstat_job.wait_for_rows("step_ms", "count", total=1400)
    assert shmstat_job.per_rank("step_ms") == {0: 700, 1: 700}


def test_subprocess_ranks_started_by_the_test_itself_need_only_the_env(shmstat_job):
    procs = [subprocess.Popen([sys.executable, RANKS_MODULE, "300"], env=shmstat_job.rank_env(r, 2), cwd=REPO)
             for r in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    shmstat_job.wait_for_rows("step_ms", "count", total=600)


def test_multiprocessing_children_started_inside_environ_join_the_job(shmstat_job):
    import multiprocessing as mp

    with shmstat_job.environ():
        procs = [mp.get_context("spawn").Process(target=mp_rank, args=(r, 250)) for r in range(2)]
        for p in procs:
            p.start()
    assert "SHMSTAT_RUNTIME_DIR" not in os.environ or os.environ["SHMSTAT_RUNTIME_DIR"] != shmstat_job.runtime_dir
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    shmstat_job.wait_for_rows("mp_step", "count", total=500)
    assert shmstat_job.per_rank("mp_step") == {0: 250, 1: 250}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (torchrun)")
def test_torchrun_ranks_need_only_the_jobs_env(shmstat_job):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        RANKS_MODULE, "torchrun"], env=shmstat_job.env, cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    shmstat_job.wait_for_rows("tr_step", "count", total=600)
    assert shmstat_job.per_rank("tr_step") == {0: 300, 1: 300}
    assert sorted(e.rank for e in shmstat_job.wait_for_event("tr.done", count=2)) == [0, 1]


def test_a_failing_rank_fails_with_its_exit_code_and_output(shmstat_job):
    with pytest.raises(AssertionError) as err:
        shmstat_job.run_ranks(failing_rank, 3)
    text = str(err.value)
    assert "1 of 3 ranks failed" in text and "rank 1: exit code 1" in text
    assert "rank 1 lost its data loader" in text and "rank 1 starting" in text


def test_waits_fail_with_what_was_seen(shmstat_job):
    shmstat_job.run_ranks(counting_rank, 2, args=(100,))
    shmstat_job.wait_for_rows("step_ms", "count", total=200)
    with pytest.raises(AssertionError, match=r"more than 150: merged 200 in \d+ windows, per rank \{0: 100"):
        shmstat_job.wait_for_rows("step_ms", "count", total=150)
    with pytest.raises(AssertionError, match=r"timed out after 0.3 s .* merged 200"):
        shmstat_job.wait_for_rows("step_ms", "count", total=201, timeout=0.3)
    with pytest.raises(AssertionError, match=r"5 events 'ckpt.saved': saw 2"):
        shmstat_job.wait_for_event("ckpt.saved", count=5, timeout=0.3)


def test_jobs_are_unique_and_close_removes_everything():
    a, b = ShmstatJob(), ShmstatJob()
    try:
        assert a.job != b.job and a.runtime_dir != b.runtime_dir
        a.run_ranks(counting_rank, 1, args=(10,))
        a.wait_for_rows("step_ms", "count", total=10)
        assert a.job in Segment.list_jobs()
        assert b.rows() == []  # b saw nothing of a's job
    finally:
        a.close()
        b.close()
    for j in (a, b):
        assert j.job not in Segment.list_jobs() and not os.path.exists(j.runtime_dir)
        assert not [n for n in os.listdir("/dev/shm") if j.job in n]


_INNER = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from _plugin_ranks import forever_rank

    def test_runs_until_stopped(shmstat_job):
        out = {out!r}
        group = shmstat_job.start_ranks(forever_rank, 2, args=(out,))
        shmstat_job.wait_for_rows("spin", "count")
        while not all(os.path.exists(os.path.join(out, f"rank{{r}}.pid")) for r in range(2)):
            time.sleep(0.01)
        with open(os.path.join(out, "job.tmp"), "w") as f:
            f.write(shmstat_job.job + "\\n" + shmstat_job.runtime_dir + "\\n" + str(shmstat_job._collector.pid))
        os.replace(os.path.join(out, "job.tmp"), os.path.join(out, "job"))
        {then}
''')


def _run_inner(tmp_path: Path, then: str, stop) -> tuple[str, str, list[int], int, str]:
    out = tmp_path / "out"
    out.mkdir()
    test = tmp_path / "test_inner.py"
    test.write_text(_INNER.format(tests=os.path.join(REPO, "tests"), out=str(out), then=then))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             str(test)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (out / "job").exists() or proc.poll() is not None, 60, what="the inner test to start")
        assert proc.poll() is None, proc.communicate()[0]
        job, runtime_dir, collector = (out / "job").read_text().split("\n")
        pids = [int((out / f"rank{r}.pid").read_text()) for r in range(2)]
        stop(proc)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return job, runtime_dir, [*pids, int(collector)], proc.returncode, output


def _nothing_left(job: str, runtime_dir: str, pids: list[int]) -> bool:
    return (not [n for n in os.listdir("/dev/shm") if job in n] and not os.path.exists(runtime_dir)
            and not any(pid_alive(p) for p in pids))


@pytest.mark.parametrize("how", ["fails", "sigint", "sigkill"])
def test_nothing_is_left_after_a_failed_interrupted_or_killed_run(tmp_path, how):
    then = {"fails": "assert False, 'the test fails'", "sigint": "time.sleep(600)", "sigkill": "time.sleep(600)"}
    stop = {"fails": lambda p: None, "sigint": lambda p: p.send_signal(signal.SIGINT),
            "sigkill": lambda p: p.send_signal(signal.SIGKILL)}
    job, runtime_dir, pids, code, output = _run_inner(tmp_path, then[how], stop[how])
    assert code != 0, output
    if how == "fails":
        assert "the test fails" in output
    # killed outright, the test process cannot clean: its collector and ranks die with it and the collector
    # removes what is left, so that takes a moment
    wait_for(lambda: _nothing_left(job, runtime_dir, pids), 30 if how == "sigkill" else 0.001,
             what=f"{job}'s segment, runtime directory and processes to be gone")


def test_the_readme_example_runs(tmp_path):
    readme = Path(REPO, "README.md").read_text(encoding="utf-8")
    section = readme.split("## Testing your distributed code", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "test_example.py").write_text(code)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "test_example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout
