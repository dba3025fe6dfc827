"""The pytest plugin (registered through the ``pytest11`` entry point: installed with shmstat, no
``conftest.py`` needed): the ``shmstat_job`` fixture and the ``shmstat_job_factory`` fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ._job import ShmstatJob, close_all

__all__ = ["pytest_sessionfinish", "shmstat_job", "shmstat_job_factory"]


@pytest.fixture
def shmstat_job() -> Iterator[ShmstatJob]:
    """A job unique to this test (and xdist worker) with a real collector capturing every row, event and metric;
    torn down with its ranks, segment and runtime directory whatever the test did."""
    job = ShmstatJob()
    try:
        yield job
    finally:
        job.close()


@pytest.fixture
def shmstat_job_factory() -> Iterator[Callable[..., ShmstatJob]]:
    """Make more jobs in one test, with collector options: ``shmstat_job_factory(collector_args=[...])``; every
    job made is torn down after the test."""
    made: list[ShmstatJob] = []

    def make(**kwargs: Any) -> ShmstatJob:
        job = ShmstatJob(**kwargs)
        made.append(job)
        return job

    try:
        yield make
    finally:
        for job in made:
            job.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """An interrupted session still closes every job a fixture opened (normally each closed at its teardown)."""
    close_all()
