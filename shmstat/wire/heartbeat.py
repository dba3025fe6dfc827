"""The collector's heartbeats, and what a subscriber makes of them: loss told from silence.

Every ``--heartbeat-interval`` seconds (1 by default) and once more right before it closes, a collector publishes
on :data:`shmstat.wire.HEARTBEAT_TOPIC` what it has relayed from every sender, a sender being a
``(rank, pid, incarnation)`` (the collector's own stream of windows and lifecycle is rank -1). A heartbeat leaves
the collector's publish socket behind every message it relayed before, on the same ordered pipe, so a subscriber
that reads it has read everything sent before it that was not lost: any difference is a loss, at the tail
too. A heartbeat is one or more messages of kind ``heartbeat`` (header: rank -1, the collector's pid,
incarnation 0, seq counting heartbeat items); each message's items are one *summary* map then *sender* maps:

summary  ``{"beat": n, "part": j, "parts": m, "senders": tracked, "listed": listed, "final": bool,
"job_ended": bool}`` — beat ``n`` (0, 1, ... for this collector) in ``m`` messages; ``final`` on the last beat,
sent as the collector closes, where ``job_ended`` says no rank of the job was alive and every window was emitted
(otherwise the job goes on and a next collector takes it over).

sender   ``{"rank", "pid", "incarnation", "next_seq", "since_beat", "dropped", "n_event", "n_metric", "n_stat",
"n_rank"}`` — ``next_seq``: the sequence number after the newest item the collector has from the sender;
``since_beat``: the beat the collector was about to send when it first heard from it; ``dropped``: items the
sender dropped before they reached the collector (gaps in its sequence numbers); ``n_<kind>``: items of that kind
the collector relayed from it. At most :data:`MAX_LISTED` senders, the most recently active, are listed per beat,
at most :data:`ITEMS_PER_MESSAGE` per message.

:class:`GapTracker` is the subscriber's side: fed every message it receives, it returns a :class:`Gap` for every
item lost on the way to it (per kind it follows whole: an ``event/`` subscription follows events, ``""`` every
kind) and every item a sender dropped before the collector, as soon as a heartbeat shows it. Counting starts at
the first heartbeat the subscriber receives from a collector: a sender that collector first heard from later is
followed from its first item; for the others, what was lost before that heartbeat is not known.

A subscriber that can send tells the collector what it lost: a *loss report*, one frame sent upstream on its
``XSUB`` socket (:func:`encode_loss_report`), :data:`LOSS_REPORT_PREFIX` then a msgpack map ``{"v": 1, "job": job,
"lost": {kind: items}}`` of at most :data:`MAX_LOSS_REPORT` bytes, with the items of each data kind a heartbeat
showed lost on the way to it (``job``: on a node collector's endpoint, the job whose messages they were; else
``""``). The collector adds them up (``collector.subscriber_items_lost``); libzmq gives it no other way to know:
once a subscriber's queue is full, its publish socket skips it without a word until it has read half of it.

A *source* is one collector's stream: an endpoint, or, on a node collector's endpoint (three-frame messages, the
third naming the job: :mod:`shmstat.wire`), the endpoint *and the job*. Every job of a node collector has its own
heartbeats and numbering, but they share the collector's pid and rank -1, so a subscriber of a node endpoint must
key its sources by job (``shmstat subscribe`` uses ``"<endpoint> job <job>"``), or the jobs' beats would mix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple

import msgpack

from . import HEARTBEAT_KIND, HEARTBEAT_TOPIC, KINDS, WireMessage

__all__ = [
    "COUNT_KEYS",
    "ITEMS_PER_MESSAGE",
    "LOSS_REPORT_PREFIX",
    "MAX_LISTED",
    "MAX_LOSS_REPORT",
    "SENDER_STREAM",
    "Beat",
    "Gap",
    "GapTracker",
    "decode_loss_report",
    "encode_loss_report",
    "followed_kinds",
]

MAX_LISTED: Final = 4096
"""Senders listed in one beat at most (the most recently active first)."""
ITEMS_PER_MESSAGE: Final = 512
"""Sender maps per heartbeat message at most (a message stays well under 100 KiB)."""
COUNT_KEYS: Final = {kind: f"n_{kind}" for kind in KINDS}
"""The key of a sender map counting the items of each data kind."""
SENDER_STREAM: Final = "sender"
"""The :attr:`Gap.stream` of items a sender dropped before they reached the collector."""
LOSS_REPORT_PREFIX: Final = b"\x02shmstat/lost\x00"
"""The first bytes of a subscriber's loss report (``0x02``: neither a subscription, ``0x01``, nor an
unsubscription, ``0x00``, to the collector's publish socket)."""
MAX_LOSS_REPORT: Final = 512
"""A loss report's bytes at most (the collector's publish socket takes no longer frame)."""
_LOSS_VERSION = 1
_MAX_REPORTED = 1 << 48  # items one report may claim per kind at most
_MAX_SENDERS = 100_000  # senders a tracker follows per source at most (the least recently seen are forgotten)


