"""Shared test fixtures: every test starts and ends with a clean process-global state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from elastic.metrics import _registry as _elastic_registry
from shmstat.job import _state

if TYPE_CHECKING:
    from kit.cluster import Cluster


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

    from shmstat.shm.segment import Segment

    marker = f"-{os.getpid()}-"
    for job in Segment.list_jobs():
        if marker in job:
            Segment.unlink(job)


@pytest.fixture
def job() -> Iterator[str]:
    """A job id no other test uses; afterwards this process is detached and the job's segment removed."""
    from kit.support import unique_job

    from shmstat.job.attach import shutdown
    from shmstat.shm.segment import Segment

    name = unique_job()
    yield name
    shutdown()
    Segment.unlink(name)


@pytest.fixture(params=["c", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test once per backend (:mod:`shmstat._backend`): ``"c"`` (skipped when the extensions are not
    built) and ``"python"``; yields the name. In this process, what is chosen at construction follows (writers,
    Stat cores, outboxes, the collector's intake check); processes the test starts inherit
    ``SHMSTAT_PURE_PYTHON`` and choose the same backend from their start (Event and log_event included)."""
    from collector._backend import c_intake_check
    from shmstat import _backend

    name = request.param
    if name == "c" and not (_backend.c_available() and c_intake_check() is not None):
        pytest.skip("the C extensions are not built")
    monkeypatch.setenv(_backend.VARIABLE, "1" if name == "python" else "0")
    with _backend.use(name):
        yield name


@pytest.fixture
def sim_cluster(tmp_path) -> Iterator[Cluster]:
    """Two simulated hosts and the ops side (tests/kit/cluster.py), removed after the test; skips where namespaces
    cannot be made. A failing test shows the output tail of every process started in them."""
    from kit.cluster import simulated_cluster

    with simulated_cluster(tmp_path / "cluster", hosts=2) as cluster:
        yield cluster
        print(cluster.tails())  # pytest shows it only when the test failed
