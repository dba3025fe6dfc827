"""The ``shmstat`` command line: collect, run, subscribe, top, ls, clean, demo.

User mistakes print one line on stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from shmstat.errors import ShmstatError
from shmstat.layout import DEFAULT_BANKS, DEFAULT_MAX_RANKS, DEFAULT_MAX_STATS, Geometry

__all__ = ["COMMANDS", "main"]

COMMANDS = ("collect", "run", "subscribe", "top", "ls", "clean", "demo")


def _add_collector_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--publish", default="tcp://127.0.0.1:0",
                   help="XPUB endpoint for subscribers (default: tcp://127.0.0.1:0, a free port, printed)")
    p.add_argument("--handler", action="append", default=[], metavar="GROUP=SPEC",
                   help="handler for a metric group: console, null, jsonl:PATH, pkg.module:Class; GROUP * = default")
    p.add_argument("--grace-ms", type=int, default=20, help="wait this long after a window ends (default 20)")
    p.add_argument("--publish-hwm", type=int, default=1000,
                   help="messages queued per subscriber before a slow one loses messages (default 1000)")
    p.add_argument("--hold-ms", type=int, default=300,
                   help="at start-up, hold the ranks' events up to this long for subscribers to reconnect "
                        "(default 300)")
    p.add_argument("--status-interval", type=float, default=30.0,
                   help="seconds between progress lines on stderr (default 30, 0 = none)")
    p.add_argument("--max-ranks", type=int, default=None, help=f"segment capacity (default {DEFAULT_MAX_RANKS})")
    p.add_argument("--max-stats", type=int, default=None, help=f"stats per rank (default {DEFAULT_MAX_STATS})")
    p.add_argument("--banks", type=int, default=None, help=f"windows kept per stat (default {DEFAULT_BANKS})")


def geometry_from(args: argparse.Namespace) -> Geometry | None:
    """The capacities asked for on the command line, or None to accept an existing segment's."""
    if args.max_ranks is None and args.max_stats is None and args.banks is None:
        return None
    return Geometry(args.max_ranks or DEFAULT_MAX_RANKS, args.max_stats or DEFAULT_MAX_STATS,
                    args.banks or DEFAULT_BANKS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmstat", description="Shared-memory telemetry for distributed jobs.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the collector does")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("collect", help="run the per-node collector for a job")
    c.add_argument("--job", required=True)
    _add_collector_options(c)

    r = sub.add_parser("run", help="start a collector and N ranks of a script, like torchrun")
    r.add_argument("--job", default=None, help="job id (default: a fresh one)")
    r.add_argument("--nproc-per-node", type=int, required=True)
    r.add_argument("--max-restarts", type=int, default=0)
    r.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between checks of the ranks")
    r.add_argument("--role", default="default")
    _add_collector_options(r)
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)

    s = sub.add_parser("subscribe", help="print every message of one or more collectors as JSON lines")
    s.add_argument("endpoints", nargs="+", metavar="ENDPOINT")
    s.add_argument("--topic", action="append", default=[], metavar="PREFIX", help="only topics with this prefix")
    s.add_argument("--count", type=int, default=None, help="exit after N messages")
    s.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")

    t = sub.add_parser("top", help="live per-rank view of a job's segment")
    t.add_argument("--job", required=True)
    t.add_argument("--interval", type=float, default=1.0)
    t.add_argument("--iterations", type=int, default=None, help="stop after N refreshes")

    sub.add_parser("ls", help="list the shmstat segments of this node")
    k = sub.add_parser("clean", help="remove segments of jobs with no live process")
    k.add_argument("job", nargs="?", default=None)

    d = sub.add_parser("demo", help="a demo job: a collector and a few ranks, printing aggregated windows")
    d.add_argument("--ranks", type=int, default=3)
    d.add_argument("--seconds", type=float, default=3.0)
    d.add_argument("--window-ms", type=int, default=500)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shmstat`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return _dispatch(args)
    except ShmstatError as exc:
        print(f"shmstat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "collect":
        from .daemon import Collector, CollectorConfig
        from .handlers import parse_handler_args

        config = CollectorConfig(job=args.job, publish=args.publish, handlers=parse_handler_args(args.handler),
                                 grace_ms=_non_negative(args.grace_ms, "--grace-ms"),
                                 hold_ms=_non_negative(args.hold_ms, "--hold-ms"),
                                 publish_hwm=_non_negative(args.publish_hwm, "--publish-hwm"),
                                 geometry=geometry_from(args),
                                 status_interval_s=args.status_interval)
        return Collector(config).run()
    if cmd == "run":
        from .launcher import run_job

        return run_job(args)
    if cmd == "subscribe":
        from .subscribe import subscribe

        return subscribe(args.endpoints, topics=args.topic, count=args.count, timeout_s=args.timeout)
    if cmd == "top":
        from .admin import top

        return top(args.job, interval_s=args.interval, iterations=args.iterations)
    if cmd == "ls":
        from .admin import list_segments

        return list_segments()
    if cmd == "clean":
        from .admin import clean

        return clean(args.job)
    if cmd == "demo":
        from .demo import demo

        return demo(ranks=args.ranks, seconds=args.seconds, window_ms=args.window_ms)
    raise AssertionError(cmd)


def _non_negative(value: int, flag: str) -> int:
    from shmstat.errors import ConfigError

    if value < 0:
        raise ConfigError(f"{flag} must not be negative, got {value}")
    return value


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
