"""Where the events go: the events sinks of ``--events SPEC``, each in a thread of its own.

- :mod:`~collector.sinks.events`: the records a sink receives (``EventRecord``, ``GapRecord``), the one protocol
  of a sink (``EventSink``), and the ``jsonl:PATH`` and ``console`` sinks; :mod:`~collector.sinks.otlp_logs`:
  ``otlp:ENDPOINT`` (OpenTelemetry logs);
- :mod:`~collector.sinks.specs`: the ``--events SPEC`` a user writes, and the sink it builds
  (``build_event_handler``, a user's own class loaded by ``pkg.module:Class``);
- :mod:`~collector.sinks.delivery`: each events sink in a thread of its own, behind a queue bounded in bytes;
- :mod:`~collector.sinks.kept_events`: one job's events on their way to the sinks, as the collector's loop hands
  them on.

The modules are imported by name; the public names are re-exported by :mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
