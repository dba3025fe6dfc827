"""elastic.metrics: torchelastic's metrics API, its reference behaviour, and routing to the collector."""

from __future__ import annotations

import copy
import decimal
import logging
import pickle
import re
import time
import warnings
from typing import Any

import pytest

import elastic
import elastic.metrics as metrics
from elastic.metrics import _registry, api
from shmstat.job._state import STATE
from shmstat.testing import ShmstatJob

PUBLIC = [
    "CollectorMetricHandler",
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "MetricsConfig",
    "NullMetricHandler",
    "StatMetricData",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]
JOB_VARS = ("SHMSTAT_JOB", "TORCHELASTIC_RUN_ID", "SHMSTAT_RANK", "RANK", "SHMSTAT_LOCAL_RANK", "LOCAL_RANK")


class Recorder(metrics.MetricHandler):
    """Keeps every MetricData it is given."""

    def __init__(self) -> None:
        self.data: list[metrics.MetricData] = []

    def emit(self, metric_data: metrics.MetricData) -> None:
        self.data.append(metric_data)

    def triples(self) -> list[tuple[Any, Any, Any]]:
        return [(d.group_name, d.name, d.value) for d in self.data]


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here inherits a job from the environment it runs in."""
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------------------------ a real collector socket


@pytest.fixture
def attached(shmstat_job: ShmstatJob) -> ShmstatJob:
    """This process attached as rank 0 of a fresh job with a real collector (the shmstat.testing plugin)."""
    shmstat_job.attach_here()
    return shmstat_job


def _topics(job: ShmstatJob) -> list[str]:
    """The topics of the metrics the collector relayed, in arrival order."""
    return [f"metric/{m.group}/{m.name}" for m in job.metrics()]


def _values(job: ShmstatJob, group: str, name: str) -> list[object]:
    return [m.value for m in job.metrics(name, group=group)]


def marker(name: str = "end") -> None:
    """Publish a marker metric directly; items leave in publish order, so it arrives after anything before it."""
    assert STATE.publisher is not None
    STATE.publisher.publish_metric("marker", name, 1, time.time())


# ------------------------------------------------------------------------------------ names and records


def test_all_is_exactly_the_public_names() -> None:
    assert sorted(metrics.__all__) == sorted(PUBLIC)
    assert len(metrics.__all__) == len(set(metrics.__all__))
    for name in metrics.__all__:
        assert getattr(metrics, name) is getattr(api, name)
    assert elastic.__all__ == ["events", "metrics"]
    assert elastic.metrics is metrics


def test_metric_stream_lives_in_api_as_in_torchelastic() -> None:
    assert "MetricStream" in api.__all__
    assert not hasattr(metrics, "MetricStream")


def test_metric_data_is_torchelastics_namedtuple() -> None:
    md = metrics.MetricData(1.5, "g", "n", 3)
    assert metrics.MetricData._fields == ("timestamp", "group_name", "name", "value")
    assert metrics.MetricData.__name__ == "MetricData"
    assert tuple(md) == (1.5, "g", "n", 3)
    assert (md.timestamp, md.group_name, md.name, md.value) == (1.5, "g", "n", 3)


def test_stat_metric_data_is_a_metric_data_with_extras() -> None:
    row = metrics.StatMetricData(10.0, "g", "lat.mean", 2.5, rank=3, window_start=9.0, window_end=10.0)
    assert isinstance(row, metrics.MetricData)
    assert isinstance(row, tuple)
    ts, group, name, value = row
    assert (ts, group, name, value) == (10.0, "g", "lat.mean", 2.5)
    assert len(row) == 4
    assert (row.rank, row.window_start, row.window_end, row.torn) == (3, 9.0, 10.0, False)
    merged = metrics.StatMetricData(10.0, "g", "lat.mean", 2.5, rank=None, window_start=9.0, window_end=10.0, torn=True)
    assert merged.rank is None and merged.torn is True
    assert row._asdict() == {
        "timestamp": 10.0,
        "group_name": "g",
        "name": "lat.mean",
        "value": 2.5,
        "rank": 3,
        "window_start": 9.0,
        "window_end": 10.0,
        "torn": False,
        "job": None,
    }
    assert metrics.StatMetricData(1.0, "g", "n", 1, rank=0, window_start=0.0, window_end=1.0, job="j").job == "j"
    assert "rank=3" in repr(row) and repr(row).startswith("StatMetricData(timestamp=10.0")


def test_stat_metric_data_extras_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        metrics.StatMetricData(1.0, "g", "n", 1, 0, 0.0, 1.0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        metrics.StatMetricData(1.0, "g", "n", 1)  # type: ignore[call-arg]


def test_stat_metric_data_replace_make_pickle_copy_and_equality() -> None:
    row = metrics.StatMetricData(10.0, "g", "n", 1, rank=0, window_start=9.0, window_end=10.0)
    other = row._replace(rank=1, value=2)
    assert (other.rank, other.value, other.name) == (1, 2, "n") and row.rank == 0
    with pytest.raises(ValueError):
        row._replace(nope=1)
    made = metrics.StatMetricData._make([1.0, "g", "n", 5], rank=None, window_start=0.0, window_end=1.0)
    assert made.value == 5 and made.rank is None
    for clone in (pickle.loads(pickle.dumps(row)), copy.copy(row), copy.deepcopy(row)):
        assert clone == row and clone.rank == 0 and type(clone) is metrics.StatMetricData
    assert row != row._replace(rank=1)  # extras count between two rows
    assert row == metrics.MetricData(10.0, "g", "n", 1)  # only the tuple counts against a plain MetricData
    assert hash(row) == hash(metrics.MetricData(10.0, "g", "n", 1))
    assert row != "not a tuple"


def test_metrics_config_and_elapsed_time() -> None:
    assert metrics.MetricsConfig().params == {}
    assert metrics.MetricsConfig({"a": "b"}).params == {"a": "b"}
    assert metrics.initialize_metrics() is None
    assert metrics.initialize_metrics(metrics.MetricsConfig()) is None
    elapsed = metrics.get_elapsed_time_ms(time.time() - 2.0)
    assert isinstance(elapsed, int) and 2000 <= elapsed < 60_000


def test_metric_handler_is_abstract() -> None:
    with pytest.raises(TypeError):
        metrics.MetricHandler()  # type: ignore[abstract]


# ------------------------------------------------------------------------------------ handlers and configure


def test_console_handler_prints_torchelastics_format(capsys: pytest.CaptureFixture[str]) -> None:
    metrics.ConsoleMetricHandler().emit(metrics.MetricData(1574213883.4182858, "my_app", "my_metric", 7))
    assert capsys.readouterr().out == "[1574213883.4182858][my_app]: my_metric=7\n"
    metrics.configure(metrics.ConsoleMetricHandler(), "my_app")
    before = time.time()
    metrics.put_metric("calculate_latency", 12, "my_app")
    line = capsys.readouterr().out
    found = re.fullmatch(r"\[(\d+\.\d+)\]\[my_app\]: calculate_latency=12\n", line)
    assert found, line
    assert before <= float(found.group(1)) <= time.time()


def test_default_is_null_when_not_attached(capsys: pytest.CaptureFixture[str]) -> None:
    stream = metrics.getStream("anything")
    assert isinstance(stream.handler, metrics.NullMetricHandler)
    metrics.put_metric("x", 1)
    metrics.put_metric("x", 1, "g")
    stream.add_value("y", 2)
    assert capsys.readouterr() == ("", "")
    assert STATE.publisher is None and STATE.auto_init_done


def test_null_handler_discards() -> None:
    assert metrics.NullMetricHandler().emit(metrics.MetricData(0.0, "g", "n", 1)) is None


def test_configure_group_and_default() -> None:
    default, mine = Recorder(), Recorder()
    metrics.configure(default)  # group None: replaces the default
    metrics.configure(mine, "mine")
    metrics.put_metric("a", 1, "mine")
    metrics.put_metric("b", 2, "other")
    metrics.put_metric("c", 3)
    assert mine.triples() == [("mine", "a", 1)]
    assert default.triples() == [("other", "b", 2), ("torchelastic", "c", 3)]
    assert all(isinstance(d.timestamp, float) for d in default.data)


def test_put_metric_looks_the_handler_up_on_every_call() -> None:
    first, second = Recorder(), Recorder()
    metrics.configure(first, "g")
    metrics.put_metric("n", 1, "g")
    metrics.configure(second, "g")
    metrics.put_metric("n", 2, "g")
    assert first.triples() == [("g", "n", 1)] and second.triples() == [("g", "n", 2)]


def test_get_stream_binds_the_handler_at_call_time() -> None:
    first, second = Recorder(), Recorder()
    metrics.configure(first, "g")
    stream = metrics.getStream("g")
    metrics.configure(second, "g")
    stream.add_value("n", 1)
    metrics.getStream("g").add_value("n", 2)
    assert first.triples() == [("g", "n", 1)]
    assert second.triples() == [("g", "n", 2)]
    assert stream.group_name == "g" and stream.handler is first


def test_get_stream_binds_the_default_at_call_time() -> None:
    default = Recorder()
    stream = metrics.getStream("g")
    metrics.configure(default)
    stream.add_value("n", 1)  # bound to the built-in null default
    metrics.getStream("g").add_value("n", 2)
    assert default.triples() == [("g", "n", 2)]


def test_configure_refuses_a_non_handler() -> None:
    with pytest.raises(TypeError):
        metrics.configure(object(), "g")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        metrics.configure(None)  # type: ignore[arg-type]


def test_duck_typed_handler_is_accepted() -> None:
    class Duck:
        def __init__(self) -> None:
            self.got: list[Any] = []

        def emit(self, metric_data: Any) -> None:
            self.got.append(metric_data)

    duck = Duck()
    metrics.configure(duck, "g")  # type: ignore[arg-type]
    metrics.put_metric("n", 1, "g")
    assert [d.name for d in duck.got] == ["n"]


def test_reset_forgets_configuration() -> None:
    metrics.configure(Recorder(), "g")
    metrics.configure(Recorder())
    _registry.reset()
    assert type(metrics.getStream("g").handler) is not Recorder


# ------------------------------------------------------------------------------------ prof


def plain() -> int:
    return 42


def failing() -> None:
    raise RuntimeError("boom")


class Worker:
    def step(self, x: int) -> int:
        return x * 2


def test_prof_names_a_module_function_by_leaf_module() -> None:
    rec = Recorder()
    metrics.configure(rec, "g")
    wrapped = metrics.prof(plain, group="g")
    assert wrapped() == 42
    names = [d.name for d in rec.data]
    assert names == ["test_elastic_metrics.plain.success", "test_elastic_metrics.plain.duration.ms"]
    assert rec.data[0].value == 1
    assert isinstance(rec.data[1].value, int) and rec.data[1].value >= 0
    assert wrapped.__name__ == "plain" and wrapped.__wrapped__ is plain  # type: ignore[attr-defined]


def test_prof_names_a_method_by_qualname_and_passes_arguments() -> None:
    rec = Recorder()
    metrics.configure(rec, "agent")

    class Local:
        @metrics.prof(group="agent")
        def run(self, x: int, *, y: int = 0) -> int:
            return x + y

    assert metrics.prof(Worker.step, group="agent")(Worker(), 3) == 6
    assert Local().run(1, y=2) == 3
    assert [d.name for d in rec.data] == [
        "Worker.step.success",
        "Worker.step.duration.ms",
        "test_prof_names_a_method_by_qualname_and_passes_arguments.<locals>.Local.run.success",
        "test_prof_names_a_method_by_qualname_and_passes_arguments.<locals>.Local.run.duration.ms",
    ]


def test_prof_without_arguments_uses_group_torchelastic() -> None:
    rec = Recorder()
    metrics.configure(rec, "torchelastic")
    assert metrics.prof(plain)() == 42
    assert [(d.group_name, d.name) for d in rec.data] == [
        ("torchelastic", "test_elastic_metrics.plain.success"),
        ("torchelastic", "test_elastic_metrics.plain.duration.ms"),
    ]


def test_prof_records_failure_and_duration_then_reraises() -> None:
    rec = Recorder()
    metrics.configure(rec, "g")
    with pytest.raises(RuntimeError, match="boom"):
        metrics.prof(failing, group="g")()
    assert [d.name for d in rec.data] == [
        "test_elastic_metrics.failing.failure",
        "test_elastic_metrics.failing.duration.ms",
    ]
    assert rec.data[0].value == 1


def test_prof_base_exception_records_only_duration() -> None:
    class Stop(BaseException):
        pass

    def stops() -> None:
        raise Stop

    rec = Recorder()
    metrics.configure(rec, "g")
    with pytest.raises(Stop):
        metrics.prof(stops, group="g")()
    assert [d.name for d in rec.data] == ["test_prof_base_exception_records_only_duration.<locals>.stops.duration.ms"]


def test_prof_duration_is_whole_milliseconds() -> None:
    rec = Recorder()
    metrics.configure(rec, "g")

    @metrics.prof(group="g")
    def slow() -> None:
        time.sleep(0.03)  # the duration being measured, not a wait for something

    slow()
    duration = rec.data[-1]
    assert duration.name.endswith("slow.duration.ms")
    assert isinstance(duration.value, int) and 29 <= duration.value < 10_000


def test_prof_looks_the_handler_up_at_call_time() -> None:
    wrapped = metrics.prof(plain, group="late")
    rec = Recorder()
    metrics.configure(rec, "late")
    wrapped()
    assert len(rec.data) == 2


# ------------------------------------------------------------------------------------ deprecated names


def test_profile_warns_and_uses_the_bare_name() -> None:
    rec = Recorder()
    metrics.configure(rec, "old")
    with pytest.warns(FutureWarning, match="prof"):
        deco = metrics.profile("old")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calling the decorated function warns no more
        assert deco(plain)() == 42
    assert [d.name for d in rec.data] == ["plain.success", "plain.duration.ms"]
    assert hasattr(metrics.profile, "__deprecated__")


def test_publish_metric_warns_and_publishes() -> None:
    rec = Recorder()
    metrics.configure(rec, "old")
    with pytest.warns(FutureWarning, match="put_metric"):
        metrics.publish_metric("old", "n", 5)
    assert rec.triples() == [("old", "n", 5)]


# ------------------------------------------------------------------------------------ routing to the collector


def test_put_metric_goes_to_the_collector_when_attached(attached: ShmstatJob) -> None:
    before = time.time()
    metrics.put_metric("x", 3, "trainer")
    (m,) = attached.wait_for_metric("x", group="trainer")
    assert (m.group, m.name, m.value, m.rank) == ("trainer", "x", 3, 0)
    assert before <= m.timestamp <= time.time()


def test_stream_prof_and_deprecated_names_route_too(attached: ShmstatJob) -> None:
    metrics.getStream("s").add_value("v", 1.5)
    metrics.prof(plain, group="p")()
    with pytest.warns(FutureWarning):
        metrics.publish_metric("d", "n", True)
    metrics.put_metric("default", 1)
    attached.wait_for_metric("default", group="torchelastic")
    assert _values(attached, "s", "v") == [1.5]
    assert _values(attached, "p", "test_elastic_metrics.plain.success") == [1]
    assert len(_values(attached, "p", "test_elastic_metrics.plain.duration.ms")) == 1
    assert _values(attached, "d", "n")[0] is True


def test_in_process_configure_wins_over_routing(attached: ShmstatJob) -> None:
    mine = Recorder()
    metrics.configure(mine, "trainer")
    metrics.put_metric("x", 1, "trainer")
    metrics.put_metric("y", 2, "routed")
    marker()
    attached.wait_for_metric("end", group="marker")
    assert mine.triples() == [("trainer", "x", 1)]
    assert _topics(attached) == ["metric/routed/y", "metric/marker/end"]


def test_configured_default_wins_for_every_group(attached: ShmstatJob) -> None:
    default = Recorder()
    metrics.configure(default)
    metrics.put_metric("x", 1, "a")
    metrics.prof(plain, group="b")()
    marker()
    attached.wait_for_metric("end", group="marker")
    assert _topics(attached) == ["metric/marker/end"]
    assert [n for _, n, _ in default.triples()] == [
        "x",
        "test_elastic_metrics.plain.success",
        "test_elastic_metrics.plain.duration.ms",
    ]


def test_configuring_the_builtin_default_back_restores_routing(attached: ShmstatJob) -> None:
    builtin = metrics.getStream("g").handler
    metrics.configure(Recorder(), "g")
    metrics.configure(builtin, "g")
    metrics.configure(Recorder())
    metrics.configure(builtin)
    metrics.put_metric("x", 1, "g")
    attached.wait_for_metric("x", group="g")


def test_values_the_wire_cannot_carry_are_converted_or_dropped(
    attached: ShmstatJob, caplog: pytest.LogCaptureFixture
) -> None:
    class Index:
        def __index__(self) -> int:
            return 7

    metrics.put_metric("dec", decimal.Decimal("1.5"), "c")
    metrics.put_metric("idx", Index(), "c")  # type: ignore[arg-type]
    metrics.put_metric("big", 1 << 70, "c")
    with caplog.at_level(logging.WARNING, logger="shmstat.elastic.metrics"):
        metrics.put_metric("text", "3", "c")  # type: ignore[arg-type]
        metrics.put_metric("none", None, "c")  # type: ignore[arg-type]
    metrics.put_metric(7, 1, None)  # type: ignore[arg-type]
    marker()
    attached.wait_for_metric("end", group="marker")
    assert _values(attached, "c", "dec") == [1.5]
    assert _values(attached, "c", "idx") == [7]
    assert _values(attached, "c", "big") == [float(1 << 70)]
    assert _values(attached, "None", "7") == [1]
    assert not _values(attached, "c", "text") and not _values(attached, "c", "none")
    assert _registry.REGISTRY.dropped == 2
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1


def test_attaches_lazily_from_the_environment(shmstat_job: ShmstatJob, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in shmstat_job.rank_env(1, 2).items():
        if name.startswith("SHMSTAT_"):
            monkeypatch.setenv(name, value)
    assert STATE.publisher is None and not STATE.auto_init_done  # nothing happened at import
    metrics.put_metric("lazy", 1, "env")
    assert STATE.publisher is not None
    (m,) = shmstat_job.wait_for_metric("lazy", group="env")
    assert m.rank == 1


def test_a_bad_environment_is_logged_once_and_metrics_stay_local(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SHMSTAT_JOB", "not a valid job!")
    with caplog.at_level(logging.ERROR, logger="shmstat.elastic"):
        metrics.put_metric("x", 1)
        metrics.put_metric("x", 2)
        metrics.getStream("g").add_value("y", 1)
    assert STATE.publisher is None
    assert _registry.REGISTRY.routing_disabled
    assert len([r for r in caplog.records if "cannot attach" in r.getMessage()]) == 1


# ------------------------------------------------------------------------------------ against torch itself


@pytest.mark.torch
def test_same_output_and_names_as_torchelastic(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch_metrics = pytest.importorskip("torch.distributed.elastic.metrics")
    torch_api = pytest.importorskip("torch.distributed.elastic.metrics.api")

    torch_public = {n for n in dir(torch_metrics) if not n.startswith("_")} - {"api", "Optional", "static_init"}
    assert set(metrics.__all__) == torch_public | {"StatMetricData", "CollectorMetricHandler"}
    assert metrics.MetricData._fields == torch_metrics.MetricData._fields

    class TorchRecorder(torch_metrics.MetricHandler):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.data: list[Any] = []

        def emit(self, metric_data: Any) -> None:
            self.data.append(metric_data)

    theirs, ours = TorchRecorder(), Recorder()
    monkeypatch.setattr(torch_api, "_metrics_map", {"cmp": theirs})
    monkeypatch.setattr(torch_api, "_default_metrics_handler", theirs)
    metrics.configure(ours, "cmp")
    metrics.configure(ours)

    def run(lib: Any) -> None:
        lib.put_metric("n", 1, "cmp")
        lib.put_metric("dflt", 2.5)
        lib.getStream("cmp").add_value("s", True)
        lib.prof(plain, group="cmp")()
        lib.prof(Worker.step, group="cmp")(Worker(), 2)
        with pytest.raises(RuntimeError):
            lib.prof(failing)()

    run(torch_metrics)
    run(metrics)

    def shape(rows: list[Any]) -> list[tuple[Any, Any, Any]]:
        # durations differ run to run: keep their names, not their values
        return [(g, n, v if not n.endswith(".duration.ms") else "ms") for _, g, n, v in rows]

    assert shape(ours.data) == shape(theirs.data)
    assert [type(d.value) for d in ours.data] == [type(d.value) for d in theirs.data]

    md = (1574213883.4182858, "my_app", "my_metric", 3)
    torch_metrics.ConsoleMetricHandler().emit(torch_metrics.MetricData(*md))
    metrics.ConsoleMetricHandler().emit(metrics.MetricData(*md))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == lines[1] == "[1574213883.4182858][my_app]: my_metric=3"


_PUT_CASES = r"""
import json, sys
from elastic.metrics import api, NullMetricHandler, configure, MetricHandler
from shmstat import wire
from shmstat.job import _state
from shmstat.publish.publisher import Publisher

