"""``shmstat.stats()``: this process's own counters (what was dropped, ignored or failed, and why)."""

from __future__ import annotations

from dataclasses import dataclass

from . import _state

__all__ = ["ProcessStats", "stats"]


@dataclass(frozen=True)
class ProcessStats:
    """Counters of this process; every sample or event not delivered is counted in one of them."""

    attached: bool
    job: str | None
    rank: int | None
    incarnation: int | None
    handler_errors: int
    nan_samples: int
    discarded_samples: int
    dropped_samples: int
    """Samples of this process's rank that no slot holds (a full table, the segment removed: see shmstat ls)."""
    events_queued: int
    events_sent: int
    events_dropped: int
    subscribed: bool


def stats() -> ProcessStats:
    """A snapshot of this process's counters (NaN and max_samples discards are per rank, from the segment)."""
    st = _state.STATE
    att, pub = st.attachment, st.publisher
    nan = discarded = dropped = 0
    if att is not None:
        if att.local_rank >= 0:
            info = att.segment.rank(att.local_rank)
            nan, discarded = info.nan_count, info.discarded
        if att.owner_local_rank >= 0:
            dropped = att.segment.rank(att.owner_local_rank).dropped
        else:
            dropped = att.segment.header().dropped
    ps = pub.stats() if pub is not None else None
    return ProcessStats(
        attached=att is not None,
        job=att.segment.job if att is not None else None,
        rank=att.rank if att is not None else None,
        incarnation=att.incarnation if att is not None else None,
        handler_errors=st.handler_errors,
        nan_samples=nan,
        discarded_samples=discarded,
        dropped_samples=dropped,
        events_queued=ps.queued if ps is not None else 0,
        events_sent=ps.sent_items if ps is not None else 0,
        events_dropped=ps.dropped if ps is not None else 0,
        subscribed=bool(ps.subscribed) if ps is not None else False,
    )
