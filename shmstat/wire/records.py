"""What a subscriber receives, as records: every item of a received message as the JSON object ``shmstat
subscribe`` prints, so the Python stream API and the command print one shape.

An event is shaped as a line of ``--events jsonl:PATH``: ``name``, ``job``, ``rank`` (None for the collector's
own), ``timestamp`` (unix seconds), ``data``, ``seq``, ``pid``, ``incarnation``; a put metric as ``timestamp``,
``group``, ``name``, ``value``, ``rank``, ``job``, ``seq``; the collector's maps (stat windows, rank lifecycle,
heartbeats) as they are, with ``job`` added. Non-finite floats are the strings ``"NaN"``, ``"Infinity"``,
``"-Infinity"`` (as JSON has none), so ``json.dumps(record)`` prints exactly ``shmstat subscribe``'s item.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from . import COLLECTOR_RANK, WireMessage, decode_with_job

__all__ = ["item_record", "jsonable", "records"]


def jsonable(value: Any) -> Any:
    """``value`` with its non-finite floats as JSON's customary strings, containers copied."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def item_record(msg: WireMessage, index: int, job: str | None) -> dict[str, Any]:
    """Item ``index`` of ``msg`` (of job ``job``) as a record (see the module docstring)."""
    item = msg.items[index]
    rank = None if msg.rank == COLLECTOR_RANK else msg.rank
    if msg.kind == "event":
        name, ts_ns, data = item
        return {"name": name, "job": job, "rank": rank, "timestamp": ts_ns / 1e9, "data": jsonable(data),
                "seq": msg.seq + index, "pid": msg.pid, "incarnation": msg.incarnation}
    if msg.kind == "metric":
        group, name, value, ts = item
        return {"timestamp": ts, "group": group, "name": name, "value": jsonable(value), "rank": rank, "job": job,
                "seq": msg.seq + index}
    return {**jsonable(item), "job": job}


def records(frames: Sequence[Any]) -> list[dict[str, Any]]:
    """The items of one received multipart message (``sock.recv_multipart()`` on any collector endpoint) as
    records, each naming its job; raises :class:`~shmstat.errors.WireError` for a message that is not valid."""
    msg, job = decode_with_job(frames)
    return [item_record(msg, index, job) for index in range(len(msg.items))]
