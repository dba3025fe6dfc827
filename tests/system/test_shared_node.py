"""A shared node: another local user's entries named like shmstat's in /dev/shm (a directory, a FIFO, a link,
a directory named like a lock file, a live segment, an idle one) and odd entries in the runtime directories
(directories, FIFOs, links, a socket where a file is expected, another user's files). Every command (``ls``,
``top``, ``subscribe``, ``collect`` with and without ``--job``, ``clean`` with and without a job) runs as root
and as that user (uid 65534): none crashes, each skipped entry of one's own is one line and other users' entries
are counted in one line (the node collector says each once),
``clean`` removes only the caller's own segments with no live process, and nothing of the other user is removed.
Runs in a private /dev/shm (a mount namespace): see ``tests/kit/shared_node.py``."""

from __future__ import annotations

import json
import os
import sys

import pytest
from kit.procs import REPO
from kit.support import run_with_private_dev_shm

_SCRIPT = 'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$PY" tests/kit/shared_node.py "$WORK"'

OTHER_ODD = ["shmstat.o-dir", "shmstat.o-dir2.lock", "shmstat.o-fifo", "shmstat.o-link"]
OTHER_SEGMENTS = ["shmstat.o-idle", "shmstat.o-idle.lock", "shmstat.o-live", "shmstat.o-live.lock"]
ROOT_RT = ["v.ingest", "w.collector.lock", "x.ingest", "y.publish", "z.collector.lock"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    if os.getuid() != 0:
        pytest.skip("needs root, to act as a second local user (uid 65534)")
    work = tmp_path_factory.mktemp("shared")
    env = dict(os.environ, PY=sys.executable, WORK=str(work), PYTHONPATH=REPO)
    done = run_with_private_dev_shm(_SCRIPT, env, REPO, 300)
    with open(work / "result.json") as f:
        result = json.load(f)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return result


def _skipped(run: dict) -> list[str]:
    """The paths of the ``skipped PATH: reason`` lines a command printed."""
    return [line.split()[1].rstrip(":") for line in run["err"].splitlines() if line.startswith("skipped ")]


def _left_alone(run: dict) -> list[str]:
    """The lines that count the other users' entries a command left alone."""
    return [line for line in run["err"].splitlines() if line.startswith("left alone ")]


def _names(paths: list[str]) -> list[str]:
    return sorted(os.path.basename(p) for p in paths)


def test_no_command_crashes_as_root_or_as_another_user(runs):
    commands = {name: run for name, run in runs.items() if "argv" in run}
    assert len(commands) == 15
    for name, run in commands.items():
        assert "Traceback" not in run["out"] + run["err"], name
        assert run["code"] in (0, 2), (name, run)


def test_ls_and_top_show_only_your_segments_and_name_each_skipped_entry_once(runs):
    ls = runs["root_ls"]
    assert ls["code"] == 0 and "r-dead" in ls["out"] and "r-live" in ls["out"] and "o-" not in ls["out"]
    assert _skipped(ls) == []  # every entry it left alone is the other user's: one line counts them (issue 44)
    assert _left_alone(ls) == [f"left alone {len(OTHER_ODD + OTHER_SEGMENTS)} shmstat entries of other users "
                               f"(uid 65534 (nobody): {len(OTHER_ODD + OTHER_SEGMENTS)})"]
    other = runs["other_ls"]
    assert other["code"] == 0 and "o-idle" in other["out"] and "o-live" in other["out"] and "r-" not in other["out"]
    assert _names(_skipped(other)) == sorted(OTHER_ODD)  # its own odd entries, one line each
    assert "a directory" in other["err"] and "a FIFO" in other["err"] and "a symbolic link" in other["err"]
    assert _left_alone(other) == ["left alone 4 shmstat entries of other users (uid 0 (root): 4)"]
    for name, shown, hidden in (("root_top", "r-live", "o-"), ("other_top", "o-live", "r-")):
        assert runs[name]["code"] == 0 and shown in runs[name]["out"] and hidden not in runs[name]["out"]


def test_a_named_entry_that_is_not_yours_is_one_line_and_exit_2(runs):
    for name, words in (("root_collect_dir", "a directory"), ("root_collect_other", "owned by uid 65534"),
                        ("root_top_other", "owned by uid 65534"),
                        ("root_clean_other", "owned by uid 65534"), ("other_clean_root", "owned by uid 0"),
                        ("root_subscribe", "a FIFO"), ("other_subscribe", "a directory")):
        run = runs[name]
        assert run["code"] == 2 and words in run["err"], (name, run)
        assert len(run["err"].splitlines()) <= 2 and run["out"] == "", (name, run)


def test_clean_removes_only_your_idle_segments_never_a_live_one_nor_another_users(runs):
    root = runs["root_clean"]
    assert root["code"] == 0
    assert "removed r-dead" in root["out"] and "kept r-live (live process" in root["out"]
    assert _names(_skipped(root)) == sorted(ROOT_RT)
    assert _left_alone(root) == ["left alone 8 shmstat entries of other users (uid 65534 (nobody): 8)"]
    after = runs["after_root_clean"]
    assert set(OTHER_ODD + OTHER_SEGMENTS) <= set(after["entries"]), "root's clean removed another user's entry"
    assert "shmstat.r-dead" not in after["entries"] and "shmstat.r-dead.lock" not in after["entries"]
    assert after["rt"] == ROOT_RT, "odd runtime-directory entries are left alone"
    other = runs["other_clean"]
    assert other["code"] == 0 and "kept o-live (live process" in other["out"] and "removed" not in other["err"]
    assert "p.publish" in other["err"] and "q.ingest" in other["err"]
    end = runs["end"]
    assert {"shmstat.r-idle", "shmstat.r-idle.lock", "shmstat.r-live", "shmstat.r-live.lock"} <= set(end["entries"])
    assert set([*OTHER_ODD, "shmstat.o-live", "shmstat.o-live.lock"]) <= set(end["entries"])
    assert end["root_rt"] == ROOT_RT and end["other_rt"] == ["p.publish", "q.ingest"]


def test_a_node_collector_skips_what_is_not_its_users_says_it_once_and_sweeps_only_its_own(runs):
    for name, own_dead, own_live, foreign in (("root_node", "r-dead2", "r-live", "o-"),
                                              ("other_node", "o-idle", "o-live", "r-")):
        run = runs[name]
        assert run["code"] == 0, run
        assert f"job {own_dead}'s segment removed" in run["err"] and f"job {own_live} picked up" in run["err"]
        assert f"job {foreign}" not in run["out"] + run["err"], "another user's job is never served"
        paths = _skipped(run)
        assert len(paths) == len(set(paths)) == (0 if name == "root_node" else len(OTHER_ODD)), paths
        assert len(_left_alone(run)) == 1, "other users' entries counted in one line, once over many discoveries"
    assert "shmstat.o-idle" not in runs["end"]["entries"]  # the other user's own node collector swept it
