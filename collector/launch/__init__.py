"""The per-node agent of ``shmstat run``: a process supervisor that starts a job's ranks, restarts them, and ends
them, leaving no process behind.

- :mod:`~collector.launch.agent`: ``Agent``, torchelastic's local agent on one node (the environment torchrun
  sets, restarts of the whole worker group, the agent's metrics and events);
- :mod:`~collector.launch.worker_shutdown`: ending a worker group as torchrun's agent does (signals to every
  worker's process group, then stronger ones), and the agent as the child subreaper of the job's processes.

The command itself is :mod:`collector.cli.run`. The modules are imported by name.
"""

from __future__ import annotations

__all__: list[str] = []
