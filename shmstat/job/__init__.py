"""This process as a rank of a job: who it is, its entry in the job's segment, attaching and detaching.

- :mod:`~shmstat.job.identity`: who this process is, from our variables or torchrun's;
- :mod:`~shmstat.job.rank`: registering in the segment as a rank, or as an extra writer of one;
- :mod:`~shmstat.job.attach`: ``init()``, ``shutdown()`` and the lazy attach from the environment;
- :mod:`~shmstat.job._state`: the process-global state (handlers, attachment, publisher);
- :mod:`~shmstat.job._degrade`: degrading instead of raising (drop counters, once-only warnings, capacities);
- :mod:`~shmstat.job.counters`: ``shmstat.stats()``, this process's own counters.

The modules are imported by name; the public names are re-exported by :mod:`shmstat`.
"""

from __future__ import annotations

__all__: list[str] = []
