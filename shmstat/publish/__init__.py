"""Events and where they go: the ``torch.monitor`` event API and the publisher that ships events and metrics.

- :mod:`~shmstat.publish.events`: ``Event``, ``log_event`` and the event handler registry, with the checks of an
  event's data in :mod:`~shmstat.publish._eventdata`; :mod:`~shmstat.publish.tensorboard`: the TensorBoard handler;
- :mod:`~shmstat.publish.publisher`: the rank's publisher to the node's collector, never blocking its caller, with
  its backlog (:mod:`~shmstat.publish.outbox`, its bounds and item sizes in :mod:`~shmstat.publish.item_sizes`),
  its socket thread (:mod:`~shmstat.publish.sender`), its fork and exit hooks (:mod:`~shmstat.publish._pubprocess`)
  and its Python slow path for odd items (:mod:`~shmstat.publish.item_encoding`).

The C twin of the hot paths is ``shmstat._pubfast``. The modules are imported by name; the public names are
re-exported by :mod:`shmstat`.
"""

from __future__ import annotations

__all__: list[str] = []
