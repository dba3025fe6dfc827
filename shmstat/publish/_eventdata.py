"""What an :class:`shmstat.publish.events.Event` holds, checked and converted: its data (a fresh dict of plain values),
name and timestamp, and a naive local timestamp as Unix nanoseconds (with a per-quarter-hour offset cache).
The C publish path (``shmstat._pubfast``) does the common cases; these are the Python rules it follows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from .._backend import backend
from ..errors import ConfigError

data_value_t = str | float | int | bool
"""A value in :attr:`Event.data`: one of ``str``, ``float``, ``int``, ``bool`` (mirrors torch's type)."""

_NS_PER_S = 1_000_000_000
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

# the C twins (None on the pure-Python backend): fixed when shmstat is imported, as Event's storage is
_c_check_data: Callable[[Any], dict[str, Any] | None] | None = backend().check_data
_c_naive_ns: Callable[[datetime], int | None] | None = backend().naive_local_ns  # used by events (Event._timestamp_ns)
_c_remember_offset: Callable[[datetime, int], None] | None = backend().remember_offset


def _check_data(data: Any) -> dict[str, data_value_t]:
    """Return a fresh dict of ``data``: every key a ``str``, every value a ``str``/``float``/``int``/``bool``.

    Subclasses of those types (an ``IntEnum``, a ``str`` subclass) are converted to the base type. Raises
    :class:`TypeError` for any other key or value type and :class:`ConfigError` for an int outside int64.
    """
    if _c_check_data is not None:
        out = _c_check_data(data)  # the same check in C: a copy, or None for anything else
        if out is not None:
            return out
    elif type(data) is dict:  # the common case, checked in one pass over exact types (~3x faster)
        out = data.copy()
        for key, value in out.items():
            kind = type(value)
            if type(key) is not str or (
                kind is not float and kind is not str and kind is not bool
                and (kind is not int or not _INT64_MIN <= value <= _INT64_MAX)
            ):
                break
        else:
            return out
    return _check_data_slow(data)


def _check_data_slow(data: Any) -> dict[str, data_value_t]:
    """:func:`_check_data` for any mapping and any subclass (and the errors)."""
    if not isinstance(data, Mapping):
        raise TypeError(
            f"Event data must be a dict of str to str, float, int or bool, not {type(data).__name__}"
        )
    out: dict[str, data_value_t] = {}
    for key, value in data.items():
        if type(key) is not str:
            if not isinstance(key, str):
                raise TypeError(f"Event data key {key!r} is a {type(key).__name__}, but keys must be str")
            key = str(key)
        kind = type(value)
        if kind is float or kind is str or kind is bool:
            pass
        elif kind is int or isinstance(value, int):
            if kind is not int:
                value = int(value)
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise ConfigError(
                    f"Event data value for key {key!r} is an int outside the signed 64-bit range"
                )
        elif isinstance(value, float):
            value = float(value)
        elif isinstance(value, str):
            value = str(value)
        else:
            raise TypeError(
                f"Event data value for key {key!r} is a {kind.__name__}, "
                "but values must be str, float, int or bool"
            )
        out[key] = value
    return out


def _check_name(name: Any) -> str:
    """Return ``name`` as a plain ``str`` or raise :class:`TypeError`."""
    if type(name) is str:
        return name
    if isinstance(name, str):
        return str(name)
    raise TypeError(f"Event name must be a str, not {type(name).__name__}")


def _check_timestamp(timestamp: Any) -> datetime:
    """Return ``timestamp`` if it is a :class:`datetime.datetime`, else raise :class:`TypeError`."""
    if not isinstance(timestamp, datetime):
        raise TypeError(f"Event timestamp must be a datetime.datetime, not {type(timestamp).__name__}")
    return timestamp


_EPOCH_NAIVE = datetime(1970, 1, 1)
_offsets: dict[tuple[int, int], int] = {}  # (local quarter-hour, fold) -> its UTC offset in seconds


def _naive_local_ns(ts: datetime) -> int:
    """``ts`` (naive: local time) as Unix ns, exactly as ``ts.timestamp()`` reads it, to the microsecond.

    ``timestamp()`` asks the C library for the local offset on every call (~1 us); the offset is looked up once
    per local quarter of an hour instead (zones change their offset on a quarter hour; ``fold`` tells a
    repeated interval apart).
    """
    d = ts - _EPOCH_NAIVE
    local_s = d.days * 86_400 + d.seconds
    key = (local_s // 900, ts.fold)
    offset = _offsets.get(key)
    if offset is None:
        start = ts - timedelta(seconds=local_s % 900, microseconds=d.microseconds)
        offset = local_s - local_s % 900 - int(start.replace(fold=ts.fold).timestamp())
        if len(_offsets) > 4096:  # events from all over history: bounded
            _offsets.clear()
        _offsets[key] = offset
        if _c_remember_offset is not None and -(1 << 31) < offset < 1 << 31:
            _c_remember_offset(ts, offset)
    return ((local_s - offset) * 1_000_000 + d.microseconds) * 1000


def _datetime_from_ns(ts_ns: int) -> datetime:
    """The naive local-time datetime of a Unix time in nanoseconds (truncated to microseconds)."""
    seconds, rest = divmod(ts_ns, _NS_PER_S)
    return datetime.fromtimestamp(seconds).replace(microsecond=rest // 1000)
