"""The optional C hot path (``shmstat._fastpath.SlotWriter``) writes exactly the bytes the pure-Python path does."""

from __future__ import annotations

import math
import mmap
import os
import random
import struct
import subprocess
import sys
import time

import pytest
from kit.support import MS, FakeClock, unique_job

from shmstat import _backend
from shmstat.aggregation import Aggregation as A
from shmstat.job.attach import init, shutdown
from shmstat.publish.events import register_event_handler, unregister_event_handler
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.segment import Segment
from shmstat.writer._pywriter import PySlotWriter
from shmstat.writer.stat import Stat

pytestmark = pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
SlotWriter = _backend.load("c").SlotWriter

WITH_VALUE = [A.VALUE, A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN]
WITHOUT_VALUE = [A.MEAN, A.COUNT, A.SUM, A.MAX, A.MIN]
GEOMETRY = {"max_ranks": 2, "max_stats": 2, "banks": 3}


@pytest.fixture
def jobs():
    """Job ids handed out to a test; every segment is unlinked afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(unique_job("fp"))
        return made[-1]

    yield make
    shutdown()
    for job in made:
        Segment.unlink(job)


def _bits(x: float) -> bytes:
    """A float as its bytes, so NaN compares equal to NaN (and -0.0 differs from 0.0)."""
    return struct.pack("<d", x)


def _snapshot(stat: Stat, att, error: type | None) -> tuple:
    """Everything observable after one step: slot bytes, rank counters, count, get() and the error raised."""
    seg, geo = att.segment, att.segment.geometry
    start = geo.slot_offset(att.local_rank, stat._core.index)
    slot = bytes(seg.buf[start : start + geo.banks * L.BANK_SIZE])
    r = geo.rank_offset(att.local_rank)
    beat = bytes(seg.buf[r + L.R_HEARTBEAT : r + L.R_HEARTBEAT + 8])
    counters = beat + bytes(seg.buf[r + L.R_NAN : r + L.R_DISCARDED + 8])
    got = tuple((agg, _bits(v)) for agg, v in stat.get().items())
    return slot, counters, stat.count, got, error


def _event_key(event) -> tuple:
    return event.name, event._timestamp_ns(), tuple((k, _bits(v)) for k, v in event.data.items())


def _run(job: str, pure: bool, steps: list, aggs, max_samples: int, window_ms: int) -> tuple:
    """Drive one attached Stat through ``steps`` on a fresh segment, written by the C writer or (``pure``) its
    Python twin; return every step's snapshot and events."""
    with _backend.use("python" if pure else "c"):
        att = init(job, rank=0, publish=False, **GEOMETRY)
        return _drive(att, steps, aggs, max_samples, window_ms, pure)


def _drive(att, steps: list, aggs, max_samples: int, window_ms: int, pure: bool) -> tuple:
    clock = FakeClock()
    clock.to_window(window_ms)
    events: list = []
    handle = register_event_handler(events.append)
    stat = Stat("lat", aggs, window_ms / 1000, max_samples, clock=clock)
    try:
        assert isinstance(stat._core.binding._writer, PySlotWriter) is pure
        trace = []
        for advance_ns, value in steps:
            clock.now += advance_ns
            error = None
            try:
                stat.add(value)
            except Exception as exc:
                error = type(exc)
            trace.append(_snapshot(stat, att, error))
        return trace, [_event_key(e) for e in events]
    finally:
        unregister_event_handler(handle)
        stat.close()
        shutdown()


