"""Attaching this process to a job as one rank: ``init()``, the lazy attach from the environment, detach.

Telemetry never takes the job down: the lazy attach (a Stat, ``log_event``, ``put_metric`` or ``@prof`` in a
rank configured by the environment, a forked or spawned worker) never raises because of the segment's state.
A rank or worker that finds no entry gets one without (its samples are dropped and counted in the segment), a
segment that cannot be opened leaves the process in-process; each is reported once (:mod:`shmstat.job._degrade`).
Only a bad environment value raises (:class:`~shmstat.errors.ConfigError`).

Nothing left behind: the last process of a job that no collector serves removes the job's segment and lock
file when it detaches (:func:`shutdown`, also run at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CapacityError, ConfigError, ShmstatError
from ..shm.runtime import ingest_endpoint, validate_job
from . import _state
from ._degrade import geometry_from_env, reported, warn_once
from .identity import Identity, identity_from_env, identity_variables, start_environ

if TYPE_CHECKING:  # pragma: no cover
    from ..shm.layout import Geometry
    from ..shm.segment import Segment
    from .rank import RankAttachment

# The segment, rank-table and publisher modules (and zmq, msgpack) are imported when a rank first attaches, not
# by ``import shmstat``: code that never joins a job (the torch.monitor drop-in, in-process) does not pay for them.

__all__ = ["ensure_init", "init", "shutdown"]

_REOPENS = 3
"""Times a process opens the job's segment again when it was removed between its opening and the registration."""


def init(
    job: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    *,
    max_ranks: int | None = None,
    max_stats: int | None = None,
    banks: int | None = None,
    endpoint: str | None = None,
    publish: bool = True,
    backlog_mb: float | None = None,
    section_window_s: float | None = None,
    hang_stacks: bool | None = None,
    event_latency_ms: float | None = None,
) -> RankAttachment | None:
    """Attach this process to ``job`` as ``rank`` (creating the segment if first); returns the attachment.

    Arguments left out come from the environment (see :mod:`shmstat.job.identity`); with no job anywhere the
    process stays in-process (torch.monitor behaviour) and None is returned. Capacities given explicitly
    must match an existing segment; left out, a segment this call creates takes them from
    ``SHMSTAT_MAX_RANKS`` / ``SHMSTAT_MAX_STATS`` / ``SHMSTAT_MAX_PERCENTILE_STATS`` (an existing one is taken as
    it is). A rank that finds no room in the rank table is attached without an entry: its samples are dropped
    and counted in the segment, and the job warns once. Stats created afterwards write to shared memory; events
    and metrics are published to the collector at ``endpoint`` (default: the job's ipc socket) unless ``publish=False``;
    ``backlog_mb`` bounds what the rank holds while no collector takes it (default ``SHMSTAT_BACKLOG_MB`` or 64).
    ``section_window_s`` is the window of :func:`shmstat.section` Stats (default ``SHMSTAT_SECTION_WINDOW_S`` or
    5 s), in a job or not. ``hang_stacks`` (default ``SHMSTAT_HANG_STACKS``) lets the collector ask a rank it
    finds hung for its Python stacks (:mod:`shmstat.job.hang_stacks`). ``event_latency_ms`` is how long the rank
    may hold an event or metric before sending it to the collector (default ``SHMSTAT_EVENT_LATENCY_MS`` or 20 ms; a
    message's worth and the exit go at once): a longer budget costs the node's collector less per event.
    Calling ``init`` again for another job detaches from the first.

    A process whose rank comes from the environment (``rank`` left out) and that took that environment unchanged
    from the process that started it (a forked child, a ``multiprocessing`` worker of a rank: a DataLoader's,
    a pool's) is a *worker* of that rank: it writes for the rank from an entry of its own and leaves the rank's
    entry to the rank, whether the rank attached before it or not (see :func:`_inherited`). A process given its
    variables at its start (by torchrun, ``shmstat run``, a shell) or that set them itself is the rank.
    """
    if section_window_s is not None:
        _state.STATE.section_window_s = _state.check_window_s(section_window_s, "section_window_s")
        _state.rebind_sections()
    from . import hang_stacks as stacks

    want_stacks = stacks.wanted(hang_stacks)
    who = _identity(job, rank, local_rank, world_size)
    if who is None:
        _state.STATE.auto_init_done = True
        return None
    from ..publish.publisher import event_latency_ms as latency_ms

    if publish:
        event_latency_ms = latency_ms(event_latency_ms)  # a bad budget stops init before it attaches
    geometry = _asked_geometry(max_ranks, max_stats, banks)
    create_geometry = geometry_from_env() if geometry is None else None
    with _state.STATE.lock:
        shutdown()
        att = _register(who, geometry, create_geometry)
        _state.STATE.attachment = att
        if publish:
            _start_publisher(att, who, endpoint, backlog_mb, event_latency_ms)
        _state.STATE.auto_init_done = True
        _state.rebind_sections()
        if want_stacks and att.has_entry and att.writer_of < 0:
            try:
                stacks.enable(who.job)
            except (OSError, ShmstatError) as exc:  # telemetry never stops the job: it goes on without stacks
                warn_once("stacks", f"cannot register hang stacks ({exc}); the collector gets none",
                          job=who.job)
    return att