class Gap(NamedTuple):
    """Items lost: ``items`` of ``stream`` (a data kind, lost between the collector and this subscriber; or
    :data:`SENDER_STREAM`, dropped by the sender before the collector) from one sender of ``source``."""

    source: str
    rank: int
    pid: int
    incarnation: int
    stream: str
    items: int


class Beat(NamedTuple):
    """What one heartbeat message told: the gaps it revealed, and whether it was the collector's last (``final``)
    and then whether the job ended with it (``job_ended``)."""

    gaps: list[Gap]
    final: bool
    job_ended: bool


def followed_kinds(topics: Iterable[str]) -> frozenset[str]:
    """The data kinds a subscription to ``topics`` receives whole (every topic of the kind): those whose
    ``<kind>/`` starts with one of the prefixes (no topics: every kind)."""
    prefixes = list(topics) or [""]
    return frozenset(k for k in KINDS if any(f"{k}/".startswith(p) for p in prefixes))


class _Sender:
    __slots__ = ("accounted", "base", "dropped", "got", "since")

    def __init__(self) -> None:
        self.got = dict.fromkeys(KINDS, 0)  # items received per kind
        self.accounted: dict[str, int] | None = None  # the collector's count matched by got + reported losses
        self.dropped = 0  # the sender's own drops accounted for
        self.since = -1


class _Source:
    __slots__ = ("first_beat", "pid", "senders")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first_beat = -1
        self.senders: OrderedDict[tuple[int, int, int], _Sender] = OrderedDict()