def _random_steps(rng: random.Random, n: int, window_ms: int) -> list:
    specials = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308, True, False, 2**53 + 1, -(2**40)]
    steps = []
    for _ in range(n):
        r = rng.random()
        if r < 0.70:
            advance = rng.randrange(0, window_ms * MS // 8)  # mostly inside the window
        elif r < 0.85:
            advance = window_ms * MS  # the next window
        elif r < 0.95:
            advance = rng.randrange(2, 6) * window_ms * MS  # skip windows (banks wrap around)
        else:
            advance = 0
        r = rng.random()
        if r < 0.55:
            value = rng.gauss(0.0, 100.0)
        elif r < 0.75:
            value = rng.randint(-1000, 1000)
        else:
            value = rng.choice(specials)
        steps.append((advance, value))
    return steps


@pytest.mark.parametrize("aggs", [WITH_VALUE, WITHOUT_VALUE], ids=["value", "no-value"])
@pytest.mark.parametrize("max_samples", [2**63 - 1, 1, 5])
@pytest.mark.parametrize("seed", range(4))
def test_c_and_python_paths_write_identical_bytes(jobs, aggs, max_samples, seed):
    window_ms = 100
    steps = _random_steps(random.Random(seed * 1000 + max_samples), 300, window_ms)
    pure_trace, pure_events = _run(jobs(), True, steps, aggs, max_samples, window_ms)
    c_trace, c_events = _run(jobs(), False, steps, aggs, max_samples, window_ms)
    for i, (p, c) in enumerate(zip(pure_trace, c_trace, strict=True)):
        assert c == p, f"step {i} ({steps[i]!r}) differs"
    assert c_events == pure_events
    # The sequence exercised what it is meant to: NaNs, windows rolled and logged, a full window.
    nan, discarded = struct.unpack("<QQ", c_trace[-1][1][8:])
    assert nan > 0 and len(c_events) > 10
    assert discarded > 0 or max_samples > 300


def _run_private(pure: bool, steps: list, aggs, max_samples: int, window_ms: int) -> tuple:
    """Drive one in-process Stat (its writer on a private one-bank buffer) through ``steps`` with the C writer or
    (``pure``) its Python twin; return every step's buffer bytes, kept histogram, count, get() and error, and the
    events."""
    clock = FakeClock()
    clock.to_window(window_ms)
    events: list = []
    handle = register_event_handler(events.append)
    with _backend.use("python" if pure else "c"):
        stat = Stat("lat", aggs, window_ms / 1000, max_samples, clock=clock)
    try:
        writer = stat._core._writer
        assert isinstance(writer, PySlotWriter) is pure and writer.keep_closed_hist
        trace = []
        for advance_ns, value in steps:
            clock.now += advance_ns
            error = None
            try:
                stat.add(value)
            except Exception as exc:
                error = type(exc)
            got = tuple((agg, _bits(v)) for agg, v in stat.get().items())
            trace.append((bytes(stat._core._buf), writer.closed_hist, stat.count, got, error))
        stat.close()
        trace.append(tuple((agg, _bits(v)) for agg, v in stat.get().items()))
        return trace, [_event_key(e) for e in events]
    finally:
        unregister_event_handler(handle)


@pytest.mark.parametrize("max_samples", [2**63 - 1, 1, 5])
@pytest.mark.parametrize("seed", range(3))
def test_in_process_percentiles_c_and_python_writers_keep_identical_histograms(max_samples, seed):
    """An in-process Stat with percentiles runs on the C writer too: it keeps each reported window's histogram
    (``keep_closed_hist``) byte for byte as PySlotWriter does, before the one bank is reused."""
    window_ms = 100
    steps = _random_steps(random.Random(seed * 1000 + max_samples + 7), 300, window_ms)
    aggs = [*WITH_VALUE, A.P50, A.P99]
    pure_trace, pure_events = _run_private(True, steps, aggs, max_samples, window_ms)
    c_trace, c_events = _run_private(False, steps, aggs, max_samples, window_ms)
    for i, (p, c) in enumerate(zip(pure_trace, c_trace, strict=True)):
        assert c == p, f"step {i} ({steps[i] if i < len(steps) else 'close'!r}) differs"
    assert c_events == pure_events
    assert len(c_events) > 10 and any("lat.p99" in dict(e[2]) for e in c_events)
    assert c_trace[-2][1] is not None  # windows with samples were reported and their histograms kept


def test_nan_at_a_window_boundary_does_not_roll(jobs):
    steps = [(0, 1.0), (100 * MS, math.nan), (0, math.nan), (1, 2.0), (0, 3.0)]
    pure = _run(jobs(), True, steps, WITH_VALUE, 2**63 - 1, 100)
    fast = _run(jobs(), False, steps, WITH_VALUE, 2**63 - 1, 100)
    assert fast == pure
    trace, _ = fast
    assert trace[2][2] == 0  # after the NaNs: the new window is not open yet
    assert trace[-1][2] == 2


def _writer_on(buf, **overrides):
    args = {
        "slot0": 1024, "nbanks": 3, "window_ns": 100 * MS, "incarnation": 7, "max_samples": 3, "want_last": True,
        "nan_off": 8, "discarded_off": 16, "heartbeat_off": 24,
    }
    args.update(overrides)
    return SlotWriter(buf, **args)


def _bank(buf, slot0: int, clock: FakeClock, window_ms: int = 100, nbanks: int = 3) -> bytes:
    off = slot0 + (clock.now // (window_ms * MS)) % nbanks * L.BANK_SIZE
    return bytes(buf[off : off + L.BANK_SIZE])


def test_bad_values_raise_type_error_and_leave_the_bank_untouched():
    mm = mmap.mmap(-1, 4096)
    buf = memoryview(mm)
    clock = FakeClock()
    w = _writer_on(buf, clock=clock)
    with pytest.raises(TypeError):
        w.add("1.5")  # no window yet: nothing may roll on a bad value
    assert w.wend == 0 and bytes(buf) == bytes(4096)
    w.add(1.0)
    before, counters = bytes(buf), bytes(buf[:32])
    for bad in ("x", None, object(), [1.0], 1j):
        with pytest.raises(TypeError):
            w.add(bad)
        assert bytes(buf) == before
    clock.advance_ms(100)
    with pytest.raises(TypeError):
        w.add(None)  # a bad value at a window boundary does not roll either
    assert bytes(buf) == before and bytes(buf[:32]) == counters
    clock.advance_ms(-100)
    assert struct.unpack_from("<d", _bank(buf, 1024, clock))[0] == 2.0
    assert w.state()[0] == 2.0
    del w  # releases its export: the mapping can be closed
    buf.release()
    mm.close()


def test_numbers_of_every_kind_are_accepted():
    class Half:
        def __float__(self) -> float:
            return 0.5

    class Three:
        def __index__(self) -> int:
            return 3

    mm = mmap.mmap(-1, 4096)
    clock = FakeClock()
    w = _writer_on(memoryview(mm), clock=clock, max_samples=100)
    for v in (1, True, 2.5, Half(), Three(), float("inf")):
        w.add(v)
    assert w.state() == (12.0, math.inf, 0.5, math.inf, math.inf)
    assert w.count == 6
    with pytest.raises(OverflowError):
        w.add(10**400)
    assert w.count == 6


def test_counters_full_window_and_state():
    mm = mmap.mmap(-1, 4096)
    buf = memoryview(mm)
    clock = FakeClock()
    clock.to_window(100)
    rolls = []
    w = _writer_on(buf, clock=clock, on_roll=lambda *a: rolls.append(a))
    for v in (3.0, 1.0, 5.0, 4.0, math.nan):  # max_samples=3: 4.0 is discarded, the NaN counted
        w.add(v)
    assert w.state() == (6.0, 9.0, 1.0, 5.0, 5.0)
    nan, discarded, beat = struct.unpack_from("<QQq", buf, 8)
    assert (nan, discarded, beat) == (1, 1, clock.now)
    # the add that fills the window reports it at once, as torch.monitor logs it; count is 0 from then on
    assert w.count == 0 and w.wend == clock.now + 100 * MS
    assert rolls == [(3, 9.0, 1.0, 5.0, 5.0, clock.now)]
    bank = codec.read_bank(buf, 1024 + (clock.now // (100 * MS)) % 3 * L.BANK_SIZE)
    assert (bank.count, bank.sum, bank.min, bank.max, bank.last, bank.incarnation) == (3, 9.0, 1.0, 5.0, 5.0, 7)
    t0 = clock.now
    clock.advance_ms(250)
    assert w.count == 0
    w.add(2.0)  # the roll reports the full window no more (an empty report, as after an empty window)
    assert rolls == [(3, 9.0, 1.0, 5.0, 5.0, t0), (0, 0.0, 0.0, 0.0, 0.0, clock.now)]
    assert codec.read_bank(buf, 1024 + ((t0 // (100 * MS)) + 2) % 3 * L.BANK_SIZE).count == 1


def test_on_roll_error_propagates_after_the_sample_is_written():
    mm = mmap.mmap(-1, 4096)
    buf = memoryview(mm)
    clock = FakeClock()
    clock.to_window(100)
    fail = [True]
    calls = []

    def on_roll(*args):
        calls.append(args)
        if fail[0]:
            raise RuntimeError("handler broke")

    w = _writer_on(buf, clock=clock, on_roll=on_roll, max_samples=100)
    w.add(1.0)
    w.add(2.0)
    old_bank = _bank(buf, 1024, clock)
    clock.advance_ms(100)
    with pytest.raises(RuntimeError):
        w.add(3.0)
    seq = struct.unpack_from("<d", buf, 1024 + ((clock.now // (100 * MS)) - 1) % 3 * L.BANK_SIZE)[0]
    assert seq == 4.0  # even: the previous window, as it was
    assert _bank(buf, 1024, FakeClock(clock.now - 100 * MS)) == old_bank
    # on_roll runs once the new window's bank is consistent (another thread may add meanwhile): the sample that
    # rolled is written, the report's error reaches the caller, the window goes on
    new = codec.read_bank(buf, 1024 + (clock.now // (100 * MS)) % 3 * L.BANK_SIZE)
    assert (new.count, new.sum, new.torn) == (1, 3.0, False)
    fail[0] = False
    w.add(4.0)
    assert calls == [(2, 3.0, 1.0, 2.0, 2.0, clock.now)]
    assert w.state() == (4.0, 7.0, 3.0, 4.0, 4.0)


def test_clock_errors_propagate():
    mm = mmap.mmap(-1, 4096)

    def broken() -> int:
        raise OSError("no clock")

    w = _writer_on(memoryview(mm), clock=broken)
    with pytest.raises(OSError):
        w.add(1.0)
    with pytest.raises(TypeError):
        _writer_on(memoryview(mm), clock=lambda: 1.5).add(1.0)
    assert bytes(mm) == bytes(4096)


def test_real_clock_writes_the_current_window():
    mm = mmap.mmap(-1, 4096)
    buf = memoryview(mm)
    w = _writer_on(buf, window_ns=3_600_000 * MS, max_samples=10)
    before = time.time_ns()
    w.add(1.0)
    w.add(2.0)
    after = time.time_ns()
    wns = 3_600_000 * MS
    assert w.wend in ((before // wns + 1) * wns, (after // wns + 1) * wns)
    bank = codec.read_bank(buf, 1024 + ((w.wend // wns) - 1) % 3 * L.BANK_SIZE)
    assert (bank.count, bank.sum) == (2, 3.0)
    assert before <= bank.last_ts <= after
    assert w.count in (2, 0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"slot0": 4096 - 3 * 64 + 8},  # the last bank runs past the end
        {"slot0": -64},
        {"slot0": 1028},  # misaligned
        {"nbanks": 64},
        {"nbanks": 2**62},
        {"nbanks": 0},
        {"nan_off": 4096},
        {"discarded_off": 4090},
        {"heartbeat_off": -8},
        {"heartbeat_off": 12},
        {"window_ns": 0},
        {"max_samples": 0},
    ],
)
def test_bounds_and_arguments_are_checked(overrides):
    mm = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError):
        _writer_on(memoryview(mm), **overrides)
    mm.close()  # no export left behind by the failed constructor


def test_buffer_must_be_writable_and_callbacks_callable():
    with pytest.raises((TypeError, BufferError)):
        _writer_on(bytes(4096))
    mm = mmap.mmap(-1, 4096)
    with pytest.raises(TypeError):
        _writer_on(memoryview(mm), on_roll=3)
    with pytest.raises(TypeError):
        _writer_on(memoryview(mm), clock="now")
    _writer_on(memoryview(mm), slot0=4096 - 3 * 64)  # the last slot that fits
    mm.close()


def test_the_writer_keeps_the_mapping_alive(jobs):
    att = init(jobs(), rank=0, publish=False, **GEOMETRY)
    with _backend.use("c"):
        stat = Stat("lat", WITH_VALUE, 0.1, clock=FakeClock())
    assert not isinstance(stat._core.binding._writer, PySlotWriter)
    att.segment.close()  # cannot unmap while the writer holds the buffer: writing stays safe
    stat.add(1.0)
    assert stat.count == 1


def test_default_clock_is_the_c_clock_and_each_writer_keeps_the_backend_it_was_built_on(jobs):
    init(jobs(), rank=0, publish=False, **GEOMETRY)
    with _backend.use("python"):
        pure = Stat("a", WITH_VALUE, 60)
    with _backend.use("c"):
        fast = Stat("b", WITH_VALUE, 60)
    assert isinstance(pure._core.binding._writer, PySlotWriter)
    assert not isinstance(fast._core.binding._writer, PySlotWriter)
    for s in (pure, fast):
        s.add(1.5)
        s.add(2.5)
    assert fast.count == pure.count  # both 2 unless the minute turned between the calls


def test_interpreter_exit_with_a_live_writer_is_clean():
    """Regression: the exported memoryview must not be cleared by the collector while the writer holds it."""
    job = unique_job("fp-exit")
    script = (
        "import gc, shmstat\n"
        f"shmstat.init({job!r}, rank=0, publish=False, max_ranks=1, max_stats=2, banks=3)\n"
        "s = shmstat.Stat('x', [shmstat.Aggregation.MEAN], 60)\n"
        "assert type(s._core.binding._writer).__name__ == 'SlotWriter'\n"
        "s.add(1.0)\n"
        "gc.collect()\n"
    )
    try:
        env = {k: v for k, v in os.environ.items() if k != _backend.VARIABLE}  # the default backend: C
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    finally:
        Segment.unlink(job)
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr
