"""The collector's command-line options, shared by ``shmstat collect`` and ``shmstat run``, and the
:class:`CollectorConfig` they make (checked here: a bad option is one sentence, exit status 2)."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from dataclasses import MISSING, dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from shmstat.errors import ConfigError
from shmstat.shm.layout import (
    MAX_GRACE_MS,
    Geometry,
)

from ..daemon.config import CollectorConfig
from ..daemon.straggler import MAX_WINDOWS
from ..gpu.sampler import EXTRAS, MIN_INTERVAL_S, check_interval
from ..handlers.specs import parse_handler_args
from ..prometheus.tls import TLSFiles

__all__ = ["TUNED", "Tuned", "add_collector_options", "collector_config", "config_default", "geometry_from"]


@dataclass(frozen=True)
class Tuned:
    """A command-line option that sets one :class:`CollectorConfig` field: its default and the default its help
    shows are the field's (``config value = option value * scale``)."""

    flag: str
    field: str
    type: type
    help: str
    metavar: str | None = None
    scale: int = 1

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments."""
        return self.flag.lstrip("-").replace("-", "_")

    def default(self) -> Any:
        """The option's default: the config field's, in the option's unit."""
        value = config_default(self.field)
        return value if self.scale == 1 else self.type(value / self.scale)

    def to_config(self, value: Any) -> Any:
        """The config field's value for the option's ``value``."""
        return value if self.scale == 1 else type(config_default(self.field))(value * self.scale)


TUNED: tuple[Tuned, ...] = (
    Tuned("--grace-ms", "grace_ms", int, f"wait this long after a window ends before reading it (at most "
                                         f"{MAX_GRACE_MS})"),
    Tuned("--publish-queue", "publish_queue", int,
          "messages queued per subscriber before a slow one loses messages (each at most 2 MiB), which it is told "
          "and reports, counted", metavar="MESSAGES"),
    Tuned("--heartbeat-interval", "heartbeat_interval_s", float,
          "seconds between heartbeats on heartbeat/ (each sender's newest sequence number: subscribers see what "
          "they lost)", metavar="SECONDS"),
    Tuned("--handler-queue", "handler_queue", int, "rows queued per handler before a slow one loses rows, counted"),
    Tuned("--commit-wait", "commit_wait_s", float, "seconds a pass waits for a stuck handler before the point a "
                                                   "restarted collector resumes from moves past it, counted"),
    Tuned("--events-queue-mb", "events_queue_bytes", float,
          "MiB queued per events sink before a slow one loses events, counted and written as gap records",
          scale=1 << 20),
    Tuned("--hold-ms", "hold_ms", int, "at start-up, hold the ranks' events up to this long for subscribers to "
                                       "reconnect"),
    Tuned("--status-interval", "status_interval_s", float, "seconds between status lines on stderr: ranks alive, "
                                                          "windows emitted, events relayed, drops; 0 = none"),
    Tuned("--straggler-threshold", "straggler_threshold", float,
          "a rank scoring under this against the node's median is slow in that window (median / its figure for a "
          "time; between 0 and 1)", metavar="SCORE"),
    Tuned("--straggler-windows", "straggler_windows", int,
          f"report a rank on event/shmstat.straggler once it was slow N windows in a row (1 to {MAX_WINDOWS})",
          metavar="N"),
    Tuned("--hang-after", "hang_after_s", float,
          "name the ranks of a job that made no progress (no section left, no step) for SECONDS: event/shmstat.hang, "
          "a console line, /metrics; 0 = off", metavar="SECONDS"),
    Tuned("--gpu-interval", "gpu_interval_s", float,
          f"seconds between GPU samples (--gpu), at least {MIN_INTERVAL_S:g}: NVML holds a driver lock while it "
          "samples", metavar="SECONDS"),
)
"""The options that tune a collector, each tied to the :class:`CollectorConfig` field it sets."""


