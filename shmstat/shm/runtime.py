"""Job ids, names and the owner-only runtime directory where a job's sockets live.

A job id names the node's segment (``/shmstat.<job>``) and the collector's ``ipc://`` ingest socket, so it is
validated once here (the rule is :func:`shmstat.names.is_job_id`'s): letters, digits, ``-``, ``_``, ``.``; at
most 64 characters.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat as _stat
import tempfile

from ..errors import ConfigError, SegmentError
from ..names import MAX_JOB_LEN, is_job_id

__all__ = [
    "MAX_JOB_LEN",
    "env_number",
    "ingest_endpoint",
    "lock_path",
    "node_collector_running",
    "node_lock_path",
    "publish_endpoint",
    "runtime_dir",
    "segment_name",
    "semaphore_name",
    "validate_job",
]



def env_number(name: str, low: float, high: float, unit: str) -> float | None:
    """The number in environment variable ``name``, None when unset or empty; a value that is not a number
    from ``low`` to ``high`` is a :class:`ConfigError` naming the variable and the ``unit``."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} is not a number of {unit} between {low:g} and {high:g}")
    return value


def validate_job(job: str) -> str:
    """Return ``job`` if it is a valid job id, else raise :class:`ConfigError` saying what is allowed."""
    if not is_job_id(job):
        raise ConfigError(
            f"job id {job!r} is invalid: use 1 to {MAX_JOB_LEN} letters, digits, '-', '_' or '.', "
            "not ending in '.lock'"
        )
    return job


def segment_name(job: str) -> str:
    """The POSIX shared-memory name of the job's segment on this node."""
    return f"/shmstat.{validate_job(job)}"


def semaphore_name(job: str) -> str:
    """The POSIX named semaphore earlier versions locked the job with (only removed now: see :func:`lock_path`)."""
    return f"/shmstat.{validate_job(job)}.lock"


def runtime_dir() -> str:
    """The per-user directory (mode 0700) holding the ipc sockets; created if missing, refused if unsafe.

    ``$SHMSTAT_RUNTIME_DIR`` wins, then ``$XDG_RUNTIME_DIR/shmstat``, then ``<tmp>/shmstat-<uid>``.
    """
    base = os.environ.get("SHMSTAT_RUNTIME_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "shmstat") if xdg else os.path.join(tempfile.gettempdir(), f"shmstat-{os.getuid()}")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        st = os.lstat(base)
    except OSError as exc:
        raise SegmentError(f"cannot create the runtime directory {base}: {exc.strerror}") from exc
    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SegmentError(
            f"runtime directory {base} is not a directory owned by you; remove it or set SHMSTAT_RUNTIME_DIR"
        )
    if st.st_mode & 0o077:
        os.chmod(base, 0o700)
    return base


_MAX_SOCKET_PATH = 107  # a Unix socket path's limit (sun_path is 108 bytes with its NUL)


def _socket_path(job: str, suffix: str) -> str:
    """``<runtime dir>/<job><suffix>``, or, when that is too long for a Unix socket, ``<runtime dir>/<hash of the
    job><suffix>`` (every process computes the same name); a runtime directory too long even then is an error."""
    base = runtime_dir()
    path = os.path.join(base, validate_job(job) + suffix)
    if len(path.encode()) <= _MAX_SOCKET_PATH:
        return path
    short = os.path.join(base, "j" + hashlib.sha256(job.encode()).hexdigest()[:16] + suffix)
    if len(short.encode()) > _MAX_SOCKET_PATH:
        raise SegmentError(f"the runtime directory {base} is too long a path for Unix sockets; set "
                           "SHMSTAT_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a shorter one")
    return short


def ingest_endpoint(job: str) -> str:
    """The ``ipc://`` endpoint where the job's collector receives events and metrics from the ranks."""
    return f"ipc://{_socket_path(job, '.ingest')}"


def publish_endpoint(job: str) -> str:
    """The collector's default ``ipc://`` endpoint for subscribers (owner-only: it lives in the 0700 runtime dir)."""
    return f"ipc://{_socket_path(job, '.publish')}"


def node_collector_running() -> bool:
    """Whether a node collector of this user runs on this node: it holds the lock of :func:`node_lock_path` while
    it runs, so a rank of a job it has not picked up yet knows one will."""
    try:
        fd = os.open(node_lock_path(), os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, SegmentError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also lets go of the lock this took
    return False


def lock_path(job: str) -> str:
    """The file whose ``flock`` serialises creation and registration in the job's segment (next to it in
    ``/dev/shm``; the kernel drops the lock of a process that dies)."""
    return f"/dev/shm/shmstat.{validate_job(job)}.lock"


def node_lock_path() -> str:
    """The file whose ``flock`` the node collector (``shmstat collect`` serving every job) holds while it runs, in
    the owner-only runtime directory: a second one refuses to start (the kernel drops the lock of a process that
    dies, so a stale file never blocks). Not a job id (it ends in ``.lock``): no job's files are named so."""
    return os.path.join(runtime_dir(), "node-collector.lock")
