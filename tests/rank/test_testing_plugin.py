"""shmstat.testing, the pytest plugin users test their distributed code with, used the way they would: real
rank processes (functions and scripts), a real collector, exact reconciliation, waits that fail with what was
seen, and nothing left in /dev/shm or the runtime directory after a failed, interrupted or killed run."""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from kit.plugin_ranks import (
    LoadsOnlyHere,
    counting_rank,
    failing_rank,
    forever_rank,
    gloo_rank,
    mp_rank,
    orphaning_rank,
    raise_or_block_rank,
)
from kit.procs import REPO
from kit.support import wait_for

import shmstat
import shmstat.testing._ranks
from shmstat.errors import CollectorError, ConfigError, ShmstatError
from shmstat.shm.segment import Segment, pid_alive
from shmstat.testing import RanksFailed, ShmstatJob, start_collector, unique_job_id

RANKS_MODULE = os.path.join(REPO, "tests", "kit", "plugin_ranks.py")


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
    with pytest.raises(RanksFailed) as err:
        shmstat_job.run_ranks(failing_rank, 3)
    text = str(err.value)
    assert isinstance(err.value, AssertionError) and isinstance(err.value, ShmstatError)
    assert text.startswith("1 of 3 ranks failed: rank 1 exit code 1 after ") and "rank 1 (exit code 1)" in text
    assert "rank 1 lost its data loader" in text and "rank 1 starting" in text
    assert [r.exitcode for r in err.value.results][1] == 1
    again = pickle.loads(pickle.dumps(err.value))  # as a worker process would send it
    assert str(again) == text and again.results == err.value.results


def _gone(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return not any(alive(p) for p in pids)


def test_what_a_rank_leaves_running_when_it_exits_is_ended(shmstat_job, tmp_path):
    assert [r.exitcode for r in shmstat_job.run_ranks(orphaning_rank, 2, args=(str(tmp_path),))] == [0, 0]
    children = [int((tmp_path / f"child{r}.pid").read_text()) for r in range(2)]
    wait_for(lambda: _gone(children), 5, what="the children the ranks left to be gone")


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["blocked", "blocked-deaf-to-sigterm"])
def test_one_rank_raising_ends_the_blocked_ones_at_once(shmstat_job, tmp_path, ignore_sigterm):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        shmstat_job.run_ranks(raise_or_block_rank, 3, args=(str(tmp_path), ignore_sigterm), timeout=60)
    took = time.monotonic() - start
    failed_after = time.time() - float((tmp_path / "failed_at").read_text())
    text = str(err.value)
    assert failed_after < 10, f"run_ranks failed {failed_after:.1f} s after rank 0 raised (timeout 60 s): {text}"
    assert took < 30, f"run_ranks took {took:.1f} s in all (timeout 60 s)"  # the ranks' start counts here
    assert text.startswith("1 of 3 ranks failed: rank 0 exit code 1 after "), text
    assert "ranks 1, 2 still running, so ended" in text
    assert "Traceback (most recent call last)" in text and "RuntimeError: rank 0 ran out of data" in text
    took_s = float(re.search(r"rank 0 exit code 1 after ([0-9.]+) s", text).group(1))
    assert 0 < took_s < took + 0.005  # the message rounds to hundredths: 1.1197 s reads 1.12
    by_rank = {r.rank: r for r in err.value.results}
    assert by_rank[0].exitcode == 1 and not by_rank[0].stopped
    killed_by = signal.SIGKILL if ignore_sigterm else signal.SIGTERM
    assert all(by_rank[r].stopped and by_rank[r].exitcode == -killed_by for r in (1, 2))
    pids = [int((tmp_path / f"{what}{r}.pid").read_text()) for what, r in
            [("rank", 0), ("rank", 1), ("rank", 2), ("child", 1), ("child", 2)]]
    wait_for(lambda: _gone(pids), 5, what="the ranks and their children to be gone")


def test_command_ranks_fail_fast_too(shmstat_job):
    code = ("import os, sys, time\nprint('rank', os.environ['SHMSTAT_RANK'], 'up', flush=True)\n"
            "sys.exit(3) if os.environ['SHMSTAT_RANK'] == '0' else time.sleep(600)")
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        shmstat_job.run_ranks([sys.executable, "-c", code], 2, timeout=60)
    assert time.monotonic() - start < 30
    text = str(err.value)
    assert re.match(r"1 of 2 ranks failed: rank 0 exit code 3 after [0-9.]+ s; rank 1 still running, so ended\n"
                    r"rank 0 \(exit code 3\), its output ends with:\nrank 0 up$", text), text
    assert [(r.exitcode, r.stopped) for r in err.value.results] == [(3, False), (-signal.SIGTERM, True)]


