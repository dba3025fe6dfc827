"""The ``shmstat`` command line: collect, run, subscribe, top, report, grafana, prometheus-rules, ls, clean, demo,
keys.

User mistakes print one line on stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from shmstat.errors import ConfigError, ShmstatError, see_docs

from .options import add_collector_options, collector_config
from .unbreakable_output import keep_writing

__all__ = ["COMMANDS", "main"]

COMMANDS = ("collect", "run", "subscribe", "top", "report", "grafana", "prometheus-rules", "ls", "clean", "demo",
            "keys")


def _parser() -> argparse.ArgumentParser:
    """The parser of the ``shmstat`` console script: its own options, then one subcommand per name of
    :data:`COMMANDS`, in that order (docs/hooks.py walks it for the CLI reference)."""
    parser = _Parser(prog="shmstat", description="Shared-memory telemetry for distributed jobs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what shmstat does on stderr (INFO level)")
    parser.add_argument("--version", action="version", version=f"shmstat {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], about: str) -> argparse.ArgumentParser:
        return _subcommand(subparsers, name, run, about)

    _collect_arguments(command("collect", _collect,
                               "run this node's collector: every job of yours on it, or the --job ones"))
    _run_arguments(command("run", _run, "start a collector and N ranks of a script or module, like torchrun"))
    _subscribe_arguments(command("subscribe", _subscribe,
                                 "print the messages of collectors as JSON lines, and what was lost"))
    _top_arguments(command("top", _top, "live view of a job's stats: merged windows, spread across ranks, stragglers"))
    _report_arguments(command("report", _report,
                              "one self-contained HTML page of a finished job, from its jsonl output"))
    _grafana_arguments(command("grafana", _grafana,
                               "print a Grafana dashboard (JSON) of the collectors' Prometheus series"))
    _rules_arguments(command("prometheus-rules", _prometheus_rules,
                             "print Prometheus recording and alerting rules (YAML): stragglers job-wide, hangs, "
                             "data lost, collectors down"))
    command("ls", _ls, "list the shmstat segments of this node: RANKS and WRITERS (ranks' worker processes) as "
                       "alive/registered, the collector, SIZE, samples DROPPED")
    _clean_arguments(command("clean", _clean, "remove segments of jobs with no live process"))
    _demo_arguments(command("demo", _demo, "a demo job: a collector and a few ranks, printing aggregated windows"))
    _keys_arguments(command("keys", _keys,
                            "write CURVE keys: a collector's TCP streams only for subscribers holding one"))
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a refused command line is the one sentence that says why, not that sentence under a
    screenful of usage (``--help`` prints the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _subcommand(subparsers: argparse._SubParsersAction[_Parser], name: str,
                run: Callable[[argparse.Namespace], int], about: str) -> argparse.ArgumentParser:
    """Add the subcommand ``name``, run by ``run``, with its own ``-v/--verbose`` (:data:`_VERBOSE` says what it
    logs); returns its parser."""
    command = subparsers.add_parser(name, help=about, description=about)
    command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help=_VERBOSE.get(name, "log what this command does on stderr (INFO level)"))
    command.set_defaults(run=run)
    return command


def _collect_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat collect``'s arguments: the jobs, then the collector's options."""
    command.add_argument("--job", action="append", default=[],
                         help="collect only this job (repeatable); without --job, every job of this user on this node")
    add_collector_options(command)


def _run_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat run``'s arguments: torchrun's that apply to one node, the collector's options, the script."""
    command.add_argument("--job", default=None, help="job id (default: a fresh one)")
    command.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                         help="ranks on this node (default 1, as torchrun)")
    command.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                         help="restart the whole group this many times after a rank fails (default 0, as torchrun)")
    command.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                         help="seconds between checks of the ranks (default 0.1)")
    command.add_argument("--role", default="default",
                         help="the worker role, in the agent's metric names workers.ROLE.* (default 'default', as "
                              "torchrun)")
    command.add_argument("--standalone", action="store_true",
                         help="accepted for torchrun's sake: shmstat run is always one standalone node")
    command.add_argument("--nnodes", type=_one_node, default="1", metavar="1",
                         help="accepted for torchrun's sake as 1 or 1:1; for more nodes use torchrun with a node "
                              f"collector ({see_docs('guides/torchrun.md')})")
    command.add_argument("--stop-grace", type=float, default=10.0, metavar="SECONDS",
                         help="on SIGINT/SIGTERM the workers get the same signal, then SIGTERM and SIGKILL after this "
                              "long each (default 10)")
    command.add_argument("-m", "--module", action="store_true",
                         help="run SCRIPT as a module, each rank as 'python -m MODULE ARGS' (torchrun's -m)")
    add_collector_options(command)
    command.add_argument("script", metavar="SCRIPT", help="the script each rank runs (with -m: the module)")
    command.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")