@dataclass(frozen=True)
class _Who:
    """Who ``init`` attaches: the job, the rank's numbers, and whether it is a worker of that rank."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    inherited: bool


def _identity(job: str | None, rank: int | None, local_rank: int | None, world_size: int | None) -> _Who | None:
    """``init``'s arguments completed from the environment and checked; None with no job anywhere."""
    env = identity_from_env()
    inherited = env is not None and rank is None and local_rank is None and job in (None, env.job) and _inherited()
    if job is None:
        if env is None:
            return None
        job = env.job
    validate_job(job)
    if rank is None:
        rank = env.rank if env is not None else 0
    if local_rank is None:
        local_rank = env.local_rank if env is not None and env.rank == rank else rank
    if world_size is None:
        world_size = env.world_size if env is not None else 1
    for label, value in (("rank", rank), ("local_rank", local_rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{label} must be a non-negative int, got {value!r}")
    return _Who(job, rank, local_rank, world_size, inherited)


def _asked_geometry(max_ranks: int | None, max_stats: int | None, banks: int | None) -> Geometry | None:
    """The capacities ``init`` was given (the others at their defaults), or None when it was given none."""
    from ..shm.layout import Geometry

    if max_ranks is None and max_stats is None and banks is None:
        return None
    default = Geometry()
    return Geometry(max_ranks or default.max_ranks, max_stats or default.max_stats, banks or default.banks)


def _register(who: _Who, geometry: Geometry | None, create_geometry: Geometry | None) -> RankAttachment:
    """Open the job's segment and register the rank in it (an attachment without an entry when the table is full),
    opening it again when it was removed in between."""
    from ..shm.segment import Segment
    from .rank import RankAttachment, SegmentRemoved

    tries_left = _REOPENS
    while True:
        segment = Segment.open(who.job, geometry=geometry, create_geometry=create_geometry)
        try:
            return RankAttachment.register(segment, rank=who.rank, local_rank=who.local_rank,
                                           world_size=who.world_size, inherited=who.inherited)
        except SegmentRemoved:
            segment.close()
            if not tries_left:
                raise
            tries_left -= 1  # removed between its opening and the registration: the job's segment is made anew
        except CapacityError:
            return _no_room_for_rank(segment, who.rank, who.local_rank, who.world_size)
        except BaseException:
            segment.close()
            raise


def _start_publisher(att: RankAttachment, who: _Who, endpoint: str | None, backlog_mb: float | None,
                     event_latency_ms: float | None) -> None:
    """The rank's publisher to its collector, which records in the segment what it could not deliver."""
    from ..publish.publisher import Publisher

    target = (endpoint or ingest_endpoint(who.job), who.rank, att.incarnation)
    _state.STATE.publish_target = target
    _state.STATE.publisher = pub = Publisher(
        target[0], rank=who.rank, incarnation=att.incarnation,
        backlog_bytes=None if backlog_mb is None else int(backlog_mb * 1024 * 1024), job=who.job,
        event_latency_ms=event_latency_ms,
    )
    pub.on_undelivered = att.record_events_end


def ensure_init() -> RankAttachment | None:
    """The current attachment, attaching from the environment the first time it is asked.

    In a process forked from an attached rank, the first call registers the child as a writer of that rank
    (its own slots; the collector counts its samples in the rank's rows).
    """
    st = _state.STATE
    if st.attachment is not None and st.attachment.pid == os.getpid():
        return st.attachment
    if st.fork_owner is not None:
        with st.lock:
            if st.attachment is not None and st.attachment.pid == os.getpid():
                return st.attachment
            segment, owner = st.fork_owner
            from .rank import RankAttachment

            try:
                st.attachment = RankAttachment.register_writer(segment, owner_local_rank=owner)
            except (ShmstatError, OSError) as exc:  # e.g. the job's lock file became unusable
                warn_once("attach", f"a forked worker cannot register in job {segment.job!r} ({exc}); its samples "
                          "are dropped and counted in its rank's entry", job=segment.job)
                owner_info = segment.rank(owner)
                st.attachment = RankAttachment.without_entry(segment, rank=owner_info.rank,
                                                             world_size=owner_info.world_size, writer_of=owner)
            st.fork_owner = None
            return st.attachment
    if st.auto_init_done:
        return None
    with st.lock:
        if st.auto_init_done:
            return st.attachment
        env: Identity | None = identity_from_env()  # a bad variable raises: that is a configuration mistake
        if env is None:
            st.auto_init_done = True
            return None
        from .rank import EntryHeldError

        if reported(env.job, "removed"):
            return _stand_in(env)
        try:
            return init()  # the environment's job and rank, as the environment gives them (a worker: see init)
        except EntryHeldError as exc:  # not a bad value: the table's state (e.g. a stale process of the job)
            reason: Exception = exc
        except ConfigError:
            raise
        except (ShmstatError, OSError) as exc:
            reason = exc
        warn_once("attach", f"this process cannot attach to job {env.job!r} ({reason}); its Stats work in-process "
                  "only and its events and metrics stay local", job=env.job)
        st.auto_init_done = True
        return None


def _inherited() -> bool:
    """Whether this process's identity variables (:data:`~shmstat.job.identity.IDENTITY_VARIABLES`) are those the
    process that started it had, unchanged: then that process is its rank (or a worker of it) and this one a
    worker. A forked child compares them with its parent's at the fork (noted by :func:`_after_fork_in_child`);
    a ``multiprocessing`` child (spawn, forkserver, or a fork before shmstat was imported), whose environment at
    its start is its parent's, with ``/proc/self/environ``. A process started with its variables by a launcher
    that does not have them (torchrun's agent, ``shmstat run``: not ``multiprocessing`` children) or that set
    them itself after its start (``mp.spawn``-style launchers, the testing plugin's ranks) is a rank."""
    now = identity_variables(os.environ)
    forked = _state.STATE.fork_environ
    if forked is not None:
        return forked == now
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is None or mp_process.parent_process() is None:
        return False
    started = start_environ()
    return started is not None and identity_variables(started) == now


def _stand_in(env: Identity) -> RankAttachment:
    """A worker started after its rank found the job's segment removed from /dev/shm: making the segment again
    would hold its samples where no one reads them and remove them at its exit, uncounted. It attaches to a
    private stand-in instead (:meth:`~shmstat.shm.segment.Segment.stand_in`), holding no entry: every sample is
    dropped and counted (:func:`shmstat.stats`), and the warning its rank gave is not given again."""
    from ..shm.segment import Segment
    from .rank import RankAttachment

    st = _state.STATE
    st.attachment = RankAttachment.without_entry(Segment.stand_in(env.job), rank=env.rank,
                                                 world_size=env.world_size)
    st.auto_init_done = True
    return st.attachment


def _no_room_for_rank(segment: Segment, rank: int, local_rank: int, world_size: int) -> RankAttachment:
    """An attachment without an entry for a rank that does not fit the table (counted and reported once)."""
    from .rank import RankAttachment

    geo = segment.geometry
    want = max(2 * geo.max_ranks, local_rank + 1)
    try:
        with segment.locked():
            warn_once("ranks", f"local rank {local_rank} does not fit the {geo.max_ranks} entries of job "
                      f"{segment.job!r}; its samples are dropped and counted (see 'shmstat ls'); start the job with "
                      f"SHMSTAT_MAX_RANKS={want} (shmstat collect/run: --max-ranks {want})", segment)
    except ShmstatError:
        pass
    return RankAttachment.without_entry(segment, rank=rank, world_size=world_size)


def shutdown(flush_timeout_s: float = 2.0) -> None:
    """Flush and close the publisher, mark this rank exited and detach; the process is in-process again.

    When no collector serves the job and no other process of its table is alive, the job's segment and lock file
    are removed (see :meth:`shmstat.shm.segment.Segment.remove_if_last`): a job nobody collects leaves nothing.
    ``SHMSTAT_KEEP_SEGMENT=1`` keeps it (to read it afterwards: ``shmstat top``, a collector started later).
    """
    st = _state.STATE
    pub = st.publisher
    st.publisher = None
    st.publish_target = None
    if pub is not None:  # (while still attached: what it could not deliver is recorded in this process's entry)
        with contextlib.suppress(Exception):
            pub.close(linger_ms=int(flush_timeout_s * 1000))
    att = st.attachment
    st.attachment = None
    if att is not None:
        _state.rebind_sections()
        from .hang_stacks import disable

        disable()
    if att is not None and att.pid == os.getpid():
        from ..shm.segment import Segment

        try:
            # (a process without an entry cannot tell whether others without one still run: it removes nothing)
            if att.has_entry and os.environ.get("SHMSTAT_KEEP_SEGMENT") != "1" and \
                    Segment.remove_if_last(att.segment, att.local_rank, att.pid):
                _say_removed_samples(att.segment)
        except Exception:  # e.g. the job lock cannot be taken: leave the segment, still say this entry exited
            pass
        with contextlib.suppress(Exception):
            att.mark_exited()


def _say_removed_samples(segment: Segment) -> None:
    """Say, once, how many samples no collector emitted the segment this process just removed held: they are lost
    with it (its processes all gone, none of them is written anywhere else)."""
    from .rank import unemitted_samples

    lost = sum(unemitted_samples(segment, info) for info in segment.ranks())
    if lost:
        warn_once("removed_unemitted", f"job {segment.job} ends with {lost} samples no collector emitted; they are "
                  "removed with its segment (run 'shmstat collect' on the node before the job to keep them)")


def _after_fork_in_child() -> None:
    # The child is not the registered rank: it must not write the parent's slots or use its socket. It writes
    # samples as a writer of the same rank (registered on first use) and publishes events as the same rank
    # under its own pid, on a socket of its own.
    st = _state.STATE
    parent = st.attachment
    st.fork_owner = None
    st.attachment = None
    st.fork_environ = identity_variables(os.environ)  # the parent's, as they were at the fork
    if parent is not None and parent.owner_local_rank >= 0:
        st.fork_owner = (parent.segment, parent.owner_local_rank)
    elif parent is not None:  # the parent rank got no entry: neither does the child (its samples are counted)
        from .rank import RankAttachment

        st.attachment = RankAttachment(parent.segment, -1, parent.rank, parent.world_size, os.getpid(), 0)
    st.lock = threading.RLock()  # a parent thread may have held it at the fork
    st.publisher = None
    # a parent that did not attach yet (or has no job) leaves the child to attach on its first use, as a worker
    st.auto_init_done = st.auto_init_done or parent is not None
    if st.publish_target is not None:
        endpoint, rank, incarnation = st.publish_target
        job = parent.segment.job if parent is not None else None
        from ..publish.publisher import Publisher  # already imported: this process had a publish target

        with contextlib.suppress(Exception):
            st.publisher = Publisher(endpoint, rank=rank, incarnation=incarnation, job=job)
            st.publisher.on_undelivered = _record_in_forked_child


def _record_in_forked_child(end: int, incarnation: int) -> None:
    """A forked child's publisher closed with items no collector acknowledged: recorded in the child's writer
    entry (taken now if its first Stat has not taken it), where the next collector finds it."""
    st = _state.STATE
    att = st.attachment if st.attachment is not None and st.attachment.pid == os.getpid() else ensure_init()
    if att is not None:
        att.record_events_end(end, incarnation)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
