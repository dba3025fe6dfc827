"""The shapes of the items a wire message carries (see :mod:`shmstat.wire`, which defines the format): the
lenient check of the encode side, the quick exact-type check of the common case, and the strict checks of the
decode side, which raise :class:`~shmstat.errors.WireError` with a one-sentence reason."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final, NoReturn

from ..errors import WireError

__all__ = [
    "check_event_items",
    "check_map_items",
    "check_metric_items",
    "encode_item_reason",
    "fast_ok",
    "hist_problem",
    "is_int",
]

_DATA_TYPES: Final = frozenset((str, int, float, bool))
_MAP_TYPES: Final = frozenset((str, int, float, bool, type(None)))
_STR_ONLY: Final = frozenset((str,))


def _fail(reason: str) -> NoReturn:
    raise WireError(reason)


def is_int(x: object) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def encode_item_reason(kind: str, item: Any) -> str | None:
    """The reason ``item`` cannot be sent as part of a ``kind`` message, or None (encode side, lenient on
    subclasses, which msgpack writes as their base type)."""
    if kind == "event":
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            return "an event item is not a [name, ts_ns, data] sequence"
        name, ts_ns, data = item
        if not isinstance(name, str):
            return "an event name is not a str"
        if not is_int(ts_ns):
            return "an event ts_ns is not an int"
        if not isinstance(data, dict):
            return "an event data is not a dict"
        for key, value in data.items():
            if not isinstance(key, str):
                return "an event data key is not a str"
            if not isinstance(value, (str, int, float)):
                return f"event data value for {key!r} is a {type(value).__name__}, not str/int/float/bool"
        return None
    if kind == "metric":
        if not isinstance(item, (list, tuple)) or len(item) != 4:
            return "a metric item is not a [group, name, value, ts] sequence"
        group, name, value, ts = item
        if not isinstance(group, str) or not isinstance(name, str):
            return "a metric group or name is not a str"
        if "/" in group:
            return "a metric group holds '/' (the topic's separator, kept out of groups by shmstat.names)"
        if not isinstance(value, (int, float)):
            return f"a metric value is a {type(value).__name__}, not int/float"
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            return "a metric ts is not a float"
        return None
    if not isinstance(item, dict):
        return f"a {kind} item is not a dict"
    for key, value in item.items():
        if not isinstance(key, str):
            return f"a {kind} item key is not a str"
        if kind == "stat" and key == "hist":
            problem = hist_problem(value)
            if problem is not None:
                return problem
            continue
        if value is not None and not isinstance(value, (str, int, float)):
            return f"{kind} item value for {key!r} is a {type(value).__name__}, not a scalar or None"
    return None


def fast_ok(kind: str, items: Sequence[Any]) -> bool:
    """True if every item has exactly the built-in types of its kind (the common case, checked quickly)."""
    data_types = _DATA_TYPES
    if kind == "event":
        for item in items:
            if type(item) not in (list, tuple) or len(item) != 3:
                return False
            name, ts_ns, data = item
            if type(name) is not str or type(ts_ns) is not int or type(data) is not dict:
                return False
            for key, value in data.items():
                if type(key) is not str or type(value) not in data_types:
                    return False
        return True
    if kind == "metric":
        for item in items:
            if type(item) not in (list, tuple) or len(item) != 4:
                return False
            group, name, value, ts = item
            if (
                type(group) is not str
                or type(name) is not str
                or "/" in group
                or type(value) not in data_types
                or type(value) is str
                or (type(ts) is not float and type(ts) is not int)
            ):
                return False
        return True
    return False


def check_event_items(items: list[Any], name_expected: str) -> None:
    """Raise WireError unless every item is exactly ``[name_expected, ts_ns: int, {str: scalar}]``."""
    data_types = _DATA_TYPES
    for item in items:
        if type(item) is not list or len(item) != 3:
            _fail("an event item is not a [name, ts_ns, data] array")
        name, ts_ns, data = item
        if name != name_expected:  # only a str equals a str: this also checks the type
            _fail("an event item's name does not match its topic")
        if type(ts_ns) is not int:
            _fail("an event item's ts_ns is not an int")
        if type(data) is not dict:
            _fail("an event item's data is not a map")
        for value in data.values():
            if type(value) not in data_types:
                _fail("an event item's data has a value that is not a str, int, float or bool")
        for key in data:
            if type(key) is not str:
                _fail("an event item's data has a key that is not a str")


def check_metric_items(items: list[Any], rest: str) -> None:
    """Raise WireError unless every item is exactly ``[group, name, value, ts]`` with ``group/name == rest`` and no
    ``/`` in ``group`` (so a topic names one group and one name)."""
    for item in items:
        if type(item) is not list or len(item) != 4:
            _fail("a metric item is not a [group, name, value, ts] array")
        group, name, value, ts = item
        if type(group) is not str or type(name) is not str:
            _fail("a metric item's group or name is not a str")
        if "/" in group:
            _fail("a metric item's group holds '/'")
        if rest != f"{group}/{name}":
            _fail("a metric item's group and name do not match its topic")
        tv = type(value)
        if tv is not int and tv is not float and tv is not bool:
            _fail("a metric item's value is not an int, float or bool")
        tt = type(ts)
        if tt is not float and tt is not int:
            _fail("a metric item's ts is not a float")


def check_map_items(items: list[Any], kind: str) -> None:
    """Raise WireError unless every item is a map of str to scalars or nil (a stat's ``hist`` map checked)."""
    str_only = _STR_ONLY
    map_types = _MAP_TYPES
    for item in items:
        if type(item) is not dict:
            _fail(f"a {kind} item is not a map")
        if not str_only.issuperset(map(type, item)):
            _fail(f"a {kind} item has a key that is not a str")
        values: Iterable[Any] = item.values()
        if kind == "stat" and "hist" in item:
            problem = hist_problem(item["hist"])
            if problem is not None:
                _fail(problem)
            values = [v for k, v in item.items() if k != "hist"]
        if not map_types.issuperset(map(type, values)):
            _fail(f"a {kind} item has a value that is not a str, int, float, bool or nil")


_HIST_KEYS = frozenset(("scale", "zero", "pos", "neg"))
_HIST_INF_KEYS = frozenset(("pos_inf", "neg_inf"))  # present only when not 0


def hist_problem(value: Any) -> str | None:
    """Why ``value`` is not a stat item's ``hist`` map (see the module docstring), or None."""
    if type(value) is not dict or not _HIST_KEYS <= value.keys() <= _HIST_KEYS | _HIST_INF_KEYS:
        return "a stat item's hist is not a map of scale, zero, pos and neg (and pos_inf, neg_inf)"
    if not is_int(value["scale"]) or not is_int(value["zero"]) or value["zero"] < 0:
        return "a stat item's hist scale or zero count is not an int"
    if not all(is_int(value[k]) and value[k] >= 0 for k in _HIST_INF_KEYS & value.keys()):
        return "a stat item's hist pos_inf or neg_inf count is not a non-negative int"
    for sign in ("pos", "neg"):
        part = value[sign]
        if (type(part) not in (list, tuple) or len(part) != 2 or not is_int(part[0])
                or type(part[1]) not in (list, tuple)):
            return f"a stat item's hist {sign} is not [offset, [counts]]"
        if not all(is_int(c) and c >= 0 for c in part[1]):
            return f"a stat item's hist {sign} counts are not non-negative ints"
    return None
