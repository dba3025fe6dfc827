"""The collector processes: the loop serving one job, and the node collector serving every job of a node.

- :mod:`~collector.daemon.collector`: ``Collector``, one loop that scans, relays, watches ranks and dispatches
  (with its passes, the put metrics and its own figures, what goes to the events sinks, what other threads
  submit, and its lock on the job's segment), configured by :mod:`~collector.daemon.config`; the watermarks of
  its passes are written once their handlers took them (:mod:`~collector.daemon.commits`);
- :mod:`~collector.daemon.liveness`: which ranks joined, exited or died, and what each costs;
- :mod:`~collector.daemon.straggler`: how each rank compares with the node, per window;
- :mod:`~collector.daemon.node`: ``NodeCollector``, one process for every job of this user on this node, which
  removes unused segments (:mod:`~collector.daemon.sweep`).

The modules are imported by name; ``Collector`` and ``CollectorConfig`` are re-exported by :mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
