"""The C intake check (``collector._intake``) against ``shmstat.wire.decode``, the one definition of valid.

Differential: on random, adversarial and mutated messages the C check accepts exactly what decode accepts, with
the same header; when it says "decode would refuse", decode refuses; it may only leave a message undecided (None),
never be wrong, and it never leaves a well-formed event or metric message undecided (that is the fast path).
Hypothesis runs derandomized, so every run checks the same cases.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import test_collector_bad_input as bad_input
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rank import test_wire  # tests/rank/test_wire.py (tests/ is on sys.path: pyproject)

from collector._backend import c_intake_check
from collector.relay import intake
from shmstat import _backend, wire
from shmstat.errors import WireError

check_c = c_intake_check()  # the C check's raw answer: the header tuple, the reason decode refuses, or None
pytestmark = pytest.mark.skipif(check_c is None, reason="collector._intake is not built")

SETTINGS = settings(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def agree(topic: bytes, payload: bytes) -> str:
    """Assert the C check agrees with decode on one message; return "accepted", "refused" or "undecided"."""
    got = check_c(topic, payload)
    try:
        msg = wire.decode(topic, payload)
    except WireError:
        msg = None
    if got is None:
        return "undecided"
    if isinstance(got, tuple):
        assert msg is not None, (topic, payload, got)
        assert got == (msg.kind, msg.rank, msg.pid, msg.incarnation, msg.seq, len(msg.items))
        return "accepted"
    assert isinstance(got, str) and got
    assert msg is None, (topic, payload, got)
    return "refused"


def accepted(topic: bytes, payload: bytes) -> None:
    assert agree(topic, payload) == "accepted", (topic, payload)


# ------------------------------------------------------------------ a msgpack writer with every encoding width


def pack(obj: Any, wide: int = 0) -> bytes:
    """msgpack bytes of ``obj``; ``wide`` 1 or 2 uses wider-than-needed encodings (still valid msgpack). A tuple
    ``("__pairs__", (k, v), ...)`` is a map written pair by pair (so keys may repeat)."""
    if obj is None or obj is True or obj is False or isinstance(obj, bytes):
        return msgpack.packb(obj, use_bin_type=True)
    if isinstance(obj, int):
        if wide and 0 <= obj < (1 << 64) and (wide == 1 or obj >= (1 << 63)):
            return b"\xcf" + struct.pack(">Q", obj)
        if wide and -(1 << 63) <= obj < (1 << 63):
            return b"\xd3" + struct.pack(">q", obj)
        return msgpack.packb(obj)
    if isinstance(obj, float):
        try:
            as_f32 = b"\xca" + struct.pack(">f", obj)
        except OverflowError:
            as_f32 = b""
        if wide and as_f32 and struct.unpack(">f", as_f32[1:])[0] == obj:
            return as_f32
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        n = len(raw)
        if wide:
            return b"\xda" + struct.pack(">H", n) + raw
        head = bytes([0xa0 | n]) if n < 32 else b"\xd9" + bytes([n]) if n < 256 else b"\xda" + struct.pack(">H", n)
        return head + raw
    if isinstance(obj, list):
        head = b"\xdc" + struct.pack(">H", len(obj)) if wide else _array_head(len(obj))
        return head + b"".join(pack(x, wide) for x in obj)
    if isinstance(obj, tuple) and obj[:1] == ("__pairs__",):
        pairs = obj[1:]
        head = b"\xde" + struct.pack(">H", len(pairs)) if wide else _map_head(len(pairs))
        return head + b"".join(pack(k, wide) + pack(v, wide) for k, v in pairs)
    if isinstance(obj, dict):
        return pack(("__pairs__", *obj.items()), wide)
    raise TypeError(type(obj))


def _array_head(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)


def _map_head(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)


def header(kind: str = "event", items: Any = None, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"v": 1, "k": kind, "r": 0, "p": 10, "i": 0, "s": 0,
                            "items": items if items is not None else [["e", 1, {"a": 1}]]}
    body.update(over)
    return body


def test_pack_writes_what_msgpack_reads() -> None:
    obj = {"a": [1, -3, 70000, 2.5, "x", "", b"b", None, True, {"k": -(1 << 20)}]}
    for wide in (0, 1, 2):
        assert msgpack.unpackb(pack(obj, wide), raw=False) == obj


# ------------------------------------------------------------------------------------------- fixed cases


def test_well_formed_messages_are_accepted_with_their_header() -> None:
    assert check_c(b"event/e", wire.encode("event", 3, 4, 5, 6, [["e", 1, {"a": 1.5}]] * 3)) == (
        "event", 3, 4, 5, 6, 3)
    accepted(b"event/", wire.encode("event", -1, 0, 0, 0, [["", -5, {}]]))
    accepted(b"metric/a/b/c", wire.encode("metric", 0, 1, 2, (1 << 64) - 1,
                                          [["a", "b/c", True, 1], ["a", "b/c", 2.5, 1.5]]))
    assert agree(b"metric/a/b/c", pack(header("metric", [["a", "b/c", 1, 2], ["a/b", "c", 1, 2]]))) == "refused"
    accepted("event/é€😀".encode(), wire.encode("event", 0, 1, 0, 0, [["é€😀", 0, {"ключ": "значение"}]]))
    for wide in (1, 2):  # non-canonical widths are still valid msgpack
        accepted(b"event/e", pack(header(items=[["e", 7, {"a": 1, "b": -2, "c": 0.5, "d": "x", "e": False}]]),
                                  wide))
        accepted(b"metric/g/m", pack(header("metric", [["g", "m", 1, 2]], r=5, p=70000), wide))


def test_unusual_payloads_are_left_to_decode_or_judged_right() -> None:
    dup_bad_last = pack(("__pairs__", *header().items(), ("items", [["x", 1, {}]])))
    dup_good_last = pack(("__pairs__", ("items", [["x", 1, {}]]), *header().items()))
    data_dup = pack(header(items=[["e", 1, ("__pairs__", ("a", None), ("a", 1))]]))
    data_dup_bad = pack(header(items=[["e", 1, ("__pairs__", ("a", 1), ("a", None))]]))
    for payload in (dup_bad_last, dup_good_last, data_dup, data_dup_bad):
        agree(b"event/e", payload)
    assert wire.decode(b"event/e", data_dup).items == [["e", 1, {"a": 1}]]  # why a bad data value is undecided
    for rank in ((1 << 63), (1 << 64) - 1):  # beyond int64: valid, left to decode
        agree(b"event/e", pack(header(r=rank)))
    for kind, topic in (("stat", b"stat/g/m"), ("rank", b"rank/exited")):
        assert check_c(topic, wire.encode(kind, -1, 1, 0, 0, [{"a": 1}])) is None


@pytest.mark.parametrize("text", [b"\xed\xa0\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf",
                                  b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82", b"\xff"])
def test_strings_that_are_not_strict_utf8_are_refused_everywhere(text: bytes) -> None:
    marker = "Q" * len(text)
    for topic, body in ((b"event/e", header(items=[["e", 1, {marker: 1}]])),
                        (b"event/e", header(items=[["e", 1, {"a": marker}]])),
                        (b"event/" + marker.encode(), header(items=[[marker, 1, {}]])),
                        (b"metric/g/m", header("metric", [["g", "m", 1, 2]], k=marker))):
        payload = pack(body).replace(marker.encode(), text)
        assert agree(topic.replace(marker.encode(), text), payload) == "refused"


def test_every_corpus_message_of_the_wire_and_bad_input_tests() -> None:
    cases: list[tuple[bytes, bytes]] = []
    for frames in bad_input.CRAFTED:
        if len(frames) >= 2:
            cases.append((frames[0], frames[1]))
    t = test_wire
    builders = {
        t.test_payload_not_msgpack: lambda v: t._raw(t._body()) if v is None else v,
        t.test_payload_not_a_map: t._raw,
        t.test_wrong_version: lambda v: t._raw(t._body(v=v)),
        t.test_ill_typed_header: lambda v: t._raw(t._body(**v)),
        t.test_ill_typed_event_items: lambda v: t._raw(t._body(items=[t.EVENT_ITEMS[0], v])),
    }
    for fn, build in builders.items():
        for mark in fn.pytestmark:
            cases.extend((b"event/train.step", build(v)) for v in mark.args[1])
    for mark in t.test_ill_typed_metric_items.pytestmark:
        cases.extend((b"metric/g/m", t._raw(t._body(k="metric", items=[v]))) for v in mark.args[1])
    for mark in t.test_topic_unknown_prefix.pytestmark:
        cases.extend((v, t._GOOD) for v in mark.args[1])
    cases += [(b"event/train.step", t._GOOD), (b"metric/g/m", t._GOOD_METRIC), (b"x" * 5000, t._GOOD),
              (b"event/train.step", b"\x00" * (wire.MAX_PAYLOAD + 1))]
    verdicts = [agree(topic, payload) for topic, payload in cases]
    assert verdicts.count("accepted") >= 2 and verdicts.count("refused") > len(cases) // 2


@pytest.mark.parametrize("good", ["event", "metric"])
def test_every_truncation_and_single_byte_change(good: str) -> None:
    topic, payload = ((b"event/train.step", test_wire._GOOD) if good == "event"
                      else (b"metric/g/m", test_wire._GOOD_METRIC))
    for n in range(len(payload)):
        assert agree(topic, payload[:n]) == "refused"
    for pos in range(len(payload)):
        for value in range(256):
            changed = payload[:pos] + bytes([value]) + payload[pos + 1:]
            agree(topic, changed)


# ------------------------------------------------------------------------------------------- hypothesis

_text = st.text(max_size=6)
_value = st.one_of(st.text(max_size=6), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(), st.booleans(),
                   st.none(), st.binary(max_size=3), st.lists(st.integers(0, 3), max_size=2))


@st.composite
def messages(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """Mostly valid event/metric messages, with now and then one field wrong, in random encoding widths."""
    kind = draw(st.sampled_from(["event", "metric"]))
    if kind == "event":
        name = draw(st.sampled_from(["e", "", "a/b", "é"]))
        topic = "event/" + name
        items = draw(st.lists(st.tuples(st.just(name), st.integers(-(1 << 63), (1 << 64) - 1),
                                        st.dictionaries(_text, st.one_of(_text, st.integers(-(1 << 63), (1 << 64) - 1),
                                                                         st.floats(), st.booleans()), max_size=4)),
                              min_size=1, max_size=4))
        items = [list(i) for i in items]
    else:
        group, name = draw(st.sampled_from([("g", "m"), ("a/b", "c"), ("a", "b/c"), ("", "")]))
        topic = f"metric/{group}/{name}"
        items = draw(st.lists(st.tuples(st.just(group), st.just(name),
                                        st.one_of(st.integers(-5, 1 << 40), st.floats(), st.booleans()),
                                        st.one_of(st.floats(), st.integers(0, 1 << 40))), min_size=1, max_size=4))
        items = [list(i) for i in items]
    body = header(kind, items, r=draw(st.integers(-1, 1 << 40)), p=draw(st.integers(0, 1 << 33)),
                  i=draw(st.integers(0, 300)), s=draw(st.integers(0, (1 << 63) - 1)))
    if draw(st.integers(0, 3)) == 0:  # spoil one thing
        where = draw(st.sampled_from(["header", "item", "data", "topic", "extra", "dup"]))
        if where == "header":
            body[draw(st.sampled_from(sorted(body)))] = draw(_value)
        elif where == "item":
            item = items[draw(st.integers(0, len(items) - 1))]
            item[draw(st.integers(0, len(item) - 1))] = draw(_value)
        elif where == "data" and kind == "event":
            items[0][2][draw(_text)] = draw(_value)
        elif where == "topic":
            topic = draw(st.sampled_from(["event/x", "metric/g", "metric/g/x", "stat/g/m", "events/e", "event"]))
        elif where == "extra":
            body[draw(st.sampled_from(["x", "items2", "V"]))] = 1
        else:
            body = ("__pairs__", *body.items(), (draw(st.sampled_from(sorted(body))), draw(_value)))
    payload = pack(body, draw(st.integers(0, 2)))
    return topic.encode(), payload


@SETTINGS
@given(msg=messages())
def test_random_messages(msg: tuple[bytes, bytes]) -> None:
    topic, payload = msg
    verdict = agree(topic, payload)
    try:
        wire.decode(topic, payload)
    except WireError:
        return
    if topic.startswith((b"event/", b"metric/")) and b"\xc0" not in payload:
        assert verdict == "accepted"  # the fast path takes every plain valid message


@SETTINGS
@given(msg=messages(), data=st.data())
def test_random_messages_mutated(msg: tuple[bytes, bytes], data: st.DataObject) -> None:
    topic, payload = msg
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    agree(topic, bytes(raw[: data.draw(st.integers(0, len(raw)))]))


@SETTINGS
@given(topic=st.binary(max_size=20), payload=st.binary(max_size=200))
def test_random_bytes(topic: bytes, payload: bytes) -> None:
    agree(topic, payload)
    agree(b"event/e", payload)
    agree(b"metric/g/m", payload)


def test_inspect_matches_decode_in_both_paths(backend: str) -> None:
    cases = [(b"event/e", wire.encode("event", 2, 3, 4, 5, [["e", 1, {"a": 1}]] * 2)),
             (b"metric/g/m", wire.encode("metric", 2, 3, 4, 5, [["g", "m", 1.5, 2.0]])),
             (b"stat/g/m", wire.encode("stat", -1, 3, 0, 5, [{"a": 1}])),
             (b"event/e", b"\xc1"), (b"nope/e", b"")]
    assert _backend.backend().name == backend
    for topic, payload in cases:
        try:
            want = wire.decode(topic, payload)
        except WireError:
            with pytest.raises(WireError):
                intake.inspect(topic, payload)
            continue
        got = intake.inspect(memoryview(topic), memoryview(payload))
        assert (got.topic, got.kind, got.rank, got.pid, got.incarnation, got.seq, got.n_items, got.items) == (
            want.topic, want.kind, want.rank, want.pid, want.incarnation, want.seq, len(want.items), want.items)
