"""What a collector is configured with (:class:`CollectorConfig`), the name of its own metric group, and the
handlers and the GPU sampler a configuration asks for (:func:`build_dispatcher`, :func:`start_sampler`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from elastic.metrics import MetricHandler
from shmstat.errors import ConfigError
from shmstat.names import COLLECTOR_GROUP
from shmstat.publish.sender import DEFAULT_EVENT_LATENCY_MS
from shmstat.shm.layout import Geometry

from ..gpu.figures import GPU_GROUP
from ..gpu.nvml import RECORDING_ENV, driver_present, open_devices
from ..gpu.sampler import GpuSampler
from ..handlers.dispatch import DEFAULT_HANDLER_QUEUE, Dispatcher, ThreadedDispatcher
from ..prometheus.tls import TLSFiles
from ..sinks.delivery import DEFAULT_EVENTS_QUEUE_BYTES, EventDelivery
from .commits import DEFAULT_COMMIT_WAIT_S
from .straggler import DEFAULT_THRESHOLD, DEFAULT_WINDOWS

__all__ = ["PLATFORM_GROUP", "SERVING_RANK_LOOK_S", "CollectorConfig", "build_dispatcher", "build_event_delivery",
           "start_sampler", "write_ready_file"]

PLATFORM_GROUP = COLLECTOR_GROUP
"""The collector's own metric group, ``shmstat`` (rank CPU/RSS and the collector's counters), as torchelastic's agent
has ``torchelastic``; the name rule (:mod:`shmstat.names`) keeps every rank out of it."""


SERVING_RANK_LOOK_S = 0.25
"""How often a serving collector looks at the rank table and liveness: its loop turns for every batch of messages,
and doing it every turn cost a node collector 0.62 CPU-s/s at 2,000 events/s, 0.41 every 5 ms (multinode_bench);
with no message it sleeps until the next look, so this also sets how often an idle collector wakes (a rank's exit
is seen within it)."""


@dataclass
class CollectorConfig:
    """Everything a collector needs; defaults are what ``shmstat collect --job JOB`` uses."""

    job: str
    publish: str | None = None
    """The XPUB endpoint for subscribers; default: the job's ``ipc://`` path in the owner-only runtime directory. For
    a :class:`~collector.daemon.node.NodeCollector`: the node's endpoint, carrying every job it serves (default:
    none; each job has its own endpoint either way)."""
    curve: str | None = None
    """A key directory (``shmstat keys DIR``): the XPUB is a CURVE server that lets in only subscribers whose public
    key is a ``*.key`` file there other than ``server.key`` (:mod:`collector.relay.curve`); None: no CURVE."""
    handlers: dict[str, str] = field(default_factory=dict)
    """``{group: spec}``; ``*`` is the default for other groups (``compact`` if absent: one line per merged
    window)."""
    grace_ms: int = 20
    usage_interval_s: float = 1.0
    status_interval_s: float = 10.0
    """Seconds between one-line status reports on stderr (:func:`collector.handlers.console.status_line`; 0: none)."""
    publish_queue: int = 128
    """Messages queued per subscriber at most (libzmq's ``SNDHWM``: it counts messages, not bytes); past them a
    subscriber that does not keep up loses messages. Each message is at most
    :data:`collector.relay.publish_socket.MAX_MESSAGE_BYTES` (2 MiB), so a queue holds at most ``publish_queue`` times
    that (256 MiB by default), and far less for smaller messages (a rank's message batches up to 1,024 items or
    256 KiB). The subscriber learns exactly what it lost from the heartbeats; ``shmstat subscribe`` reports it to
    the collector, counted in ``subscriber_items_lost`` (a plain ``SUB`` cannot report: it counts its own losses
    with :class:`shmstat.wire.heartbeat.GapTracker`); ``subscriber_queue_full`` counts the times a message found
    a subscriber's queue full."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats on ``heartbeat/`` (the newest sequence number of every sender relayed, so a
    subscriber tells loss from silence: :mod:`shmstat.wire.heartbeat`); one more is sent as the collector closes."""
    hold_ms: int = 300
    """At start-up, how long the ranks' held events and metrics wait for a subscriber to (re)connect before
    they flow anyway (they flow at once when one connects): subscribers of a restarted collector miss none."""
    handler_queue: int = DEFAULT_HANDLER_QUEUE
    """Rows queued per handler (each runs in a thread of its own) before rows for it are dropped and counted."""
    commit_wait_s: float = DEFAULT_COMMIT_WAIT_S
    """Seconds a pass waits for every handler to take it before its watermark is written into the segment anyway
    (counted in ``collector.passes_not_taken``; :mod:`collector.daemon.commits`)."""
    events: list[str] = field(default_factory=list)
    """Events sinks, one SPEC each (``--events``: ``jsonl:PATH``, ``console``, ``otlp:ENDPOINT``,
    ``pkg.module:Class``; :mod:`collector.sinks.events`); none: events are relayed to subscribers only."""
    events_queue_bytes: int = DEFAULT_EVENTS_QUEUE_BYTES
    """Bytes queued per events sink (each runs in a thread of its own) before events for it are dropped, counted
    and written as gap records."""
    straggler_threshold: float = DEFAULT_THRESHOLD
    straggler_windows: int = DEFAULT_WINDOWS
    """A rank scoring under ``straggler_threshold`` for this many windows in a row is reported
    (collector.daemon.straggler)."""
    event_latency_ms: float = DEFAULT_EVENT_LATENCY_MS
    """The event path's latency budget in ms: while messages flow the loop turns every half of it (at least
    :data:`collector.daemon.loop.RELAY_TURN_S`), and ``shmstat run`` gives it to its ranks
    (``SHMSTAT_EVENT_LATENCY_MS``: how long a rank may hold an event). The collector's own events go at once."""
    hang_after_s: float = 30.0
    """A job whose ranks made no progress (no section left, no step) for this long while one is in a section hangs
    (:mod:`collector.daemon.hangs`); 0: hangs are not watched."""
    prometheus: str | None = None
    """``HOST:PORT`` to serve ``/metrics`` on (None: no Prometheus endpoint)."""
    prometheus_node: str | None = None
    """This node's name: the ``node`` label of the Prometheus series and the ``node`` of the jsonl handler's rows
    and the events sink's lines (default: the host name)."""
    prometheus_sd: str | None = None
    """A Prometheus ``file_sd`` file to write for the endpoint."""
    prometheus_tls: TLSFiles | None = None
    """Serve ``/metrics`` over HTTPS with these PEM files (a client CA among them: client certificates required);
    None: plain HTTP."""
    gpu: str = "auto"
    """GPU telemetry (:mod:`collector.gpu.sampler`): ``auto`` (on where an NVIDIA driver is loaded, silent where
    none is), ``on`` (one line saying why when it cannot be), ``off``."""
    gpu_interval_s: float = 1.0
    """Seconds between GPU samples (at least :data:`collector.gpu.sampler.MIN_INTERVAL_S`)."""
    gpu_extra: tuple[str, ...] = ()
    """Expensive GPU figures to sample too: ``energy``, ``pcie``."""
    geometry: Geometry | None = None
    ingest: str | None = None
    ready_file: str | None = None
    """Once serving, write the endpoints here as JSON
    (:meth:`collector.daemon.collector.Collector.write_ready_file`)."""
    clock: Callable[[], int] = time.time_ns


