"""The relay's book of senders and the heartbeats made from it (the format: :mod:`shmstat.wire.heartbeat`).

Per sender ``(rank, pid, incarnation)``: the sequence number after its newest item, the beat at which the relay
first heard from it, the items it dropped before the relay (gaps in its numbering) and the items of each kind
relayed. At most ``max_senders`` are kept (the least recently active are forgotten first), and a heartbeat
lists the most recently active ones, those a subscriber is most likely following.
"""

from __future__ import annotations

from shmstat import wire
from shmstat.wire.heartbeat import COUNT_KEYS, ITEMS_PER_MESSAGE, MAX_LISTED

__all__ = ["SenderBook"]

_KIND_SLOT = {kind: 4 + i for i, kind in enumerate(wire.KINDS)}  # record: next_seq, since, dropped, tick, n/kind
_HEARTBEAT_TOPIC = wire.HEARTBEAT_TOPIC.encode()


class SenderBook:
    """What the relay has from every sender, and the heartbeat messages that say it. Single-threaded; a sender's
    record is a list (the relay updates one per message), ordered by activity only when a beat or the bound needs
    it."""

    def __init__(self, pid: int, max_senders: int = 100_000) -> None:
        self.pid = pid
        self.max_senders = max_senders
        self.beat = 0
        """The number of the next beat."""
        self._items_sent = 0  # heartbeat items so far: the seq of the next heartbeat message
        self._tick = 0  # counts updates: a record's tick says when it was last active
        self._senders: dict[tuple[int, int, int], list[int]] = {}

    def _record(self, key: tuple[int, int, int]) -> list[int]:
        self._tick += 1
        rec = self._senders.get(key)
        if rec is None:
            if len(self._senders) >= self.max_senders:  # forget the least recently active tenth at once
                oldest = sorted(self._senders.items(), key=lambda kv: kv[1][3])[: max(1, self.max_senders // 10)]
                for k, _ in oldest:
                    del self._senders[k]
            rec = self._senders[key] = [0, self.beat, 0, 0, 0, 0, 0, 0]
        rec[3] = self._tick
        return rec

    def relayed(self, key: tuple[int, int, int], kind: str, n_items: int, next_seq: int, dropped: int = 0) -> None:
        """``n_items`` of ``kind`` from ``key`` went out (or were offered to subscribers), ending at ``next_seq``;
        the sender had dropped ``dropped`` items just before them."""
        rec = self._record(key)
        if next_seq > rec[0]:
            rec[0] = next_seq
        rec[2] += dropped
        slot = _KIND_SLOT.get(kind)
        if slot is not None:
            rec[slot] += n_items

    def held(self, key: tuple[int, int, int], next_seq: int, dropped: int) -> None:
        """The sender's hand-over marker: it numbered up to ``next_seq``, dropping ``dropped`` items at the end."""
        rec = self._record(key)
        rec[0] = max(rec[0], next_seq)
        rec[2] += dropped

    def heartbeat(self, *, final: bool = False, job_ended: bool = False) -> list[list[bytes]]:
        """The frames of the next beat: one or more ``[topic, payload]`` messages listing the
        :data:`~shmstat.wire.heartbeat.MAX_LISTED` most recently active senders."""
        listed = list(self._senders.items())
        if len(listed) > MAX_LISTED:
            listed = sorted(listed, key=lambda kv: kv[1][3], reverse=True)[:MAX_LISTED]
        chunks = [listed[i:i + ITEMS_PER_MESSAGE] for i in range(0, len(listed), ITEMS_PER_MESSAGE)] or [[]]
        messages = []
        for part, chunk in enumerate(chunks):
            items: list[dict] = [{"beat": self.beat, "part": part, "parts": len(chunks), "senders": len(self._senders),
                                  "listed": len(listed), "final": final, "job_ended": job_ended}]
            for (rank, pid, incarnation), rec in chunk:
                item = {"rank": rank, "pid": pid, "incarnation": incarnation, "next_seq": rec[0],
                        "since_beat": rec[1], "dropped": rec[2]}
                for kind, slot in _KIND_SLOT.items():
                    item[COUNT_KEYS[kind]] = rec[slot]
                items.append(item)
            payload = wire.encode(wire.HEARTBEAT_KIND, wire.COLLECTOR_RANK, self.pid, 0, self._items_sent, items)
            self._items_sent += len(items)
            messages.append([_HEARTBEAT_TOPIC, payload])
        self.beat += 1
        return messages