@pytest.mark.parametrize("watcher", ["pidfd", "polling"])
def test_wait_fails_fast_and_without_check_returns_who_was_ended(shmstat_job, tmp_path, monkeypatch, watcher):
    if watcher == "polling":  # kernels before 5.3 have no pidfd_open
        monkeypatch.setattr(shmstat.testing._ranks, "_pidfd", lambda pid: None)
    group = shmstat_job.start_ranks(raise_or_block_rank, 2, args=(str(tmp_path), False))
    results = group.wait(60, check=False)
    assert [(r.exitcode, r.stopped) for r in results] == [(1, False), (-signal.SIGTERM, True)]
    assert results[0].seconds is not None and results[0].how == "exit code 1"
    assert results[1].how == "killed by SIGTERM"
    assert _gone(group.pids)


def test_a_rank_still_running_at_the_timeout_fails_with_its_output(shmstat_job, tmp_path):
    group = shmstat_job.start_ranks(forever_rank, 2, args=(str(tmp_path),))
    wait_for(lambda: all((tmp_path / f"rank{r}.pid").exists() for r in range(2)), 60, what="the ranks to start")
    with pytest.raises(RanksFailed) as err:
        group.wait(0.5)
    text = str(err.value)
    assert text.startswith("2 of 2 ranks failed: ranks 0, 1 still running after the 0.5 s timeout, so ended")
    assert "rank 1 (killed by SIGTERM), its output ends with:" in text
    assert _gone(group.pids)


def test_without_fail_fast_the_wait_runs_to_the_timeout_and_says_so(shmstat_job, tmp_path):
    group = shmstat_job.start_ranks(raise_or_block_rank, 2, args=(str(tmp_path), False))
    wait_for(lambda: (tmp_path / "failed_at").exists(), 60, what="rank 0 to fail")
    with pytest.raises(RanksFailed, match=r"^2 of 2 ranks failed: rank 0 exit code 1 after [0-9.]+ s; rank 1 still "
                                          r"running after the 1 s timeout, so ended\n"):
        group.wait(1, fail_fast=False)
    assert _gone(group.pids)


def test_without_check_ranks_still_running_at_the_timeout_are_left_running(shmstat_job, tmp_path):
    group = shmstat_job.start_ranks(forever_rank, 1, args=(str(tmp_path),))
    assert [(r.exitcode, r.stopped, r.seconds) for r in group.wait(0.2, check=False)] == [(None, False, None)]
    assert psutil.pid_exists(group.pids[0])
    group.kill()
    assert group.wait(0, check=False)[0].exitcode == -signal.SIGTERM and _gone(group.pids)


@pytest.mark.torch
def test_a_rank_raising_ends_a_rank_blocked_in_a_gloo_all_reduce(shmstat_job, tmp_path):
    pytest.importorskip("torch.distributed")
    with pytest.raises(RanksFailed) as err:
        shmstat_job.run_ranks(gloo_rank, 3, args=(str(tmp_path),), timeout=180)
    failed_after = time.time() - float((tmp_path / "failed_at").read_text())
    text = str(err.value)
    assert failed_after < 10, f"run_ranks failed {failed_after:.1f} s after rank 2 raised: {text}"
    assert text.startswith("1 of 3 ranks failed: rank 2 exit code 1 after ") and "ranks 0, 1 still running" in text
    assert "RuntimeError: rank 2 hit a bad batch" in text
    assert (tmp_path / "rank1.in_collective").exists()
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(3)]
    wait_for(lambda: _gone(pids), 5, what="the ranks to be gone")


def _module_level(rank: int) -> None:
    """A rank body that is fine to run."""


def _closure_over(n: int):
    def body(rank: int) -> None:
        print(rank + n)

    return body


def test_a_function_ranks_cannot_import_is_refused_in_one_sentence(shmstat_job):
    def inside_the_test(rank: int) -> None:
        pass

    here = "test_a_function_ranks_cannot_import_is_refused_in_one_sentence.<locals>"
    for target, qualname in [(inside_the_test, f"{here}.inside_the_test"), (lambda rank: None, f"{here}.<lambda>"),
                             (_closure_over(3), "_closure_over.<locals>.body")]:
        with pytest.raises(ConfigError) as err:
            shmstat_job.run_ranks(target, 2)
        text = str(err.value)
        assert text.startswith("run_ranks needs a function defined at module level of an importable module")
        assert text.endswith(f"got test_testing_plugin.{qualname}; move it to module level"), text
        assert "\n" not in text and err.value.__cause__ is None
    with pytest.raises(ConfigError, match=r"^run_ranks sends args to each rank's fresh interpreter, so they must "
                                          r"pickle, but .*lambda.*; pass plain data") as err:
        shmstat_job.run_ranks(_module_level, 2, args=(lambda: 1,))
    assert "\n" not in str(err.value)
    assert not [n for n in os.listdir(shmstat_job.runtime_dir) if n.startswith("rank")]  # no rank was started
    shmstat_job.run_ranks(_module_level, 2)  # a module-level function of the test module itself is fine


