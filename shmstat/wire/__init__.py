"""The wire format between ranks, the collector and subscribers: the one place that defines it.

A rank sends the collector two-frame ZeroMQ multipart messages ``[topic, payload]``. A collector publishes every
message with one more frame naming its job, on every endpoint: ``[topic, payload, job]``, the first two exactly as
the rank sent them, the third the job id in UTF-8 (the job id rule of :func:`shmstat.names.is_job_id`: 1 to 64 of
``A-Z a-z 0-9 - _ .``), so a subscriber knows the job of everything it receives — on a job's own endpoint as on a
node collector's (``shmstat collect --publish ENDPOINT``), which carries the messages of every job it serves.
Subscribers filter on the topic; :func:`decode_with_job` reads a received message (and the two-frame shape of
collectors before 0.1.0's release), and :func:`shmstat.wire.records.records` turns its items into the records
``shmstat subscribe`` prints. All the jobs of a node collector share its pid and rank -1 for what the collector
makes, so a subscriber keeps its accounting per job (and per sender: :mod:`shmstat.wire.heartbeat`).

Topic (frame 1, UTF-8, at most :data:`MAX_TOPIC` bytes) — subscribers filter on its prefix:

==========================  =========================================================================
``event/<name>``            events logged by a rank (``log_event``)
``metric/<group>/<name>``   torchelastic-style metrics (``put_metric``)
``stat/<group>/<name>``     closed stat windows, produced by the collector
``rank/<state>``            rank lifecycle (registered, exited, dead, ...), produced by the collector
``heartbeat/``              the collector's heartbeats: the newest sequence number of every sender it
                            relays, so a subscriber can tell loss from silence (:mod:`shmstat.wire.heartbeat`)
==========================  =========================================================================

Payload (frame 2, at most :data:`MAX_PAYLOAD` bytes) — a msgpack map with exactly these keys::

    {"v": 1,              wire version (int); anything else is refused
     "k": kind,           "event" | "metric" | "stat" | "rank" | "heartbeat"; must equal the topic's first segment
     "r": rank,           int >= -1; -1 (COLLECTOR_RANK) marks a message made by the collector itself
     "p": pid,            int >= 0, the sending process
     "i": incarnation,    int >= 0, bumped each time the rank re-registers (restart)
     "s": first_seq,      int >= 0, the seq of items[0]; items[j] has seq first_seq + j
     "items": [...]}      a non-empty list; every item has the shape of its kind:

    event   [name: str, ts_ns: int, data: {str: str | int | float | bool}]   name == topic after "event/"
    metric  [group: str, name: str, value: int | float | bool, ts: float | int (unix seconds)]
                                                                   "<group>/<name>" == topic after "metric/",
                                                                   no "/" in group (shmstat.names)
    stat    {str: str | int | float | bool | None}   (made by the collector); a stat keeping percentiles also
            has "hist": {"scale": int, "zero": int, "pos": [offset: int, [count: int, ...]],
            "neg": [offset: int, [count: int, ...]], and "pos_inf": int, "neg_inf": int when not 0 (the +inf
            and -inf samples, in no bucket)} (shmstat.histogram.Histogram.to_wire: what subscribers merge)
    rank    {str: str | int | float | bool | None}   (made by the collector)
    heartbeat {str: str | int | float | bool | None}  (made by the collector: :mod:`shmstat.wire.heartbeat`
                                                       says which maps; its seqs count heartbeat items)

Sequence numbers are per rank and per incarnation and count items (not messages), starting at 0. A sender
that loses or drops an item still consumes its seq, so a gap of ``n`` seen by a receiver is exactly ``n``
items of that (rank, incarnation) that never arrived. Several consecutive items with the same topic may be
batched into one message. A bool in a metric value is kept as a bool, as torchelastic passes it through.

Safety: nothing from the wire is evaluated or unpickled. :func:`decode` refuses oversized frames before
unpacking, bounds every msgpack length by the payload size, refuses every ext type (the msgpack timestamp
included), and checks every field's exact type; any violation raises :class:`~shmstat.errors.WireError`
with a one-sentence reason and nothing else escapes (a caller may count and drop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import msgpack

from ..errors import WireError
from ..names import MAX_JOB_LEN, is_job_id
from ._items import (
    check_event_items,
    check_map_items,
    check_metric_items,
    encode_item_reason,
    fast_ok,
)

_encode_item_reason = encode_item_reason  # the publisher's slow path checks single items

__all__ = [
    "ACK_PREFIX",
    "COLLECTOR_RANK",
    "HANDOVER_REQUEST",
    "HEARTBEAT_KIND",
    "HEARTBEAT_TOPIC",
    "HELD_TOPIC",
    "KINDS",
    "MAX_EVENT_BYTES",
    "MAX_PAYLOAD",
    "MAX_TOPIC",
    "WIRE_VERSION",
    "WireMessage",
    "decode",
    "decode_frames",
    "decode_with_job",
    "encode",
    "event_topic",
    "metric_topic",
    "rank_topic",
    "stat_topic",
]

WIRE_VERSION: Final = 1
"""The payload version this module writes and the only one it accepts."""

MAX_PAYLOAD: Final = 16 * 1024 * 1024
"""Largest payload frame in bytes; :func:`decode` refuses larger ones unread, :func:`encode` refuses to build them."""

MAX_EVENT_BYTES: Final = 1024 * 1024
"""Largest single event or metric item a rank accepts (its encoded size, name and data included); larger ones
are refused at ``log_event`` with a clear error. Bounds what one item can cost every buffer on its way."""

MAX_TOPIC: Final = 4096
"""Largest topic frame in bytes."""

HANDOVER_REQUEST: Final = b"\x02shmstat/handover"
"""What a collector that shuts down sends upstream to every rank's publisher: "answer with a marker on
HELD_TOPIC and hold your items for the next collector"."""