out = []
api.put_metric("m", 1, "g")  # not attached (no job in the environment): dropped
_state.STATE.publisher = pub = Publisher("ipc:///nonexistent/shmstat-put.ipc", rank=0)  # never collected: kept here

class Big(int): pass
class Num:
    def __index__(self): return 7
seen = []
class Keep(MetricHandler):
    def emit(self, m): seen.append([m.group_name, m.name, m.value])
calls = [(("m", 1, "g"), {}), (("m", 2.5, "g"), {}), (("m", True, "g"), {}), (("m", 1 << 70, "g"), {}),
         (("m", Big(3), "g"), {}), (("m", Num(), "g"), {}), (("m", "text", "g"), {}), (("n", 1), {}),
         (("m", 4), {"metric_group": "g"}), ((), {"metric_name": "m", "metric_value": 5}),
         (("bad\nname", 1, "g"), {}), (("m", 1, "bad/group"), {}), ((3, 1, "g"), {}), (("m",), {}),
         (("m", 1, "g", 4), {})]
for args, kwargs in calls:
    try:
        api.put_metric(*args, **kwargs)
        out.append("ok")
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
configure(Keep(), "kept")
api.put_metric("m", 6, "kept")
configure(Keep())
api.put_metric("m", 7, "g")
configure(api._BUILTIN_DEFAULT)
original = api.getStream
api.getStream = lambda group: original("kept")
api.put_metric("m", 8, "g")
api.getStream = original
api.put_metric("m", 9, "g")
items = []
while (frames := pub.outbox.head(wire.MAX_TOPIC)) is not None:
    items += [[it[0], it[1], it[2]] for it in wire.decode(*frames).items]
    pub.outbox.pop()
