"""Testing your distributed code: real ranks, a real collector, assertions that wait on the data.

Installed with shmstat as a pytest plugin (the ``pytest11`` entry point ``shmstat``), so every test can ask for
the ``shmstat_job`` fixture (a :class:`ShmstatJob`)::

    def rank_main(rank):
        step = shmstat.Stat("step_ms", [shmstat.Aggregation.COUNT], 0.05)
        for _ in range(1000):
            step.add(1.0)

    def test_two_ranks(shmstat_job):
        shmstat_job.run_ranks(rank_main, 2)
        shmstat_job.wait_for_rows("step_ms", "count", total=2000)

As with ``torchrun``, a rank that fails ends the others at once (:class:`RanksFailed` shows its exit status,
run time and output), even when they are blocked in a collective. Works under ``pytest -n auto`` (job ids are
unique per test and worker); nothing is left in ``/dev/shm`` or the runtime directory after a failed or
interrupted test. The collector is ``shmstat collect`` itself, run in a subprocess; :func:`start_collector` starts
one with any options (returning once it serves, with its endpoints) for a test that needs its own.
"""

from __future__ import annotations

from ._collector import CollectorProcess, start_collector
from ._job import ShmstatJob, unique_job_id
from ._ranks import RankGroup, RankResult, RanksFailed
from ._records import EventRecord, MetricRecord, Row

__all__ = [
    "CollectorProcess", "EventRecord", "MetricRecord", "RankGroup", "RankResult", "RanksFailed", "Row", "ShmstatJob",
    "start_collector", "unique_job_id",
]
