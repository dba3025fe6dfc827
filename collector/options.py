"""The collector's command-line options, shared by ``shmstat collect`` and ``shmstat run``, and the
:class:`CollectorConfig` they make (checked here: a bad option is one sentence, exit status 2)."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from urllib.parse import urlsplit

from shmstat.errors import ConfigError
from shmstat.layout import (
    DEFAULT_BANKS,
    DEFAULT_HIST_SLOTS,
    DEFAULT_MAX_RANKS,
    DEFAULT_MAX_STATS,
    MAX_GRACE_MS,
    Geometry,
)

from .daemon import CollectorConfig
from .dispatch import DEFAULT_HANDLER_QUEUE
from .handlers import parse_handler_args
from .straggler import DEFAULT_THRESHOLD, DEFAULT_WINDOWS, MAX_WINDOWS

__all__ = ["add_collector_options", "collector_config", "geometry_from"]


def add_collector_options(p: argparse.ArgumentParser) -> None:
    """Add the options every command that runs a collector takes."""
    p.add_argument("--publish", default=None, metavar="ENDPOINT",
                   help="XPUB endpoint for subscribers (default: an ipc:// socket in your owner-only runtime "
                        "directory; a tcp:// endpoint is readable by every local user)")
    p.add_argument("--allow-remote-publish", action="store_true",
                   help="allow --publish on an address other than loopback (anyone who reaches it reads every "
                        "stream)")
    p.add_argument("--handler", action="append", default=[], metavar="GROUP=SPEC",
                   help="handler for a metric group: compact, console, null, jsonl:PATH, tensorboard:DIR, "
                        "otlp:ENDPOINT, pkg.module:Class[,key=value...]; GROUP * = default (default: compact, one "
                        "line per merged window; put metrics and @prof calls of a group only with GROUP=console)")
    p.add_argument("--grace-ms", type=int, default=20,
                   help=f"wait this long after a window ends before reading it (default 20, at most {MAX_GRACE_MS})")
    p.add_argument("--publish-buffer-mb", type=float, default=256.0,
                   help="MiB queued per subscriber before a slow one loses messages (default 256)")
    p.add_argument("--handler-queue", type=int, default=DEFAULT_HANDLER_QUEUE,
                   help=f"rows queued per handler before a slow one loses rows, counted (default "
                        f"{DEFAULT_HANDLER_QUEUE})")
    p.add_argument("--hold-ms", type=int, default=300,
                   help="at start-up, hold the ranks' events up to this long for subscribers to reconnect "
                        "(default 300)")
    p.add_argument("--status-interval", type=float, default=10.0,
                   help="seconds between status lines on stderr: ranks alive, windows emitted, events relayed, "
                        "drops (default 10, 0 = none)")
    p.add_argument("--straggler-threshold", type=float, default=DEFAULT_THRESHOLD, metavar="SCORE",
                   help="a rank scoring under this against the node's median is slow in that window (median / its "
                        f"figure for a time; between 0 and 1, default {DEFAULT_THRESHOLD})")
    p.add_argument("--straggler-windows", type=int, default=DEFAULT_WINDOWS, metavar="N",
                   help=f"report a rank on event/shmstat.straggler once it was slow N windows in a row (1 to "
                        f"{MAX_WINDOWS}, default {DEFAULT_WINDOWS})")
    p.add_argument("--prometheus", default=None, metavar="HOST:PORT",
                   help="serve /metrics for Prometheus here (e.g. 127.0.0.1:9464; port 0 picks a free one)")
    p.add_argument("--prometheus-node", default=None, metavar="NAME",
                   help="the node label of the Prometheus series (default: this host's name)")
    p.add_argument("--prometheus-sd", default=None, metavar="FILE",
                   help="write a Prometheus file_sd target file for the endpoint (removed on a clean exit)")
    p.add_argument("--max-ranks", type=int, default=None, help=f"segment capacity (default {DEFAULT_MAX_RANKS})")
    p.add_argument("--max-stats", type=int, default=None, help=f"stats per rank (default {DEFAULT_MAX_STATS})")
    p.add_argument("--banks", type=int, default=None, help=f"windows kept per stat (default {DEFAULT_BANKS})")
    p.add_argument("--max-percentile-stats", type=int, default=None,
                   help=f"stats per rank that may keep P50/P90/P99/P999 (default {DEFAULT_HIST_SLOTS})")


def geometry_from(args: argparse.Namespace) -> Geometry | None:
    """The capacities asked for on the command line, or None to accept an existing segment's."""
    hist_slots = getattr(args, "max_percentile_stats", None)
    if args.max_ranks is None and args.max_stats is None and args.banks is None and hist_slots is None:
        return None
    max_stats = DEFAULT_MAX_STATS if args.max_stats is None else args.max_stats
    for flag, value, low, high in (("--max-ranks", args.max_ranks, 1, 4096), ("--max-stats", args.max_stats, 1, 65536),
                                   ("--banks", args.banks, 3, 64),
                                   ("--max-percentile-stats", hist_slots, 0, 65536)):
        if value is not None and not low <= value <= high:
            raise ConfigError(f"{flag} must be between {low} and {high}, got {value}")
    return Geometry(DEFAULT_MAX_RANKS if args.max_ranks is None else args.max_ranks, max_stats,
                    DEFAULT_BANKS if args.banks is None else args.banks,
                    DEFAULT_HIST_SLOTS if hist_slots is None else hist_slots)


