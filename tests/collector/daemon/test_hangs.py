"""Hangs named while they happen (collector.daemon.hangs): real ranks in sections, a real collector with a short
--hang-after, the events it keeps, its console and its /metrics."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.parse
import urllib.request

from kit.procs import read_jsonl, spawn, start_collector
from kit.prometheus import needs_prometheus, query, scraping, start_prometheus_as_written, static_job
from kit.support import wait_for

from collector.cli.prometheus_rules import rules_yaml
from collector.daemon.hangs import innermost_frames

HANG_AFTER = 2


def _wait_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def _block_until_go(tmp: str) -> None:
    """Block in the kernel until :func:`_go` (opening the FIFO ``go.fifo`` waits for a writer): the process sleeps
    throughout, where polling for a file shows it running now and then on a loaded machine."""
    os.close(os.open(os.path.join(tmp, "go.fifo"), os.O_RDONLY))


def _fifo(tmp: str) -> None:
    if not os.path.exists(os.path.join(tmp, "go.fifo")):
        os.mkfifo(os.path.join(tmp, "go.fifo"), 0o600)


def _go(tmp: str) -> int:
    """Let every rank go on: the file ``go``, and the FIFO's writer end (held open until the ranks ended: a
    rank that opens the FIFO later is let through at once); the writer's descriptor, to close."""
    open(os.path.join(tmp, "go"), "w").close()
    return os.open(os.path.join(tmp, "go.fifo"), os.O_RDWR | os.O_NONBLOCK)


def _rank(job: str, rank: int, world: int, role: str, tmp: str, stacks: bool) -> None:
    """A rank: steps in sections (``data``, then the wait section ``allreduce``) for a moment, then, until the file
    ``go`` exists, ``stuck`` sleeps in ``data``, ``waits`` waits in ``allreduce``, ``plain`` (no section at all)
    sleeps; ``holds`` waits in ``allreduce`` until ``go`` exists, then writes ``released``, for which ``follows``
    waits in ``allreduce`` (a collective the holding rank ends); then a few steps more."""
    import shmstat

    shmstat.init(job, rank=rank, local_rank=rank, world_size=world, hang_stacks=stacks)
    go = os.path.join(tmp, "go")

    def steps(n: int) -> None:
        for _ in range(n):
            with shmstat.section("data"):
                time.sleep(0.01)
            with shmstat.section("allreduce", wait=True):
                time.sleep(0.01)
            shmstat.advance_step()

    def ready() -> None:  # once in the place the role holds: a test that kills the rank then finds it there
        open(os.path.join(tmp, f"ready.{rank}"), "w").close()

    if role != "plain":
        steps(10)
    if role == "stuck":
        with shmstat.section("data"):
            ready()
            _block_until_go(tmp)
    elif role in ("waits", "holds", "follows"):
        with shmstat.section("data"):
            pass
        with shmstat.section("allreduce", wait=True):
            ready()
            _wait_file(os.path.join(tmp, "released") if role == "follows" else go)
            if role == "holds":
                open(os.path.join(tmp, "released"), "w").close()
    else:
        ready()
        _wait_file(go)
    if role != "plain":
        steps(10)
    shmstat.shutdown()


def _start_job(job: str, tmp: str, roles: list[str], stacks: bool = False) -> list:
    _fifo(tmp)
    procs = [spawn(_rank, job, r, len(roles), role, tmp, stacks) for r, role in enumerate(roles)]
    wait_for(lambda: all(os.path.exists(os.path.join(tmp, f"ready.{r}")) for r in range(len(roles))), timeout_s=60)
    return procs


def _events(path: str, name: str) -> list[dict]:
    return [e for e in read_jsonl(path) if e["name"] == name]


def _hang(path: str, deadline_s: float, ranks: str = "0,1,2") -> dict:
    """The one ``shmstat.hang`` event on the table of ``ranks``, waited for at most ``deadline_s`` seconds. A rank
    slow to start (a loaded machine) can leave an earlier episode named without it: its first phase word is
    progress, so that one was resolved before; those are skipped (:func:`_whole`)."""
    wait_for(lambda: _whole(path, ranks), timeout_s=deadline_s)
    (event,) = _whole(path, ranks)
    return event["data"]


def _whole(path: str, ranks: str) -> list[dict]:
    """The ``shmstat.hang`` events named on the table of ``ranks``; checks that each earlier one was resolved."""
    hangs = _events(path, "shmstat.hang")
    whole = [i for i, e in enumerate(hangs) if e["data"]["ranks"] == ranks]
    if whole:
        assert len(_events(path, "shmstat.hang.resolved")) >= whole[0], read_jsonl(path)
    return [hangs[i] for i in whole]


def _collector(job: str, tmp: str, *extra: str):
    return start_collector(job, "--hang-after", str(HANG_AFTER), "--status-interval", "0", "--grace-ms", "10",
                           "--events", f"jsonl:{tmp}/events.jsonl", *extra)


def _finish(coll, procs: list, tmp: str) -> str:
    held = _go(tmp)
    try:
        for p in procs:
            p.join(60)
    finally:
        os.close(held)
    _, out = coll.finish()
    return out


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_a_rank_stuck_in_a_section_is_named_once_with_its_state_stacks_and_metrics_and_resolves(job, tmp_path):
    tmp = str(tmp_path)
    events = f"{tmp}/events.jsonl"
    coll = _collector(job, tmp, "--prometheus", "127.0.0.1:0")
    procs = _start_job(job, tmp, ["waits", "stuck", "waits"], stacks=True)
    try:
        in_place = time.monotonic()
        data = _hang(events, HANG_AFTER + 5)
        assert time.monotonic() - in_place <= HANG_AFTER + 5
        line = data["line"]
        assert re.search(r"ranks 0,2 in allreduce for \d+ s; rank 1 in data for \d+ s \(pid "
                         rf"{procs[1].pid}, sleeping, \d+% CPU, stacks: \S+\)", line), line
        assert data["suspects"] == "1" and data["rank.1.status"] == "sleeping" and data["elsewhere"] is False
        assert "_block_until_go" in data["rank.1.stacks"] and data["rank.1.stacks_file"] in line
        body = _scrape(coll.prometheus)
        hung = re.search(rf'shmstat_job_hung{{job="{job}",node="[^"]+"}} 1\.0', body)
        age = re.search(rf'shmstat_rank_progress_age_seconds{{job="{job}",node="[^"]+",rank="1",section="data",'
                        r'wait="0"} ([0-9.]+)', body)
        waits = re.findall(rf'shmstat_rank_progress_age_seconds{{job="{job}",[^}}]*section="allreduce",wait="1"}}',
                           body)
        assert hung and age and float(age.group(1)) >= HANG_AFTER and len(waits) == 2, body
        suspects = re.findall(rf'shmstat_hang_suspect_age_seconds{{job="{job}",node="[^"]+",rank="(\d+)",'
                              r'section="(\w*)",state="(\w+)"} ([0-9.]+)', body)
        assert [s[:3] for s in suspects] == [("1", "data", "sleeping")] and float(suspects[0][3]) >= HANG_AFTER, body
        os.close(_go(tmp))  # a writer's open lets the blocked reader through, closed or not
        wait_for(lambda: _events(events, "shmstat.hang.resolved"), timeout_s=10)
        wait_for(lambda: "shmstat_hang_suspect_age_seconds{" not in _scrape(coll.prometheus), timeout_s=10,
                 interval_s=0.2, what="the suspect's series gone once the hang resolved")
        time.sleep(0.5)  # a second episode or line would come now
    finally:
        out = _finish(coll, procs, tmp)
    hangs = _events(events, "shmstat.hang")
    assert len(_whole(events, "0,1,2")) == 1 and len(_events(events, "shmstat.hang.resolved")) == len(hangs)
    said = [ln for ln in out.splitlines() if "hang:" in ln]
    assert len(said) == len(hangs) and len([ln for ln in said if line in ln]) == 1, out


def test_a_sigstopped_rank_is_named_stopped(job, tmp_path):
    tmp = str(tmp_path)
    coll = _collector(job, tmp)
    procs = _start_job(job, tmp, ["waits", "stuck"])
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        data = _hang(f"{tmp}/events.jsonl", HANG_AFTER + 5, "0,1")
        assert re.search(rf"rank 1 in data for \d+ s \(pid {procs[1].pid}, stopped, 0% CPU\)", data["line"]), data
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        _finish(coll, procs, tmp)


def test_a_rank_sigstopped_in_a_wait_section_is_named_stopped_not_another_nodes(job, tmp_path):
    tmp = str(tmp_path)
    coll = _collector(job, tmp)
    procs = _start_job(job, tmp, ["waits", "waits", "waits"])
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        data = _hang(f"{tmp}/events.jsonl", HANG_AFTER + 5)
        assert re.fullmatch(rf"hang: job {job}: ranks 0,2 in allreduce for \d+ s; rank 1 in allreduce for \d+ s "
                            rf"\(pid {procs[1].pid}, stopped, 0% CPU\)", data["line"]), data
        assert (data["suspects"], data["elsewhere"]) == ("1", False)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        _finish(coll, procs, tmp)


@needs_prometheus
def test_live_shmstathang_names_a_rank_sigstopped_in_a_wait_section_and_resolves_on_sigcont(job, tmp_path):
    """Every rank waits in ``allreduce``, rank 1 because it is SIGSTOPped there (the others wait for it to end the
    collective): a real Prometheus scraping the collector every second and loading the printed rules
    (``--hang-after 2``) fires ``ShmstatHang`` for rank 1 alone, with its section and state, and resolves it once
    SIGCONT lets the collective end."""
    tmp = str(tmp_path)
    coll = _collector(job, tmp, "--prometheus", "127.0.0.1:0", "--prometheus-node", "node-a")
    path = tmp_path / "shmstat-rules.yml"
    path.write_text(rules_yaml(hang_after_s=HANG_AFTER, interval_s=4, windows=1))
    prom, base = start_prometheus_as_written(tmp_path, (
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{path}']\nscrape_configs:\n" + static_job([urllib.parse.urlsplit(coll.prometheus).netloc])))
    procs = _start_job(job, tmp, ["follows", "holds", "follows"])
    os.kill(procs[1].pid, signal.SIGSTOP)
    alert = f'ALERTS{{alertname="ShmstatHang", job="{job}"}}'
    try:
        wait_for(lambda: scraping(base), 60, what=f"Prometheus scraping (log: {tmp_path / 'prometheus.log'})")
        wait_for(lambda: query(base, f'{alert[:-1]}, alertstate="firing"}}'), HANG_AFTER + 30, interval_s=0.5,
                 what=f"ShmstatHang firing (log: {tmp_path / 'prometheus.log'})")
        named = [{k: v for k, v in r["metric"].items() if k not in ("__name__", "instance")}
                 for r in query(base, alert)]
        assert named == [{"alertname": "ShmstatHang", "alertstate": "firing", "job": job, "node": "node-a",
                          "rank": "1", "section": "allreduce", "state": "stopped", "severity": "critical"}], named
        open(os.path.join(tmp, "go"), "w").close()
        os.kill(procs[1].pid, signal.SIGCONT)
        wait_for(lambda: _events(f"{tmp}/events.jsonl", "shmstat.hang.resolved"), timeout_s=10)
        wait_for(lambda: not query(base, alert), 15, interval_s=0.5, what="ShmstatHang resolved")
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        try:
            _finish(coll, procs, tmp)
        finally:
            prom.terminate()
            prom.wait(30)


def test_a_rank_that_died_in_its_section_is_named_died(job, tmp_path):
    tmp = str(tmp_path)
    coll = _collector(job, tmp)
    procs = _start_job(job, tmp, ["waits", "stuck", "waits"])
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    try:
        data = _hang(f"{tmp}/events.jsonl", HANG_AFTER + 5)
        assert re.search(rf"ranks 0,2 in allreduce for \d+ s; rank 1 in data for \d+ s \(pid {procs[1].pid}, "
                         r"died\)", data["line"]), data
    finally:
        _finish(coll, procs, tmp)


def test_every_rank_waiting_in_one_wait_section_names_another_node(job, tmp_path):
    tmp = str(tmp_path)
    coll = _collector(job, tmp)
    procs = _start_job(job, tmp, ["waits", "waits"])
    try:
        data = _hang(f"{tmp}/events.jsonl", HANG_AFTER + 5, "0,1")
        assert re.fullmatch(rf"hang: job {job}: ranks 0,1 in allreduce for \d+ s; the rank holding the job is "
                            r"elsewhere \(another node\)", data["line"]), data
        assert data["elsewhere"] is True and data["suspects"] == ""
    finally:
        _finish(coll, procs, tmp)


def test_hang_after_0_says_nothing(job, tmp_path):
    off = tmp_path
    coll = start_collector(job, "--hang-after", "0", "--status-interval", "0", "--events", f"jsonl:{off}/events.jsonl",
                           "--prometheus", "127.0.0.1:0")
    procs = _start_job(job, str(off), ["waits", "stuck"])
    try:
        time.sleep(HANG_AFTER + 2)
        assert "shmstat_rank_progress_age_seconds{" not in _scrape(coll.prometheus)
    finally:
        out = _finish(coll, procs, str(off))
    assert not _events(f"{off}/events.jsonl", "shmstat.hang") and "hang" not in out


def test_a_job_without_sections_says_nothing(job, tmp_path):
    tmp = str(tmp_path)
    coll = _collector(job, tmp)
    procs = _start_job(job, tmp, ["plain", "plain"])
    try:
        time.sleep(HANG_AFTER + 2)
    finally:
        out = _finish(coll, procs, tmp)
    assert not _events(f"{tmp}/events.jsonl", "shmstat.hang") and "hang" not in out


def test_innermost_frames_keep_each_threads_first_frames_within_the_bound():
    dump = ("Thread 0x01 (most recent call first):\n" + "".join(f'  File "a.py", line {i} in f{i}\n' for i in range(9))
            + "\nCurrent thread 0x02 (most recent call first):\n  File \"b.py\", line 1 in g\n")
    text = innermost_frames(dump, per_thread=2)
    assert text.splitlines() == ["Thread 0x01 (most recent call first):", '  File "a.py", line 0 in f0',
                                 '  File "a.py", line 1 in f1', "Current thread 0x02 (most recent call first):",
                                 '  File "b.py", line 1 in g']
    assert len(innermost_frames(dump * 100, limit=300)) == 300


def test_a_rank_that_shows_up_after_the_hang_was_named_changes_the_named_picture(job, tmp_path):
    """Ranks 0 and 2 wait in ``allreduce`` while rank 1 has not started (a slow start): the node names the holder
    elsewhere; then rank 1 starts, steps and sticks in ``data``. The episode named on the old picture resolves (a
    rank that shows up is progress) and the next one names rank 1, once."""
    tmp = str(tmp_path)
    events = f"{tmp}/events.jsonl"
    coll = _collector(job, tmp)
    _fifo(tmp)
    procs = [spawn(_rank, job, r, 3, "waits", tmp, False) for r in (0, 2)]
    try:
        first = _hang(events, 60, "0,2")
        assert first["elsewhere"] is True and first["ranks"] == "0,2", first
        procs.append(spawn(_rank, job, 1, 3, "stuck", tmp, False))
        wait_for(lambda: len(_events(events, "shmstat.hang")) == 2, timeout_s=60,
                 what="the hang named again once rank 1 showed up")
        names = [e["name"] for e in read_jsonl(events) if e["name"].startswith("shmstat.hang")]
        assert names == ["shmstat.hang", "shmstat.hang.resolved", "shmstat.hang"], names
        data = _events(events, "shmstat.hang")[1]["data"]
        assert re.search(rf"ranks 0,2 in allreduce for \d+ s; rank 1 in data for \d+ s \(pid {procs[2].pid}, "
                         r"sleeping", data["line"]), data
        assert (data["suspects"], data["elsewhere"]) == ("1", False)
    finally:
        out = _finish(coll, procs, tmp)
    assert len([ln for ln in out.splitlines() if "hang:" in ln]) == 2, out


def test_a_suspect_that_dies_while_the_hang_lasts_is_named_again_died(job, tmp_path):
    """Rank 1 is named stuck in ``data`` (sleeping); then it is SIGKILLed, and no rank makes progress: the episode
    resolves with reason ``changed`` and the next one, named at once, says rank 1 died; no more after."""
    tmp = str(tmp_path)
    events = f"{tmp}/events.jsonl"
    coll = _collector(job, tmp)
    procs = _start_job(job, tmp, ["waits", "stuck", "waits"])
    try:
        first = _hang(events, 60)
        assert (first["suspects"], first["rank.1.status"]) == ("1", "sleeping"), first
        named = len(_events(events, "shmstat.hang"))
        os.kill(procs[1].pid, signal.SIGKILL)
        wait_for(lambda: len(_events(events, "shmstat.hang")) == named + 1, timeout_s=10,
                 what="the hang named again once rank 1 died")
        assert _events(events, "shmstat.hang.resolved")[-1]["data"]["reason"] == "changed"
        data = _events(events, "shmstat.hang")[-1]["data"]
        assert re.search(rf"ranks 0,2 in allreduce for \d+ s; rank 1 in data for \d+ s \(pid {procs[1].pid}, "
                         r"(zombie|died)\)", data["line"]), data  # a zombie until the test reaps it
        procs[1].join(10)  # reaped: its zombie goes, and it is still named gone, not again
        time.sleep(1)
        assert len(_events(events, "shmstat.hang")) == named + 1
    finally:
        out = _finish(coll, procs, tmp)
    assert len([ln for ln in out.splitlines() if "hang:" in ln]) == named + 1, out
