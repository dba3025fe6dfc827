"""Creating, attaching and listing a job's shared-memory segment.

Whoever comes first (collector or rank) creates and initialises the segment under the job lock (``flock`` on
a file beside the segment, :mod:`shmstat.shm._joblock`); everyone else attaches and validates magic, layout
version and capacities. Segments are created with mode 0600 and fully allocated up front
(``posix_fallocate``), so a full ``/dev/shm`` is a clear error at creation instead of a SIGBUS in the middle
of a training step. ``posix_ipc`` is used rather than ``multiprocessing.shared_memory``, whose resource
tracker unlinks segments when their creator exits. Registering as a rank is :mod:`shmstat.job.rank`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Iterator

import posix_ipc

from ..errors import ConfigError, LayoutMismatchError, SegmentError
from . import layout as L
from . import layout_codec as codec
from ._joblock import JobLock, job_lock
from .layout_records import BankSnapshot, Header, RankInfo, StatDescriptor
from .runtime import lock_path, segment_name, semaphore_name, validate_job
from .shm_entries import SHM_DIR, check_segment_path, scan_shm

__all__ = ["Segment", "pid_alive"]

_log = logging.getLogger("shmstat")


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (zombies count as alive until reaped)."""
    if not 0 < pid < 1 << 31:  # a pid beyond what the kernel hands out (garbage in a segment)
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """An open mapping of one job's segment on this node.

    ``buf`` is a byte view, ``f64`` and ``i64`` are 8-byte views of the same memory (index = byte offset // 8),
    ``u32`` a 4-byte view (index = byte offset // 4).
    """

    def __init__(self, job: str, mm: mmap.mmap, geometry: L.Geometry, created: bool) -> None:
        self.job = job
        self.geometry = geometry
        self.created = created
        self._mm = mm
        self.buf = memoryview(mm)
        self.f64 = self.buf.cast("d")
        self.i64 = self.buf.cast("q")
        self.u32 = self.buf.cast("I")  # histogram bucket counts (index = byte offset // 4)
        self._lock: JobLock | None = None
        self.inode = -1
        """Inode of the segment file this maps (tells it from one created again under the same name)."""
        self._delivered_at = geometry.mark_offset(0) + L.M_DELIVERED  # mark 0's delivered word (moved per message)

    # -- opening -------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, job: str, *, create: bool = True, geometry: L.Geometry | None = None,
             wait: bool = True, create_geometry: L.Geometry | None = None) -> Segment:
        """Attach to the job's segment, creating it with ``geometry`` (or the defaults) if it does not exist.

        ``geometry`` given explicitly must match an existing segment; ``None`` accepts what is there.
        ``create_geometry`` (with ``geometry`` None) is used only to create a segment (e.g. capacities from the
        environment), never checked against an existing one.
        Raises :class:`SegmentError` if the segment is missing (``create=False``), unsafe or unusable, and
        :class:`LayoutMismatchError` if it is not ours or of another layout version or capacity. ``wait=False``
        (with ``create=False``: a look, as ``shmstat ls`` takes) does not wait for the job lock, so another job's
        stalled process never stalls it; a segment still being created may then read as not ours.
        """
        validate_job(job)
        if geometry is not None:
            _check_geometry(geometry)
        if create_geometry is not None:
            _check_geometry(create_geometry)
        path = "/dev/shm" + segment_name(job)
        check_segment_path(job)  # another user's directory, FIFO or link of that name: refused, nothing made
        if not create and not os.path.exists(path):  # checked before the lock file is made: nothing left behind
            raise SegmentError(f"no shared memory segment exists for job {job!r}; start its collector or a rank first")
        if not wait and not create:
            return cls._open_locked(job, create, geometry)
        lock = job_lock(job)
        try:
            with lock.held():
                seg = cls._open_locked(job, create, geometry, create_geometry)
        except BaseException:
            lock.close()
            if not os.path.exists(path):  # no segment (e.g. no room to create it): no lock file either,
                _remove_lock_file_if_free(lock.path)  # unless another process took the lock meanwhile
            raise
        seg._lock = lock
        return seg

    @classmethod
    def stand_in(cls, job: str) -> Segment:
        """A private anonymous mapping laid out as a (one-entry) segment of ``job``, in no /dev/shm and seen by no
        other process: for a process that must not make the job's segment again (it was removed while the job
        ran) to count what it drops where :func:`shmstat.stats` reads it."""
        validate_job(job)
        geo = L.Geometry(1, 1, L.DEFAULT_BANKS, 0)
        mm = mmap.mmap(-1, geo.total_size)
        codec.write_header(memoryview(mm), geo, time.time_ns())
        return cls(job, mm, geo, created=False)

    @classmethod
    def _open_locked(cls, job: str, create: bool, geometry: L.Geometry | None,
                     create_geometry: L.Geometry | None = None) -> Segment:
        name = segment_name(job)
        if create:
            geo = geometry or create_geometry or L.Geometry()
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
            except posix_ipc.ExistentialError:
                pass
            except OSError as exc:
                raise SegmentError(f"cannot create shared memory segment {name}: {exc}") from exc
            else:
                return cls._initialise(job, shm, geo)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentError(
                f"no shared memory segment exists for job {job!r}; start its collector or a rank first"
            ) from None
        except posix_ipc.PermissionsError:
            raise SegmentError(f"segment {name} belongs to another user; pick another job id") from None
        try:
            inode = _check_owner(shm.fd, name)
            if shm.size < L.HEADER_SIZE:
                raise LayoutMismatchError(
                    f"segment {name} is too small to be a shmstat segment; remove it with 'shmstat clean {job}'"
                )
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        header = codec.read_header(memoryview(mm))
        try:
            _validate_header(header, mm.size(), name, geometry)
        except LayoutMismatchError:
            mm.close()
            raise
        seg = cls(job, mm, header.geometry, created=False)
        seg.inode = inode
        return seg

    @classmethod
    def _initialise(cls, job: str, shm: posix_ipc.SharedMemory, geo: L.Geometry) -> Segment:
        try:
            os.fchmod(shm.fd, 0o600)
            os.ftruncate(shm.fd, geo.total_size)
            try:
                os.posix_fallocate(shm.fd, 0, geo.total_size)
            except OSError as exc:
                raise SegmentError(
                    f"cannot allocate {geo.total_size} bytes for segment {shm.name} ({exc.strerror}); "
                    "free space in /dev/shm or lower --max-ranks/--max-stats"
                ) from exc
            mm = mmap.mmap(shm.fd, geo.total_size)
            inode = os.fstat(shm.fd).st_ino
        except BaseException:
            shm.close_fd()
            with contextlib.suppress(posix_ipc.ExistentialError):
                shm.unlink()
            raise
        shm.close_fd()
        codec.write_header(memoryview(mm), geo, time.time_ns())
        seg = cls(job, mm, geo, created=True)
        seg.inode = inode
        return seg

    # -- locking ---------------------------------------------------------------------------------------------
    def linked(self) -> bool:
        """Whether ``/dev/shm`` still names this mapping as the job's segment (a node collector removes a segment
        no process uses: a process that opened it just before, and registers just after, would write where no
        collector reads). A mapping whose inode is not known (a stand-in) counts as linked."""
        if self.inode < 0:
            return True
        try:
            return os.stat("/dev/shm" + segment_name(self.job)).st_ino == self.inode
        except OSError:
            return False

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the job lock (for allocation of rank entries and descriptors)."""
        if self._lock is None:
            self._lock = job_lock(self.job)
        with self._lock.held():
            yield

    # -- reading -----------------------------------------------------------------------------------------------
    def header(self) -> Header:
        """The current header."""
        return codec.read_header(self.buf)

    def rank(self, local_rank: int) -> RankInfo:
        """Rank entry ``local_rank``."""
        return codec.read_rank(self.buf, self.geometry, local_rank)

    def ranks(self) -> list[RankInfo]:
        """Every rank entry that was ever used (state other than free)."""
        out = []
        geometry, free = self.geometry, L.RankState.FREE
        # every entry's state word at once: a free entry is not decoded (a collector reads the table many times a
        # second, and most entries of a segment are free)
        first = (geometry.rank_offset(0) + L.R_STATE) // 8
        states = self.i64[first:first + geometry.max_ranks * (L.RANK_ENTRY_SIZE // 8):L.RANK_ENTRY_SIZE // 8]
        for i, state in enumerate(states.tolist()):
            if state == free:
                continue
            info = self.rank(i)
            if info.state != free:
                out.append(info)
        return out

    def descriptors(self, local_rank: int) -> list[StatDescriptor]:
        """Every published stat descriptor of a rank, in index order."""
        nstats = min(self.rank(local_rank).nstats, self.geometry.max_stats)
        out = []
        for j in range(nstats):
            desc = codec.read_descriptor(self.buf, self.geometry, local_rank, j)
            if desc is not None:
                out.append(desc)
        return out

    def read_bank(self, local_rank: int, stat: int, bank: int) -> BankSnapshot:
        """A consistent copy of one bank (see :func:`shmstat.shm.layout_codec.read_bank`)."""
        return codec.read_bank(self.buf, self.geometry.slot_offset(local_rank, stat) + bank * L.BANK_SIZE)

    # -- fields written by the collector -----------------------------------------------------------------------
    def set_collector(self, pid: int, beat_ns: int) -> None:
        """Record the serving collector's pid and heartbeat in the header."""
        codec.write_collector(self.buf, pid, beat_ns)

    def dispatched_ns(self) -> int:
        """Wall-clock ns by which every window that ended may have reached a collector's handlers (0: none yet)."""
        return codec.read_dispatched_ns(self.buf)

    def set_dispatched(self, ns: int) -> None:
        """Record, before a pass is dispatched, that windows ended by ``ns`` may reach the handlers (only moves
        forward)."""
        if ns > self.dispatched_ns():
            codec.write_dispatched_ns(self.buf, ns)

    def overwritten(self) -> int:
        """Windows of the job lost to the ring before a collector read them, counted once across collectors (the
        collector adds to it with the watermarks that move past them: :class:`collector.read.scanner.DurableMarks`)."""
        return codec.read_overwritten(self.buf)

    def entries_epoch(self) -> int:
        """A number that changes whenever a rank or writer entry is taken or a stat descriptor published."""
        return codec.read_entries_epoch(self.buf)

    def bump_entries_epoch(self) -> None:
        """Say that an entry was taken or a descriptor published (the job lock is held)."""
        codec.bump_entries_epoch(self.buf)

    def set_rank_pid(self, local_rank: int, pid: int) -> None:
        """Give entry ``local_rank`` to process ``pid`` (a writer entry handed back to its rank; job lock held)."""
        codec.write_rank_pid(self.buf, self.geometry, local_rank, pid)

    def set_rank_state(self, local_rank: int, state: int) -> None:
        """Set a rank entry's state (collector: died; rank: exited)."""
        codec.write_rank_state(self.buf, self.geometry, local_rank, state)

    def record_events_end(self, local_rank: int, end: int, incarnation: int) -> None:
        """(The entry's process, as its publisher closes.) Its items numbered below ``end`` under ``incarnation``
        were not all acknowledged by a collector: the next collector counts what it did not receive."""
        codec.write_events_end(self.buf, self.geometry, local_rank, end, incarnation)

    def clear_events_end(self, local_rank: int, pid: int, end: int) -> bool:
        """(The collector, once it counted what a gone process did not deliver.) Set entry ``local_rank``'s
        ``events_end`` to 0, under the job lock, if the entry still holds ``pid`` and ``end``; True if it did."""
        with self.locked():
            return codec.clear_events_end(self.buf, self.geometry, local_rank, pid, end)

    def delivered_marks(self) -> list[tuple[int, int, int, int, int, int]]:
        """Every delivered mark in use (see :mod:`shmstat.shm.layout`): ``(index, pid, rank, incarnation,
        delivered, origin)``."""
        return codec.read_delivered_marks(self.buf, self.geometry)

    def set_delivered_mark(self, index: int, pid: int, rank: int, incarnation: int, delivered: int,
                           origin: int) -> None:
        """(Re)use mark ``index`` for sender (``rank``, ``pid``, ``incarnation``, ``origin``): its pid is written
        last, so a collector killed mid-write leaves a free mark, never a torn one (collector only)."""
        codec.write_delivered_mark(self.buf, self.geometry, index, pid, rank, incarnation, delivered, origin)

    def move_delivered_mark(self, index: int, delivered: int) -> None:
        """Advance mark ``index`` to ``delivered`` (one aligned 8-byte store; collector only)."""
        codec.write_delivered(self.buf, self._delivered_at + index * L.MARK_SIZE, delivered)

    # -- lifetime -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the segment (the segment itself stays until unlinked)."""
        for view in (self.f64, self.i64, self.u32, self.buf):
            with contextlib.suppress(Exception):
                view.release()
        with contextlib.suppress(Exception):
            self._mm.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    @staticmethod
    def unlink(job: str) -> bool:
        """Remove the job's segment, its lock file and any semaphore of older versions; True if a segment existed.

        The lock file is removed only while no process holds it (taken without waiting): removing a held one
        would let a newcomer lock a new file beside the holder, two holders at once. A waiter that then finds
        the file gone takes the new one.
        """
        existed = True
        try:
            posix_ipc.unlink_shared_memory(segment_name(job))
        except posix_ipc.ExistentialError:
            existed = False
        _remove_lock_file_if_free(lock_path(job))
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(semaphore_name(job))  # what versions before the flock lock used
        return existed

    @staticmethod
    def unlink_if_unused(job: str) -> bool:
        """Remove the job's segment (and then its lock file, if free) only when no process recorded in its rank
        table is still alive, checked and removed under the job lock, so no rank can be registering meanwhile;
        True if it was removed. A node collector calls it once it has emitted every window of a finished job."""
        path = "/dev/shm" + segment_name(job)
        if not os.path.exists(path):
            return False
        lock = job_lock(job)
        try:
            with lock.held():
                try:
                    seg = Segment._open_locked(job, False, None)
                except (SegmentError, OSError):
                    return False
                try:
                    if any(pid_alive(r.pid) for r in seg.ranks() if r.pid):
                        return False
                finally:
                    seg.close()
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory(segment_name(job))
        finally:
            lock.close()
        _remove_lock_file_if_free(lock_path(job))
        return True

    @staticmethod
    def remove_if_last(segment: Segment, local_rank: int, pid: int) -> bool:
        """Mark entry ``local_rank`` (held by ``pid``; -1 for none) exited and, when no collector serves the job
        and no other entry is active with a live process, remove the job's segment and lock file; True if
        removed. All under the job lock, so two processes exiting together cannot both leave it: the first
        marks itself exited, and an entry marked exited counts as gone even while its process still runs.
        A segment replaced under the same name (removed and created again) is left to its own
        processes. The mapping stays open (a Stat kept after this may still add to it, harmlessly)."""
        job = segment.job
        path = "/dev/shm" + segment_name(job)
        removed = False
        with segment.locked():
            if local_rank >= 0 and segment.rank(local_rank).pid == pid:
                segment.set_rank_state(local_rank, L.RankState.EXITED)
            try:
                same = os.stat(path).st_ino == segment.inode
            except OSError:
                same = False
            if same and _unserved(segment, pid):
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory(segment_name(job))
                removed = True
            elif not os.path.exists(path):
                removed = True  # removed by someone else: only the lock file may be left
        if removed:
            _remove_lock_file_if_free(lock_path(job))
        return removed

    @staticmethod
    def leftover_jobs() -> list[str]:
        """Jobs with a lock file, or a semaphore of an older version, of this user in /dev/shm but no entry named
        like their segment (entries not this user's regular files are left out: see :mod:`shmstat.shm.shm_entries`)."""
        scan = scan_shm()
        return [j for j in scan.lock_jobs if not os.path.lexists(f"{SHM_DIR}/shmstat.{j}")]

    @staticmethod
    def list_jobs() -> list[str]:
        """Job ids of this user's shmstat segments in /dev/shm on this node (regular files owned by this uid,
        named after a valid job id); anything else named like one is left out (:func:`shmstat.shm.shm_entries.scan_shm`
        says what and why)."""
        return scan_shm().segments