def config_default(name: str) -> Any:
    """The default of :class:`CollectorConfig`'s field ``name`` (the one source of the collector's defaults)."""
    f = {f.name: f for f in fields(CollectorConfig)}[name]
    return f.default_factory() if f.default is MISSING and callable(f.default_factory) else f.default


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_collector_options(p: argparse.ArgumentParser) -> None:
    """Add the options every command that runs a collector takes; defaults come from :class:`CollectorConfig`
    (and :class:`shmstat.shm.layout.Geometry` for capacities)."""
    p.add_argument("--publish", default=config_default("publish"), metavar="ENDPOINT",
                   help="XPUB endpoint for subscribers (default: an ipc:// socket in your owner-only runtime "
                        "directory; a tcp:// endpoint is readable by every local user); for a node collector (no "
                        "or several --job), one endpoint carrying every job it serves, each message naming its job")
    p.add_argument("--allow-remote-publish", action="store_true",
                   help="allow --publish on an address other than loopback without --curve (anyone who reaches "
                        "it reads every stream)")
    p.add_argument("--curve", default=config_default("curve"), metavar="DIR",
                   help="with --publish tcp://: encrypt the streams and let in only subscribers whose public key is "
                        "a *.key file in DIR (keys from: shmstat keys DIR); a non-loopback address then needs no "
                        "--allow-remote-publish")
    p.add_argument("--handler", action="append", default=[], metavar="GROUP=SPEC",
                   help="handler for a metric group: compact, console, null, jsonl:PATH, tensorboard:DIR, "
                        "otlp:ENDPOINT, pkg.module:Class[,key=value...]; GROUP * = default (default: compact, one "
                        "line per merged window; put metrics and @prof calls of a group only with GROUP=console)")
    p.add_argument("--events", action="append", default=[], metavar="SPEC",
                   help="keep every event (ranks' log_event and elastic.events.record, the backlog they held, the "
                        "collector's own, gaps as records): jsonl:PATH, console, otlp:ENDPOINT, "
                        "pkg.module:Class[,key=value...] with emit_events(batch); repeatable")
    for t in TUNED:
        default = t.default()
        p.add_argument(t.flag, type=t.type, default=default, metavar=t.metavar,
                       help=f"{t.help} (default {_shown(default)})")
    p.add_argument("--prometheus", default=config_default("prometheus"), metavar="HOST:PORT",
                   help="serve /metrics for Prometheus here (e.g. 127.0.0.1:9464; port 0 picks a free one)")
    p.add_argument("--prometheus-node", default=config_default("prometheus_node"), metavar="NAME",
                   help="the node label of the Prometheus series (default: this host's name)")
    p.add_argument("--prometheus-tls", default=None, metavar="CERT,KEY[,CLIENT_CA]",
                   help="serve /metrics over HTTPS with these PEM files (the key owner-only); with CLIENT_CA every "
                        "scraper must present a certificate that CA signed")
    p.add_argument("--prometheus-sd", default=config_default("prometheus_sd"), metavar="FILE",
                   help="write a Prometheus file_sd target file for the endpoint (removed on a clean exit; with "
                        "--prometheus-tls it says __scheme__: https)")
    p.add_argument("--gpu", choices=("auto", "on", "off"), default=config_default("gpu"),
                   help="GPU telemetry per rank, group gpu (needs shmstat[gpu]): auto = on where an NVIDIA driver "
                        "is loaded; on = also say in one line why it cannot be; off (default auto)")
    p.add_argument("--gpu-extra", action="append", default=[], choices=EXTRAS,
                   help="also sample this expensive GPU figure: energy (3.7 ms per GPU), pcie (21 ms per GPU); "
                        "repeatable")
    p.add_argument("--ready-file", default=config_default("ready_file"), metavar="FILE",
                   help="once serving, write the collector's endpoints here as JSON (job, pid, ingest, publish, "
                        "prometheus; a node collector's: pid, publish, prometheus, jobs), for the program that "
                        "started it")
    for flag, field_name in _CAPACITIES:
        p.add_argument(flag, type=int, default=None,
                       help=f"{_CAPACITY_HELP[field_name]} (default {getattr(Geometry(), field_name)})")


_CAPACITIES = (("--max-ranks", "max_ranks"), ("--max-stats", "max_stats"), ("--banks", "banks"),
               ("--max-percentile-stats", "hist_slots"))
_CAPACITY_HELP = {"max_ranks": "segment capacity", "max_stats": "stats per rank", "banks": "windows kept per stat",
                  "hist_slots": "stats per rank that may keep P50/P90/P99/P999"}
_CAPACITY_RANGE = {"max_ranks": (1, 4096), "max_stats": (1, 65536), "banks": (3, 64), "hist_slots": (0, 65536)}


def geometry_from(args: argparse.Namespace) -> Geometry | None:
    """The capacities asked for on the command line (the others :class:`Geometry`'s defaults), or None to accept
    an existing segment's."""
    asked = {name: getattr(args, flag.lstrip("-").replace("-", "_"), None) for flag, name in _CAPACITIES}
    if all(value is None for value in asked.values()):
        return None
    for flag, name in _CAPACITIES:
        low, high = _CAPACITY_RANGE[name]
        value = asked[name]
        if value is not None and not low <= value <= high:
            raise ConfigError(f"{flag} must be between {low} and {high}, got {value}")
    return Geometry(**{name: value for name, value in asked.items() if value is not None})