print(json.dumps({"out": out, "seen": seen, "items": items, "builtin": type(api.put_metric).__name__}))
"""


def test_the_c_and_python_put_metric_agree():
    """put_metric's common case runs in C on the C backend (everything else goes on to the Python function): the
    same calls publish the same items, reach the same handlers and raise the same errors on both backends."""
    import json
    import os
    import subprocess
    import sys

    from kit.procs import REPO

    from shmstat import _backend

    if not _backend.c_available():
        pytest.skip("the C extensions are not built")
    got = {}
    for pure in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
        r = subprocess.run([sys.executable, "-c", _PUT_CASES], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env=dict(env, PYTHONPATH=REPO, **{_backend.VARIABLE: pure}))
        assert r.returncode == 0, r.stderr
        got[pure] = json.loads(r.stdout)
    c, py = got["0"], got["1"]
    assert (c["builtin"], py["builtin"]) == ("builtin_function_or_method", "function")
    assert c["out"] == py["out"] and c["seen"] == py["seen"] and c["items"] == py["items"]
    assert c["out"][:10] == ["ok"] * 10 and c["out"][10][0] == c["out"][11][0] == "ConfigError"
    assert c["out"][12:] == ["ok", ["TypeError", c["out"][13][1]], ["TypeError", c["out"][14][1]]]
    assert c["seen"] == [["kept", "m", 6], ["g", "m", 7], ["kept", "m", 8]]
    # items of one topic travel together (batched per topic), in order
    assert c["items"] == [["g", "m", 1], ["g", "m", 2.5], ["g", "m", True], ["g", "m", float(1 << 70)],
                          ["g", "m", 3], ["g", "m", 7], ["g", "m", 4], ["g", "m", 9], ["torchelastic", "n", 1],
                          ["torchelastic", "m", 5], ["g", "3", 1]]