class GapTracker:
    """Counts what a subscriber received per sender and kind, and compares it with the collector's heartbeats.

    ``kinds``: the data kinds the subscription receives whole (:func:`followed_kinds`); losses of other kinds
    cannot be told from filtering and are not reported. ``source`` names one collector's stream (an endpoint;
    on a node collector's endpoint, the endpoint and the job: see the module docstring). Memory is bounded (at
    most 100,000 senders per source).
    """

    def __init__(self, kinds: Iterable[str]) -> None:
        self.kinds = frozenset(kinds)
        self._sources: dict[str, _Source] = {}

    def forget(self, source: str) -> None:
        """Drop what is known of ``source`` (its collector ended)."""
        self._sources.pop(source, None)

    def take(self, source: str, msg: WireMessage) -> Beat | None:
        """Account one message from ``source``: a data message is counted (None); a heartbeat is compared with
        what was counted and its :class:`Beat` returned."""
        if msg.kind == HEARTBEAT_KIND:
            return self._beat(source, msg)
        src = self._sources.get(source)
        if src is None:
            return None  # before the first heartbeat: counted from there
        key = (msg.rank, msg.pid, msg.incarnation)
        st = src.senders.get(key)
        if st is None:
            st = src.senders[key] = _Sender()
            if len(src.senders) > _MAX_SENDERS:
                src.senders.popitem(last=False)
        if msg.kind in st.got:
            st.got[msg.kind] += len(msg.items)
        return None

    def _beat(self, source: str, msg: WireMessage) -> Beat:
        items = msg.items
        head: dict[str, Any] = items[0] if items and isinstance(items[0], dict) else {}
        beat = _int(head.get("beat"))
        src = self._sources.get(source)
        if src is None or src.pid != msg.pid or beat < src.first_beat:  # a new collector on this source
            src = self._sources[source] = _Source(msg.pid)
        if src.first_beat < 0:
            src.first_beat = beat
        gaps: list[Gap] = []
        for item in items[1:]:
            if isinstance(item, dict):
                self._sender(source, src, item, gaps)
        return Beat(gaps, head.get("final") is True, head.get("job_ended") is True)

    def _sender(self, source: str, src: _Source, item: dict[str, Any], gaps: list[Gap]) -> None:
        key = (_int(item.get("rank")), _int(item.get("pid")), _int(item.get("incarnation")))
        since = _int(item.get("since_beat"), -1)
        counts = {k: _int(item.get(COUNT_KEYS[k])) for k in KINDS}
        dropped = _int(item.get("dropped"))
        st = src.senders.get(key)
        if st is None:
            st = src.senders[key] = _Sender()
            if len(src.senders) > _MAX_SENDERS:
                src.senders.popitem(last=False)
        else:
            src.senders.move_to_end(key)
        if st.accounted is None or st.since != since:
            st.since = since
            if since > src.first_beat:  # first heard of after this subscriber's first beat: all of it is due here
                st.accounted = dict.fromkeys(KINDS, 0)
                st.dropped = 0
            else:  # older than this subscriber: what came before is not known, count from now
                st.accounted = counts
                st.got = dict.fromkeys(KINDS, 0)
                st.dropped = dropped
                return
        for kind in self.kinds:
            due = counts[kind] - st.accounted[kind]
            lost = due - st.got[kind]
            if lost > 0:
                gaps.append(Gap(source, key[0], key[1], key[2], kind, lost))
            st.accounted[kind] = counts[kind]
            st.got[kind] = 0
        if dropped > st.dropped:
            gaps.append(Gap(source, key[0], key[1], key[2], SENDER_STREAM, dropped - st.dropped))
        st.dropped = max(st.dropped, dropped)


def encode_loss_report(lost: Mapping[str, int], job: str = "") -> bytes | None:
    """The loss report of ``lost`` (items per data kind) for ``job`` ("" off a node collector's endpoint); None
    when nothing was lost or it would not fit in :data:`MAX_LOSS_REPORT` (a job name that long)."""
    counts = {kind: n for kind, n in lost.items() if kind in KINDS and 0 < n <= _MAX_REPORTED}
    if not counts:
        return None
    frame = LOSS_REPORT_PREFIX + msgpack.packb({"v": _LOSS_VERSION, "job": job, "lost": counts}, use_bin_type=True)
    return frame if len(frame) <= MAX_LOSS_REPORT else None


def decode_loss_report(frame: bytes) -> tuple[str, dict[str, int]] | None:
    """``(job, items lost per data kind)`` of a loss report, or None for anything else or anything malformed
    (a version other than 1, another key, a kind not of :data:`KINDS`, a count not an int in ``1..2**48``)."""
    if len(frame) > MAX_LOSS_REPORT or not frame.startswith(LOSS_REPORT_PREFIX):
        return None
    try:
        body = msgpack.unpackb(frame[len(LOSS_REPORT_PREFIX):], raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception:  # any malformed msgpack (msgpack raises several types): not a report
        return None
    if type(body) is not dict or set(body) != {"v", "job", "lost"} or body["v"] != _LOSS_VERSION:
        return None
    job, lost = body["job"], body["lost"]
    if type(job) is not str or type(lost) is not dict or not lost:
        return None
    for kind, n in lost.items():
        if kind not in KINDS or type(n) is not int or not 0 < n <= _MAX_REPORTED:
            return None
    return job, lost


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("no ext types in a loss report")


def _int(value: Any, default: int = 0) -> int:
    return value if type(value) is int else default


assert HEARTBEAT_TOPIC.startswith(HEARTBEAT_KIND + "/")