def _subscribe_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat subscribe``'s arguments: what to subscribe to, what to print, when to stop, the CURVE keys."""
    command.add_argument("endpoints", nargs="*", metavar="ENDPOINT",
                         help="collector publish endpoints (default: every job a collector serves on this node)")
    command.add_argument("--job", action="append", default=[],
                         help="subscribe to this job's collector on this node, until the job ends (repeatable)")
    command.add_argument("--follow", action="store_true", help="with --job: keep following after the job ends")
    command.add_argument("--topic", action="append", default=[], metavar="PREFIX",
                         help="only topics with this prefix")
    command.add_argument("--count", type=int, default=None, help="exit after N messages")
    command.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    command.add_argument("--json", action="store_true",
                         help='also print heartbeats, and {"record": "gap"} and {"record": "end"} lines, on stdout')
    command.add_argument("--curve", default=None, metavar="DIR",
                         help="connect to tcp:// ENDPOINTs of collectors started with --curve, with "
                              "DIR/client.key_secret and the collector's DIR/server.key")
    command.add_argument("--curve-client", default=None, metavar="NAME",
                         help="with --curve: use DIR/NAME.key_secret (a key made with shmstat keys DIR --client NAME)")


def _top_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat top``'s arguments: what to show, how to sort it, how often."""
    command.add_argument("--job", default=None, help="the job to show (default: every job of this user on this node)")
    command.add_argument("--stat", default=None, metavar="GROUP/NAME", help="one row per rank of this stat")
    command.add_argument("--sections", action="store_true",
                         help="one row per rank: its time split across its sections (shmstat.section), the section "
                              "it is in now and for how long")
    command.add_argument("--sort", default="name", metavar="KEY",
                         help="name, or count, mean, p99, spread (descending); default name; with --sections name "
                              "or spread (the worst score first)")
    command.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    command.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    command.add_argument("--iterations", type=int, default=None, help="stop after N refreshes")
    command.add_argument("--history", type=int, default=20, metavar="N",
                         help="windows kept per stat for the sparklines and straggler marks under the table "
                              "(default 20)")
    command.add_argument("--nodes", nargs="+", default=None, metavar="ENDPOINT",
                         help="the job across nodes: their collectors' publish endpoints (tcp://HOST:PORT or "
                              "NODE=tcp://HOST:PORT), each rank and node scored against the job-wide median")
    command.add_argument("--curve", default=None, metavar="DIR",
                         help="with --nodes: connect as subscribe --curve DIR does")
    command.add_argument("--curve-client", default=None, metavar="NAME",
                         help="with --nodes --curve: use DIR/NAME.key_secret")
    command.add_argument("--silent-after", type=float, default=None, metavar="SECONDS",
                         help="with --nodes: a node that sends nothing, not even a heartbeat, for SECONDS is shown "
                              "silent (default 5: five beats of a collector's --heartbeat-interval)")


def _report_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat report``'s arguments: the job's files, where the page goes, the straggler threshold."""
    command.add_argument("jsonl", metavar="JSONL", nargs="+",
                         help="the job's windows, as the jsonl:PATH handler wrote them; one file per node for a job "
                              "across nodes")
    command.add_argument("--events", action="append", default=None, metavar="FILE",
                         help="the job's events, as --events jsonl:FILE wrote them (a timeline, hangs, restarts and "
                              "gaps); repeatable, one per node")
    command.add_argument("-o", "--output", default=None, metavar="HTML",
                         help="where the page goes (default: the first JSONL with the suffix .html)")
    command.add_argument("--job", default=None,
                         help="the job to show, when JSONL holds several (a node collector's)")
    command.add_argument("--threshold", type=float, default=None, metavar="SCORE",
                         help="mark a rank's window as a straggler's under this score (default 0.75, the collector's)")


def _grafana_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat grafana``'s arguments: the dashboard's title and uid."""
    command.add_argument("--title", default="shmstat", help="the dashboard's title (default shmstat)")
    command.add_argument("--uid", default="shmstat-jobs", help="the dashboard's uid (default shmstat-jobs)")