def test_a_rank_failing_before_its_function_runs_shows_why(shmstat_job):
    with pytest.raises(RanksFailed) as err:
        shmstat_job.run_ranks(counting_rank, 2, args=(LoadsOnlyHere(),))
    text = str(err.value)
    assert "ImportError: this argument cannot be loaded in a rank" in text and "Traceback" in text


_IMPORTLIB_MODE = textwrap.dedent('''
    def body(rank):
        pass

    def test_it(shmstat_job):
        shmstat_job.run_ranks(body, 2)
''')


def test_a_function_of_a_module_off_sys_path_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "test_importlib_mode.py").write_text(_IMPORTLIB_MODE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "--import-mode=importlib", "--rootdir", str(tmp_path), "inner/test_importlib_mode.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONSAFEPATH="1", PYTHONPATH=REPO))
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"E +shmstat.errors.ConfigError: run_ranks needs a function defined at module level of an "
                     r"importable module \(each rank imports it in a fresh interpreter\), got "
                     r"inner.test_importlib_mode.body from module 'inner.test_importlib_mode', which is not on "
                     r"sys.path \(pytest's importlib import mode\?\); use pytest's default import mode or put the "
                     r"function in a module on sys.path\n", r.stdout), r.stdout


def test_a_test_attached_with_attach_here_tears_down_at_once_and_keeps_every_window():
    job = ShmstatJob()
    job.attach_here()
    samples = 5000
    step = shmstat.Stat("here_step", [shmstat.Aggregation.COUNT], 0.05)
    for _ in range(samples):
        step.add(1.0)
    collector = job._collector.pid
    start = time.monotonic()
    job.close()
    took = time.monotonic() - start
    assert took < 1.5, f"teardown took {took:.2f} s"
    assert job.merged("here_step") == samples  # the open window too: emitted at the collector's stop
    assert job.per_rank("here_step") == {0: samples}
    assert not [n for n in os.listdir("/dev/shm") if job.job in n] and not os.path.exists(job.runtime_dir)
    assert not psutil.pid_exists(collector)


def test_waits_fail_with_what_was_seen(shmstat_job):
    shmstat_job.run_ranks(counting_rank, 2, args=(100,))
    shmstat_job.wait_for_rows("step_ms", "count", total=200)
    with pytest.raises(AssertionError, match=r"more than 150: merged 200 in \d+ windows, per rank \{0: 100"):
        shmstat_job.wait_for_rows("step_ms", "count", total=150)
    with pytest.raises(AssertionError, match=r"timed out after 0.3 s .* merged 200"):
        shmstat_job.wait_for_rows("step_ms", "count", total=201, timeout=0.3)
    with pytest.raises(AssertionError, match=r"5 events 'ckpt.saved': saw 2"):
        shmstat_job.wait_for_event("ckpt.saved", count=5, timeout=0.3)


def test_a_wait_on_data_that_times_out_names_the_ranks_that_failed_meanwhile(shmstat_job):
    group = shmstat_job.start_ranks(failing_rank, 2)
    wait_for(lambda: group.results()[1].exitcode is not None, 60, what="rank 1 to fail")
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for .*; meanwhile rank 1 exit code 1 "
                                             r"after [0-9.]+ s \(.*RuntimeError: rank 1 lost its data loader\)$"):
        shmstat_job.wait_for_rows("step_ms", "count", total=1, timeout=0.2)


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
    from kit.plugin_ranks import forever_rank

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
    section = Path(REPO, "docs", "guides", "pytest-plugin.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "test_example.py").write_text(code)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "test_example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout


def test_start_collector_returns_once_it_serves_and_a_collector_that_cannot_start_says_why():
    """The one way tests start a collector process: it returns with what the ready file said, the process
    serving; its private ready file goes at the stop; a collector that ends before serving raises its sentence."""
    job = unique_job_id("start")
    coll = start_collector(["collect", "--job", job, "--handler", "*=null", "--status-interval", "0"])
    try:
        assert coll.proc.poll() is None and coll.info["pid"] == coll.proc.pid and coll.info["job"] == job
        assert coll.publish.startswith("ipc://") and coll.ingest is not None and coll.prometheus is None
        assert coll.lines_seen("shmstat collector:")
    finally:
        assert coll.stop() == 0
    assert not os.path.exists(os.path.dirname(coll.ready_file)) and job not in Segment.list_jobs()
    with pytest.raises(CollectorError, match=r"(?s)did not start: it ended \(exit status 2\).*--grace-ms must be"):
        start_collector(["collect", "--job", job, "--grace-ms", "-1"])
