"""Drop-in down to torchelastic's test hooks: code (and tests) that replace ``metrics.api.getStream`` see every
``put_metric`` and ``@prof`` data point, as with torchelastic; ``metrics.api._get_metric_name`` names functions
as torchelastic does."""

from __future__ import annotations

from unittest import mock

import pytest

import elastic.metrics as metrics
from elastic.metrics import api
from elastic.metrics.api import MetricStream, _get_metric_name


class Recorder(metrics.MetricHandler):
    def __init__(self) -> None:
        self.got: dict[str, list] = {}

    def emit(self, metric_data) -> None:
        self.got.setdefault(metric_data.name, []).append(metric_data)


class Parent:
    @metrics.prof(group="test")
    def func(self, fail: bool = False) -> int:
        if fail:
            raise ValueError("boom")
        return 7


@metrics.prof
def module_func() -> int:
    return 1


def test_a_replaced_getstream_sees_put_metric_and_prof():
    handler = Recorder()
    stream = MetricStream("test", handler)
    with mock.patch("elastic.metrics.api.getStream", return_value=stream) as patched:
        metrics.put_metric("loss", 3, "anything")
        assert Parent().func() == 7
        with pytest.raises(ValueError):
            Parent().func(fail=True)
    assert patched.call_count == 1 + 2 + 2  # put_metric, success + duration, failure + duration
    assert [m.value for m in handler.got["loss"]] == [3]
    assert [m.value for m in handler.got["Parent.func.success"]] == [1]
    assert [m.value for m in handler.got["Parent.func.failure"]] == [1]
    assert len(handler.got["Parent.func.duration.ms"]) == 2
    assert all(m.group_name == "test" for ms in handler.got.values() for m in ms)  # the stream's group


def test_after_the_patch_the_fast_path_is_back():
    handler = Recorder()
    metrics.configure(handler, "g")
    with mock.patch("elastic.metrics.api.getStream", return_value=MetricStream("other", Recorder())):
        pass
    assert api.getStream is api._GET_STREAM
    metrics.put_metric("m", 1, "g")
    assert [m.value for m in handler.got["m"]] == [1]


def test_get_metric_name_as_torchelastic():
    assert _get_metric_name(Parent.func.__wrapped__) == "Parent.func"
    assert _get_metric_name(module_func.__wrapped__) == "test_elastic_test_hooks.module_func"

    def nested() -> None:
        pass

    assert _get_metric_name(nested) == "test_get_metric_name_as_torchelastic.<locals>.nested"


@pytest.mark.torch
def test_get_metric_name_matches_torch():
    torch_api = pytest.importorskip("torch.distributed.elastic.metrics.api")

    def nested() -> None:
        pass

    for fn in (Parent.func.__wrapped__, module_func.__wrapped__, nested, len):
        assert _get_metric_name(fn) == torch_api._get_metric_name(fn)


def test_the_semi_public_handler_map_and_default_behave_as_torchelastics():
    rec, default = Recorder(), Recorder()
    api._metrics_map["direct"] = rec  # torchelastic code may fill its map directly
    metrics.put_metric("m", 3, "direct")
    assert [d.value for d in rec.got["m"]] == [3]
    assert api._default_metrics_handler is not default
    metrics.configure(default)
    assert api._default_metrics_handler is default
    metrics.put_metric("n", 4, "unconfigured")
    assert [d.value for d in default.got["n"]] == [4]
    with pytest.raises(AttributeError):
        api.no_such_name  # noqa: B018