ACK_PREFIX: Final = b"\x02shmstat/ack/"
"""What a collector sends upstream when a hand-over marker arrived, followed by the sender's pid in ASCII: a
closing publisher waits for it (bounded by its linger) before it closes its socket, because libzmq may drop
what is still queued at close when the receiver's queue is full (libzmq issue 4660)."""

HELD_TOPIC: Final = b"rank/held"
"""Control topic of a rank publisher's hand-over marker: "all I sent before this has been sent" (the answer
to HANDOVER_REQUEST, and the last message of a publisher that closes). It takes no sequence number and is
not re-published."""

KINDS: Final = ("event", "metric", "stat", "rank")
"""The kinds of data message, which are also the first segment of their topics (what a rank may publish)."""

HEARTBEAT_KIND: Final = "heartbeat"
"""The kind of the collector's heartbeats (never a rank's: the collector refuses it from a rank)."""

HEARTBEAT_TOPIC: Final = "heartbeat/"
"""The topic of every heartbeat message (:mod:`shmstat.wire.heartbeat`)."""

COLLECTOR_RANK: Final = -1
"""The rank field of messages made by the collector itself (stat windows, rank lifecycle)."""

_KEYS: Final = frozenset(("v", "k", "r", "p", "i", "s", "items"))
_KIND_SET: Final = frozenset((*KINDS, HEARTBEAT_KIND))
_INT64_MIN: Final = -(1 << 63)
_UINT64_MAX: Final = (1 << 64) - 1


def event_topic(name: str) -> str:
    """The topic of an event named ``name``: ``event/<name>``."""
    return "event/" + name


def metric_topic(group: str, name: str) -> str:
    """The topic of metric ``name`` in ``group``: ``metric/<group>/<name>`` (one topic per pair: a group holds no
    ``/`` by the name rule of :mod:`shmstat.names`, so the topic splits back at its second ``/``)."""
    return f"metric/{group}/{name}"


def stat_topic(group: str, name: str) -> str:
    """The topic of the windows of stat ``name`` in ``group``: ``stat/<group>/<name>`` (one topic per pair, as
    :func:`metric_topic`)."""
    return f"stat/{group}/{name}"


