"""``elastic``: the torchelastic face of shmstat, rank side.

``elastic.metrics`` mirrors ``torch.distributed.elastic.metrics`` and ``elastic.events`` mirrors
``torch.distributed.elastic.events``: same names, signatures and local behaviour, so code written for
torchelastic runs on them by changing the import. When the process is attached to a job, metrics of groups
without an in-process handler and every recorded event are also published to the node's collector.

This package imports only :mod:`shmstat` and the standard library.
"""

from __future__ import annotations

from . import events, metrics

__all__ = ["events", "metrics"]
