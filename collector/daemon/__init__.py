"""The collector processes: one serving loop, over one job or over every job of a node.

- :mod:`~collector.daemon.loop`: ``Loop``, the one run/serve/step/stop sequence of every collector, and its
  deadlines;
- :mod:`~collector.daemon.collector`: ``Collector``, one job as the loop turns it (relay, scan, watch ranks) and
  its lifecycle (open, hand-over, close, finish), configured by :mod:`~collector.daemon.config`; its hold on the
  job's segment (:mod:`~collector.daemon.job_segment`); its passes, the put metrics and its own figures
  (:mod:`~collector.daemon.job_pass`), whose watermarks are written once their handlers took them
  (:mod:`~collector.daemon.commits`); the delivered marks of what its events sinks took
  (:mod:`~collector.daemon.delivered_marks`; the events themselves: :mod:`collector.sinks.kept_events`);
- :mod:`~collector.daemon.liveness`: which ranks joined, exited or died, and what each costs;
- :mod:`~collector.daemon.hangs`: every rank's phase word at each rank look, a hang named while it happens;
- :mod:`~collector.daemon.straggler`: how each rank compares with the node, per window;
- :mod:`~collector.daemon.node`: ``NodeCollector``, the loop serving every job of this user on this node, which
  removes unused segments (:mod:`~collector.daemon.sweep`).

The modules are imported by name; ``Collector`` and ``CollectorConfig`` are re-exported by :mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
