"""The collector's Prometheus endpoint (``shmstat collect --prometheus 127.0.0.1:9464``): every job's windows as
metric families of ``prometheus_client`` (a custom collector; the exposition format is the library's).

Series (labels ``job``, ``node``, ``group``, ``stat``; per-rank series add ``rank``, merged series have no
``rank`` label, so ``sum without (rank)`` of the per-rank series equals the merged one):

- ``shmstat_stat_count_total``, ``shmstat_stat_sum_total``: counters, the running totals over every window this
  collector emitted (they only grow; a restarted collector starts again from 0, which ``rate()`` and
  ``increase()`` treat as a counter reset);
- ``shmstat_stat_mean``, ``shmstat_stat_min``, ``shmstat_stat_max``: gauges, the newest window's figures
  (min/max merged only); ``shmstat_stat_p50`` / ``_p90`` / ``_p99`` / ``_p999`` for stats with percentiles;
- ``shmstat_stat_straggler_score`` (per-rank series of scored stats): gauge, the collector's straggler score of the
  rank in the newest scored window (:mod:`collector.daemon.straggler`, in the stat's own direction);
- ``shmstat_stat_window_empty``: gauge, 1, only on a series whose newest window had no sample (possible only on a
  window torn by a writer that died in the middle of an ``add``; its mean and percentiles read 0): the collector
  does not score that window, and ``shmstat prometheus-rules`` leaves it out too;
- ``shmstat_stat_info`` (one per stat): gauge, always 1, labels ``higher_is_better``, ``scored`` and ``wait``
  (``"1"`` or ``"0"``): the stat's direction (a rate declared higher_is_better scores ``figure / median``, a time
  ``median / figure``), whether the straggler rule scores it at all and whether it times a wait for other ranks (a
  wait section, never scored), so Prometheus rules (``shmstat prometheus-rules``) score
  ranks and nodes job-wide by the collector's rule;
- ``shmstat_stat_hist`` (merged series of percentile stats): a classic cumulative histogram whose ``le``
  boundaries are those of exponential schema 2, ``2^(k/4)`` for ``k`` in -80..160 (2^-20 to 2^40) and
  ``+Inf``: the same on every node, so ``histogram_quantile(0.99, sum by (le, stat) (rate(...)))`` merges nodes.
  A window's bucket counts map exactly when its scale is 2 or more (values spanning less than 2^68); a coarser
  bucket counts at its upper edge. Zero and negative samples (``-inf`` too) count in the lowest bucket, ``+inf``
  only in ``le="+Inf"`` (so ``_count`` is every sample);
- put metrics (:mod:`collector.prometheus.put_metrics`; labels ``job``, ``node``, ``group``, ``name`` and ``rank``,
  none for the agent's): ``shmstat_metric`` (gauge, the newest value), ``shmstat_metric_count_total`` and
  ``shmstat_metric_sum_total`` (counters: values put and their sum), ``shmstat_metric_dropped_total`` (per job:
  values of series past the job's bound);
- ``shmstat_collector_<counter>_total``: the collector's own counters per job;
- the hang detector's (:mod:`collector.daemon.hangs`, handed over by :meth:`PrometheusExporter.set_progress`):
  ``shmstat_rank_progress_age_seconds`` (labels ``job``, ``node``, ``rank``, ``section``, ``wait``: seconds since
  the rank's phase word last changed, at the rendering), ``shmstat_job_hung`` (``job``, ``node``: 1 while the
  job hangs) and ``shmstat_hang_suspect_age_seconds`` (``job``, ``node``, ``rank``, ``section``, ``state``: while a
  hang episode lasts, each rank its hang line names, its section and process state as the line says them, the
  seconds since its progress);
- the GPU figures (group ``gpu``, :mod:`collector.gpu.figures`), besides their ``shmstat_stat_*`` series, as
  one gauge family per figure, ``shmstat_gpu_<figure>`` (``shmstat_gpu_util``, ``shmstat_gpu_fb_used``, ...: the
  unit of dcgm-exporter's ``DCGM_FI_DEV_*`` twin), labels ``job``, ``node``, ``gpu`` (NVML index), ``uuid`` and,
  per rank, ``rank``: the newest window's mean (a mask or a running total: its latest sample). The series
  without ``rank`` is the GPU's, merged across the ranks that share it.

A scrape sends a cached rendering (:mod:`collector.prometheus.server`): the newest figures while rendering is cheap, at
most one rendering behind once it is not (8 ranks x 8,000 stats: ~5 s of a background thread per rendering,
capped at a fifth of a core; the scrape itself takes milliseconds).

Counts are Python ints (exact at any size; the text exposition writes them as ``3.0``, exact up to 2^53).
Series are bounded: a stat's by the job's segment (its stat and rank tables), put metrics by
:data:`collector.prometheus.put_metrics.MAX_SERIES_BYTES` per job. A job's series are dropped
:data:`RETIRE_AFTER_S` after the node collector let the job go. ``--prometheus-sd FILE`` writes a Prometheus
``file_sd`` target file for this endpoint (and removes it on a clean exit); with ``--prometheus-tls`` the endpoint
is HTTPS (:mod:`collector.prometheus.tls`) and the target carries ``__scheme__: https``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import numpy as np

from elastic.metrics import MetricData
from shmstat.errors import ConfigError
from shmstat.histogram import Histogram

from ..gpu.figures import FIGURES, figure_of
from .put_metrics import MAX_SERIES_BYTES, PutMetrics, put_families
from .server import MetricsServer, RenderCache

if TYPE_CHECKING:  # pragma: no cover
    from ..daemon.config import CollectorConfig
    from ..read.columns import Columns
    from ..read.passes import Pass, RankScore, Wanted

__all__ = ["BUCKET_BOUNDS", "RETIRE_AFTER_S", "PrometheusExporter", "parse_listen", "start_exporter"]

_log = logging.getLogger("shmstat.prometheus")

_K_MIN, _K_MAX = -80, 160
BUCKET_BOUNDS: tuple[float, ...] = tuple(2.0 ** (k / 4) for k in range(_K_MIN, _K_MAX + 1))
"""The classic histogram's finite ``le`` boundaries (exponential schema 2), then ``+Inf``."""
_NB = len(BUCKET_BOUNDS) + 1
_LE = (*(repr(b) for b in BUCKET_BOUNDS), "+Inf")
RETIRE_AFTER_S = 600.0
_PERCENTILES = ("p50", "p90", "p99", "p999")
_Progress = tuple[float, list[tuple[int, str, bool, float]], bool, list[tuple[int, str, str, float]]]
"""A job's hang table as handed over: when, per rank (rank, section, wait, age s), hung, per suspect (rank,
section, state, age s)."""


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as ``(host, port)``; one clear sentence for anything else."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"--prometheus {text!r} is not HOST:PORT with a port from 0 (any free one) to 65535")
    return host, int(port_text)


