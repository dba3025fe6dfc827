"""``shmstat run``: the per-node agent (:class:`collector.launch.agent.Agent`) over the ranks of a script or module,
with its collector serving the job in a thread of its own (:func:`run_job`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import uuid

from shmstat.errors import ConfigError
from shmstat.shm.runtime import validate_job

from ..daemon.collector import Collector
from ..launch.agent import STOP_SIGNALS, Agent, check_agent_options
from ..launch.worker_shutdown import become_subreaper

__all__ = ["run_job"]


def _check_module_name(name: str) -> None:
    """A module's dotted name, else one sentence. Whether it exists is the ranks' to find (as with torchrun): the
    agent imports none of the job's code."""
    if name.endswith(".py") and os.path.exists(name):
        raise ConfigError(f"-m takes a module name, not a file: run the file without -m (shmstat run {name}) or "
                          f"the module as -m {name[:-3].replace(os.sep, '.')}")
    if not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"-m {name!r} is not a module name (dotted Python names, like pkg.train)")


def run_job(args: argparse.Namespace) -> int:
    """``shmstat run``: collector in a thread, agent in the main thread; returns the workers' exit status (128 +
    the signal's number when a signal stopped the run). The job's segment and lock file are removed on every
    exit once the collector emitted every window; otherwise one line says what was not emitted and how to look."""
    from .options import collector_config  # options imports the daemon: late, as cli does

    job = validate_job(args.job or f"run-{uuid.uuid4().hex[:12]}")
    if args.module:
        _check_module_name(args.script)
    elif not os.path.exists(args.script):
        raise ConfigError(f"script {args.script!r} does not exist")
    check_agent_options(args.nproc_per_node, args.max_restarts, args.monitor_interval, args.stop_grace, args.role)
    config = collector_config(args, job)  # before anything is made
    adopting = become_subreaper()  # the ranks' daemons reparent to us, to be stopped with the ranks
    stopped: list[int] = []
    # a signal ignored when we started stays ignored (nohup's SIGHUP, SIGINT of a job started with & by a script)
    handled = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) != signal.SIG_IGN]
    previous = {sig: signal.signal(sig, lambda signum, _f: stopped.append(signum)) for sig in handled}
    try:
        collector = Collector(config)
        cmd = [sys.executable, "-u", *(["-m"] if args.module else []), args.script, *args.script_args]
        agent = Agent(collector, job, cmd, args.nproc_per_node, max_restarts=args.max_restarts,
                      monitor_interval_s=args.monitor_interval, role=args.role, stop_grace_s=args.stop_grace,
                      adopt_orphans=adopting)
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise
    for sig in handled:
        signal.signal(sig, agent.on_signal)
    for signum in stopped:  # a signal that came while the collector was being made
        agent.on_signal(signum)
    print(f"shmstat run: job {job}, {args.nproc_per_node} workers, collector publish {collector.publish_endpoint}",
          file=sys.stderr, flush=True)
    thread = threading.Thread(target=collector.serve, name="shmstat-collector", daemon=True)
    thread.start()
    try:
        collector.write_ready_file()
        result = agent.run()
    finally:
        collector.request_stop()
        thread.join(30)
        if config.ready_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(config.ready_file)
    if collector.config.status_interval_s > 0:
        collector.print_status(final=True)
    if result.state == "INTERRUPTED":
        how = ", then ".join(signal.Signals(s).name for s in agent.signals_sent) or "nothing (no worker was left)"
        assert agent.stop_signal is not None
        print(f"shmstat run: interrupted by {signal.Signals(agent.stop_signal).name}; sent the workers {how}; "
              f"exit code {result.exit_code}", file=sys.stderr, flush=True)
    else:
        print(f"shmstat run: {result.state.lower()} after {result.restarts} restart(s), exit code {result.exit_code}",
              file=sys.stderr, flush=True)
    kept = collector.finish() if not thread.is_alive() else (
        f"job {job}'s segment kept: the collector did not finish within 30 s, so its last windows may not be emitted "
        f"(inspect: shmstat ls; remove: shmstat clean {job})")
    if kept:
        print(f"shmstat run: {kept}", file=sys.stderr, flush=True)
    return result.exit_code
