"""No room: a full /dev/shm is one sentence and a non-zero exit, and nothing is left behind; ``shmstat clean``
removes what jobs left: lock files, semaphores of older versions, socket files in the runtime directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import posix_ipc
import pytest
from _procs import REPO, start_collector

from shmstat.runtime import lock_path, runtime_dir

_SCRIPT = r"""
set -e
mount -t tmpfs -o size=256k tmpfs /dev/shm
set +e
"$PY" -m collector collect --job "$JOB" --handler '*=null' > /tmp/out.$$ 2> "$ERR"
echo $? > "$CODE"
"$PY" -m collector top --job nope-"$JOB" --iterations 1 >/dev/null 2>> "$ERR"
ls -A /dev/shm > "$LEFT"
"""


def test_a_full_dev_shm_is_one_sentence_and_leaves_nothing(job, tmp_path):
    if not shutil.which("unshare") or os.getuid() != 0:
        pytest.skip("needs root and unshare to give the test a private, tiny /dev/shm")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.decode().strip()}")
    err, code, left = (str(tmp_path / n) for n in ("err", "code", "left"))
    env = dict(os.environ, PYTHONPATH=REPO, PY=sys.executable, JOB=job, ERR=err, CODE=code, LEFT=left)
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", _SCRIPT], env=env, cwd=REPO,
                   check=True, timeout=120)
    with open(code) as f:
        assert int(f.read()) == 2
    with open(err) as f:
        lines = f.read().strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("shmstat: error: ") for line in lines), lines
    assert "No space left on device" in lines[0] and "free space in /dev/shm" in lines[0]
    assert "no shared memory segment exists" in lines[1]
    with open(left) as f:
        assert f.read().split() == [], "something was left in /dev/shm"


def test_clean_removes_orphaned_locks_semaphores_and_sockets(job):
    open(lock_path(job), "w").close()
    sem = posix_ipc.Semaphore(f"/shmstat.{job}.lock", posix_ipc.O_CREAT, mode=0o600, initial_value=1)
    sem.close()
    runtime = [os.path.join(runtime_dir(), job + s) for s in (".ingest", ".publish", ".collector.lock")]
    for path in runtime:
        open(path, "w").close()
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-m", "collector", "clean", job], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(lock_path(job))
    assert not os.path.exists(f"/dev/shm/sem.shmstat.{job}.lock")
    assert not [p for p in runtime if os.path.exists(p)]


def test_clean_keeps_a_live_job_and_ls_lists_it(job):
    coll = start_collector(job, "--handler", "*=null")
    env = dict(os.environ, PYTHONPATH=REPO)
    try:
        refused = subprocess.run([sys.executable, "-m", "collector", "clean", job], capture_output=True, text=True,
                                 env=env, cwd=REPO, timeout=60)
        assert refused.returncode == 2 and "live processes" in refused.stderr
        listed = subprocess.run([sys.executable, "-m", "collector", "ls"], capture_output=True, text=True,
                                env=env, cwd=REPO, timeout=60)
        assert job in listed.stdout and f"{coll.proc.pid} up" in listed.stdout
    finally:
        assert coll.stop() == 0
    assert os.path.exists(f"/dev/shm/shmstat.{job}")