def rank_topic(state: str) -> str:
    """The topic of a rank lifecycle change to ``state``: ``rank/<state>``."""
    return "rank/" + state


@dataclass(frozen=True, slots=True)
class WireMessage:
    """One decoded, validated message. ``items[j]`` has sequence number ``seq + j``.

    Items are lists (event, metric) or dicts (stat, rank) exactly as described in the module docstring;
    they hold only ``str``, ``int``, ``float``, ``bool`` and ``None`` values.
    """

    topic: str
    kind: str
    rank: int
    pid: int
    incarnation: int
    seq: int
    items: list[Any]


# --------------------------------------------------------------------------------------------- encode


def _check_header(kind: object, rank: object, pid: object, incarnation: object, seq: object) -> str | None:
    """The reason the header fields are invalid, or None."""
    if type(kind) is not str or kind not in _KIND_SET:
        return f"kind {kind!r} is not one of {', '.join(sorted(_KIND_SET))}"
    if type(rank) is not int or rank < COLLECTOR_RANK:
        return f"rank {rank!r} is not an int >= {COLLECTOR_RANK}"
    if type(pid) is not int or pid < 0:
        return f"pid {pid!r} is not a non-negative int"
    if type(incarnation) is not int or incarnation < 0:
        return f"incarnation {incarnation!r} is not a non-negative int"
    if type(seq) is not int or seq < 0:
        return f"seq {seq!r} is not a non-negative int"
    if max(rank, pid, incarnation, seq) > _UINT64_MAX:
        return "a header field does not fit in 64 bits"
    return None


def encode(kind: str, rank: int, pid: int, incarnation: int, first_seq: int, items: Sequence[Any]) -> bytes:
    """Build the payload frame of a ``kind`` message carrying ``items`` (seq ``first_seq`` onwards).

    Validates the header and every item against the shapes in the module docstring and raises
    :class:`WireError` if anything would not pass :func:`decode` (bad type, int beyond 64 bits, a string
    that is not encodable as UTF-8, a payload over :data:`MAX_PAYLOAD`). Subclasses of the scalar types
    are accepted and sent as their base type. Thread-safe. The topic frame is the caller's (see
    :func:`event_topic` and friends).
    """
    reason = _check_header(kind, rank, pid, incarnation, first_seq)
    if reason is None and not items:
        reason = "items is empty"
    if reason is None and not fast_ok(kind, items):
        for item in items:
            reason = encode_item_reason(kind, item)
            if reason is not None:
                break
    if reason is not None:
        raise WireError(f"cannot encode a {kind} message: {reason}")
    body = {"v": WIRE_VERSION, "k": kind, "r": rank, "p": pid, "i": incarnation, "s": first_seq,
            "items": items}
    try:
        payload = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # huge ints, lone surrogates, recursion
        raise WireError(f"cannot encode a {kind} message: {exc}") from exc
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"cannot encode a {kind} message: {len(payload)} bytes exceed MAX_PAYLOAD")
    return payload


# --------------------------------------------------------------------------------------------- decode


class _ExtRefused(Exception):
    pass


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise _ExtRefused(code)


def _fail(reason: str) -> NoReturn:
    raise WireError(reason)


def _as_bytes(frame: Any, what: str) -> bytes:
    if type(frame) is bytes:
        return frame
    try:
        return bytes(memoryview(frame))
    except TypeError:
        _fail(f"the {what} frame is a {type(frame).__name__}, not bytes")


def decode_frames(frames: Sequence[Any]) -> WireMessage:
    """:func:`decode` of a received multipart message of either shape (:func:`decode_with_job`), its job left out."""
    return decode_with_job(frames)[0]


