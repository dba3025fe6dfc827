"""``elastic.metrics.api``: torchelastic's module path (``torch.distributed.elastic.metrics.api``), kept for the
code that imports it by that path or replaces a name in it, as torchelastic's own tests replace ``getStream``.

It is :mod:`elastic.metrics.emitting` itself, not a copy: importing this module puts that one in its place, so
``elastic.metrics.api is elastic.metrics.emitting``, every name of it is here (the private ones too), and a name
replaced here is the one :func:`~elastic.metrics.emitting.put_metric` looks up.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from . import emitting

if TYPE_CHECKING:  # what a type checker sees here: the module this name stands for
    from .emitting import *  # noqa: F403

sys.modules[__name__] = emitting
