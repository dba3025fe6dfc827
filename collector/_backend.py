"""The collector's C twin, chosen by shmstat's one switch (:func:`shmstat._backend.backend`).

``collector._intake.check`` (the C intake check; its Python twin is :func:`shmstat.wire.decode`, and
tests/collector/relay/test_intake.py holds them together) runs when shmstat's backend is ``"c"`` and the extension
is built.
shmstat cannot import the collector, so the decision is shmstat's and the lookup is here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from shmstat._backend import backend

__all__ = ["INTAKE_API", "c_intake_check", "intake_check"]

INTAKE_API = ("check",)
"""What ``collector._intake`` must provide."""

IntakeCheck = Callable[[Any, Any], "tuple[str, int, int, int, int, int] | str | None"]

_built: list[IntakeCheck | None] = []  # [the C check or None], looked up once


def c_intake_check() -> IntakeCheck | None:
    """The C intake check if ``collector._intake`` is built (and provides its API), whatever the backend."""
    if not _built:
        try:
            module = importlib.import_module("collector._intake")
        except ImportError:
            module = None
        _built.append(getattr(module, "check", None))
    return _built[0]


def intake_check() -> IntakeCheck | None:
    """The C intake check on the ``"c"`` backend when it is built; None where :func:`shmstat.wire.decode` runs."""
    return c_intake_check() if backend().is_c else None