def _unserved(segment: Segment, pid: int) -> bool:
    """No collector serves the job or left windows in it for the next one, and no entry but ``pid``'s is active
    with a live process. A collector that died (SIGKILL) leaves its pid in the header, and one that stopped while
    ranks ran leaves -1: either way the windows wait for the next collector (a node collector sweeps the segment
    once they are emitted), as when a collector is restarted."""
    if segment.header().collector_pid != 0:
        return False
    return not any(r.state == L.RankState.ACTIVE and r.pid != pid and pid_alive(r.pid) for r in segment.ranks())


def _remove_lock_file_if_free(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        with contextlib.suppress(OSError):
            if os.path.islink(path):
                os.unlink(path)  # a symlink is never ours to lock
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # held right now by a live process: leave it (``shmstat clean`` takes it later)
        st = os.fstat(fd)
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(path, follow_symlinks=False)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)  # we hold it, so no one holds the file removed
    finally:
        os.close(fd)


def _check_geometry(geo: L.Geometry) -> None:
    if not (1 <= geo.max_ranks <= 4096 and 1 <= geo.max_stats <= 65536 and 3 <= geo.banks <= 64
            and 0 <= geo.hist_slots <= 65536):
        raise ConfigError(
            f"capacities {geo.max_ranks} ranks x {geo.max_stats} stats x {geo.banks} banks with {geo.hist_slots} "
            "percentile stats are out of range (1-4096 ranks, 1-65536 stats, 3-64 banks, 0-65536 percentile "
            "stats)"
        )


