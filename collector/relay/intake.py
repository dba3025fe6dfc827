"""The collector's intake check: is a rank's ``[topic, payload]`` valid, and what is its header.

:func:`shmstat.wire.decode` is the one definition of a valid message. Decoding every item in Python capped the
collector at a few hundred thousand items per second, and the collector needs no event item and only some metric
items: :func:`inspect` validates event and metric messages with the optional C check ``collector._intake`` (which
accepts exactly what ``decode`` accepts, tests/collector/relay/test_intake.py checks that) and returns a
:class:`Received` whose ``items`` are decoded only when read. Other kinds, and the payloads the C check leaves
undecided, go through ``decode``; so does everything on shmstat's pure-Python backend (:mod:`collector._backend`).
"""

from __future__ import annotations

from typing import Any

from shmstat import wire
from shmstat.errors import WireError

from .._backend import IntakeCheck, intake_check

__all__ = ["Received", "inspect", "inspect_with"]


class Received:
    """One valid rank message: its header, its raw frames, and its items decoded on first use.

    Has the fields of :class:`shmstat.wire.WireMessage` (``topic``, ``kind``, ``rank``, ``pid``, ``incarnation``,
    ``seq``, ``items``) plus ``n_items`` and the frames as received (``raw_topic``, ``payload``). ``items[j]`` has
    sequence number ``seq + j``.
    """

    __slots__ = ("_items", "incarnation", "kind", "n_items", "payload", "pid", "rank", "raw_topic", "seq")

    def __init__(self, raw_topic: Any, payload: Any, kind: str, rank: int, pid: int, incarnation: int, seq: int,
                 n_items: int, items: list[Any] | None = None) -> None:
        self.raw_topic = raw_topic
        self.payload = payload
        self.kind = kind
        self.rank = rank
        self.pid = pid
        self.incarnation = incarnation
        self.seq = seq
        self.n_items = n_items
        self._items = items

    @property
    def topic(self) -> str:
        """The topic as text."""
        return bytes(self.raw_topic).decode("utf-8")

    @property
    def items(self) -> list[Any]:
        """The decoded items (decoded on first use, then kept)."""
        if self._items is None:
            self._items = wire.decode(self.raw_topic, self.payload).items
        return self._items

    def __repr__(self) -> str:
        return (f"Received({self.topic!r}, rank={self.rank}, pid={self.pid}, incarnation={self.incarnation}, "
                f"seq={self.seq}, n_items={self.n_items})")


def _decoded(topic: Any, payload: Any) -> Received:
    msg = wire.decode(topic, payload)
    return Received(topic, payload, msg.kind, msg.rank, msg.pid, msg.incarnation, msg.seq, len(msg.items),
                    msg.items)


def inspect(topic: Any, payload: Any) -> Received:
    """Validate one ``[topic, payload]`` message as :func:`shmstat.wire.decode` does and return it as a
    :class:`Received`; raise :class:`WireError` if ``decode`` would. Frames may be ``bytes`` or any buffer."""
    return inspect_with(intake_check(), topic, payload)  # None: the pure-Python backend, or no extension built


def inspect_with(check: IntakeCheck | None, topic: Any, payload: Any) -> Received:
    """:func:`inspect` with the C check as :func:`collector._backend.intake_check` returned it (a relay looks it up
    once, not per message)."""
    if check is None:
        return _decoded(topic, payload)
    try:
        got = check(topic, payload)
    except TypeError:  # not a buffer: decode says why
        return _decoded(topic, payload)
    if got is None:
        return _decoded(topic, payload)
    if isinstance(got, str):
        raise WireError(got)
    kind, rank, pid, incarnation, seq, n_items = got
    return Received(topic, payload, kind, rank, pid, incarnation, seq, n_items)

