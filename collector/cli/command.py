"""The ``shmstat`` command line: collect, run, subscribe, top, ls, clean, demo, keys.

User mistakes print one line on stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from shmstat.errors import ShmstatError

from .options import add_collector_options, collector_config
from .streams import keep_writing

__all__ = ["COMMANDS", "main"]

COMMANDS = ("collect", "run", "subscribe", "top", "ls", "clean", "demo", "keys")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmstat", description="Shared-memory telemetry for distributed jobs.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the collector does")
    p.add_argument("--version", action="version", version=f"shmstat {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    verbose = argparse.ArgumentParser(add_help=False)  # -v after the command too
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log what the collector does")

    def command(name: str, run: Callable[[argparse.Namespace], int], about: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, parents=[verbose], help=about)
        c.set_defaults(run=run)
        return c

    c = command("collect", _collect, "run the per-node collector for a job")
    c.add_argument("--job", action="append", default=[],
                   help="collect only this job (repeatable); without --job, every job of this user on this node")
    add_collector_options(c)

    r = command("run", _run, "start a collector and N ranks of a script or module, like torchrun")
    r.add_argument("--job", default=None, help="job id (default: a fresh one)")
    r.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (default 1, as torchrun)")
    r.add_argument("--max-restarts", type=int, default=0)
    r.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between checks of the ranks")
    r.add_argument("--role", default="default")
    r.add_argument("--stop-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM the workers get the same signal, then SIGTERM and SIGKILL after this long "
                        "each (default 10)")
    r.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module, each rank as 'python -m MODULE ARGS' (torchrun's -m)")
    add_collector_options(r)
    r.add_argument("script", metavar="SCRIPT", help="the script each rank runs (with -m: the module)")
    r.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")

    s = command("subscribe", _subscribe, "print the messages of collectors as JSON lines, and what was lost")
    s.add_argument("endpoints", nargs="*", metavar="ENDPOINT",
                   help="collector publish endpoints (default: every job a collector serves on this node)")
    s.add_argument("--job", action="append", default=[],
                   help="subscribe to this job's collector on this node, until the job ends (repeatable)")
    s.add_argument("--follow", action="store_true", help="with --job: keep following after the job ends")
    s.add_argument("--topic", action="append", default=[], metavar="PREFIX", help="only topics with this prefix")
    s.add_argument("--count", type=int, default=None, help="exit after N messages")
    s.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    s.add_argument("--json", action="store_true",
                   help='also print heartbeats, and {"record": "gap"} and {"record": "end"} lines, on stdout')
    s.add_argument("--curve", default=None, metavar="DIR",
                   help="connect to tcp:// ENDPOINTs of collectors started with --curve, with DIR/client.key_secret "
                        "and the collector's DIR/server.key")
    s.add_argument("--curve-client", default=None, metavar="NAME",
                   help="with --curve: use DIR/NAME.key_secret (a key made with shmstat keys DIR --client NAME)")

    t = command("top", _top, "live view of a job's stats: merged windows, spread across ranks, stragglers")
    t.add_argument("--job", default=None, help="the job to show (default: every job of this user on this node)")
    t.add_argument("--stat", default=None, metavar="GROUP/NAME", help="one row per rank of this stat")
    t.add_argument("--sort", default="name", metavar="KEY",
                   help="name, or count, mean, p99, spread (descending); default name")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    t.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    t.add_argument("--iterations", type=int, default=None, help="stop after N refreshes")

    command("ls", _ls, "list the shmstat segments of this node")
    k = command("clean", _clean, "remove segments of jobs with no live process")
    k.add_argument("job", nargs="?", default=None)

    d = command("demo", _demo, "a demo job: a collector and a few ranks, printing aggregated windows")
    d.add_argument("--ranks", type=int, default=3)
    d.add_argument("--seconds", type=float, default=3.0)
    d.add_argument("--window-ms", type=int, default=500)

    y = command("keys", _keys, "write CURVE keys: a collector's TCP streams only for subscribers holding one")
    y.add_argument("dir", metavar="DIR", help="where the keys go (created owner-only if missing)")
    y.add_argument("--client", default=None, metavar="NAME",
                   help="add a subscriber's pair NAME.key and NAME.key_secret to DIR's key set")
    y.add_argument("--force", action="store_true",
                   help="replace files of the same names (whoever holds the old keys is locked out)")
    return p


def _version() -> str:
    from shmstat import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shmstat`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command in ("collect", "run"):  # daemons: a reader that died (| tee, then Ctrl-C) must not end them
        keep_writing()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.run(args))
    except ShmstatError as exc:
        print(f"shmstat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _collect(args: argparse.Namespace) -> int:
    from ..daemon.collector import Collector

    if len(args.job) == 1:
        collector = Collector(collector_config(args, args.job[0]))
        try:
            return collector.run()
        finally:  # whatever ended the run: the job's segment and lock file go unless something was not emitted
            collector.shutdown()  # (a no-op once run shut down)
            kept = collector.finish()
            if kept:
                print(f"shmstat collector: {kept}", file=sys.stderr, flush=True)
    from shmstat.shm.runtime import validate_job

    from ..daemon.node import NodeCollector

    jobs = [validate_job(j) for j in args.job] or None
    # --publish: one endpoint for every job served (each message names its job); each job keeps its own too
    return NodeCollector(collector_config(args, ""), jobs=jobs).run()


def _run(args: argparse.Namespace) -> int:
    from .launcher import run_job

    return run_job(args)


def _subscribe(args: argparse.Namespace) -> int:
    from shmstat.shm.runtime import validate_job

    from .subscribe import subscribe

    return subscribe(args.endpoints, jobs=[validate_job(j) for j in args.job], follow=args.follow,
                     topics=args.topic, count=args.count, timeout_s=args.timeout, records=args.json,
                     curve=args.curve, curve_client=args.curve_client)


def _top(args: argparse.Namespace) -> int:
    from .top_live import run_top

    return run_top(args.job, stat=args.stat, sort=args.sort, interval_s=args.interval, once=args.once,
                   iterations=args.iterations)


def _ls(args: argparse.Namespace) -> int:
    from .admin import list_segments

    return list_segments()


def _clean(args: argparse.Namespace) -> int:
    from .admin import clean

    return clean(args.job)


def _keys(args: argparse.Namespace) -> int:
    from .keys import instructions, make_keys

    written = make_keys(args.dir, client=args.client, force=args.force)
    print(f"shmstat keys: wrote {', '.join(written)}")
    print(instructions(args.dir, args.client))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo

    return demo(ranks=args.ranks, seconds=args.seconds, window_ms=args.window_ms)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
