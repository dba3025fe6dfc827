"""The publisher's outbox: the C one (``Backend.Outbox``, shmstat._backend) against the pure-Python reference on
random input.

Both are driven with the same random sequence of publishes and sends; every return value, every message's two
frames and every counter must be identical, and every payload must be what :func:`shmstat.wire.encode` builds
for the same items (and pass :func:`shmstat.wire.decode`).
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from shmstat import _backend, wire
from shmstat.publish.item_sizes import item_bytes
from shmstat.publish.outbox import KIND_CODES, Outbox, counters_of, new_outbox

C = _backend.load("c")  # the C twins, whichever backend this process runs
needs_c = pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")

ARGS = {"rank": 3, "pid": 4242, "incarnation": 2, "batch_max": 5, "max_items": 40, "max_bytes": 6000,
        "max_batch_bytes": 900, "metric_bytes": 160}
NAMES = ["a", "b", "step", "é", "x" * 40, "loss/\u4e2d"]
INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
        -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63)]
BAD = [1 << 64, -(1 << 63) - 1, [1], None, b"x", "\ud800"]


def _value(rnd: random.Random, bad: float) -> Any:
    roll = rnd.random()
    if roll < bad:
        return rnd.choice(BAD)
    if roll < 0.35:
        return rnd.choice(INTS)
    if roll < 0.55:
        return rnd.choice([0.0, -1.5, 1e300, float("inf"), rnd.random()])
    if roll < 0.65:
        return rnd.choice([True, False])
    return rnd.choice(["", "x", "train", "y" * 31, "z" * 32, "w" * 300, "\u00e9t\u00e9", "\U0001f600" * 3])


def _data(rnd: random.Random, bad: float) -> dict[Any, Any]:
    return {rnd.choice(["k", "step", "loss", "phase", "é", "long" * 10, f"k{rnd.randrange(20)}"]): _value(rnd, bad)
            for _ in range(rnd.randrange(0, 20 if rnd.random() < 0.1 else 4))}


def _publish(ob: Any, op: tuple[Any, ...]) -> Any:
    """Apply one publish the way the publisher does (fast path, else validate and encode, else invalid)."""
    kind, args = op
    if kind == "event":
        name, ts, data = args
        r = ob.event(name, ts, data)
        if r != -1:
            return r
        item = [name, ts, data]
    else:
        r = ob.metric(*args)
        if r is None:
            return r
        item = list(args)
    if wire.encode_item_reason(kind, item) is not None:
        ob.invalid(1)
        return "invalid"
    try:
        encoded = msgpack.packb(item, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        ob.invalid(1)
        return "invalid"
    size = item_bytes(item[0], item[2]) if kind == "event" else 160
    ob.raw(KIND_CODES[kind], item[0], None if kind == "event" else item[1], encoded, size)
    return "raw"


def _ops(seed: int, n: int, bad: float) -> list[tuple[str, Any]]:
    rnd = random.Random(seed)
    ops: list[tuple[str, Any]] = []
    for _ in range(n):
        roll = rnd.random()
        if roll < 0.5:
            ops.append(("event", (rnd.choice(NAMES), rnd.choice(INTS), _data(rnd, bad))))
        elif roll < 0.8:
            value = _value(rnd, bad) if rnd.random() < 0.9 else "text"
            ts = rnd.choice([1.5, 0.0, 1700000000.25, 3, -7]) if rnd.random() > bad else True
            ops.append(("metric", (rnd.choice(["g", "torchelastic", "é"]), rnd.choice(NAMES), value, ts)))
        elif roll < 0.9:
            ops.append(("send", rnd.randrange(1, 4)))
        elif roll < 0.95:
            ops.append(("refused", rnd.randrange(1, 3)))
        else:
            ops.append(("check", None))
    return ops


def _run(ob: Any, ops: list[tuple[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for op, arg in ops:
        if op in ("event", "metric"):
            out.append((op, _publish(ob, (op, arg))))
        elif op == "send":
            for _ in range(arg):
                frames = ob.head(wire.MAX_TOPIC)
                out.append(("frames", frames))
                if frames is None:
                    break
                ob.pop()
        elif op == "refused":
            ob.refused(arg)
        else:
            out.append(("state", ob.counters(), ob.frontier(), ob.end_seq(), ob.wire_seq()))
    while (frames := ob.head(wire.MAX_TOPIC)) is not None:
        out.append(("frames", frames))
        ob.pop()
    out.append(("end", ob.counters(), ob.frontier(), ob.end_seq(), ob.wire_seq()))
    return out


def _check_wire(results: list[Any]) -> int:
    """Every message decodes, equals wire.encode of its items, and seqs never go backwards."""
    next_seq, messages = 0, 0
    for entry in results:
        if entry[0] != "frames" or entry[1] is None:
            continue
        topic, payload = entry[1]
        msg = wire.decode(topic, payload)
        assert (msg.rank, msg.pid, msg.incarnation) == (ARGS["rank"], ARGS["pid"], ARGS["incarnation"])
        assert payload == wire.encode(msg.kind, msg.rank, msg.pid, msg.incarnation, msg.seq, msg.items)
        assert msg.seq >= next_seq and 1 <= len(msg.items) <= ARGS["batch_max"]
        next_seq = msg.seq + len(msg.items)
        messages += 1
    return messages


@pytest.mark.parametrize("seed", range(12))
def test_pure_python_outbox_puts_valid_messages_in_order_and_counts_everything(seed: int) -> None:
    ops = _ops(seed, 400, bad=0.05)
    ob = Outbox(**ARGS)
    results = _run(ob, ops)
    assert _check_wire(results) > 0
    published, sent_items, _messages, dropped, held, held_bytes, _invalid, late = ob.counters()
    assert held == held_bytes == late == 0
    assert published == sent_items + dropped
    assert ob.wire_seq() == published  # every item took its sequence number, sent or dropped


@needs_c
@pytest.mark.parametrize("seed", range(40))
def test_c_outbox_matches_the_pure_python_one_byte_for_byte(seed: int) -> None:
    ops = _ops(seed, 400, bad=0.05 if seed % 2 else 0.0)
    c_results = _run(C.Outbox(**ARGS), ops)
    py_results = _run(Outbox(**ARGS), ops)
    assert c_results == py_results
    _check_wire(c_results)


@needs_c
def test_new_outbox_is_the_backends() -> None:
    with _backend.use("c"):
        assert type(new_outbox(**ARGS)) is C.Outbox
    with _backend.use("python"):
        assert type(new_outbox(**ARGS)) is Outbox


def test_event_data_is_encoded_at_publish_so_later_changes_do_not_travel(backend: str) -> None:
    ob = new_outbox(**ARGS)
    data = {"step": 1, "phase": "train"}
    assert ob.event("e", 5, data) == item_bytes("e", data)
    data["step"] = 2
    data["new"] = True
    msg = wire.decode(*ob.head(wire.MAX_TOPIC))
    assert msg.items == [["e", 5, {"step": 1, "phase": "train"}]]


def test_closed_outbox_counts_late_publishes_and_keeps_nothing(backend: str) -> None:
    ob = new_outbox(**ARGS)
    ob.event("e", 1, {})
    ob.close()
    assert ob.event("e", 2, {}) == 0
    assert ob.metric("g", "m", 1, 1.0) is None
    counters = counters_of(ob)
    assert counters.published == 1 and counters.late == 2 and counters == ob.counters()
    assert ob.head(wire.MAX_TOPIC) is not None  # what was held before close still goes


@needs_c
def test_check_data_matches_the_python_check() -> None:
    from shmstat.publish import events

    rnd = random.Random(7)
    for _ in range(500):
        data = _data(rnd, 0.1)
        c = C.check_data(data)
        exact = all(type(k) is str and (type(v) in (str, float, bool) or (type(v) is int and -(1 << 63) <= v < 1 << 63))
                    for k, v in data.items())
        assert (c is not None) == exact
        if c is not None:
            assert c == data and c is not data
            assert c == events._check_data_slow(data)
    assert C.check_data([("a", 1)]) is None


@needs_c
@pytest.mark.parametrize("seed", range(5))
def test_logging_event_objects_puts_the_same_bytes_on_both_outboxes(seed: int) -> None:
    import datetime

    from shmstat.publish.events import Event

    rnd = random.Random(seed)
    events = []
    for i in range(300):
        data = {f"k{j}": rnd.choice([1, -5, 2.5, "s", True, "é" * rnd.randrange(3)]) for j in range(rnd.randrange(4))}
        if rnd.random() < 0.3:
            events.append(Event._from_ns(rnd.choice(NAMES), rnd.randrange(1 << 62), data))
        else:
            when = datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=rnd.randrange(20_000), microseconds=i)
            if rnd.random() < 0.2:
                when = when.replace(tzinfo=datetime.timezone(datetime.timedelta(hours=rnd.randrange(-5, 6))))
            events.append(Event(rnd.choice(NAMES), when, data))

    def run(ob: Any) -> list[Any]:
        sends = random.Random(seed + 1000)
        out = []
        for ev in events:
            ev._ts_ns, ev._nbytes = None if ev._ts is not None else ev._ts_ns, 0  # as built, both times
            size = ob.log(ev, wire.MAX_EVENT_BYTES)
            if size < 0:  # what log_event then does itself
                size = ob.event(ev._name, ev._timestamp_ns(), ev._data, 0, wire.MAX_EVENT_BYTES)
            out.append((size, ev._timestamp_ns()))
            while (frames := ob.head(wire.MAX_TOPIC)) is not None and sends.random() < 0.3:
                out.append(frames)
                ob.pop()
        while (frames := ob.head(wire.MAX_TOPIC)) is not None:
            out.append(frames)
            ob.pop()
        return out

    big = dict(ARGS, max_items=10**6, max_bytes=10**9)
    assert run(C.Outbox(**big)) == run(Outbox(**big))


@needs_c
@pytest.mark.parametrize("batch", [1, 15, 16, 17, 40])
def test_c_outbox_writes_every_header_length_in_place_as_the_reference_does(batch: int) -> None:
    # the C outbox builds a message behind room kept for its header, guessed when the batch starts (a sequence
    # number near the publish index, 16 or more items): batches under 16 items and sequence numbers that grow a
    # byte while the batch fills must still give the reference's bytes
    args = dict(ARGS, batch_max=64, max_items=10**6, max_bytes=10**9, max_batch_bytes=1 << 20)
    c_ob, py_ob = C.Outbox(**args), Outbox(**args)
    for jump in (0, 120, 7, 120, 65_280, 8, (1 << 32) - 65_600, 3, (1 << 32)):
        for ob in (c_ob, py_ob):
            ob.refused(jump)  # a gap: its sequence numbers are consumed
            for i in range(batch):
                ob.event("e", i, {"i": i})
            ob.metric("g", "m", 1, 1.5)  # another topic's batch, started at the same index
        for _ in range(3):
            c_frames, py_frames = c_ob.head(wire.MAX_TOPIC), py_ob.head(wire.MAX_TOPIC)
            assert c_frames == py_frames
            if c_frames is None:
                break
            assert type(c_frames[1]) is bytes
            c_ob.pop()
            py_ob.pop()
    assert c_ob.counters() == py_ob.counters() and c_ob.wire_seq() == py_ob.wire_seq()


@needs_c
def test_c_outbox_reuses_only_payloads_nobody_holds() -> None:
    # a sealed message's bytes object is remembered by the C outbox and reused for a later batch once nothing
    # else holds it: the messages a publisher still keeps (for an acknowledgement) must never change
    args = dict(ARGS, batch_max=50, max_items=10**6, max_bytes=10**9, max_batch_bytes=1 << 20)
    ob = C.Outbox(**args)
    held: list[tuple[tuple[bytes, bytes], bytearray]] = []
    seq = 0
    for round_ in range(200):
        for i in range(1 + round_ % 60):
            ob.event("ev", round_, {"i": i, "s": "x" * (round_ % 7)})
        while (frames := ob.head(wire.MAX_TOPIC)) is not None:
            msg = wire.decode(*frames)
            assert msg.seq == seq and all(item[1] == round_ for item in msg.items)
            seq += len(msg.items)
            if round_ % 3 == 0:
                held.append((frames, bytearray(frames[1])))  # kept: must stay as it was
            ob.pop()
            del frames
        if len(held) > 40:
            del held[:20]  # acknowledged: given up, and reusable
        for frames, copy in held:
            assert frames[1] == copy
    assert counters_of(ob).sent_items == seq
