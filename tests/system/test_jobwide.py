"""The job across nodes, live (collector.watch, ``shmstat top --nodes``): three node collectors on this machine stand
for three nodes of one job (each in a private /dev/shm, with its own runtime directory and a CURVE endpoint on port
0), three real ranks each stepping in sections and adding its step time to ``train/step_ms``. Node n2's ranks are all
1.6x slower (a slow node: equal to each other, so no node collector sees it), rank 4 of node n1 is 2x slower (a
slow rank), then rank 1 of
node n0 stays in ``compute`` while every other rank waits in ``allreduce`` (a hang held on n0). The library's events
and top's screen, read while it runs, name the node, the rank and the rank holding the job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from kit.procs import REPO
from kit.support import unique_job, wait_for

import collector
from collector.cli.keys import make_keys
from collector.jobwide.watch import (
    JOB_HANG_EVENT,
    JOB_STRAGGLER_EVENT,
    NODE_BACK_EVENT,
    NODE_SILENT_EVENT,
    JobWatch,
)

RANKS, NODES = 3, ("n0", "n1", "n2")
SLOW = {"n0": "-", "n1": "4:2.0", "n2": "1.6"}
STUCK = 1
_NODE = ('mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$PY" tests/kit/watch_node.py "$WORK" "$NODE" "$JOB" '
         '"$KEYS" "$RANKS" "$WORLD" "$FIRST" "$SLOW" "$STUCK"')


def _unshare_or_skip() -> None:
    import shutil

    if not shutil.which("unshare") or os.getuid() != 0:
        pytest.skip("needs root and unshare (util-linux) for a private /dev/shm per node")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}")


def _events(found: list, name: str, **match) -> list[dict]:
    return [e.data for e in list(found) if e.name == name and all(e.data.get(k) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One job on three nodes, followed by ``collector.watch`` (in a thread here) and ``shmstat top --nodes`` (a
    process, frames printed one after the other), through its slow phase and then its hang."""
    _unshare_or_skip()
    work = tmp_path_factory.mktemp("jobwide")
    keys = str(work / "keys")
    make_keys(keys)
    job = unique_job("jw")
    nodes = []
    for i, node in enumerate(NODES):
        env = dict(os.environ, PY=sys.executable, WORK=str(work), NODE=node, JOB=job, KEYS=keys, RANKS=str(RANKS),
                   WORLD=str(RANKS * len(NODES)), FIRST=str(i * RANKS), SLOW=SLOW[node], STUCK=str(STUCK),
                   PYTHONPATH=REPO)
        nodes.append(subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", _NODE],
                                      env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    found: list = []
    stop = threading.Event()
    top = None
    try:
        wait_for(lambda: all((work / f"{n}.ready").exists() for n in NODES), timeout_s=60, what="node collectors")
        import json

        endpoints = [f"{n}={json.loads((work / f'{n}.ready').read_text())['publish']}" for n in NODES]
        state = JobWatch()

        def follow() -> None:
            for ev in collector.watch(endpoints, curve=keys, state=state, timeout_s=180):
                found.append(ev)
                if stop.is_set():
                    return

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        top_out = open(work / "top.out", "w")  # noqa: SIM115 (the child's, closed below)
        top = subprocess.Popen([sys.executable, "-m", "collector", "top", "--nodes", *endpoints, "--curve", keys,
                                "--interval", "0.5", "--stat", "train/step_ms"], cwd=REPO,
                               env=dict(os.environ, PYTHONPATH=REPO, COLUMNS="100"), stdout=top_out,
                               stderr=subprocess.STDOUT)
        time.sleep(1.0)  # the subscriptions reach the collectors before the first window
        (work / "go").touch()
        wait_for(lambda: _events(found, JOB_STRAGGLER_EVENT, node="n2", rank=-1, stat="step_ms")
                 and _events(found, JOB_STRAGGLER_EVENT, rank=4, stat="step_ms"), timeout_s=90, interval_s=0.1,
                 what="the slow node and the slow rank")
        wait_for(lambda: "SLOW NODE" in (work / "top.out").read_text(), timeout_s=30, what="top's slow node")
        slow_top = (work / "top.out").read_text()
        (work / "hang").touch()
        wait_for(lambda: _events(found, JOB_HANG_EVENT, rank=STUCK), timeout_s=60, interval_s=0.1,
                 what="the job-wide hang")
        wait_for(lambda: "holds the job" in (work / "top.out").read_text(), timeout_s=30, what="top's hang line")
        hang_top = (work / "top.out").read_text()
        views = state.views()
    finally:
        (work / "stop").touch()
        stop.set()
        if top is not None:
            top.send_signal(2)
            top.wait(30)
        codes = [p.wait(120) for p in nodes]
    assert codes == [0, 0, 0], [p.stderr.read() if p.stderr else "" for p in nodes]
    with open(work / "events.txt", "w") as f:
        f.write("\n".join(f"{e.name} {e.data.get('line')}" for e in found) + f"\nlate {state.late} lost {state.lost}\n")
    return {"found": found, "slow_top": slow_top, "hang_top": hang_top, "views": views, "job": job,
            "late": state.late, "lost": state.lost}


def test_the_slow_node_is_named_once_as_a_node_and_the_slow_rank_as_a_rank(run):
    found = run["found"]
    (node,) = _events(found, JOB_STRAGGLER_EVENT, rank=-1, stat="step_ms")
    assert node["node"] == "n2" and node["group"] == "train" and node["score"] < 0.75, node
    assert re.fullmatch(rf"straggler: job {run['job']}: node n2 \(3 ranks\) scores 0\.6\d on train/step_ms "
                        r"against the job-wide median [\d.]+ for 3 windows", node["line"]), node["line"]
    ranks = _events(found, JOB_STRAGGLER_EVENT, stat="step_ms")  # the sections' sleeps stretch with the load
    assert [(d["node"], d["rank"]) for d in ranks] == [("n2", -1), ("n1", 4)] or \
        [(d["node"], d["rank"]) for d in ranks] == [("n1", 4), ("n2", -1)], ranks
    assert not _events(found, JOB_STRAGGLER_EVENT, stat="allreduce")  # a wait section is never scored
    assert (run["late"], run["lost"]) == (0, 0)  # every window scored whole, nothing lost on the way


def test_the_hang_names_the_rank_holding_the_job_and_the_nodes_that_wait(run):
    (hang,) = _events(run["found"], JOB_HANG_EVENT, rank=STUCK)
    assert hang["node"] == "n0" and hang["section"] == "compute" and hang["waiting"] == "n1,n2", hang
    assert re.fullmatch(rf"hang: job {run['job']}: rank 1 on node n0 in compute for \d+ s holds the job; nodes "
                        r"n1,n2 wait", hang["line"]), hang["line"]


def test_top_nodes_marks_the_slow_node_and_rank_and_names_the_hang(run):
    frames = [f for f in run["slow_top"].split("\n\n") if "SLOW NODE" in f]
    assert frames, run["slow_top"]
    last = frames[-1]
    node_rows = [line for line in last.splitlines() if "ranks" in line and "nodes" not in line]
    assert [line.split()[0] for line in node_rows] == ["n0", "n1", "n2"], last
    assert [line.endswith("SLOW NODE") for line in node_rows] == [False, False, True], last
    slow_ranks = [line.split()[0] for line in last.splitlines() if line.rstrip().endswith(" SLOW")]
    assert slow_ranks == ["4"], last
    hang = re.findall(r"hang: job \S+: rank 1 on node n0 in compute for \d+ s holds the job; nodes n1,n2 wait",
                      run["hang_top"])
    assert hang, run["hang_top"][-3000:]


def test_a_node_whose_collector_is_killed_is_marked_silent_left_out_and_back_once_restarted(tmp_path):
    """Three nodes of one job, none slow; node n2's collector is SIGKILLed (no rows, no heartbeat) while its ranks go
    on: collector.watch says ``shmstat.job.node_silent`` for n2 once, scores the windows after it on n0 and n1 only,
    and ``top --nodes`` marks n2 ``SILENT N s`` without figures; a successor collector on the same endpoint takes
    the ranks over: n2 is back (the event, and its ranks in top again)."""
    _unshare_or_skip()
    import json

    keys = str(tmp_path / "keys")
    make_keys(keys)
    job = unique_job("jws")
    nodes = []
    for i, node in enumerate(NODES):
        env = dict(os.environ, PY=sys.executable, WORK=str(tmp_path), NODE=node, JOB=job, KEYS=keys,
                   RANKS=str(RANKS), WORLD=str(RANKS * len(NODES)), FIRST=str(i * RANKS), SLOW="-", STUCK="-",
                   PYTHONPATH=REPO)
        nodes.append(subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", _NODE],
                                      env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    found: list = []
    top = None
    state = JobWatch(silent_after_s=3.0)  # fifteen of the nodes' heartbeats (--heartbeat-interval 0.2)
    out = tmp_path / "top.out"

    def nodes_scored() -> list[str]:
        views = state.views()
        return [n.node for n in views[0].stats[0].nodes] if views and views[0].stats else []

    try:
        wait_for(lambda: all((tmp_path / f"{n}.ready").exists() for n in NODES), timeout_s=60,
                 what="node collectors")
        endpoints = [f"{n}={json.loads((tmp_path / f'{n}.ready').read_text())['publish']}" for n in NODES]

        def follow() -> None:
            for ev in collector.watch(endpoints, curve=keys, state=state, timeout_s=180):
                found.append(ev)

        threading.Thread(target=follow, daemon=True).start()
        with open(out, "w") as top_out:
            top = subprocess.Popen([sys.executable, "-m", "collector", "top", "--nodes", *endpoints, "--curve", keys,
                                    "--interval", "0.5", "--stat", "train/step_ms"], cwd=REPO,
                                   env=dict(os.environ, PYTHONPATH=REPO, COLUMNS="100"), stdout=top_out,
                                   stderr=subprocess.STDOUT)
        time.sleep(1.0)  # the subscriptions reach the collectors before the first window
        (tmp_path / "go").touch()
        wait_for(lambda: nodes_scored() == list(NODES), timeout_s=60, interval_s=0.1, what="every node scored")
        wait_for(lambda: re.search(r"\n\s*n2\s+3 ranks", out.read_text()), timeout_s=30, what="top showing n2")
        (tmp_path / "n2.kill").touch()
        wait_for(lambda: (tmp_path / "n2.killed").exists(), timeout_s=30, what="n2's collector killed")
        wait_for(lambda: _events(found, NODE_SILENT_EVENT, node="n2"), timeout_s=30, interval_s=0.1,
                 what="n2 silent")
        wait_for(lambda: re.search(r"\n\s*n2\s+-\s+-\s+-\s+SILENT \d+ s", out.read_text()), timeout_s=30,
                 what="top's SILENT mark")
        silent_wid = state.views()[0].stats[0].wid
        wait_for(lambda: state.views()[0].stats[0].wid > silent_wid + 2, timeout_s=30, interval_s=0.1,
                 what="windows scored while n2 is silent")
        scored_silent = nodes_scored()
        silent_top = out.read_text()
        (tmp_path / "n2.restart").touch()
        wait_for(lambda: _events(found, NODE_BACK_EVENT, node="n2"), timeout_s=60, interval_s=0.1, what="n2 back")
        wait_for(lambda: nodes_scored() == list(NODES), timeout_s=60, interval_s=0.1, what="n2 scored again")

        def back_frames() -> list[str]:  # top's frames since n2 was marked where n2 is back with its ranks
            return [f for f in out.read_text()[len(silent_top):].split("\n\n")
                    if re.search(r"\n\s*n2\s+3 ranks", f) and "SILENT" not in f]

        wait_for(back_frames, timeout_s=30, what="top's n2 back")
        back_top = back_frames()[0]
    finally:
        (tmp_path / "hang").touch()  # no rank stuck: every rank waits for the stop, then ends
        (tmp_path / "stop").touch()
        if top is not None:
            top.send_signal(2)
            top.wait(30)
        codes = [p.wait(120) for p in nodes]
    assert codes == [0, 0, 0], [p.stderr.read() if p.stderr else "" for p in nodes]
    # the collectors said their final heartbeats as they closed: their quiet since is not silence
    wait_for(lambda: state.followed == (), timeout_s=30, interval_s=0.1, what="the nodes' final heartbeats")
    said = "\n".join(f"{e.name} {e.data.get('line')}" for e in found if e.name.startswith("shmstat.job.node"))
    assert len(_events(found, NODE_SILENT_EVENT)) == len(_events(found, NODE_BACK_EVENT)) == 1, said
    (silent,) = _events(found, NODE_SILENT_EVENT)
    assert silent["node"] == "n2" and silent["silent_s"] >= 3.0, silent
    assert re.fullmatch(rf"node silent: job {job}: node n2 sent nothing, not even a heartbeat, for \d+ s; its "
                        r"windows are left out of the scores", silent["line"]), silent["line"]
    (back,) = _events(found, NODE_BACK_EVENT)
    assert back["node"] == "n2" and re.fullmatch(rf"node back: job {job}: node n2 heard again after \d+ s silent",
                                                 back["line"]), back
    assert scored_silent == ["n0", "n1"]  # n2's last figures not scored against the live nodes
    assert not _events(found, JOB_STRAGGLER_EVENT), found  # every rank adds the same figure: nobody is slow
    frames = [f for f in silent_top.split("\n\n") if "SILENT" in f]
    marked = [line for line in frames[-1].splitlines() if ("ranks" in line and "nodes" not in line) or "SILENT" in line]
    assert [line.split()[0] for line in marked] == ["n0", "n1", "n2"], frames[-1]
    assert marked[-1].split()[1:5] == ["-", "-", "-", "SILENT"], frames[-1]
    assert [line.split()[0] for line in back_top.splitlines() if "ranks" in line and "nodes" not in line] == \
        ["n0", "n1", "n2"], back_top
    with open(tmp_path / "events.txt", "w") as f:
        f.write("\n".join(f"{e.name} {e.data.get('line')}" for e in found) + f"\nlate {state.late} lost {state.lost}\n")
