"""``elastic.events.api``: torchelastic's module path (``torch.distributed.elastic.events.api``), kept for the
code that imports the event types by that path.

It is :mod:`elastic.events.event_types` itself, not a copy: importing this module puts that one in its place, so
``elastic.events.api is elastic.events.event_types`` and every name of it is here.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from . import event_types

if TYPE_CHECKING:  # what a type checker sees here: the module this name stands for
    from .event_types import *  # noqa: F403

sys.modules[__name__] = event_types