def decode_with_job(frames: Sequence[Any]) -> tuple[WireMessage, str | None]:
    """:func:`decode` of a received multipart message and its job: ``[topic, payload, job]`` as every collector
    endpoint sends it (the job id it names), or ``[topic, payload]`` as a rank sends it (the job is None). Any
    other number of frames, or a job frame that is not a job id in UTF-8, raises :class:`WireError`."""
    n = len(frames)
    if n == 2:
        return decode(frames[0], frames[1]), None
    if n != 3:
        _fail(f"a message has {n} frames, not 2 (topic, payload) or 3 (topic, payload, job)")
    raw = _as_bytes(frames[2], "job")
    if len(raw) > MAX_JOB_LEN:
        _fail(f"the job frame is {len(raw)} bytes, more than {MAX_JOB_LEN}")
    try:
        job = raw.decode("utf-8")
    except UnicodeDecodeError:
        _fail("the job frame is not valid UTF-8")
    if not is_job_id(job):
        _fail(f"the job frame {job!r} is not a job id (1 to {MAX_JOB_LEN} of A-Z a-z 0-9 - _ .)")
    return decode(frames[0], frames[1]), job


def decode(topic: bytes, payload: bytes) -> WireMessage:
    """Parse and validate one ``[topic, payload]`` message; raise :class:`WireError` if it is not valid.

    Accepts ``bytes`` or any object exposing the buffer protocol (a ``zmq.Frame``'s buffer, a
    ``memoryview``). Checks the topic prefix, the payload size, the msgpack encoding (no ext types, lengths
    bounded by the payload), the exact key set, the version, every header field and every item's shape;
    returns a :class:`WireMessage` whose items are plain lists/dicts of scalars. Never raises anything but
    :class:`WireError` for bad input.
    """
    topic = _as_bytes(topic, "topic")
    payload = _as_bytes(payload, "payload")
    if len(topic) > MAX_TOPIC:
        _fail(f"the topic is {len(topic)} bytes, more than {MAX_TOPIC}")
    try:
        topic_s = topic.decode("utf-8")
    except UnicodeDecodeError:
        _fail("the topic is not valid UTF-8")
    kind, sep, rest = topic_s.partition("/")
    if not sep or kind not in _KIND_SET:
        _fail(f"the topic {topic_s[:64]!r} does not start with event/, metric/, stat/, rank/ or heartbeat/")
    n = len(payload)
    if n > MAX_PAYLOAD:
        _fail(f"the payload is {n} bytes, more than {MAX_PAYLOAD}")
    try:
        body = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
        )
    except _ExtRefused:
        _fail("the payload contains a msgpack ext type, which is refused")
    except Exception as exc:  # msgpack raises ValueError, its own UnpackException family, TypeError, ...
        if "max_ext_len" in str(exc):  # max_ext_len=0 stops ext types (the timestamp too) before ext_hook
            _fail("the payload contains a msgpack ext type, which is refused")
        _fail(f"the payload is not a valid msgpack document ({type(exc).__name__})")
    if type(body) is not dict:
        _fail("the payload is not a msgpack map")
    if body.keys() != _KEYS:
        keys = {k for k in body if type(k) is str}
        missing = sorted(_KEYS - keys)
        _fail(f"the payload is missing {missing}" if missing else "the payload has unknown keys")
    v = body["v"]
    if type(v) is not int or v != WIRE_VERSION:
        _fail(f"the payload has wire version {v!r}, but only {WIRE_VERSION} is understood")
    k = body["k"]
    if k != kind or type(k) is not str:
        _fail(f"the payload kind {k!r} does not match the topic prefix {kind!r}")
    r, p, i, s = body["r"], body["p"], body["i"], body["s"]
    reason = _check_header(k, r, p, i, s)
    if reason is not None:
        _fail(f"the payload header is invalid: {reason}")
    items = body["items"]
    if type(items) is not list or not items:
        _fail("the payload items are not a non-empty array")
    if kind == "event":
        check_event_items(items, rest)
    elif kind == "metric":
        check_metric_items(items, rest)
    else:
        check_map_items(items, kind)
    return WireMessage(topic_s, k, r, p, i, s, items)