def collector_config(args: argparse.Namespace, job: str) -> CollectorConfig:
    """The :class:`CollectorConfig` of the parsed options; raises :class:`ConfigError` for a bad one."""
    if not 0 <= args.grace_ms <= MAX_GRACE_MS:
        raise ConfigError(f"--grace-ms must be between 0 and {MAX_GRACE_MS}, got {args.grace_ms}")
    for flag, value in (("--hold-ms", args.hold_ms), ("--status-interval", args.status_interval)):
        if value < 0:
            raise ConfigError(f"{flag} must not be negative, got {value}")
    if not 0.01 <= args.heartbeat_interval <= 3600:
        raise ConfigError(f"--heartbeat-interval must be between 0.01 and 3600 seconds, got {args.heartbeat_interval}")
    if not 4 <= args.publish_queue <= 1 << 19:
        raise ConfigError(f"--publish-queue must be between 4 and 524288 messages, got {args.publish_queue}")
    if not 1 <= args.events_queue_mb <= 1 << 20:
        raise ConfigError(f"--events-queue-mb must be between 1 and 1048576, got {args.events_queue_mb}")
    if not 1 <= args.handler_queue <= 100_000_000:
        raise ConfigError(f"--handler-queue must be between 1 and 100000000, got {args.handler_queue}")
    if not 0 < args.commit_wait <= 3600:
        raise ConfigError(f"--commit-wait must be more than 0 and at most 3600 seconds, got {args.commit_wait}")
    if not 0 < args.straggler_threshold < 1:
        raise ConfigError(f"--straggler-threshold must be above 0 and below 1, got {args.straggler_threshold}")
    if not 1 <= args.straggler_windows <= MAX_WINDOWS:
        raise ConfigError(f"--straggler-windows must be between 1 and {MAX_WINDOWS}, got {args.straggler_windows}")
    if not 0 <= args.hang_after <= 86400:
        raise ConfigError(f"--hang-after must be between 0 (off) and 86400 seconds, got {args.hang_after}")
    check_interval(args.gpu_interval)
    if args.curve is not None:
        _check_curve(args.curve, args.publish)
    if args.publish is not None:
        _check_publish(args.publish, args.allow_remote_publish, args.curve)
    return CollectorConfig(
        job=job, publish=args.publish, curve=args.curve, handlers=parse_handler_args(args.handler),
        events=_checked_events(args.events),
        geometry=geometry_from(args),
        prometheus=_checked_listen(args.prometheus), prometheus_node=args.prometheus_node,
        prometheus_sd=_checked_sd(args.prometheus_sd, args.prometheus),
        prometheus_tls=_checked_tls(args.prometheus_tls, args.prometheus), ready_file=args.ready_file,
        gpu=args.gpu, gpu_extra=tuple(dict.fromkeys(args.gpu_extra)),
        **{t.field: t.to_config(getattr(args, t.dest)) for t in TUNED},
    )


def _checked_events(specs: list[str]) -> list[str]:
    for spec in specs:
        if not spec.strip():
            raise ConfigError("--events needs a SPEC: jsonl:PATH, console, otlp:ENDPOINT or pkg.module:Class")
    return list(specs)


def _checked_listen(listen: str | None) -> str | None:
    if listen is not None:
        from ..prometheus.exporter import parse_listen

        parse_listen(listen)
    return listen


def _checked_sd(path: str | None, listen: str | None) -> str | None:
    if path is not None and listen is None:
        raise ConfigError("--prometheus-sd needs --prometheus HOST:PORT (the endpoint it names)")
    return path


def _checked_tls(spec: str | None, listen: str | None) -> TLSFiles | None:
    """The files of ``--prometheus-tls``, each read and checked now (a mistake is one sentence before anything
    starts; the warning about a key its group may read comes when the endpoint starts)."""
    if spec is None:
        return None
    if listen is None:
        raise ConfigError("--prometheus-tls needs --prometheus HOST:PORT (the endpoint it secures)")
    from ..prometheus.tls import parse_tls, server_context

    files = parse_tls(spec)
    server_context(files)
    return files


def _check_curve(key_dir: str, publish: str | None) -> None:
    """``--curve`` secures a ``tcp://`` publish endpoint with a key directory that holds a usable server key."""
    if publish is None or not publish.startswith("tcp://"):
        raise ConfigError(f"--curve secures a TCP publish endpoint; add --publish tcp://ADDRESS:PORT "
                          f"(got {'no --publish' if publish is None else repr(publish)})")
    from ..relay.curve import check_server_dir

    check_server_dir(key_dir)


def _check_publish(endpoint: str, allow_remote: bool, curve_dir: str | None = None) -> None:
    """Refuse a non-loopback TCP endpoint unless asked for or secured with CURVE; say who can read it."""
    scheme = endpoint.partition("://")[0]
    if scheme == "ipc":
        return
    if scheme != "tcp":
        raise ConfigError(f"--publish {endpoint!r} is not an ipc:// or tcp:// endpoint")
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None or port < 0:
        raise ConfigError(f"--publish {endpoint!r} needs a port from 0 (any free one) to 65535")
    host = parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if curve_dir is not None:
        print(f"shmstat: --publish {endpoint} is secured with CURVE: streams are encrypted, and only subscribers "
              f"whose public key is a *.key file in {curve_dir} (other than server.key) can connect; anyone who "
              "reaches the port can still try (refused handshakes are counted)", file=sys.stderr, flush=True)
        return
    if not loopback and not allow_remote:
        raise ConfigError(
            f"--publish {endpoint!r} is not on loopback; add --curve DIR so that only subscribers holding a key "
            "can read it, or --allow-remote-publish if every host that reaches it may read every stream"
        )
    print(f"shmstat: warning: --publish {endpoint} is a TCP endpoint: any local user"
          f"{'' if loopback else ' and any host that reaches it'} can subscribe and read every event and stat "
          "(the default ipc:// endpoint is owner-only)", file=sys.stderr, flush=True)
