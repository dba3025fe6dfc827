"""Who this process is in a job: read from our variables, else from what torchrun sets.

``SHMSTAT_JOB`` / ``SHMSTAT_RANK`` / ``SHMSTAT_LOCAL_RANK`` / ``SHMSTAT_WORLD_SIZE`` win; otherwise
``TORCHELASTIC_RUN_ID``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (set by ``torchrun`` and
by ``shmstat run``). Read only when asked, never at import time.

torchrun without ``--rdzv-id`` (static rendezvous, the default with ``--master-addr``/``--master-port``, and
c10d) sets ``TORCHELASTIC_RUN_ID=none`` for every job: used as it is, two such jobs on one node would share one
segment. Such a job is ``none-<12 hex digits>`` instead, a hash of ``MASTER_ADDR:MASTER_PORT`` as torchrun gives
them to the workers (checked with torchrun 2.13): the same for every rank of the job on the node and across its
restarts (``--max-restarts``), the same on every node that was given the same ``--master-addr`` text (static) or
read it from the rendezvous (c10d: rank 0's address and a port it picked), and different for two jobs running at
once (one port on the master's host serves one job). A job run again later with the same address and port gets
the same id, as a job run again with the same ``--rdzv-id`` does.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..shm.runtime import validate_job

__all__ = ["IDENTITY_VARIABLES", "TORCHRUN_DEFAULT_RUN_ID", "Identity", "identity_from_env", "identity_variables",
           "start_environ"]

IDENTITY_VARIABLES = ("SHMSTAT_JOB", "SHMSTAT_RANK", "SHMSTAT_LOCAL_RANK", "SHMSTAT_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Every environment variable :func:`identity_from_env` reads."""

TORCHRUN_DEFAULT_RUN_ID = "none"
"""The ``TORCHELASTIC_RUN_ID`` torchrun gives every job started without ``--rdzv-id`` (static and c10d)."""


@dataclass(frozen=True)
class Identity:
    """A rank's place in a job."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def _int(env: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw not in (None, ""):
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
            if value < 0:
                raise ConfigError(f"environment variable {name}={raw!r} must not be negative")
            return value
    return default


def _torchrun_job(env: Mapping[str, str]) -> str | None:
    """The job of torchrun's variables: ``TORCHELASTIC_RUN_ID``, or for torchrun's default run id a name made
    from ``MASTER_ADDR:MASTER_PORT`` (see the module docstring; without them, the default run id as it is)."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if run_id != TORCHRUN_DEFAULT_RUN_ID or not addr or not port:
        return run_id
    digest = hashlib.sha256(f"{addr}:{port}".encode("utf-8", "surrogateescape")).hexdigest()
    return f"{TORCHRUN_DEFAULT_RUN_ID}-{digest[:12]}"


def identity_from_env(env: Mapping[str, str] | None = None) -> Identity | None:
    """The identity the environment describes, or None when no job is configured."""
    env = os.environ if env is None else env
    job = env.get("SHMSTAT_JOB") or _torchrun_job(env)
    if not job:
        return None
    validate_job(job)
    rank = _int(env, ("SHMSTAT_RANK", "RANK"), 0)
    local_rank = _int(env, ("SHMSTAT_LOCAL_RANK", "LOCAL_RANK"), rank)
    world = _int(env, ("SHMSTAT_WORLD_SIZE", "WORLD_SIZE"), 1)
    local_world = _int(env, ("LOCAL_WORLD_SIZE",), world)
    assert rank is not None and local_rank is not None and world is not None and local_world is not None
    return Identity(job, rank, local_rank, world, local_world)


def identity_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The :data:`IDENTITY_VARIABLES` set in ``env``, as they are (two environments naming the same rank the same
    way have equal ones)."""
    return {name: env[name] for name in IDENTITY_VARIABLES if name in env}


def start_environ() -> dict[str, str] | None:
    """The environment this process was started with (``/proc/self/environ``: what its ``exec`` was given, not
    what it set since), or None where it cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
    return out
