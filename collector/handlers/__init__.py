"""Where the collector's rows go: handlers per metric group, each in a thread of its own.

- :mod:`~collector.handlers.protocol`: the one way a handler is called (``ColumnsHandler``: each pass as
  columns), ``RowsAdapter``, which gives a torchelastic ``MetricHandler`` the same passes as rows, and
  ``AgentMetricData``, the agent's metrics as handlers get them;
- :mod:`~collector.handlers.specs`: the ``--handler GROUP=SPEC`` a user writes, and what it builds
  (``build_handler``, a user's own class loaded by ``pkg.module:Class``);
- :mod:`~collector.handlers.dispatch`: which handler serves each group (``Dispatcher``), and each handler behind a
  bounded queue and a thread of its own (``ThreadedDispatcher``);
- :mod:`~collector.handlers.console`: the default output, one line per merged window, and the status line;
- :mod:`~collector.handlers.jsonl`, :mod:`~collector.handlers.tensorboard_sink` and :mod:`~collector.handlers.otlp`:
  the ``jsonl:PATH``, ``tensorboard:DIR`` and ``otlp:ENDPOINT`` handlers;
- :mod:`~collector.handlers.otlp_export`: what the two OTLP exporters share (this handler and the events sink of
  :mod:`collector.sinks.otlp_logs`).

The events sinks are :mod:`collector.sinks`.

The modules are imported by name; the public names are re-exported by :mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
