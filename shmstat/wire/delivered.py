"""The delivered acknowledgement: how a collector tells the ranks which of their items its sinks took, and the
re-sync marker a rank sends before re-sending what was not acknowledged.

Upstream (collector to every rank's publisher, on the ``XSUB``): one user message
:data:`DELIVERED_PREFIX` followed by 32-byte records ``<q pid, q rank, Q incarnation, Q delivered>`` (little-endian),
one per sender whose delivered watermark moved: every item of that sender numbered below ``delivered`` was
delivered (events taken by every events sink or counted lost there, other items handed on). Batched: a
collector sends one such message per acknowledgement interval, at most :data:`MAX_RECORDS` records each.

Downstream (a rank to the collector): when a collector subscribes (``b"\\x01"``), the publisher first sends a
marker on :data:`shmstat.wire.HELD_TOPIC` with the item ``{"state": SYNC_STATE, "origin": ID}`` (``ID``: the
publisher's random id, which tells a new process from a dead one that had the same pid, rank and incarnation)
whose sequence number is the first one it still holds (sent and not acknowledged, or not yet sent), then
re-sends, in order, every message it sent that no collector acknowledged. The collector drops what it delivered
already (its delivered watermark, kept in the segment's delivered marks, :mod:`shmstat.shm.layout`) and counts a
gap for what the rank no longer holds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

__all__ = ["DELIVERED_PREFIX", "MAX_RECORDS", "SYNC_STATE", "delivered_in", "encode_delivered"]

DELIVERED_PREFIX: Final = b"\x02shmstat/delivered/"
"""The first bytes of a delivered acknowledgement (a user message upstream: not a subscription)."""

SYNC_STATE: Final = "sync"
"""The ``state`` of a rank's re-sync marker on :data:`shmstat.wire.HELD_TOPIC`."""

MAX_RECORDS: Final = 4096
"""Senders per acknowledgement message at most (128 KiB)."""

_RECORD = struct.Struct("<qqQQ")
_KEY = struct.Struct("<qqQ")


def encode_delivered(marks: Iterable[tuple[int, int, int, int]]) -> list[bytes]:
    """The acknowledgement messages for ``marks`` of ``(pid, rank, incarnation, delivered)``; none if empty."""
    records = [_RECORD.pack(*mark) for mark in marks]
    return [DELIVERED_PREFIX + b"".join(records[i:i + MAX_RECORDS]) for i in range(0, len(records), MAX_RECORDS)]


def delivered_in(frame: bytes, pid: int, rank: int, incarnation: int) -> int | None:
    """The delivered watermark an acknowledgement ``frame`` carries for sender (``rank``, ``pid``,
    ``incarnation``), or None if it names no such sender (or is not an acknowledgement)."""
    if not frame.startswith(DELIVERED_PREFIX):
        return None
    key = _KEY.pack(pid, rank, incarnation)
    base = len(DELIVERED_PREFIX)
    at = frame.find(key, base)
    while at >= 0:
        if (at - base) % _RECORD.size == 0 and at + _RECORD.size <= len(frame):
            return int.from_bytes(frame[at + _KEY.size:at + _RECORD.size], "little")
        at = frame.find(key, at + 1)
    return None