def build_dispatcher(config: CollectorConfig, handler_objects: dict[str, MetricHandler] | None = None,
                     quiet: tuple[str, ...] = ()) -> ThreadedDispatcher:
    """The handlers of ``config`` (and the given objects) behind their threads; the collector's own group goes
    nowhere unless asked for: by name (``--handler shmstat=SPEC``, or a handler object for it) or by ``*``
    (``--handler '*=SPEC'`` or a ``"*"`` handler object: every group; its counters are on ``/metrics`` and the status
    line already, so without either it is left out). Nor do the groups in ``quiet``
    (the GPU figures' when the collector samples GPUs: a dozen figures per GPU are not for the default console
    line) unless a handler names them or ``*`` is configured."""
    inner = Dispatcher.from_specs(config.handlers, node=config.prometheus_node)
    for group, handler in (handler_objects or {}).items():
        inner.bind(group, handler)
    from elastic.metrics import NullMetricHandler

    star = "*" in config.handlers or "*" in (handler_objects or {})  # every group, by a spec or an object
    if PLATFORM_GROUP not in inner.handlers and not star:
        inner.bind(PLATFORM_GROUP, NullMetricHandler())
    for group in quiet:
        if group not in inner.handlers and not star:
            inner.bind(group, NullMetricHandler())
    return ThreadedDispatcher(inner, handler_queue=config.handler_queue)


def build_event_delivery(config: CollectorConfig) -> EventDelivery | None:
    """The events sinks ``config.events`` names, behind their threads (None when it names none); a bad SPEC is a
    :class:`ConfigError` before anything starts."""
    if not config.events:
        return None
    return EventDelivery.from_specs(config.events, queue_bytes=config.events_queue_bytes,
                                    node=config.prometheus_node)


def write_ready_file(path: str, info: dict[str, object]) -> None:
    """Write ``info`` to ``path`` as one JSON object, owner-only and whole at once (written beside it, then
    renamed: a reader that sees the file sees all of it); a :class:`ConfigError` in one sentence if it cannot."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the ready file {path!r}: {exc.strerror}") from None


def start_sampler(config: CollectorConfig, out: IO[str], err: IO[str] | None = None) -> GpuSampler | None:
    """The GPU sampler ``config`` asks for, sampling; None when GPU telemetry is off. ``config.gpu``: ``off``;
    ``on`` (off with one line on ``err`` saying why when there is nothing to sample); ``auto`` (the default:
    as ``on`` where an NVIDIA driver is loaded or :data:`~collector.gpu.nvml.RECORDING_ENV` is set, else off
    without a word). Never raises for a missing GPU or NVML."""
    err = err if err is not None else sys.stderr
    if config.gpu == "off":
        return None
    if config.gpu == "auto" and not os.environ.get(RECORDING_ENV) and not driver_present():
        return None
    try:
        devices = open_devices()
    except ConfigError as exc:
        print(f"shmstat collector: GPU telemetry off: {exc}", file=err, flush=True)
        return None
    try:
        sampler = GpuSampler(devices, interval_s=config.gpu_interval_s, extra=tuple(config.gpu_extra),
                             clock=config.clock, err=err)
    except BaseException:
        devices.close()
        raise
    sampler.start()
    names = sorted(set(sampler.names))
    print(f"shmstat collector: GPU telemetry: {len(sampler.uuids)} GPU{'s' if len(sampler.uuids) != 1 else ''} "
          f"({', '.join(names)}; driver {devices.driver}) every {sampler.interval_s:g} s, group {GPU_GROUP}",
          file=out, flush=True)
    return sampler