def collector_config(args: argparse.Namespace, job: str) -> CollectorConfig:
    """The :class:`CollectorConfig` of the parsed options; raises :class:`ConfigError` for a bad one."""
    if not 0 <= args.grace_ms <= MAX_GRACE_MS:
        raise ConfigError(f"--grace-ms must be between 0 and {MAX_GRACE_MS}, got {args.grace_ms}")
    for flag, value in (("--hold-ms", args.hold_ms), ("--status-interval", args.status_interval)):
        if value < 0:
            raise ConfigError(f"{flag} must not be negative, got {value}")
    if not 1 <= args.publish_buffer_mb <= 1 << 20:
        raise ConfigError(f"--publish-buffer-mb must be between 1 and 1048576, got {args.publish_buffer_mb}")
    if not 1 <= args.handler_queue <= 100_000_000:
        raise ConfigError(f"--handler-queue must be between 1 and 100000000, got {args.handler_queue}")
    if not 0 < args.straggler_threshold < 1:
        raise ConfigError(f"--straggler-threshold must be above 0 and below 1, got {args.straggler_threshold}")
    if not 1 <= args.straggler_windows <= MAX_WINDOWS:
        raise ConfigError(f"--straggler-windows must be between 1 and {MAX_WINDOWS}, got {args.straggler_windows}")
    if args.publish is not None:
        _check_publish(args.publish, args.allow_remote_publish)
    return CollectorConfig(
        job=job, publish=args.publish, handlers=parse_handler_args(args.handler), grace_ms=args.grace_ms,
        hold_ms=args.hold_ms, publish_buffer_bytes=int(args.publish_buffer_mb * 1024 * 1024),
        handler_queue=args.handler_queue, geometry=geometry_from(args), status_interval_s=args.status_interval,
        straggler_threshold=args.straggler_threshold, straggler_windows=args.straggler_windows,
        prometheus=_checked_listen(args.prometheus), prometheus_node=args.prometheus_node,
        prometheus_sd=_checked_sd(args.prometheus_sd, args.prometheus),
    )


def _checked_listen(listen: str | None) -> str | None:
    if listen is not None:
        from .prometheus import parse_listen

        parse_listen(listen)
    return listen


def _checked_sd(path: str | None, listen: str | None) -> str | None:
    if path is not None and listen is None:
        raise ConfigError("--prometheus-sd needs --prometheus HOST:PORT (the endpoint it names)")
    return path


def _check_publish(endpoint: str, allow_remote: bool) -> None:
    """Refuse a non-loopback TCP endpoint unless asked for; warn that TCP is readable by every local user."""
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
    if not loopback and not allow_remote:
        raise ConfigError(
            f"--publish {endpoint!r} is not on loopback; add --allow-remote-publish if every host that reaches it "
            "may read every stream"
        )
    print(f"shmstat: warning: --publish {endpoint} is a TCP endpoint: any local user"
          f"{'' if loopback else ' and any host that reaches it'} can subscribe and read every event and stat "
          "(the default ipc:// endpoint is owner-only)", file=sys.stderr, flush=True)
