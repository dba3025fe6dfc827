"""The ``shmstat`` command line: collect, run, subscribe, top, report, grafana, ls, clean, demo, keys.

User mistakes print one line on stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from shmstat.errors import ShmstatError, see_docs

from .options import add_collector_options, collector_config
from .streams import keep_writing

__all__ = ["COMMANDS", "main"]

COMMANDS = ("collect", "run", "subscribe", "top", "report", "grafana", "ls", "clean", "demo", "keys")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmstat", description="Shared-memory telemetry for distributed jobs.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what shmstat does on stderr (INFO level)")
    p.add_argument("--version", action="version", version=f"shmstat {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], about: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=about, description=about)
        c.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help=_VERBOSE.get(name, "log what this command does on stderr (INFO level)"))
        c.set_defaults(run=run)
        return c

    c = command("collect", _collect, "run this node's collector: every job of yours on it, or the --job ones")
    c.add_argument("--job", action="append", default=[],
                   help="collect only this job (repeatable); without --job, every job of this user on this node")
    add_collector_options(c)

    r = command("run", _run, "start a collector and N ranks of a script or module, like torchrun")
    r.add_argument("--job", default=None, help="job id (default: a fresh one)")
    r.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="ranks on this node (default 1, as torchrun)")
    r.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the whole group this many times after a rank fails (default 0, as torchrun)")
    r.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                   help="seconds between checks of the ranks (default 0.1)")
    r.add_argument("--role", default="default",
                   help="the worker role, in the agent's metric names workers.ROLE.* (default 'default', as torchrun)")
    r.add_argument("--standalone", action="store_true",
                   help="accepted for torchrun's sake: shmstat run is always one standalone node")
    r.add_argument("--nnodes", type=_one_node, default="1", metavar="1",
                   help="accepted for torchrun's sake as 1 or 1:1; for more nodes use torchrun with a node collector "
                        f"({see_docs('guides/torchrun.md')})")
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
    t.add_argument("--history", type=int, default=20, metavar="N",
                   help="windows kept per stat for the sparklines and straggler marks under the table (default 20)")

    o = command("report", _report, "one self-contained HTML page of a finished job, from its jsonl output")
    o.add_argument("jsonl", metavar="JSONL", help="the job's windows, as the jsonl:PATH handler wrote them")
    o.add_argument("--events", default=None, metavar="FILE",
                   help="the job's events, as --events jsonl:FILE wrote them (a timeline, restarts and gaps)")
    o.add_argument("-o", "--output", default=None, metavar="HTML",
                   help="where the page goes (default: JSONL with the suffix .html)")
    o.add_argument("--job", default=None, help="the job to show, when JSONL holds several (a node collector's)")
    o.add_argument("--threshold", type=float, default=None, metavar="SCORE",
                   help="mark a rank's window as a straggler's under this score (default 0.75, the collector's)")

    g = command("grafana", _grafana, "print a Grafana dashboard (JSON) of the collectors' Prometheus series")
    g.add_argument("--title", default="shmstat", help="the dashboard's title (default shmstat)")
    g.add_argument("--uid", default="shmstat-jobs", help="the dashboard's uid (default shmstat-jobs)")

    command("ls", _ls, "list the shmstat segments of this node: RANKS and WRITERS (ranks' worker processes) as "
                       "alive/registered, the collector, SIZE, samples DROPPED")
    k = command("clean", _clean, "remove segments of jobs with no live process")
    k.add_argument("job", nargs="?", default=None, metavar="JOB",
                   help="clean only this job (default: every job of yours with no live process)")

    d = command("demo", _demo, "a demo job: a collector and a few ranks, printing aggregated windows")
    d.add_argument("--ranks", type=int, default=3, help="ranks to start, rank 1 slowed on purpose (default 3)")
    d.add_argument("--seconds", type=float, default=3.0, help="how long the ranks run (default 3)")
    d.add_argument("--window-ms", type=int, default=500, help="the stats' window in milliseconds (default 500)")

    y = command("keys", _keys, "write CURVE keys: a collector's TCP streams only for subscribers holding one")
    y.add_argument("dir", metavar="DIR", help="where the keys go (created owner-only if missing)")
    y.add_argument("--client", default=None, metavar="NAME",
                   help="add a subscriber's pair NAME.key and NAME.key_secret to DIR's key set")
    y.add_argument("--force", action="store_true",
                   help="replace files of the same names (whoever holds the old keys is locked out)")
    return p


_VERBOSE = {
    "collect": "log what the collector does on stderr (INFO level)",
    "run": "log what the collector and the agent do on stderr (INFO level)",
    "demo": "log what the demo's collector does on stderr (INFO level)",
    "subscribe": "log what the subscriber does on stderr (INFO level)",
    "top": "log what top does on stderr (INFO level)",
    "ls": "log what ls does on stderr (INFO level)",
    "clean": "log what clean does on stderr (INFO level)",
    "keys": "log what keys does on stderr (INFO level)",
}

_TORCHRUN_ONLY = ("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id",
                  "--rdzv-conf", "--rdzv_conf", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
                  "--master-port", "--master_port", "--max-nodes", "--local-addr", "--local_addr")
"""torchrun's rendezvous flags: ``shmstat run`` makes its own rendezvous on one node, so they get a pointer to
torchrun instead."""


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> NoReturn:
    """Refuse arguments no parser took, with the usage of the subcommand they were given to, and a pointer for
    torchrun's multi-node flags."""
    sub = _subparser(parser, getattr(args, "command", None))
    torchrun = [e.partition("=")[0] for e in extras if e.partition("=")[0] in _TORCHRUN_ONLY]
    if sub is not None and args.command == "run" and torchrun:
        sub.error(f"{torchrun[0]} is torchrun's rendezvous (shmstat run makes its own, on one node); for more use "
                  f"torchrun with a node collector ({see_docs('guides/torchrun.md')})")
    (sub or parser).error(f"unrecognized arguments: {' '.join(extras)}")


def _one_node(text: str) -> str:
    """``--nnodes`` as torchrun takes it, accepted only where it means this one node (1, 1:1)."""
    if text.strip() in ("1", "1:1"):
        return text
    raise argparse.ArgumentTypeError(f"shmstat run runs one node (1 or 1:1, got {text!r}); for more use torchrun "
                                     f"with a node collector ({see_docs('guides/torchrun.md')})")


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            sub: argparse.ArgumentParser = action.choices[name]
            return sub
    return None


def _version() -> str:
    from shmstat import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shmstat`` console script; returns the exit status."""
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
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
                   iterations=args.iterations, history=args.history)


def _report(args: argparse.Namespace) -> int:
    from ..daemon.straggler import DEFAULT_THRESHOLD
    from .report import write_report

    threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
    out = write_report(args.jsonl, args.output, events=args.events, job=args.job, threshold=threshold)
    print(f"shmstat report: wrote {out}")
    return 0


def _grafana(args: argparse.Namespace) -> int:
    from .grafana import dashboard_json

    print(dashboard_json(title=args.title, uid=args.uid))
    return 0


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
