"""Shared test fixtures: every test starts and ends with a clean process-global state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic.metrics import _registry as _elastic_registry
from shmstat import _state


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the process-global state before and after each test: shmstat's (handlers, attachment, publisher)
    and elastic.metrics' handler registry."""
    _state.reset()
    _elastic_registry.reset()
    yield
    _state.reset()
    _elastic_registry.reset()


@pytest.fixture(autouse=True, scope="session")
def _remove_leftover_segments() -> Iterator[None]:
    """A safety net: segments of this test process's jobs (ids carry its pid) that a failed test left behind."""
    yield
    import os

    from shmstat.segment import Segment

    marker = f"-{os.getpid()}-"
    for job in Segment.list_jobs():
        if marker in job:
            Segment.unlink(job)


@pytest.fixture
def job() -> Iterator[str]:
    """A job id no other test uses; afterwards this process is detached and the job's segment removed."""
    from _support import unique_job

    from shmstat.attach import shutdown
    from shmstat.segment import Segment

    name = unique_job()
    yield name
    shutdown()
    Segment.unlink(name)