def _check_owner(fd: int, name: str) -> int:
    """Refuse a segment of another user or open to others; returns its inode."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        raise SegmentError(f"segment {name} belongs to uid {st.st_uid}, not you; pick another job id")
    if st.st_mode & 0o077:
        raise SegmentError(f"segment {name} is accessible to other users (mode {st.st_mode & 0o777:o}); refusing it")
    return st.st_ino


def _validate_header(header: Header, size: int, name: str, want: L.Geometry | None) -> None:
    if header.magic != L.MAGIC:
        raise LayoutMismatchError(f"segment {name} was not created by shmstat (bad magic); pick another job id")
    if header.version != L.LAYOUT_VERSION:
        raise LayoutMismatchError(
            f"segment {name} has layout version {header.version}, this shmstat speaks {L.LAYOUT_VERSION}; "
            "stop the job's processes and run 'shmstat clean'"
        )
    geo = header.geometry
    if geo.total_size != header.total_size or size < header.total_size:
        raise LayoutMismatchError(f"segment {name} is truncated or inconsistent; run 'shmstat clean'")
    if want is not None and want != geo:
        raise LayoutMismatchError(
            f"segment {name} holds {geo.max_ranks} ranks x {geo.max_stats} stats x {geo.banks} banks "
            f"({geo.hist_slots} with percentiles) but {want.max_ranks} x {want.max_stats} x {want.banks} "
            f"({want.hist_slots}) was asked for; use the same capacities everywhere"
        )
