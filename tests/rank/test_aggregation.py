"""Tests of shmstat.aggregation: the Aggregation enum, data-key suffixes and bit masks."""

from __future__ import annotations

import datetime as dt
import enum
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmstat import aggregation as agg_module
from shmstat.aggregation import AGG_BIT, PERCENTILES, Aggregation, aggregation_key, from_mask, to_mask
from shmstat.errors import ConfigError

ORDER = [
    Aggregation.VALUE,
    Aggregation.MEAN,
    Aggregation.COUNT,
    Aggregation.SUM,
    Aggregation.MAX,
    Aggregation.MIN,
    Aggregation.P50,
    Aggregation.P90,
    Aggregation.P99,
    Aggregation.P999,
]


class TorchLike:
    """Stands in for a torch.monitor.Aggregation member: not ours, but has a ``.name``."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_members_have_torchs_integer_values() -> None:
    assert {a.name: int(a) for a in Aggregation} == {
        "VALUE": 0,
        "MEAN": 2,
        "COUNT": 3,
        "SUM": 4,
        "MAX": 5,
        "MIN": 6,
        "P50": 10,  # ours: torch.monitor has no percentiles
        "P90": 11,
        "P99": 12,
        "P999": 13,
    }


def test_aggregation_is_an_int_enum_iterated_in_torchs_order() -> None:
    assert issubclass(Aggregation, enum.IntEnum)
    assert list(Aggregation) == ORDER
    assert Aggregation(2) is Aggregation.MEAN
    assert Aggregation["MIN"] is Aggregation.MIN


def test_each_member_has_its_own_docstring() -> None:
    assert Aggregation.VALUE.__doc__ == "VALUE returns the last value to be added."
    assert Aggregation.MEAN.__doc__ == "MEAN computes the arithmetic mean of all the added values."
    assert Aggregation.COUNT.__doc__ == "COUNT returns the total number of added values."
    assert Aggregation.SUM.__doc__ == "SUM returns the sum of the added values."
    assert Aggregation.MAX.__doc__ == "MAX returns the max of the added values."
    assert Aggregation.MIN.__doc__ == "MIN returns the min of the added values."
    assert "aggregations" in (Aggregation.__doc__ or "")


def test_members_print_like_torchs() -> None:
    assert str(Aggregation.MEAN) == "Aggregation.MEAN"
    assert f"{Aggregation.SUM}" == "Aggregation.SUM"
    assert repr(Aggregation.MAX) == "<Aggregation.MAX: 5>"


def test_members_pickle_to_themselves() -> None:
    for agg in Aggregation:
        assert pickle.loads(pickle.dumps(agg)) is agg


def test_module_level_member_aliases_like_torch_monitor() -> None:
    for agg in Aggregation:
        assert getattr(agg_module, agg.name) is agg


def test_aggregation_key_is_the_lower_case_name() -> None:
    assert [aggregation_key(a) for a in ORDER] == ["value", "mean", "count", "sum", "max", "min", "p50", "p90", "p99",
                                                   "p999"]


def test_aggregation_key_accepts_an_object_named_like_a_member() -> None:
    assert aggregation_key(TorchLike("MAX")) == "max"


def test_aggregation_key_rejects_an_unknown_name_with_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        aggregation_key(TorchLike("MEDIAN"))


@pytest.mark.parametrize("bad", [2, "mean", None, 2.0])
def test_aggregation_key_rejects_non_aggregations_with_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="not an Aggregation"):
        aggregation_key(bad)


def test_agg_bit_is_one_shifted_by_the_value() -> None:
    assert {a: AGG_BIT[a] for a in ORDER} == {a: 1 << int(a) for a in ORDER}
    assert AGG_BIT[Aggregation.VALUE] == 1
    assert AGG_BIT[Aggregation.MIN] == 64


def test_to_mask_merges_duplicates_and_empty_is_zero() -> None:
    assert to_mask([]) == 0
    assert to_mask([Aggregation.MEAN, Aggregation.MEAN]) == 1 << 2
    assert to_mask([Aggregation.MIN, Aggregation.VALUE]) == (1 << 6) | 1


def test_to_mask_accepts_any_iterable_and_torch_like_members() -> None:
    assert to_mask(iter([TorchLike("SUM"), Aggregation.COUNT])) == (1 << 4) | (1 << 3)


def test_to_mask_rejects_non_aggregations() -> None:
    with pytest.raises(TypeError):
        to_mask([Aggregation.MEAN, 4])
    with pytest.raises(TypeError):
        to_mask(Aggregation.MEAN)  # type: ignore[arg-type]  # a single member, not an iterable


def test_from_mask_returns_enum_order() -> None:
    mask = to_mask([Aggregation.MIN, Aggregation.VALUE, Aggregation.SUM, Aggregation.MEAN])
    assert from_mask(mask) == [Aggregation.VALUE, Aggregation.MEAN, Aggregation.SUM, Aggregation.MIN]
    assert from_mask(0) == []


@pytest.mark.parametrize("mask", [-1, 1 << 1, 1 << 7, 1 << 40])
def test_from_mask_rejects_bits_no_aggregation_owns(mask: int) -> None:
    with pytest.raises(ConfigError, match="mask"):
        from_mask(mask)


@pytest.mark.parametrize("mask", [1.0, "4", None, True])
def test_from_mask_rejects_non_ints(mask: Any) -> None:
    with pytest.raises(TypeError):
        from_mask(mask)


@given(st.lists(st.sampled_from(ORDER)))
def test_mask_round_trip(aggs: list[Aggregation]) -> None:
    result = from_mask(to_mask(aggs))
    assert result == [a for a in ORDER if a in aggs]
    assert to_mask(result) == to_mask(aggs)


def test_values_keys_and_masks_match_torch_monitor() -> None:
    monitor = pytest.importorskip("torch.monitor")
    torch_members = dict(monitor.Aggregation.__members__)
    ours = {a.name: int(a) for a in Aggregation if a not in PERCENTILES}  # the percentiles are ours alone
    assert {name: int(member) for name, member in torch_members.items()} == ours
    assert str(monitor.Aggregation.MEAN) == str(Aggregation.MEAN)
    assert to_mask(torch_members.values()) == to_mask(a for a in Aggregation if a not in PERCENTILES)
    for name, member in torch_members.items():
        assert aggregation_key(member) == aggregation_key(Aggregation[name]) == name.lower()


def test_data_keys_match_the_keys_torch_stat_logs() -> None:
    monitor = pytest.importorskip("torch.monitor")
    events: list[Any] = []
    handle = monitor.register_event_handler(events.append)
    try:
        torch_aggs = [
            monitor.Aggregation.MEAN,
            monitor.Aggregation.COUNT,
            monitor.Aggregation.SUM,
            monitor.Aggregation.MAX,
            monitor.Aggregation.MIN,
        ]
        stat = monitor.Stat("acc.lat", torch_aggs, dt.timedelta(hours=1))
        stat.add(1.0)
        del stat  # logs the open window
    finally:
        monitor.unregister_event_handler(handle)
    assert len(events) == 1
    assert events[0].name == "torch.monitor.Stat"
    ours = {f"acc.lat.{aggregation_key(a)}" for a in torch_aggs}
    assert set(events[0].data) == ours
