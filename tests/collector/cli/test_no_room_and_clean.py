"""``shmstat clean`` removes what dead jobs left (lock files, semaphores of older versions, socket files in the
runtime directory) and refuses a live job, which ``shmstat ls`` lists (no room:
``tests/collector/daemon/test_no_room.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import posix_ipc
from kit.procs import REPO, start_collector

from shmstat.errors import SegmentError
from shmstat.shm.runtime import lock_path, runtime_dir


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
    assert not os.path.exists(f"/dev/shm/shmstat.{job}")  # no process of the job lives: removed on exit


def test_socket_paths_too_long_for_unix_sockets_get_short_names(monkeypatch):
    import tempfile

    import pytest

    from shmstat.shm.runtime import ingest_endpoint, publish_endpoint

    short = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    deep = os.path.join(short, "d" * 50)
    os.mkdir(deep, 0o700)
    monkeypatch.setenv("SHMSTAT_RUNTIME_DIR", str(deep))
    job = "j" * 64
    for endpoint in (ingest_endpoint(job), publish_endpoint(job)):
        assert len(endpoint[len("ipc://"):].encode()) <= 107 and job not in endpoint
    assert ingest_endpoint(job) == ingest_endpoint(job) != ingest_endpoint(job[:-1] + "k")
    monkeypatch.setenv("SHMSTAT_RUNTIME_DIR", os.path.join(deep, "e" * 100))
    with pytest.raises(SegmentError, match="too long"):
        ingest_endpoint(job)
    shutil.rmtree(short)
