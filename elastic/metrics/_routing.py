"""Handing metrics to the rank's publisher in a shape the wire carries (used by the built-in default handler).

The wire takes a metric as ``[group: str, name: str, value: int | float | bool, ts: float]`` with ints in
64 bits (see :mod:`shmstat.wire`). Values of other numeric types are converted here; a value that is not a
number at all is dropped, counted in ``REGISTRY.dropped`` and logged once.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

from ._registry import REGISTRY

__all__ = ["INT_MIN", "UINT_MAX", "coerce", "publish"]

_log = logging.getLogger("shmstat.elastic.metrics")

INT_MIN = -(1 << 63)
"""The smallest int the wire carries."""
UINT_MAX = (1 << 64) - 1
"""The largest int the wire carries."""


def publish(pub: Any, group: Any, name: Any, value: Any, ts: float) -> None:
    """Hand one metric to the publisher, converting what the wire cannot carry (see :func:`coerce`)."""
    kind = type(value)
    if not (
        (kind is float or kind is bool or (kind is int and INT_MIN <= value <= UINT_MAX))
        and type(group) is str
        and type(name) is str
    ):
        number = coerce(value)
        if number is None:
            REGISTRY.dropped += 1
            if REGISTRY.dropped == 1:
                _log.warning(
                    "metric %s/%s has a value the collector cannot take (a %s); dropped (further ones are "
                    "counted in elastic.metrics._registry.REGISTRY.dropped)",
                    group,
                    name,
                    type(value).__name__,
                )
            return
        group, name, value = str(group), str(name), number
    pub.publish_metric(group, name, value, ts)


def coerce(value: Any) -> int | float | bool | None:
    """``value`` as an int, float or bool the wire carries; None when it is not a number at all.

    Subclasses become their base type, integers outside 64 bits and objects with ``__float__`` (a
    0-d tensor, ``Decimal``) become floats, objects with ``__index__`` (numpy integers) become ints;
    text (even ``"3"``) is not a number.
    """
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (str, bytes, bytearray)):
        return None  # float("3") would parse it: text is not a number here
    try:
        number = operator.index(value)
    except TypeError:
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return number if INT_MIN <= number <= UINT_MAX else float(number)
