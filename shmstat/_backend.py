"""The one switch between shmstat's C extensions and their pure-Python twins: decided here, asked for everywhere.

The hot paths exist twice: in C (``shmstat._fastpath``, ``shmstat._pubfast``; optional, built at install time)
and in Python, the reference each C twin is held to by a differential test. :func:`backend` says which runs: the
``"c"`` backend when the extensions are built and ``SHMSTAT_PURE_PYTHON`` is not ``1``, else ``"python"``.

When the variable is read: once, on the first call of :func:`backend`, and the answer is kept for the process.
That first call is made by ``import shmstat``, because :mod:`shmstat.publish.events` fixes the storage class of
``Event`` and the ``log_event`` function when it is defined; so this variable (and no other) is read when shmstat
is imported, as prometheus_client's ``values`` module picks its value class. A child process started with another
value makes its own choice.

The API every backend provides: a :class:`Backend` field per C name below. On the ``"python"`` backend each
field is ``None`` and the caller runs the Python twin named here (a missing extension leaves its fields ``None``
too); the right column is the test that holds the two to the same behaviour.

========================================  ===============================================  ========================
C (``Backend`` field)                     Python twin                                      differential test
========================================  ===============================================  ========================
``SlotWriter`` (at each writer's birth,   ``shmstat.writer._pywriter.PySlotWriter``        test_fastpath.py,
  in a job and in process)                                                                 test_percentiles.py
``add_u64`` (at each add)                 ``shmstat.job._degrade.add_counter``'s locked add (one atomic add)
``SectionCore``, ``RecordCore``,          ``shmstat.writer.sections``' ``_enter_py``,      test_sections.py
``PhaseWriter``, ``thread_stack``,        ``_exit_py``, ``_PyStack``; ``shmstat.shm.phase.
``section_epoch``, ``SectionFunction``    PhaseWriter``; ``section.__call__``'s wrapper
``Outbox`` (at each publisher's birth)    ``shmstat.publish.outbox.Outbox``                test_outbox.py
``EventBase``, ``set_event_checks``       ``shmstat.publish.events._PyEventStorage``       test_event_paths.py
``check_data``                            ``shmstat.publish._eventdata._check_data``       test_outbox.py
``naive_local_ns``, ``remember_offset``   ``shmstat.publish._eventdata._naive_local_ns``   test_event_timestamps.py
``log_event``, ``set_log_state``,         ``shmstat.publish.events.log_event``             test_event_paths.py
``sync_log_state``
``put_metric``, ``set_metric_state``      ``elastic.metrics.emitting._py_put_metric``      test_elastic_metrics.py
``collector._intake.check``               ``shmstat.wire.decode``                          test_intake.py
  (asked through ``collector._backend``)
========================================  ===============================================  ========================

The rows marked "at each ..." ask :func:`backend` when they build (or run); the others were bound at import.
Tests switch what is chosen later with :func:`use` (the ``backend`` fixture of tests/conftest.py does, and sets
the variable for the processes a test starts); what was bound at import is tested in child processes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

__all__ = ["FASTPATH_API", "NAMES", "PUBFAST_API", "VARIABLE", "Backend", "backend", "c_available", "load", "use"]

VARIABLE = "SHMSTAT_PURE_PYTHON"
"""The environment variable that asks for the pure-Python backend (``1``)."""

NAMES = ("c", "python")
"""The backends, by name."""

FASTPATH_API = ("SlotWriter", "add_u64", "SectionCore", "RecordCore", "PhaseWriter", "thread_stack", "section_epoch",
                "SectionFunction")
"""What ``shmstat._fastpath`` must provide (the attached writer)."""

PUBFAST_API = ("Outbox", "EventBase", "set_event_checks", "check_data", "naive_local_ns", "remember_offset",
               "log_event", "set_log_state", "sync_log_state", "put_metric", "set_metric_state")
"""What ``shmstat._pubfast`` must provide (the publish path and events)."""

BackendName = Literal["c", "python"]


@dataclass(frozen=True)
class Backend:
    """The implementations of shmstat's hot paths: each field the C one, or None where its Python twin runs."""

    name: BackendName
    SlotWriter: Any = None
    add_u64: Callable[[Any, int, int], None] | None = None
    SectionCore: Any = None
    SectionFunction: Any = None
    RecordCore: Any = None
    PhaseWriter: Any = None
    thread_stack: Callable[[], Any] | None = None
    section_epoch: Callable[[list[int]], None] | None = None
    Outbox: Any = None
    EventBase: Any = None
    set_event_checks: Callable[..., None] | None = None
    check_data: Callable[[Any], dict[str, Any] | None] | None = None
    naive_local_ns: Callable[[Any], int | None] | None = None
    remember_offset: Callable[[Any, int], None] | None = None
    log_event: Callable[[Any], None] | None = None
    set_log_state: Callable[..., None] | None = None
    sync_log_state: Callable[..., None] | None = None
    put_metric: Callable[..., None] | None = None
    set_metric_state: Callable[..., None] | None = None

    @property
    def is_c(self) -> bool:
        """Whether this is the C backend."""
        return self.name == "c"


_PYTHON = Backend("python")
_current: list[Backend] = []  # [the chosen backend], once chosen
_loaded: dict[str, Backend] = {}


def _extension(name: str, api: tuple[str, ...]) -> ModuleType | None:
    """The extension module ``shmstat.<name>`` if it is built and provides ``api`` (a build older than its source
    may not: then it is not used), else None."""
    try:
        module = importlib.import_module(f"shmstat.{name}")
    except ImportError:
        return None
    return module if all(hasattr(module, part) for part in api) else None


def load(name: BackendName) -> Backend:
    """The backend called ``name``, without choosing it (loaded once): ``"c"`` holds the extensions that are built
    (the ``"python"`` backend if none is); a name not in :data:`NAMES` is a :class:`ValueError`."""
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(NAMES)}")
    if name == "python":
        return _PYTHON
    found = _loaded.get(name)
    if found is None:
        fields: dict[str, Any] = {}
        for module, api in (("_fastpath", FASTPATH_API), ("_pubfast", PUBFAST_API)):
            ext = _extension(module, api)
            if ext is not None:
                fields.update({part: getattr(ext, part) for part in api})
        found = _loaded[name] = Backend("c", **fields) if fields else _PYTHON
    return found


def backend() -> Backend:
    """The backend this process runs: chosen on the first call (see the module docstring), then the same."""
    if _current:
        return _current[0]
    chosen = load("python" if os.environ.get(VARIABLE) == "1" else "c")
    _current.append(chosen)
    return chosen


def c_available() -> bool:
    """Whether every C extension of shmstat is built (and provides its API)."""
    c = load("c")
    return all(getattr(c, part) is not None for part in FASTPATH_API + PUBFAST_API)


@contextlib.contextmanager
def use(name: BackendName) -> Iterator[Backend]:
    """For tests: within the block, :func:`backend` is ``name`` (what is chosen at construction follows; what
    shmstat bound at import does not). Raises :class:`LookupError` if ``"c"`` is asked and not built."""
    chosen = load(name)
    if chosen.name != name:
        raise LookupError("the C extensions of shmstat are not built")
    saved = list(_current)
    _current[:] = [chosen]
    try:
        yield chosen
    finally:
        _current[:] = saved
