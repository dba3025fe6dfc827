"""Creating a Stat is idempotent under any concurrency: threads of one rank that create the same Stat at the same
moment get one slot (one descriptor in the rank's entry, one writer in the process), and every sample they add
is counted. Real shared memory, read back with the collector's reader; C and pure-Python writers."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from shmstat import Aggregation as A
from shmstat.job.attach import init
from shmstat.shm.reader import SegmentReader
from shmstat.shm.segment import Segment
from shmstat.writer.stat import Stat

ROUNDS = 30
PER_THREAD = 2_000


def _slot_counts(job: str) -> tuple[dict[str, int], dict[str, int]]:
    """Per stat group: (descriptors published in rank 0's entry, samples in every window of those slots), read
    from the segment as a collector reads it."""
    seg = Segment.open(job, create=False)
    try:
        reader = SegmentReader(seg)
        (info,) = reader.ranks()
        descriptors: dict[str, int] = defaultdict(int)
        samples: dict[str, int] = defaultdict(int)
        for desc in reader.descriptors(info.local_rank):
            descriptors[desc.group] += 1
            for window in reader.read_slot(info, desc, 1 << 62, 0, -1).windows:
                samples[desc.group] += window.count
        return dict(descriptors), dict(samples)
    finally:
        seg.close()


def _create_and_add(start: threading.Barrier, group: str, errors: list[BaseException]) -> None:
    try:
        start.wait()
        stat = Stat("created", [A.COUNT, A.SUM], 3600.0, group=group)
        add = stat.add
        for _ in range(PER_THREAD):
            add(1.0)
    except BaseException as exc:  # reported by the test: a thread's failure must fail it
        errors.append(exc)


@pytest.mark.parametrize("threads", [6, 16])
def test_threads_creating_one_stat_at_once_get_one_slot_and_lose_nothing(job, backend, threads):
    # a round per group: each round's key is new to the process, so every round races on creating it
    init(job, rank=0, publish=False, max_stats=ROUNDS + 1)
    errors: list[BaseException] = []
    for r in range(ROUNDS):
        start = threading.Barrier(threads)
        pool = [threading.Thread(target=_create_and_add, args=(start, f"round{r}", errors)) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    assert not errors, errors
    descriptors, samples = _slot_counts(job)
    want = {f"round{r}": 1 for r in range(ROUNDS)}
    assert descriptors == want, "a Stat created by several threads at once got several slots"
    assert samples == {f"round{r}": threads * PER_THREAD for r in range(ROUNDS)}
