"""The publisher's slow path, in Python: checking that a :meth:`shmstat.publish.publisher.Publisher.publish`
call's topic is the one its kind and item imply (:func:`check_topic`), and validating and msgpack-encoding an item
the outbox's fast path left to Python — subclasses, odd values, ``publish`` (:func:`encode_item`). Nothing here
touches the outbox or the socket; the publisher queues or drops what these return.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .. import wire
from ..errors import ConfigError
from .item_sizes import METRIC_BYTES, item_bytes

__all__ = ["check_topic", "encode_item"]


def check_topic(topic: str, kind: str, item: Any) -> None:
    """Raise :class:`~shmstat.errors.ConfigError` unless ``kind`` is a wire kind, ``topic`` starts with
    ``<kind>/`` and, for events and metrics, is the topic the item's name implies."""
    if type(kind) is not str or kind not in wire.KINDS:
        raise ConfigError(f"publish kind must be one of {wire.KINDS}, got {kind!r}")
    if type(topic) is not str or not topic.startswith(kind + "/"):
        raise ConfigError(f"publish topic {topic!r} must start with {kind!r} + '/'")
    expected = topic
    try:
        if kind == "event":
            expected = wire.event_topic(item[0])
        elif kind == "metric":
            expected = wire.metric_topic(item[0], item[1])
    except (TypeError, IndexError, KeyError) as exc:
        raise ConfigError(f"publish item {item!r} does not have the shape of a {kind} item") from exc
    if expected != topic:
        raise ConfigError(f"publish topic {topic!r} does not match the item's topic {expected!r}")


def encode_item(kind: str, key1: str, key2: str | None, item: Any, size: int) -> tuple[bytes, int] | str:
    """``item`` encoded for the wire and its estimated size in bytes (``size``, or computed for an event that
    has none); or, for an item that cannot go on the wire (or keys that are not str), why, in words."""
    reason = wire.encode_item_reason(kind, item)
    encoded = b""
    if reason is None:
        try:
            encoded = msgpack.packb(item, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:  # huge ints, lone surrogates, recursion
            reason = str(exc)
    if reason is not None or type(key1) is not str or (key2 is not None and type(key2) is not str):
        return reason or "a name that is not a str"
    if kind == "event" and not size:
        try:
            size = item_bytes(key1, item[2])
        except Exception:  # keys that are not str (refused above), or odd mappings
            size = METRIC_BYTES
    return encoded, size
