"""The name rule (:mod:`shmstat.names`): every entry point refuses each kind of bad name with a ConfigError that
names the rule, on both backends alike (C and pure Python, each in a fresh process), and accepts the names at
the limits; the collector reads back exactly what a rank wrote and refuses bytes that are not UTF-8; the
(group, name) -> topic and -> TensorBoard tag mappings are one-to-one over every pair the rule accepts."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.procs import REPO

from elastic import events as elastic_events
from elastic import metrics
from shmstat import Aggregation, ConfigError, Event, Stat, _backend, log_event, register_event_handler, wire
from shmstat import names as N
from shmstat.job.rank import RankAttachment
from shmstat.shm import layout as L
from shmstat.shm import layout_codec as codec
from shmstat.shm.segment import Segment

NOW = dt.datetime(2026, 1, 2, 3, 4, 5)

BAD_NAMES = {
    "empty": "",
    "U+FFFD": "loss\ufffd",
    "lone surrogate": "loss\ud800",
    "NUL": "a\x00b",
    "newline": "a\nb",
    "DEL": "a\x7f",
    "C1 control": "a\x85b",
    "line separator": "a\u2028b",
    "256 bytes, ASCII": "x" * 256,
    "256 bytes, a 2-byte letter across the limit": "x" * 254 + "é",
    "256 bytes, an emoji across the limit": "x" * 252 + "😀",
}
"""Names no entry point takes (a metric or event name; a stat's limit is 80 bytes, see STAT_TOO_LONG)."""

STAT_TOO_LONG = {"81 bytes, ASCII": "x" * 81, "81 bytes, é at the limit": "x" * 79 + "é",
                 "81 bytes, emoji": "😀" * 20 + "x"}
BAD_GROUPS = {**{k: v for k, v in BAD_NAMES.items() if not k.startswith("256")}, "49 bytes": "é" * 24 + "x",
              "a slash": "a/b", "an equals sign": "a=b", "star": "*", "the collector's group": "shmstat",
              "rank0": "rank0", "rank17": "rank17", "rank-1": "rank-1"}

GOOD_NAMES = ["torchelastic", "my_app", "foo.bar", "calculate_latency", "module.func.success",
              "Worker.step.duration.ms", "outer.<locals>.Inner.run.duration.ms", "torch.monitor.Stat",
              "torchelastic.worker.status.SUCCEEDED", "dynamic_rendezvous.py:next_rendezvous", "loss/train",
              "rank/joined", "step time (ms)", "损失", "x" * 255, "é" * 127 + "x", "😀" * 63 + "abc"]
GOOD_STAT_NAMES = ["steps", "loss/train", "é" * 40, "😀" * 20, "x" * 80, "训练" * 13 + "ab"]
GOOD_GROUPS = ["default", "torchelastic", "my_app", "train", "dev-eu.1", "rank", "ranks", "rank0a", "myrank0",
               "训练组", "ü" * 24, "g" * 48, "*a", "shmstat2"]


# ----------------------------------------------------------------------------------- the rule itself


@pytest.mark.parametrize("text", GOOD_NAMES)
def test_the_names_the_project_and_torchelastic_use_stay_valid(text: str) -> None:
    assert N.name_problem(text) is None
    assert N.check_name(text) == text


@pytest.mark.parametrize("label", sorted(BAD_NAMES))
def test_each_bad_name_is_refused_with_its_reason_and_the_rule(label: str) -> None:
    text = BAD_NAMES[label]
    with pytest.raises(ConfigError) as err:
        N.check_name(text, "metric name")
    message = str(err.value)
    assert message.startswith("metric name ") and N.RULE_REFERENCE in message and "\n" not in message
    assert len(message) < 160, message  # one short sentence: the page states the rule
    assert N.name_problem(text) in message


def test_a_stat_name_is_at_most_80_bytes_counted_in_utf8() -> None:
    for text in GOOD_STAT_NAMES:
        assert N.name_problem(text, N.MAX_STAT_NAME_BYTES) is None, text
    for label, text in STAT_TOO_LONG.items():
        assert "shorten it to at most 80" in (N.name_problem(text, N.MAX_STAT_NAME_BYTES) or ""), label
    assert N.MAX_STAT_NAME_BYTES == L.MAX_NAME_BYTES and N.MAX_GROUP_BYTES == L.MAX_GROUP_BYTES  # the fields


@pytest.mark.parametrize("label", sorted(BAD_GROUPS))
def test_each_bad_group_is_refused(label: str) -> None:
    assert N.group_problem(BAD_GROUPS[label]) is not None
    with pytest.raises(ConfigError, match="the name rule"):
        N.check_group(BAD_GROUPS[label])


@pytest.mark.parametrize("group", GOOD_GROUPS)
def test_groups_that_are_one_segment_and_no_reserved_word_are_valid(group: str) -> None:
    assert N.group_problem(group) is None


def test_a_name_of_another_type_is_a_type_error_and_a_str_subclass_becomes_a_str() -> None:
    class Name(str):
        pass

    with pytest.raises(TypeError, match="must be a str"):
        N.check_name(5, "Stat name")
    assert type(N.check_name(Name("x"))) is str


# ----------------------------------------------------------------------- the mappings are one-to-one

_alphabet = st.sampled_from(["a", "b", "/", ".", "rank", "0", "7", "-", "é", " ", "=", "*", "count", "shmstat"])
_texts = st.lists(_alphabet, min_size=1, max_size=6).map("".join)


@settings(max_examples=400, deadline=None)
@given(pairs=st.lists(st.tuples(_texts, _texts), min_size=2, max_size=6), ranks=st.lists(st.integers(0, 11)))
def test_topics_and_tensorboard_tags_of_valid_pairs_never_collide(pairs: list[tuple[str, str]],
                                                                   ranks: list[int]) -> None:
    valid = {(g, n) for g, n in pairs if N.group_problem(g) is None and N.name_problem(n) is None}
    for make in (wire.stat_topic, wire.metric_topic):
        assert len({make(g, n) for g, n in valid}) == len(valid)
        for g, n in valid:  # and each splits back at its second '/'
            assert make(g, n).split("/", 2)[1:] == [g, n]
    # TensorBoard: <group>/<stat>.<agg> merged, rank<N>/<group>/<stat>.<agg> per rank (collector/handlers)
    tags = [(f"{g}/{n}.count", (None, g, n)) for g, n in valid]
    tags += [(f"{N.rank_segment(r)}/{g}/{n}.count", (r, g, n)) for g, n in valid for r in set(ranks)]
    assert len({t for t, _ in tags}) == len(tags)


# ------------------------------------------------------------------ every entry point, both backends

_ENTRY_POINTS = r"""
import datetime, json, logging, sys
import shmstat
from elastic import events, metrics
logging.disable(logging.CRITICAL)
now = datetime.datetime(2026, 1, 2, 3, 4, 5)
seen = []
shmstat.register_event_handler(lambda e: seen.append(e.name))
metrics.configure(metrics.NullMetricHandler(), "g")
names, stat_names, groups = json.loads(sys.argv[1])

def outcome(call):
    try:
        call()
        return "ok"
    except Exception as exc:
        return [type(exc).__name__, str(exc)]

entry = {
    "Stat": lambda n: shmstat.Stat(n, [shmstat.Aggregation.SUM], 1.0),
    "log_event": lambda n: shmstat.log_event(shmstat.Event(n, now, {"a": 1})),
    "put_metric": lambda n: metrics.put_metric(n, 1, "g"),
    "put_metric, routed": lambda n: metrics.put_metric(n, 1, "unconfigured"),
    "getStream.add_value": lambda n: metrics.getStream("unconfigured").add_value(n, 1),
    "record": lambda n: events.record(events.Event(name=n, source=events.EventSource.WORKER)),
    "record_rdzv_event": lambda n: events.record_rdzv_event(events.RdzvEvent(n, "run", "m", "h", 1,
                                                                             events.NodeState.INIT)),
}
by_group = {
    "Stat": lambda g: shmstat.Stat("x", [shmstat.Aggregation.SUM], 1.0, group=g),
    "put_metric": lambda g: metrics.put_metric("x", 1, g),
    "prof": lambda g: metrics.prof(lambda: None, group=g),
}
out = {"names": {k: {n: outcome(lambda: f(n)) for n in names} for k, f in entry.items()},
       "stat_names": {n: outcome(lambda: entry["Stat"](n)) for n in stat_names},
       "groups": {k: {g: outcome(lambda: f(g)) for g in groups} for k, f in by_group.items()},
       "seen": seen}
print(json.dumps(out))
"""


def _entry_outcomes(pure: str, names: list[str], stat_names: list[str], groups: list[str]) -> dict:
    arg = json.dumps([names, stat_names, groups])  # lone surrogates travel as JSON escapes
    r = subprocess.run([sys.executable, "-c", _ENTRY_POINTS, arg], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=REPO, **{_backend.VARIABLE: pure}))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("pure", ["0", "1"], ids=["c", "python"])
