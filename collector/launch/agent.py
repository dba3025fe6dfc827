"""``shmstat run``: the per-node agent. Starts the collector and N ranks like ``torchrun``, restarts them.

Each rank runs ``python -u SCRIPT ARGS``, or with ``-m``/``--module`` ``python -u -m MODULE ARGS`` (torchrun's
``-m``: a flag that makes the positional a module name); ``--nproc-per-node`` is 1 unless given, as torchrun's.

The agent plays torchelastic's local agent on one node: it sets the environment torchrun sets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
...), watches the worker group, restarts the whole group when a worker fails (up to ``--max-restarts``
times; each restart is a new incarnation of every rank) and exits with the workers' status. Signals are handled
as torchrun's agent does (:mod:`collector.launch.worker_shutdown`): the signal received (SIGINT, SIGTERM, SIGHUP,
SIGQUIT) is forwarded to every worker's process group, then SIGTERM and SIGKILL follow after ``stop_grace_s`` each,
and the launcher exits with 128 + the signal's number (130 on Ctrl-C), no process of the group left. The launcher owns
every process of the job: it is their child subreaper, so a daemon a rank starts (``setsid cmd &``, a double-forked
helper) is reparented to it, reaped when it ends, and stopped with the ranks on every way the run ends. It emits the
agent's metrics in group ``torchelastic`` under torchelastic's names and the ``torchelastic.worker.status.<STATE>``
events, through the collector it runs in a thread of its own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from elastic import metrics
from shmstat.errors import ConfigError
from shmstat.names import check_name

from ..daemon.collector import Collector
from ..handlers.protocol import AgentMetricData
from .worker_shutdown import reap_adopted, stop_group

__all__ = ["STOP_SIGNALS", "Agent", "AgentResult", "check_agent_options"]

AGENT_GROUP = "torchelastic"
DEFAULT_STOP_GRACE_S = 10.0
"""Seconds a worker group is given after each stopping signal before the next, stronger one."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals ``shmstat run`` forwards to its workers (torchrun's agent's)."""


@dataclass
class _Worker:
    local_rank: int
    proc: subprocess.Popen
    started: float


@dataclass
class AgentResult:
    """How the run ended."""

    state: str
    """``SUCCEEDED``, ``FAILED``, or ``INTERRUPTED`` (a signal stopped the run: ``exit_code`` is 128 + its
    number)."""
    exit_code: int
    restarts: int
    failures: list[tuple[int, int]] = field(default_factory=list)
    """(local rank, exit code) of every failed worker, over all attempts."""


class _ToCollector(metrics.MetricHandler):
    """Hands the agent's own metrics to the collector running in this process, as the agent's metrics of the job
    (:class:`collector.handlers.protocol.AgentMetricData`)."""

    def __init__(self, collector: Collector, job: str) -> None:
        self.collector = collector
        self.job = job

    def emit(self, metric_data: metrics.MetricData) -> None:
        self.collector.submit_metric(AgentMetricData.of(metric_data, self.job))


