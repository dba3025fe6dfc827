"""``Stat`` and the writer of its slot in the job's segment.

- :mod:`~shmstat.writer.stat`: ``Stat``, windowed summary statistics in-process or in the job's shared memory;
- :mod:`~shmstat.writer._writer`: the one writer of a slot per process (C: ``shmstat._fastpath``; its pure-Python
  twin in :mod:`~shmstat.writer._pywriter`);
- :mod:`~shmstat.writer._pyhist`: the pure-Python twins of the C writer's histogram updates.

The modules are imported by name; ``Stat`` is re-exported by :mod:`shmstat`.
"""

from __future__ import annotations

__all__: list[str] = []