def test_every_entry_point_refuses_every_bad_name_and_takes_the_limits_on_both_backends(pure: str) -> None:
    if pure == "0" and not _backend.c_available():
        pytest.skip("the C extensions are not built")
    bad, good = list(BAD_NAMES.values()), GOOD_NAMES
    got = _entry_outcomes(pure, bad + good, list(STAT_TOO_LONG.values()) + GOOD_STAT_NAMES,
                          list(BAD_GROUPS.values()) + GOOD_GROUPS)
    for entry, outcomes in got["names"].items():
        for name in bad:
            kind, message = outcomes[name]
            assert kind == "ConfigError" and N.RULE_REFERENCE in message, (entry, name, message)
        for name in good:
            want = "ok" if entry != "Stat" or len(name.encode()) <= 80 else outcomes[name]
            assert outcomes[name] == want, (entry, name)
            if entry == "Stat" and want != "ok":
                assert outcomes[name][0] == "ConfigError" and "shorten it to at most 80" in outcomes[name][1]
    for name, outcome in got["stat_names"].items():
        assert (outcome == "ok") == (name in GOOD_STAT_NAMES), (name, outcome)
        assert outcome == "ok" or (outcome[0] == "ConfigError" and N.RULE_REFERENCE in outcome[1])
    for entry, outcomes in got["groups"].items():
        for group, outcome in outcomes.items():
            assert (outcome == "ok") == (group in GOOD_GROUPS), (entry, group, outcome)
            assert outcome == "ok" or (outcome[0] == "ConfigError" and N.RULE_REFERENCE in outcome[1]), (entry, group)
    assert got["seen"] == good  # a refused event reaches no handler; every accepted one does, as given
    if pure == "1" and _backend.c_available():
        assert got == _entry_outcomes("0", bad + good, list(STAT_TOO_LONG.values()) + GOOD_STAT_NAMES,
                                      list(BAD_GROUPS.values()) + GOOD_GROUPS)  # the C paths say the same