class Agent:
    """Runs one worker group of ``nproc`` copies of ``cmd`` next to a collector."""

    def __init__(
        self, collector: Collector, job: str, cmd: list[str], nproc: int, *, max_restarts: int = 0,
        monitor_interval_s: float = 0.1, role: str = "default", env: dict[str, str] | None = None,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S, adopt_orphans: bool = False,
    ) -> None:
        check_agent_options(nproc, max_restarts, monitor_interval_s, stop_grace_s, role)
        self.collector = collector
        self.job = job
        self.cmd = cmd
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.remaining_restarts = max_restarts
        self.monitor_interval_s = monitor_interval_s
        self.role = role
        self.base_env = dict(os.environ if env is None else env)
        self.workers: list[_Worker] = []
        self.restart_count = 0
        self.stop_grace_s = stop_grace_s
        self.adopt_orphans = adopt_orphans
        """This process is the job's child subreaper and starts no other process: every process below it is one
        of the job's, and is stopped and reaped with the workers (``shmstat run``; see
        :func:`collector.launch.worker_shutdown.become_subreaper`)."""
        self.stop_signal: int | None = None
        """The first stopping signal received (set by :meth:`on_signal`)."""
        self.signals_received = 0
        self.signals_sent: list[int] = []
        """What stopping the group took, for the final report (e.g. SIGINT, then SIGTERM)."""
        self.master_port = _free_port()
        metrics.configure(_ToCollector(collector, job), AGENT_GROUP)

    # -- workers -----------------------------------------------------------------------------------------
    def _worker_env(self, local_rank: int) -> dict[str, str]:
        env = dict(self.base_env)
        env.update({
            "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(local_rank), "ROLE_NAME": self.role, "ROLE_WORLD_SIZE": str(self.nproc),
            "WORLD_SIZE": str(self.nproc), "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RUN_ID": self.job, "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "False",
            "SHMSTAT_JOB": self.job, "SHMSTAT_RANK": str(local_rank), "SHMSTAT_LOCAL_RANK": str(local_rank),
            "SHMSTAT_WORLD_SIZE": str(self.nproc), "PYTHONUNBUFFERED": "1",
        })
        return env

    @metrics.prof(group=AGENT_GROUP)
    def _start_workers(self) -> None:
        self.workers = []
        for r in range(self.nproc):
            proc = subprocess.Popen(self.cmd, env=self._worker_env(r), start_new_session=True)
            self.workers.append(_Worker(r, proc, time.time()))
            self._status_event("START", r, proc.pid, None)

    def on_signal(self, signum: int, _frame: object = None) -> None:
        """Record a stopping signal (safe in a signal handler): the run loop stops the group with it; a further
        one cuts the current grace period short."""
        if self.stop_signal is None:
            self.stop_signal = signum
        self.signals_received += 1

    @metrics.prof(group=AGENT_GROUP)
    def _stop_workers(self, sig: int = signal.SIGTERM) -> None:
        sent = stop_group([w.proc for w in self.workers], sig, self.stop_grace_s,
                          insisted=lambda: self.signals_received, adopted=self.adopt_orphans)
        if sent:
            self.signals_sent = sent

    @metrics.prof(group=AGENT_GROUP)
    def _restart_workers(self) -> None:
        self._stop_workers()
        if self.stop_signal is not None:
            return  # a signal came while the group stopped: the run loop ends it, nothing new is started
        self.restart_count += 1
        self._start_workers()

    @metrics.prof(group=AGENT_GROUP)
    def _monitor_workers(self) -> tuple[str, list[tuple[int, int]]]:
        codes = [(w.local_rank, w.proc.poll()) for w in self.workers]
        failed = [(r, c) for r, c in codes if c is not None and c != 0]
        if failed:
            return "FAILED", [(r, int(c)) for r, c in failed]
        if all(c == 0 for _, c in codes):
            return "SUCCEEDED", []
        return "HEALTHY", []

    def _status_event(self, state: str, local_rank: int, pid: int, exit_code: int | None) -> None:
        w = self.workers[local_rank] if local_rank < len(self.workers) else None
        duration_ms = int((time.time() - w.started) * 1000) if w is not None and state != "START" else 0
        data: dict[str, str | int | float | bool] = {
            "run_id": self.job, "global_rank": local_rank, "group_rank": 0, "worker_id": str(pid),
            "role": self.role, "hostname": socket.gethostname(), "state": state,
            "total_run_time": duration_ms // 1000, "raw_error": "" if not exit_code else f"exit code {exit_code}",
            "agent_restarts": self.restart_count, "duration_ms": duration_ms, "source": "AGENT",
        }
        self.collector.submit_event(f"torchelastic.worker.status.{state}", data)

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self) -> AgentResult:
        """Start the group, watch it, restart on failure; returns when the group succeeded, gave up or was
        stopped by a signal, with no process of the group left on any of these paths."""
        try:
            result = self._run()
        finally:
            self._stop_workers()  # children a finished rank left behind, or everything after an exception
        self._record_final(result)
        return result

    def _run(self) -> AgentResult:
        failures: list[tuple[int, int]] = []
        self._start_workers()
        role = self.role
        while True:
            time.sleep(self.monitor_interval_s)
            if self.adopt_orphans:  # daemons of the ranks that ended, reparented to us
                reap_adopted([w.proc for w in self.workers])
            if self.stop_signal is not None:
                return self._interrupted(failures)
            state, failed = self._monitor_workers()
            metrics.put_metric(f"workers.{role}.remaining_restarts", self.remaining_restarts, AGENT_GROUP)
            metrics.put_metric(f"workers.{role}.{state.lower()}", 1, AGENT_GROUP)
            if state == "SUCCEEDED":
                for w in self.workers:
                    self._status_event("SUCCEEDED", w.local_rank, w.proc.pid, 0)
                return AgentResult("SUCCEEDED", 0, self.restart_count, failures)
            if state == "FAILED":
                failures.extend(failed)
                for r, code in failed:
                    self._status_event("FAILED", r, self.workers[r].proc.pid, code)
                if self.remaining_restarts > 0:
                    self.remaining_restarts -= 1
                    for w in self.workers:
                        if w.proc.poll() is None:
                            self._status_event("TERMINATED", w.local_rank, w.proc.pid, None)
                    self._restart_workers()
                    continue
                self._stop_workers()
                if self.stop_signal is not None:
                    return self._interrupted(failures)
                return AgentResult("FAILED", failed[0][1] if failed[0][1] > 0 else 1, self.restart_count, failures)

    def _interrupted(self, failures: list[tuple[int, int]]) -> AgentResult:
        sig = self.stop_signal
        assert sig is not None
        for w in self.workers:
            if w.proc.poll() is None:
                self._status_event("TERMINATED", w.local_rank, w.proc.pid, None)
        self._stop_workers(sig)
        return AgentResult("INTERRUPTED", 128 + sig, self.restart_count, failures)

    def _record_final(self, result: AgentResult) -> None:
        role = self.role
        if result.state != "SUCCEEDED":
            flakiness = 100
        else:
            flakiness = int(100 - 100 * (self.remaining_restarts + 1) / (self.max_restarts + 1))
        metrics.put_metric(f"workers.{role}.flakiness", flakiness, AGENT_GROUP)
        metrics.put_metric(f"workers.{role}.run_total", 1, AGENT_GROUP)
        retried = self.restart_count > 0
        outcome = ("run_success_" if result.state == "SUCCEEDED" else "run_failed_") + (
            "with_retries" if retried else "no_retries")
        for name in ("run_success_with_retries", "run_success_no_retries", "run_failed_with_retries",
                     "run_failed_no_retries"):
            metrics.put_metric(f"workers.{role}.{name}", 1 if name == outcome else 0, AGENT_GROUP)


def check_agent_options(nproc: int, max_restarts: int, monitor_interval_s: float, stop_grace_s: float,
                        role: str) -> None:
    """The agent's options, else one sentence (:class:`ConfigError`)."""
    # the longest metric name the agent puts for its role follows the name rule (else put_metric raises mid-run)
    check_name(f"workers.{role}.run_success_with_retries", "--role gives the metric name")
    if not 1 <= nproc <= 4096:
        raise ConfigError(f"--nproc-per-node must be between 1 and 4096, got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must not be negative, got {max_restarts}")
    if not 0 < monitor_interval_s <= 3600:
        raise ConfigError(f"--monitor-interval must be more than 0 and at most 3600 seconds, got {monitor_interval_s}")
    if not 0 <= stop_grace_s <= 3600:
        raise ConfigError(f"--stop-grace must be between 0 and 3600 seconds, got {stop_grace_s}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
