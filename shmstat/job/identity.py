"""Who this process is in a job: read from our variables, else from what torchrun sets.

``SHMSTAT_JOB`` / ``SHMSTAT_RANK`` / ``SHMSTAT_LOCAL_RANK`` / ``SHMSTAT_WORLD_SIZE`` win; otherwise
``TORCHELASTIC_RUN_ID``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (set by ``torchrun`` and
by ``shmstat run``). Read only when asked, never at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..shm.runtime import validate_job

__all__ = ["Identity", "identity_from_env"]


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


def identity_from_env(env: Mapping[str, str] | None = None) -> Identity | None:
    """The identity the environment describes, or None when no job is configured."""
    env = os.environ if env is None else env
    job = env.get("SHMSTAT_JOB") or env.get("TORCHELASTIC_RUN_ID")
    if not job:
        return None
    validate_job(job)
    rank = _int(env, ("SHMSTAT_RANK", "RANK"), 0)
    local_rank = _int(env, ("SHMSTAT_LOCAL_RANK", "LOCAL_RANK"), rank)
    world = _int(env, ("SHMSTAT_WORLD_SIZE", "WORLD_SIZE"), 1)
    local_world = _int(env, ("LOCAL_WORLD_SIZE",), world)
    assert rank is not None and local_rank is not None and world is not None and local_world is not None
    return Identity(job, rank, local_rank, world, local_world)
