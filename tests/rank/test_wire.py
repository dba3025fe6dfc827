"""The wire format: round trips per kind, every rejection of ``decode``, and fuzzing (only WireError escapes)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmstat import wire
from shmstat.errors import ShmstatError, WireError
from shmstat.wire import MAX_PAYLOAD, MAX_TOPIC, WireMessage, decode, encode

EVENT_ITEMS = [
    ["train.step", 1_700_000_000_000_000_000, {"loss": 0.25, "step": 7, "phase": "train", "ok": True}],
    ["train.step", 1_700_000_000_000_000_001, {}],
]


def _body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"v": 1, "k": "event", "r": 0, "p": 10, "i": 0, "s": 0, "items": EVENT_ITEMS}
    body.update(overrides)
    return body


def _raw(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _rejects(topic: bytes, payload: bytes, fragment: str = "") -> WireError:
    with pytest.raises(WireError) as info:
        decode(topic, payload)
    assert fragment in str(info.value)
    return info.value


# ------------------------------------------------------------------------------------------- round trips


def test_topic_helpers() -> None:
    assert wire.event_topic("a.b") == "event/a.b"
    assert wire.metric_topic("torchelastic", "workers.default.run_total") == (
        "metric/torchelastic/workers.default.run_total"
    )
    assert wire.stat_topic("train", "lat") == "stat/train/lat"
    assert wire.rank_topic("exited") == "rank/exited"
    assert set(wire.KINDS) == {"event", "metric", "stat", "rank"}


def test_event_round_trip() -> None:
    payload = encode("event", 3, 4242, 2, 17, EVENT_ITEMS)
    msg = decode(b"event/train.step", payload)
    assert msg == WireMessage("event/train.step", "event", 3, 4242, 2, 17, EVENT_ITEMS)
    data = msg.items[0][2]
    assert type(data["ok"]) is bool and type(data["step"]) is int and type(data["loss"]) is float


def test_event_accepts_tuples_and_subclasses() -> None:
    class Name(str):
        pass

    payload = encode("event", 0, 1, 0, 0, ((Name("e"), 5, {"k": True}),))
    assert decode(b"event/e", payload).items == [["e", 5, {"k": True}]]


def test_metric_round_trip() -> None:
    items = [["g", "m", 1, 1700000000.5], ["g", "m", 2.5, 1700000001.0], ["g", "m", True, 1700000002]]
    msg = decode(b"metric/g/m", encode("metric", 1, 2, 0, 5, items))
    assert msg.kind == "metric" and msg.seq == 5 and msg.items == items
    assert type(msg.items[2][2]) is bool


def test_a_metric_name_may_hold_slashes_and_a_group_may_not() -> None:
    items = [["a", "b/c", 1, 1.0]]
    assert decode(b"metric/a/b/c", encode("metric", 0, 1, 0, 0, items)).items == items
    with pytest.raises(WireError, match="holds '/'"):  # the topic would be the same: one of them is refused
        encode("metric", 0, 1, 0, 0, [["a/b", "c", 1, 1.0]])
    raw = msgpack.packb({"v": 1, "k": "metric", "r": 0, "p": 1, "i": 0, "s": 0, "items": [["a/b", "c", 1, 1.0]]})
    _rejects(b"metric/a/b/c", raw, "holds '/'")


@pytest.mark.parametrize("kind", ["stat", "rank"])
def test_map_kinds_round_trip_from_the_collector(kind: str) -> None:
    items = [{"name": "lat", "count": 3, "mean": 1.5, "torn": False, "rank": None}, {}]
    topic = wire.stat_topic("train", "lat") if kind == "stat" else wire.rank_topic("exited")
    msg = decode(topic.encode(), encode(kind, wire.COLLECTOR_RANK, 99, 0, 0, items))
    assert msg.rank == -1 and msg.kind == kind and msg.items == items


def test_nan_and_infinities_survive() -> None:
    items = [["x", 1, {"a": math.nan, "b": math.inf, "c": -math.inf}]]
    data = decode(b"event/x", encode("event", 0, 1, 0, 0, items)).items[0][2]
    assert math.isnan(data["a"]) and data["b"] == math.inf and data["c"] == -math.inf


def test_decode_accepts_buffer_objects() -> None:
    payload = encode("event", 0, 1, 0, 0, EVENT_ITEMS)
    msg = decode(memoryview(b"event/train.step"), bytearray(payload))
    assert msg.topic == "event/train.step"


def test_wire_error_is_a_value_error_and_shmstat_error() -> None:
    err = _rejects(b"nope/x", _raw(_body()))
    assert isinstance(err, ValueError) and isinstance(err, ShmstatError)


# ------------------------------------------------------------------------------------------- encode rejects


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("tweet", 0, 1, 0, 0, EVENT_ITEMS), "kind"),
        (("event", -2, 1, 0, 0, EVENT_ITEMS), "rank"),
        (("event", True, 1, 0, 0, EVENT_ITEMS), "rank"),
        (("event", 0, -1, 0, 0, EVENT_ITEMS), "pid"),
        (("event", 0, 1, 0.5, 0, EVENT_ITEMS), "incarnation"),
        (("event", 0, 1, 0, -1, EVENT_ITEMS), "seq"),
        (("event", 0, 1, 0, 0, []), "empty"),
        (("event", 0, 1, 0, 0, [["x", 1]]), "event item"),
        (("event", 0, 1, 0, 0, [["x", 1.0, {}]]), "ts_ns"),
        (("event", 0, 1, 0, 0, [["x", 1, {"a": [1]}]]), "value"),
        (("event", 0, 1, 0, 0, [["x", 1, {"a": None}]]), "value"),
        (("event", 0, 1, 0, 0, [["x", 1, {1: 1}]]), "key"),
        (("event", 0, 1, 0, 0, [["x", 1, {"a": 1 << 64}]]), "cannot encode"),
        (("event", 0, 1, 0, 0, [["x", 1, {"a": "\udc80"}]]), "cannot encode"),
        (("metric", 0, 1, 0, 0, [["g", "n", "1", 1.0]]), "value"),
        (("metric", 0, 1, 0, 0, [["g", "n", 1, "now"]]), "ts"),
        (("metric", 0, 1, 0, 0, [["g", 1, 1, 1.0]]), "group or name"),
        (("stat", -1, 1, 0, 0, [["not", "a", "map"]]), "dict"),
        (("rank", -1, 1, 0, 0, [{"a": {"nested": 1}}]), "value"),
    ],
)
def test_encode_refuses_what_decode_would_refuse(args: tuple[Any, ...], fragment: str) -> None:
    with pytest.raises(WireError) as info:
        encode(*args)
    assert fragment in str(info.value)


def test_encode_refuses_oversized_payload() -> None:
    with pytest.raises(WireError, match="MAX_PAYLOAD"):
        encode("event", 0, 1, 0, 0, [["x", 1, {"blob": "a" * (MAX_PAYLOAD + 1)}]])


# ------------------------------------------------------------------------------------------- decode rejects


def test_topic_not_utf8() -> None:
    _rejects(b"event/\xff", _raw(_body()), "UTF-8")


@pytest.mark.parametrize("topic", [b"", b"event", b"events/x", b"metric", b"/event/x", b"EVENT/x", b"stat"])
def test_topic_unknown_prefix(topic: bytes) -> None:
    _rejects(topic, _raw(_body()), "does not start with")


def test_topic_too_long() -> None:
    _rejects(b"event/" + b"x" * MAX_TOPIC, _raw(_body()), "topic is")


def test_topic_kind_mismatch() -> None:
    _rejects(b"metric/train.step", _raw(_body()), "does not match the topic prefix")
    _rejects(b"event/train.step", _raw(_body(k="stat", items=[{}])), "does not match the topic prefix")


def test_consistent_stat_message_is_accepted() -> None:
    assert decode(b"stat/g/n", _raw(_body(k="stat", r=-1, items=[{}]))).kind == "stat"


def test_event_name_must_match_topic() -> None:
    _rejects(b"event/other", _raw(_body()), "name does not match")


def test_metric_group_name_must_match_topic() -> None:
    _rejects(b"metric/g/x", _raw(_body(k="metric", items=[["g", "m", 1, 1.0]])), "do not match")


def test_payload_too_large_is_refused_unread() -> None:
    _rejects(b"event/x", b"\x00" * (MAX_PAYLOAD + 1), "more than")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        _raw(_body())[:-1],  # truncated
        _raw(_body()) + b"\x00",  # extra data
        b"\xdd\xff\xff\xff\xff",  # array of 4 G elements announced in 5 bytes
        b"\xdf\xff\xff\xff\xff",  # map of 4 G pairs announced in 5 bytes
        b"\x91" * 5000 + b"\x00",  # absurdly deep nesting
        _raw({1: 2}),  # int map key
        _raw({(1, 2): 2}),  # array map key
        b"\xa2\xff\xfe",  # str that is not UTF-8
    ],
)
def test_payload_not_msgpack(payload: bytes) -> None:
    _rejects(b"event/train.step", payload)


def test_ext_types_are_refused() -> None:
    ext = _raw(_body(items=[["train.step", 1, {"a": msgpack.ExtType(5, b"xyz")}]]))
    _rejects(b"event/train.step", ext, "ext type")
    stamp = _raw(_body(items=[["train.step", 1, {"a": msgpack.Timestamp(1, 2)}]]))
    _rejects(b"event/train.step", stamp, "ext type")


@pytest.mark.parametrize("body", [[1, 2, 3], "event", 7, None])
def test_payload_not_a_map(body: Any) -> None:
    _rejects(b"event/train.step", _raw(body), "not a msgpack map")


def test_missing_and_unknown_keys() -> None:
    body = _body()
    del body["p"]
    _rejects(b"event/train.step", _raw(body), "missing ['p']")
    _rejects(b"event/train.step", _raw(_body(extra=1)), "unknown keys")
    bin_key = {**_body(), b"p": 1}
    del bin_key["p"]
    _rejects(b"event/train.step", _raw(bin_key), "missing")


@pytest.mark.parametrize("version", [0, 2, "1", 1.0, True, None])
def test_wrong_version(version: Any) -> None:
    _rejects(b"event/train.step", _raw(_body(v=version)), "wire version")


@pytest.mark.parametrize(
    "override",
    [
        {"k": "metric"},
        {"k": 1},
        {"k": ["event"]},
        {"r": "0"},
        {"r": True},
        {"r": -2},
        {"r": 1.0},
        {"p": -1},
        {"p": None},
        {"i": -1},
        {"i": 0.5},
        {"s": -5},
        {"s": "0"},
        {"items": []},
        {"items": {"a": 1}},
        {"items": "abc"},
        {"items": None},
    ],
)
def test_ill_typed_header(override: dict[str, Any]) -> None:
    _rejects(b"event/train.step", _raw(_body(**override)))


@pytest.mark.parametrize(
    "item",
    [
        ["train.step", 1],
        ["train.step", 1, {}, 4],
        "abc",
        {"train.step": 1, "a": 2, "b": 3},
        [b"train.step", 1, {}],
        ["train.step", 1.5, {}],
        ["train.step", True, {}],
        ["train.step", None, {}],
        ["train.step", 1, []],
        ["train.step", 1, None],
        ["train.step", 1, {"a": None}],
        ["train.step", 1, {"a": [1, 2]}],
        ["train.step", 1, {"a": {"nested": 1}}],
        ["train.step", 1, {"a": b"bytes"}],
        ["train.step", 1, {b"bin-key": 1}],
        [["train.step"], 1, {}],
    ],
)
def test_ill_typed_event_items(item: Any) -> None:
    _rejects(b"event/train.step", _raw(_body(items=[EVENT_ITEMS[0], item])))


@pytest.mark.parametrize(
    "item",
    [
        ["g", "m", 1],
        ["g", "m", "1", 1.0],
        ["g", "m", None, 1.0],
        ["g", "m", [1], 1.0],
        ["g", "m", 1, "now"],
        ["g", "m", 1, None],
        ["g", b"m", 1, 1.0],
        {"g": 1},
    ],
)
def test_ill_typed_metric_items(item: Any) -> None:
    _rejects(b"metric/g/m", _raw(_body(k="metric", items=[item])))


@pytest.mark.parametrize("item", [[1, 2], "x", {"a": [1]}, {"a": {"b": 1}}, {"a": b"x"}, {b"k": 1}])
def test_ill_typed_map_items(item: Any) -> None:
    _rejects(b"stat/g/m", _raw(_body(k="stat", r=-1, items=[item])))
    _rejects(b"rank/exited", _raw(_body(k="rank", r=-1, items=[item])))


@pytest.mark.parametrize("frame", [None, 5, "event/x", ["event/x"]])
def test_frames_must_be_bytes(frame: Any) -> None:
    with pytest.raises(WireError):
        decode(frame, _raw(_body()))
    with pytest.raises(WireError):
        decode(b"event/train.step", frame)


# ------------------------------------------------------------------------------------------- fuzzing

_GOOD = encode("event", 1, 2, 3, 4, EVENT_ITEMS)
_GOOD_METRIC = encode("metric", 1, 2, 3, 4, [["g", "m", 1.5, 1.0]])


def _decode_or_wire_error(topic: bytes, payload: bytes) -> WireMessage | None:
    try:
        msg = decode(topic, payload)
    except WireError:
        return None
    assert isinstance(msg, WireMessage)
    return msg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topic=st.binary(max_size=40), payload=st.binary(max_size=300))
def test_fuzz_random_bytes(topic: bytes, payload: bytes) -> None:
    _decode_or_wire_error(topic, payload)


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=300))
def test_fuzz_random_payload_on_valid_topics(payload: bytes) -> None:
    for topic in (b"event/train.step", b"metric/g/m", b"stat/g/m", b"rank/x"):
        _decode_or_wire_error(topic, payload)


@pytest.mark.parametrize("good", [_GOOD, _GOOD_METRIC])
def test_every_truncation_is_refused(good: bytes) -> None:
    topic = b"event/train.step" if good is _GOOD else b"metric/g/m"
    for n in range(len(good)):
        _rejects(topic, good[:n])


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_fuzz_mutated_valid_payloads(data: st.DataObject) -> None:
    payload = bytearray(_GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    _decode_or_wire_error(b"event/train.step", bytes(payload[:cut]))


@settings(max_examples=200, deadline=None)
@given(body=st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
))
def test_fuzz_structured_garbage(body: Any) -> None:
    for candidate in (body, _body(items=[["train.step", 1, {"a": body}]]), _body(items=body)):
        _decode_or_wire_error(b"event/train.step", _raw(candidate))


_scalar = (
    st.text(max_size=10)
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
)


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(max_size=20),
    rank=st.integers(-1, 1 << 20),
    seq=st.integers(0, (1 << 63)),
    items=st.lists(
        st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.dictionaries(st.text(max_size=8), _scalar, max_size=5)),
        min_size=1,
        max_size=10,
    ),
)
def test_fuzz_event_round_trip(name: str, rank: int, seq: int, items: list[tuple[int, dict[str, Any]]]) -> None:
    wire_items = [[name, ts, data] for ts, data in items]
    try:
        topic = wire.event_topic(name).encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates cannot be topics (encode refuses them in the payload too)
    if len(topic) > MAX_TOPIC:
        return
    try:
        payload = encode("event", rank, 7, 0, seq, wire_items)
    except WireError:
        assert any("\ud800" <= ch <= "\udfff" for s in _strings(wire_items) for ch in s)
        return
    msg = decode(topic, payload)
    assert (msg.rank, msg.pid, msg.incarnation, msg.seq) == (rank, 7, 0, seq)
    assert msg.items == wire_items


def _strings(items: list[Any]) -> list[str]:
    out: list[str] = []
    for name, _ts, data in items:
        out.append(name)
        out.extend(data)
        out.extend(v for v in data.values() if isinstance(v, str))
    return out


def test_a_stat_item_carries_its_histogram_and_a_malformed_one_is_refused():
    from shmstat.histogram import Histogram

    h = Histogram()
    for v in (0.5, 1.0, 2.0, 3.0, -1.0, 0.0):
        h.add(v)
    item = {"group": "g", "name": "s", "count": 6, "p99": 3.0, "hist": h.to_wire()}
    msg = wire.decode(wire.stat_topic("g", "s").encode(), wire.encode("stat", -1, 1, 0, 0, [item]))
    assert msg.items == [item]
    for bad in ({"scale": 1}, {"scale": 1, "zero": 0, "pos": [0, [1, -1]], "neg": [0, []]},
                {"scale": 1.5, "zero": 0, "pos": [0, []], "neg": [0, []]}, [1, 2]):
        with pytest.raises(wire.WireError, match="hist"):
            wire.encode("stat", -1, 1, 0, 0, [{**item, "hist": bad}])
        payload = msgpack.packb({"v": 1, "k": "stat", "r": -1, "p": 1, "i": 0, "s": 0,
                                 "items": [{**item, "hist": bad}]})
        with pytest.raises(wire.WireError, match="hist"):
            wire.decode(b"stat/g/s", payload)