def _rules_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat prometheus-rules``' arguments: the straggler threshold and windows, the interval, the hang
    threshold and the collectors' scrape job."""
    from ..daemon.straggler import DEFAULT_THRESHOLD, DEFAULT_WINDOWS
    from .prometheus_rules import DEFAULT_HANG_AFTER_S, DEFAULT_INTERVAL_S

    command.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, metavar="SCORE",
                         help="a rank or node scoring under this against the job-wide median rank is slow "
                              f"(default {DEFAULT_THRESHOLD}, the collector's)")
    command.add_argument("--windows", type=int, default=DEFAULT_WINDOWS, metavar="N",
                         help="alert once a rank or node stays slow for N intervals (the alerts' for: is "
                              f"N x --interval; default {DEFAULT_WINDOWS}, the collector's)")
    command.add_argument("--interval", type=int, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                         help="a rank is scored (on its newest window's figure) while it added samples within the "
                              f"last SECONDS; also the data-lost and collector-down windows (default "
                              f"{DEFAULT_INTERVAL_S}; at least 4 scrape intervals and more than the stats' window)")
    command.add_argument("--hang-after", type=float, default=DEFAULT_HANG_AFTER_S, metavar="SECONDS",
                         help="a rank outside a wait section with no progress for SECONDS while another rank of its "
                              f"job waits is hung (default {DEFAULT_HANG_AFTER_S:g})")
    command.add_argument("--scrape-job", default="shmstat", metavar="NAME",
                         help="the job_name of the scrape configuration of the collectors, whose up series says "
                              "one is down (default shmstat)")


def _clean_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat clean``'s argument: the job."""
    command.add_argument("job", nargs="?", default=None, metavar="JOB",
                         help="clean only this job (default: every job of yours with no live process)")


def _demo_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat demo``'s arguments: ranks, duration, window."""
    command.add_argument("--ranks", type=int, default=3, help="ranks to start, rank 1 slowed on purpose (default 3)")
    command.add_argument("--seconds", type=float, default=3.0, help="how long the ranks run (default 3)")
    command.add_argument("--window-ms", type=int, default=500,
                         help="the stats' window in milliseconds (default 500)")


def _keys_arguments(command: argparse.ArgumentParser) -> None:
    """``shmstat keys``' arguments: where the keys go, a subscriber's pair, replacing."""
    command.add_argument("dir", metavar="DIR", help="where the keys go (created owner-only if missing)")
    command.add_argument("--client", default=None, metavar="NAME",
                         help="add a subscriber's pair NAME.key and NAME.key_secret to DIR's key set")
    command.add_argument("--force", action="store_true",
                         help="replace files of the same names (whoever holds the old keys is locked out)")


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
    flags = [extra.partition("=")[0] for extra in extras]
    torchrun = [flag for flag in flags if flag in _TORCHRUN_ONLY]
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
            collector.close()  # (a no-op once run closed it)
            kept = collector.finish()
            if kept:
                print(f"shmstat collector: {kept}", file=sys.stderr, flush=True)
    from shmstat.shm.runtime import validate_job

    from ..daemon.node import NodeCollector

    jobs = [validate_job(job) for job in args.job] or None
    # --publish: one endpoint for every job served (each message names its job); each job keeps its own too
    return NodeCollector(collector_config(args, ""), jobs=jobs).run()


def _run(args: argparse.Namespace) -> int:
    from .run import run_job

    return run_job(args)


def _subscribe(args: argparse.Namespace) -> int:
    from shmstat.shm.runtime import validate_job

    from .subscribe import subscribe

    return subscribe(args.endpoints, jobs=[validate_job(job) for job in args.job], follow=args.follow,
                     topics=args.topic, count=args.count, timeout_s=args.timeout, records=args.json,
                     curve=args.curve, curve_client=args.curve_client)


def _top(args: argparse.Namespace) -> int:
    if args.nodes is not None:
        from .top_nodes import run_top_nodes

        if args.job is not None:
            raise ConfigError("--nodes shows every job the nodes' collectors publish; leave out --job")
        silent = {} if args.silent_after is None else {"silent_after_s": args.silent_after}
        return run_top_nodes(args.nodes, curve=args.curve, curve_client=args.curve_client, stat=args.stat,
                             interval_s=args.interval, once=args.once, iterations=args.iterations, **silent)
    if args.curve is not None or args.curve_client is not None:
        raise ConfigError("--curve connects to other nodes' collectors: add --nodes ENDPOINT...")
    if args.silent_after is not None:
        raise ConfigError("--silent-after is how long a node of --nodes may send nothing: add --nodes ENDPOINT...")
    from .top_live import run_top

    return run_top(args.job, stat=args.stat, sort=args.sort, interval_s=args.interval, once=args.once,
                   iterations=args.iterations, history=args.history, sections=args.sections)


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


def _prometheus_rules(args: argparse.Namespace) -> int:
    from .prometheus_rules import rules_yaml

    print(rules_yaml(threshold=args.threshold, windows=args.windows, interval_s=args.interval,
                     hang_after_s=args.hang_after, scrape_job=args.scrape_job), end="")
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