@dataclass
class _Series:
    """Running totals and the newest window of one (job, group, stat, rank) series."""

    count: int = 0
    total: float = 0.0
    mean: float = 0.0
    lo: float = 0.0
    hi: float = 0.0
    percentiles: tuple[float, ...] | None = None
    buckets: list[int] | None = None  # classic, not cumulative; merged series of percentile stats only
    score: float | None = None  # per-rank series: the collector's straggler score of the newest scored window
    empty: bool = False  # the newest window had no sample (torn): its figures are 0, and no surface scores them


class PrometheusExporter:
    """Keeps what ``/metrics`` shows and serves it; a consumer of every collector pass on the collector's loop
    (:meth:`take`, so that a scrape sees each pass whole or not at all), the rendering thread reads under a lock
    (only copies are made under it) and a scrape sends the cached rendering."""

    on_loop = True
    """Passes are folded in on the loop (:class:`collector.read.passes.PassConsumer`): cheap, and consistent with
    what the loop did."""

    def __init__(self, listen: str, *, node: str | None = None, sd_file: str | None = None,
                 clock: Callable[[], float] = time.monotonic, max_put_bytes: int = MAX_SERIES_BYTES,
                 tls: ssl.SSLContext | None = None) -> None:
        self.host, port = parse_listen(listen)
        self.tls = tls
        """The server-side TLS context (:func:`collector.prometheus.tls.server_context`); None: plain HTTP."""
        self.node = node or socket.gethostname()
        self.sd_file = sd_file
        self.clock = clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, str, int | None], _Series] = {}
        self._kinds: dict[tuple[str, str, str], tuple[bool, bool, bool]] = {}  # -> (hib, scored, wait)
        self._gpu: dict[tuple[str, str, int, int | None], float] = {}  # (job, figure, gpu, rank) -> newest
        self._uuids: tuple[str, ...] = ()
        self._puts = PutMetrics(max_put_bytes)
        self._counters: dict[str, Callable[[], dict[str, int]]] = {}
        self._node_counters: list[Callable[[], dict[str, int]]] = [self._server_counters]
        self._retired: dict[str, float] = {}
        self._progress: dict[str, _Progress] = {}
        self._server: MetricsServer | None = None
        self._cache: RenderCache | None = None
        self.port = port
        self.renders = 0

    # -- serving ---------------------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind and serve ``/metrics`` in a thread, from a cached rendering (:mod:`collector.prometheus.server`);
        returns ``http://HOST:PORT/metrics`` (``https`` with TLS; the real port)."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # type: ignore[arg-type]
        cache = RenderCache(registry)
        try:
            self._server = MetricsServer(cache, self.host, self.port, tls=self.tls)
        except OSError as exc:
            cache.close()
            raise ConfigError(f"--prometheus cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        self._cache = cache
        self.port = self._server.port
        if self.sd_file:
            self._write_sd()
        return self.url

    @property
    def url(self) -> str:
        """Where Prometheus scrapes."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def scheme(self) -> str:
        """``https`` or ``http``."""
        return "http" if self.tls is None else "https"

    def close(self) -> None:
        """Stop serving; remove the ``file_sd`` file written for this endpoint."""
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.close()
            self._server = None
        if self._cache is not None:
            self._cache.close()
        if self.sd_file:
            with contextlib.suppress(OSError):
                os.unlink(self.sd_file)

    def _write_sd(self) -> None:
        assert self.sd_file is not None
        host = self.host if self.host not in ("0.0.0.0", "::") else socket.getfqdn()
        target = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        labels = {"node": self.node}
        if self.tls is not None:
            labels["__scheme__"] = "https"  # Prometheus' own label for how to scrape the target
        doc = [{"targets": [target], "labels": labels}]
        tmp = f"{self.sd_file}.tmp.{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f)
            os.replace(tmp, self.sd_file)  # Prometheus never reads a half-written file
        except OSError as exc:
            raise ConfigError(f"--prometheus-sd cannot write {self.sd_file!r}: {exc.strerror}") from None

    # -- what the collector feeds ----------------------------------------------------------------------------
    def wants(self, group: str, what: Wanted) -> bool:
        """Every group's windows and put metrics are exported (the collector's usage figures are not: its
        counters are, read at a scrape)."""
        return what != "usage"

    def take(self, pass_: Pass) -> None:
        """Fold one pass in: its windows (:meth:`observe_columns`), its put metrics (:meth:`observe_metric`, the
        ones made in the collector's process with no rank label) and its straggler scores (:meth:`observe_scores`).
        The collector's usage figures are not series here (its counters are: :meth:`add_job`)."""
        job = pass_.job
        if pass_.columns is not None:
            self.observe_columns(pass_.columns)
        for put in pass_.puts:
            self.observe_metric(job, put.metric, put.rank)
        if pass_.scores:
            self.observe_scores(job, pass_.scores)

    def observe_columns(self, cols: Columns) -> None:
        """Fold one pass (merged and per-rank rows) into the series, as the collector hands it over: columns (no
        row objects are built; histogram objects only for the merged rows, whose buckets are exported)."""
        job = cols.job
        pcts = (cols.p50.tolist(), cols.p90.tolist(), cols.p99.tolist(), cols.p999.tolist())
        exported = np.flatnonzero((cols.rank < 0) & cols.hists.present)
        merged = np.flatnonzero(cols.rank < 0)
        kinds = {(job, g, st): (h, sc, w) for g, st, h, sc, w in zip(
            cols.group[merged].tolist(), cols.stat[merged].tolist(), cols.higher_is_better[merged].tolist(),
            cols.scored_stats()[merged].tolist(), cols.wait[merged].tolist(), strict=True)}
        classic = dict(zip(exported.tolist(), map(_classic, cols.hists[exported].histograms()), strict=True))
        updates = []
        for i, (group, stat, rank, n, total, mean, lo, hi, has_hist) in enumerate(zip(
                cols.group.tolist(), cols.stat.tolist(), cols.rank.tolist(), cols.count.tolist(),
                cols.sum.tolist(), cols.mean.tolist(), cols.min.tolist(), cols.max.tolist(),
                cols.hists.present.tolist(), strict=True)):
            pct = (pcts[0][i], pcts[1][i], pcts[2][i], pcts[3][i]) if has_hist else None
            updates.append(((job, group, stat, None if rank < 0 else rank), n, total, mean, lo, hi, pct,
                            classic.get(i)))
        if len(cols):
            with self._lock:
                self._kinds.update(kinds)
                self._fold_gpu(cols)
        self._fold(job, updates)

    def observe_scores(self, job: str, scores: Iterable[RankScore]) -> None:
        """The collector's straggler scores of a pass (:class:`collector.daemon.straggler.StragglerDetector`'s, in
        window order), each kept on its rank's series as ``shmstat_stat_straggler_score``: what the dashboard
        plots, so no surface scores a rank by a rule of its own."""
        with self._lock:
            series = self._series
            for sc in scores:
                cur = series.get((job, sc.group, sc.stat, sc.rank))
                if cur is not None:
                    cur.score = sc.score
        self._changed()

    def set_gpus(self, uuids: tuple[str, ...]) -> None:
        """The UUIDs of the node's GPUs by NVML index (the ``uuid`` label of the GPU families)."""
        with self._lock:
            self._uuids = tuple(uuids)
        self._changed()

    def _fold_gpu(self, cols: Columns) -> None:
        """The GPU figures of a pass into their families' newest values (lock held)."""
        for i in np.flatnonzero(cols.group == "gpu").tolist():
            found = figure_of(cols.group[i], cols.stat[i])
            if found is None or not cols.count[i]:
                continue
            gpu, fig = found
            rank = int(cols.rank[i])
            value = cols.value[i] if fig.latest else cols.mean[i]
            self._gpu[(cols.job, fig.name, gpu, None if rank < 0 else rank)] = float(value)

    def _fold(self, job: str, updates: list[tuple]) -> None:
        with self._lock:
            self._retired.pop(job, None)
            series = self._series
            for key, n, total, mean, lo, hi, pct, classic in updates:
                cur = series.get(key)
                if cur is None:
                    cur = series[key] = _Series()
                cur.count += n
                cur.empty = n == 0
                cur.total += total
                cur.mean, cur.lo, cur.hi, cur.percentiles = mean, lo, hi, pct
                if classic is not None:
                    if cur.buckets is None:
                        cur.buckets = [0] * _NB
                    b = cur.buckets
                    for i, c in classic:
                        b[i] += c
        self._changed()

    def observe_metric(self, job: str, metric: MetricData, rank: int | None) -> None:
        """One put value (``rank`` None: the agent's), folded into its series' newest value, count and sum."""
        with self._lock:
            self._puts.add(job, metric.group_name, metric.name, rank, metric.value)
        self._changed()

    def put_dropped(self, job: str) -> int:
        """Put values of ``job`` not exported (see :mod:`collector.prometheus.put_metrics`)."""
        with self._lock:
            return self._puts.dropped.get(job, 0)

    def add_job(self, job: str, counters: Callable[[], dict[str, int]]) -> None:
        """Export ``counters()`` of a job's collector as ``shmstat_collector_<name>_total``."""
        with self._lock:
            self._counters[job] = counters
            self._retired.pop(job, None)
        self._changed()

    def add_node(self, counters: Callable[[], dict[str, int]]) -> None:
        """Export ``counters()`` of the node's own (no job's: a node collector's endpoint, this server) as
        ``shmstat_node_<name>_total`` with the ``node`` label only."""
        with self._lock:
            self._node_counters.append(counters)
        self._changed()

    def set_progress(self, job: str, ages: list[tuple[int, str, bool, float]], hung: bool,
                     suspects: list[tuple[int, str, str, float]] | None = None) -> None:
        """The hang detector's table of ``job``: ``(rank, section, wait, age in seconds now)`` per rank, whether
        the job hangs and, while it does, ``(rank, section, process state, age in seconds now)`` per suspect; a
        rendering adds the time passed since (so a scrape between two hand-overs is exact)."""
        with self._lock:
            self._progress[job] = (self.clock(), list(ages), hung, list(suspects or ()))
        self._changed()

    def _server_counters(self) -> dict[str, int]:
        server = self._server
        return {"metrics_tls_handshakes_failed": server.handshake_failures} if server and self.tls else {}

    def retire_job(self, job: str) -> None:
        """The job was let go: its series go :data:`RETIRE_AFTER_S` later (unless it comes back)."""
        with self._lock:
            self._retired[job] = self.clock() + RETIRE_AFTER_S

    def _changed(self) -> None:
        if self._cache is not None:
            self._cache.invalidate()

    # -- what Prometheus reads ---------------------------------------------------------------------------------
    def collect(self) -> Iterator[object]:
        """The metric families (``prometheus_client``'s custom collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.samples import Sample

        with self._lock:
            self._drop_retired()
            series = [(k, v.count, v.total, v.mean, v.lo, v.hi, v.percentiles,
                       list(v.buckets) if v.buckets is not None else None, v.score) for k, v in self._series.items()]
            empty = [k for k, v in self._series.items() if v.empty]
            puts = self._puts.snapshot()
            gpu = sorted(self._gpu.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2], kv[0][3] is not None,
                                                            kv[0][3] or 0))
            uuids = self._uuids
            kinds = list(self._kinds.items())
            counter_sources = list(self._counters.items())
            node_sources = list(self._node_counters)
            progress = sorted(self._progress.items())
        self.renders += 1
        node = self.node
        count = CounterMetricFamily("shmstat_stat_count", "Samples in every emitted window, running total")
        total = CounterMetricFamily("shmstat_stat_sum", "Sum of the samples of every emitted window, running total")
        mean = GaugeMetricFamily("shmstat_stat_mean", "Mean of the newest emitted window")
        lo = GaugeMetricFamily("shmstat_stat_min", "Minimum of the newest emitted window (merged series)")
        hi = GaugeMetricFamily("shmstat_stat_max", "Maximum of the newest emitted window (merged series)")
        pcts = [GaugeMetricFamily(f"shmstat_stat_{p}", f"{p} of the newest emitted window (percentile stats)")
                for p in _PERCENTILES]
        hist = HistogramMetricFamily("shmstat_stat_hist", "Samples by value, exponential schema 2 boundaries, "
                                     "running total (merged series of percentile stats)")
        scores = GaugeMetricFamily("shmstat_stat_straggler_score", "The collector's straggler score of the rank in "
                                   "the newest scored window (under the threshold: slow; per-rank series)")
        for (job, group, stat, rank), n, sm, mn, low, high, pct, buckets, score in series:
            labels = {"job": job, "node": node, "group": group, "stat": stat}
            if rank is not None:
                labels["rank"] = str(rank)
            count.samples.append(Sample("shmstat_stat_count_total", labels, n))
            total.samples.append(Sample("shmstat_stat_sum_total", labels, sm))
            mean.samples.append(Sample("shmstat_stat_mean", labels, mn))
            if rank is None:
                lo.samples.append(Sample("shmstat_stat_min", labels, low))
                hi.samples.append(Sample("shmstat_stat_max", labels, high))
            elif score is not None:
                scores.samples.append(Sample("shmstat_stat_straggler_score", labels, score))
            if pct is not None:
                for fam, value in zip(pcts, pct, strict=True):
                    fam.samples.append(Sample(fam.name, labels, value))
            if buckets is not None:
                acc = 0
                for le, c in zip(_LE, buckets, strict=True):
                    acc += c
                    hist.samples.append(Sample("shmstat_stat_hist_bucket", {**labels, "le": le}, acc))
                hist.samples.append(Sample("shmstat_stat_hist_count", labels, acc))
                hist.samples.append(Sample("shmstat_stat_hist_sum", labels, sm))
        info = GaugeMetricFamily("shmstat_stat_info", "Always 1: the stat's direction (higher_is_better), whether "
                                 "the straggler rule scores it (scored) and whether it times a wait for other ranks "
                                 "(wait)")
        for (job, group, stat), (better, scored, wait) in kinds:
            info.samples.append(Sample("shmstat_stat_info", {
                "job": job, "node": node, "group": group, "stat": stat, "higher_is_better": "1" if better else "0",
                "scored": "1" if scored else "0", "wait": "1" if wait else "0"}, 1))
        window_empty = GaugeMetricFamily("shmstat_stat_window_empty", "1 while the newest emitted window had no sample "
                                         "(torn by a writer that died in an add; its figures read 0): not scored")
        for job, group, stat, rank in empty:
            labels = {"job": job, "node": node, "group": group, "stat": stat}
            if rank is not None:
                labels["rank"] = str(rank)
            window_empty.samples.append(Sample("shmstat_stat_window_empty", labels, 1))
        yield from (count, total, mean, lo, hi, *pcts, hist, scores, info, window_empty)
        yield from _progress_families(progress, node, self.clock())
        yield from _gpu_families(gpu, uuids, node)
        yield from put_families(puts, node)
        yield from _counter_families("shmstat_collector", "Collector counter",
                                     [({"job": job, "node": node}, source) for job, source in counter_sources])
        yield from _counter_families("shmstat_node", "Node counter", [({"node": node}, s) for s in node_sources])

    def _drop_retired(self) -> None:
        now = self.clock()
        gone = {job for job, at in self._retired.items() if at <= now}
        if not gone:
            return
        for key in [k for k in self._series if k[0] in gone]:
            del self._series[key]
        for kkey in [k for k in self._kinds if k[0] in gone]:
            del self._kinds[kkey]
        for gkey in [k for k in self._gpu if k[0] in gone]:
            del self._gpu[gkey]
        self._puts.forget(gone)
        for job in gone:
            self._counters.pop(job, None)
            self._progress.pop(job, None)
            del self._retired[job]


def _progress_families(progress: list[tuple[str, _Progress]], node: str, now: float) -> Iterator[object]:
    """``shmstat_rank_progress_age_seconds``, ``shmstat_job_hung`` and ``shmstat_hang_suspect_age_seconds`` of every
    job the hang detector handed over."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.samples import Sample

    age = GaugeMetricFamily("shmstat_rank_progress_age_seconds", "Seconds since the rank last made progress (its "
                            "phase word changed: a section entered or left, a step counted); section its innermost "
                            "open section, wait 1 when that is a wait section")
    hung = GaugeMetricFamily("shmstat_job_hung", "1 while the collector's hang detector finds the job hung")
    suspect = GaugeMetricFamily("shmstat_hang_suspect_age_seconds", "While the job hangs, each rank the collector's "
                                "hang line names: seconds since its progress; section and state (its process's) as "
                                "the line says them")
    for job, (at, rows, is_hung, suspects) in progress:
        since = max(0.0, now - at)
        for rank, section, wait, seconds in rows:
            age.samples.append(Sample(age.name, {"job": job, "node": node, "rank": str(rank), "section": section,
                                                 "wait": "1" if wait else "0"}, seconds + since))
        hung.samples.append(Sample(hung.name, {"job": job, "node": node}, 1 if is_hung else 0))
        for rank, section, state, seconds in suspects:
            suspect.samples.append(Sample(suspect.name, {"job": job, "node": node, "rank": str(rank),
                                                         "section": section, "state": state}, seconds + since))
    yield from (age, hung, suspect)


def _gpu_families(series: list[tuple[tuple[str, str, int, int | None], float]], uuids: tuple[str, ...],
                  node: str) -> Iterator[object]:
    """One gauge family per GPU figure (``shmstat_gpu_<figure>``), in the order ``series`` is sorted (by figure)."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.samples import Sample

    families: dict[str, GaugeMetricFamily] = {}
    for (job, name, gpu, rank), value in series:
        fig = FIGURES[name]
        family = families.get(name)
        if family is None:
            twin = f"; as dcgm-exporter's {fig.dcgm}" if fig.dcgm else ""
            family = families[name] = GaugeMetricFamily(fig.family, f"{fig.help} ({fig.unit}{twin})")
        labels = {"job": job, "node": node, "gpu": str(gpu), "uuid": uuids[gpu] if gpu < len(uuids) else ""}
        if rank is not None:
            labels["rank"] = str(rank)
        family.samples.append(Sample(fig.family, labels, value))
    yield from families.values()


def _counter_families(prefix: str, doc: str, sources: list[tuple[dict[str, str], Callable[[], dict[str, int]]]]
                      ) -> Iterator[object]:
    """``<prefix>_<name>_total`` for every counter of every source, each sample with its source's labels; a source
    that fails (its collector closing meanwhile) is simply not shown."""
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.samples import Sample

    families: dict[str, CounterMetricFamily] = {}
    for labels, source in sources:
        try:
            values = source()
        except Exception:
            continue
        for name, value in values.items():
            family = families.get(name)
            if family is None:
                family = families[name] = CounterMetricFamily(f"{prefix}_{name}", f"{doc} {name}")
            family.samples.append(Sample(f"{prefix}_{name}_total", labels, value))
    yield from families.values()


def start_exporter(config: CollectorConfig, out: IO[str]) -> PrometheusExporter:
    """The exporter ``config`` asks for, serving; says where on ``out`` (and warns on stderr when the address
    is not loopback and no client certificate is required: every host that reaches it reads every job's
    figures)."""
    from .tls import server_context, warn_on_stderr

    assert config.prometheus is not None
    tls = config.prometheus_tls
    exporter = PrometheusExporter(config.prometheus, node=config.prometheus_node, sd_file=config.prometheus_sd,
                                  tls=server_context(tls, warn=warn_on_stderr) if tls is not None else None)
    url = exporter.start()
    print(f"shmstat collector: Prometheus endpoint {url}", file=out, flush=True)
    if not _is_loopback(exporter.host) and (tls is None or tls.client_ca is None):
        print(f"shmstat collector: warning: {url} is reachable beyond this host; whoever reaches it reads every "
              "job's figures", file=sys.stderr, flush=True)
    return exporter


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _classic(hist: Histogram) -> list[tuple[int, int]]:
    """A window's histogram as (classic bucket position, count) pairs (see the module docstring)."""
    out: dict[int, int] = {}
    s = hist.scale
    for i, c in hist.pos.items():
        j = i >> (s - 2) if s >= 2 else ((i + 1) << (2 - s)) - 1  # schema-2 bucket holding our bucket's top
        p = min(max(j + 1 - _K_MIN, 0), _NB - 1)  # its upper bound 2^((j+1)/4) is BUCKET_BOUNDS[j + 1 - _K_MIN]
        out[p] = out.get(p, 0) + c
    low = hist.zero + sum(hist.neg.values()) + hist.neg_inf
    if low:
        out[0] = out.get(0, 0) + low
    if hist.pos_inf:  # only le="+Inf" holds +inf
        out[_NB - 1] = out.get(_NB - 1, 0) + hist.pos_inf
    return list(out.items())