def test_an_event_with_any_name_can_be_built_as_in_torch_but_log_event_refuses_a_bad_one() -> None:
    seen: list[str] = []
    register_event_handler(lambda e: seen.append(e.name))
    e = Event("", NOW, {})
    with pytest.raises(ConfigError, match="event name '' is empty"):
        log_event(e)
    e.name = "ok"
    log_event(e)
    assert seen == ["ok"]


def test_prof_checks_its_names_when_decorating_so_the_call_never_raises_for_them() -> None:
    def f() -> int:
        return 1

    f.__qualname__ = "C." + "q" * 248  # a method's key is its qualname: <key>.success would be 258 bytes
    with pytest.raises(ConfigError, match="is 258 bytes of UTF-8"):
        metrics.prof(f)
    f.__qualname__ = "C." + "q" * 241  # exactly 255 with .duration.ms
    assert metrics.prof(f)() == 1


def test_the_collector_metric_handler_and_elastic_events_refuse_bad_names_too() -> None:
    with pytest.raises(ConfigError, match="metric group 'a/b'"):
        metrics.CollectorMetricHandler().emit(metrics.MetricData(0.0, "a/b", "c", 1))
    with pytest.raises(ConfigError, match="event name"):
        elastic_events.record(elastic_events.Event(name="x\ud800", source=elastic_events.EventSource.AGENT))


def test_put_metric_remembers_at_most_a_bounded_number_of_names() -> None:
    metrics.configure(metrics.NullMetricHandler(), "g")
    for i in range(N._KNOWN_MAX + 100):
        metrics.put_metric(f"m{i}", 1, "g")
    assert 0 < len(N.KNOWN[0]) <= N._KNOWN_MAX
    metrics.put_metric(7, 1, None)  # type: ignore[arg-type]  # checked as "7" in group "None", as torchelastic


# ---------------------------------------------------------------------------------- the collector side


def test_the_collector_reads_back_exactly_what_a_rank_wrote_and_refuses_bytes_that_are_not_utf8(job) -> None:
    seg = Segment.open(job, geometry=L.Geometry(2, 8, 4))
    try:
        att = RankAttachment.register(seg, rank=0, local_rank=0)
        for name, group in (("é" * 40, "ü" * 24), ("😀" * 20, "训练组"), ("b/c", "a")):
            att.allocate_stat(name, group, 100, 10, 1)
        with pytest.raises(ConfigError, match="the name rule"):
            att.allocate_stat("x", "a/b", 100, 10, 1)
        geo = seg.geometry
        bad = {4: (b"ok\xff", b"g"), 5: ("é".encode()[:1], b"g"), 6: (b"x", b"\xc3"), 7: (b"n", b"a/b")}
        for j, (name_b, group_b) in bad.items():  # what no rank writes: garbage in the segment
            codec.write_descriptor(seg.buf, geo, 1, j - 4, name=name_b, group=group_b, window_ms=100,
                                   max_samples=10, agg_mask=1, incarnation=1)
        read = [(d.name, d.group, codec.descriptor_problem(d, geo)) for d in
                (codec.read_descriptor(seg.buf, geo, 0, j) for j in range(3))]
        assert read == [("é" * 40, "ü" * 24, None), ("😀" * 20, "训练组", None), ("b/c", "a", None)]
        problems = [codec.descriptor_problem(codec.read_descriptor(seg.buf, geo, 1, j), geo) for j in range(4)]
        assert problems[:3] == ["the name is not valid UTF-8", "the name is not valid UTF-8",
                                "the group is not valid UTF-8"]
        assert problems[3] is not None and "'/'" in problems[3]
    finally:
        seg.close()
        Segment.unlink(job)


def test_stat_refuses_the_name_the_issue_saw_vanish_before_anything_is_written() -> None:
    with pytest.raises(ConfigError, match="U\\+FFFD"):
        Stat("loss\ufffd", [Aggregation.SUM], 1.0)
    with pytest.raises(ConfigError, match="lone surrogate"):
        Stat("loss\udcff", [Aggregation.SUM], 1.0)
