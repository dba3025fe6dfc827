"""The scanner's table of known slots: each slot's descriptor and watermark, and all of them as NumPy arrays in a
fixed order (what the vectorised pass of :mod:`collector.read.scanner` computes on), with the merge key that
makes slots of several ranks one stat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from shmstat.aggregation import PERCENTILE_MASK
from shmstat.shm import layout as L
from shmstat.shm.layout_records import StatDescriptor

from .column_merge import StatTable

__all__ = ["MergeKey", "Slot", "SlotTable"]


class MergeKey(NamedTuple):
    """What makes slots of several ranks one stat that merges across ranks (max_samples may differ)."""

    group: str
    name: str
    window_ms: int
    agg_mask: int


@dataclass
class Slot:
    """One known slot of the segment: its descriptor and its watermark (the newest window emitted)."""

    desc: StatDescriptor
    after_wid: int
    after_inc: int = -1
    """Long windows: the incarnation that wrote window ``after_wid`` when it was emitted (-1: unknown)."""


class SlotTable:
    """The known slots as arrays, in a fixed order (rebuilt when slots are added)."""

    def __init__(self, slots: list[Slot], geometry: L.Geometry) -> None:
        self.slots = slots
        n = len(slots)
        banks = geometry.banks
        lr = np.fromiter((s.desc.local_rank for s in slots), np.int64, n)
        si = np.fromiter((s.desc.index for s in slots), np.int64, n)
        self.lr = lr
        self.row0 = (lr * geometry.max_stats + si) * banks  # first bank of each slot, counted from BANK_BASE
        self.emitted_word = (geometry.desc_base + (lr * geometry.max_stats + si) * L.DESC_SIZE + L.D_EMITTED) // 8
        self.wns = np.fromiter((s.desc.window_ns for s in slots), np.int64, n)
        self.long = np.fromiter((s.desc.is_long for s in slots), bool, n)
        """Slots of windows over an hour: read one by one, they also close by count and by their writer's end."""
        self.max_samples = np.fromiter((s.desc.max_samples for s in slots), np.int64, n)
        self.hist = np.fromiter((s.desc.hist for s in slots), np.int64, n)
        """Each slot's histogram index in its rank's table (-1: the stat keeps no percentiles)."""
        self.after = np.fromiter((s.after_wid for s in slots), np.int64, n)
        self.after_inc = np.fromiter((s.after_inc for s in slots), np.int64, n)
        keys: dict[MergeKey, int] = {}
        self.keys = keys
        """Merge key -> its id in :attr:`key_id`."""
        groups: dict[str, int] = {}
        merge_keys = [MergeKey(s.desc.group, s.desc.name, s.desc.window_ms, s.desc.agg_mask) for s in slots]
        self.key_id = np.fromiter((keys.setdefault(k, len(keys)) for k in merge_keys), np.int64, n)
        self.group_id = np.fromiter((groups.setdefault(s.desc.group, len(groups)) for s in slots), np.int64, n)
        first_slot: dict[MergeKey, int] = {}  # the first slot of a stat: its descriptor's flags speak for the stat
        for i, k in enumerate(merge_keys):
            first_slot.setdefault(k, i)
        order = np.empty(len(keys), np.int64)
        order[[keys[k] for k in sorted(keys)]] = np.arange(len(keys))
        self.stats = StatTable(
            np.array([k.group for k in keys] + [None], object)[:-1],
            np.array([k.name for k in keys] + [None], object)[:-1],
            np.array([k.window_ms for k in keys], np.int64).reshape(-1),
            np.array([k.agg_mask for k in keys], np.int64).reshape(-1),
            np.array([slots[first_slot[k]].desc.higher_is_better for k in keys], bool).reshape(-1),
            np.array([bool(k.agg_mask & PERCENTILE_MASK) for k in keys], bool).reshape(-1), order,
        )
        """The stats, by key id (for :func:`collector.read.column_merge.merge_parts`)."""
        self.groups = list(groups)
        self.window_lengths = sorted(set(self.wns.tolist()))

    def sync_back(self) -> None:
        """Write the array watermarks back into the slot objects (before the table is rebuilt)."""
        for slot, after, inc in zip(self.slots, self.after.tolist(), self.after_inc.tolist(), strict=True):
            slot.after_wid, slot.after_inc = after, inc
