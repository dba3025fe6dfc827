"""Sizes for the publisher's backlog: its default bounds and :func:`item_bytes`, the size estimate of an item.

The backlog itself (items encoded at publish time, batched per topic, every drop numbered) is
:mod:`shmstat.publish.outbox` (and its C twin ``shmstat._pubfast``).
"""

from __future__ import annotations

from typing import Any

from ..shm.runtime import env_number

__all__ = ["DEFAULT_BACKLOG_BYTES", "MAX_BATCH_BYTES", "METRIC_BYTES", "backlog_bytes_from_env", "item_bytes"]

DEFAULT_BACKLOG_BYTES = 64 * 1024 * 1024
"""Bytes (estimated, see :func:`item_bytes`) of items a publisher holds at most;
``SHMSTAT_BACKLOG_MB`` or ``Publisher(backlog_bytes=...)`` change it."""

MAX_BATCH_BYTES = 256 * 1024
"""A batch of several items is sealed before its encoded items pass this many bytes."""

METRIC_BYTES = 160
"""The estimated size of one metric item (Python objects and wire bytes)."""

_ITEM_OVERHEAD = 128
_KEY_BYTES = 16  # per data key, besides its text
_RECOUNT_BYTES = 4096  # past this estimate, strings are counted in UTF-8 bytes (the C outbox counts the same)


def item_bytes(name: str, data: dict[str, Any]) -> int:
    """The estimated size of an event: what its Python objects and its wire encoding take, within a small
    constant (strings count in UTF-8 bytes once they are long enough to matter)."""
    n = _ITEM_OVERHEAD + len(name) + _KEY_BYTES * len(data) + sum(map(len, data))
    for value in data.values():
        if type(value) is str:
            n += len(value)
    if n > _RECOUNT_BYTES:  # long text: count UTF-8 bytes, not characters
        n = _ITEM_OVERHEAD + len(name.encode("utf-8", "replace")) + sum(
            _KEY_BYTES + len(k.encode("utf-8", "replace"))
            + (len(v.encode("utf-8", "replace")) if type(v) is str else 0)
            for k, v in data.items() if type(k) is str
        )
    return n


def backlog_bytes_from_env() -> int:
    """The backlog bound from ``SHMSTAT_BACKLOG_MB`` (MiB), or the default; a bad value is a ConfigError."""
    mb = env_number("SHMSTAT_BACKLOG_MB", 1, 1 << 20, "MiB")
    return DEFAULT_BACKLOG_BYTES if mb is None else int(mb * 1024 * 1024)
