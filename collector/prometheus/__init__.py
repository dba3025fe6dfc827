"""The collector's Prometheus endpoint (``--prometheus HOST:PORT``).

- :mod:`~collector.prometheus.exporter`: every job's windows as ``prometheus_client`` metric families;
- :mod:`~collector.prometheus.put_metrics`: put metrics as series (newest value, count, sum), bounded per job;
- :mod:`~collector.prometheus.server`: ``/metrics`` served from a cached rendering;
- :mod:`~collector.prometheus.tls`: ``--prometheus-tls``, its files checked and the server's TLS context.

The modules are imported by name.
"""

from __future__ import annotations

__all__: list[str] = []
