"""The whole job across nodes, live: node collectors' streams turned into job-wide straggler and hang events.

:func:`watch` subscribes to the publish endpoints of several node collectors (``shmstat collect --publish
tcp://...``, CURVE as ``shmstat subscribe --curve`` takes it), one endpoint standing for one node, and yields
:class:`WatchEvent` s. :class:`JobWatch` is its logic, without sockets (fed decoded messages and a clock): what
``shmstat top --nodes`` shows is its :meth:`JobWatch.views`.

Scoring: every ``stat/`` window of a rank (its figure, :func:`collector.daemon.scoring.figure`'s: the p50 when
the stat keeps percentiles, else the mean; stats the collector does not score are not scored here either: a wait
section, a count alone, GPU figures) is gathered across the nodes by job, stat and window; a window is scored once
every node that sends the stat has sent a later window of it, or ``settle_s`` after its first rows arrived. Each
rank is scored against the median of every rank of the job (:func:`~collector.daemon.scoring.score_blocks`, the
one rule), and each node's figure (the median of its ranks') against the same job-wide median
(:func:`~collector.daemon.scoring.score_against`). A node scoring under ``threshold`` for ``windows`` windows in
a row is a slow node (:data:`JOB_STRAGGLER_EVENT` with ``rank`` -1): its ranks sit below the job while equal to
each other, which no node collector can see. A rank is a straggler (the same event with its rank) when it scores
under the threshold for as long; on a slow node a rank is scored against its own node's median instead, so a slow
node is named once, not once per rank. When either scores at or above the threshold again:
:data:`JOB_RECOVERED_EVENT`.

Hangs: each node collector names a hang on its node (``shmstat.hang``, ``--hang-after``), with the ranks it
suspects; a node whose ranks all wait in one wait section says the rank holding the job is elsewhere. Across the
nodes the holder is the rank a node suspects outside every wait section: :data:`JOB_HANG_EVENT` names it, its node
and its section, and the nodes that wait; once no node hangs any more, :data:`JOB_HANG_RESOLVED_EVENT` (a node's
resolution with reason ``changed`` is not one: that node names the hang again at once, on its new picture).

Silence: a node collector sends a heartbeat every ``--heartbeat-interval`` (1 s by default) besides its data, so
a node heard of that sends nothing for ``silent_after_s`` (5 s: five beats) is gone quiet (a host down, its
collector killed, the network cut): :data:`NODE_SILENT_EVENT`, once, and :data:`NODE_BACK_EVENT` when it is heard
again. While it is silent no window waits for it, its rows not yet scored are left out (a dead node's last
windows are not scored against the live ones) and :meth:`JobWatch.views` lists it as silent, not with its last
figures. A node whose collector said its final heartbeat (it closed, or the job ended there) is not silent for
its quiet after it.

Losses: the collectors' heartbeats are compared with what arrived (:class:`shmstat.wire.heartbeat.GapTracker`);
windows lost on the way are yielded as :data:`GAP_EVENT` (and counted in :attr:`JobWatch.lost`), rows of a
window that arrive after it was scored are counted in :attr:`JobWatch.late`, never silently folded in, and
messages that do not decode are skipped and counted in :attr:`JobWatch.undecodable`: each message received is
taken or counted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq

from shmstat import wire
from shmstat.errors import ConfigError, WireError
from shmstat.wire.heartbeat import SENDER_STREAM, GapTracker, followed_kinds
from shmstat.wire.records import item_record

from ..daemon.hangs import HANG_EVENT, RESOLVED_EVENT
from ..daemon.scoring import score_against, score_blocks
from ..daemon.straggler import (
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOWS,
    STRAGGLER_EVENT,
    Score,
    StragglerDetector,
    StragglerEvent,
)
from ..gpu.figures import is_gpu_stat
from ..read.columns import COUNT_ONLY_MASK
from ..relay.curve import CLIENT, CURVE_FRAME_OVERHEAD, load_client, secure_client

__all__ = [
    "DEFAULT_SILENT_AFTER_S", "GAP_EVENT", "JOB_HANG_EVENT", "JOB_HANG_RESOLVED_EVENT", "JOB_RECOVERED_EVENT",
    "JOB_STRAGGLER_EVENT", "NODE_BACK_EVENT", "NODE_SILENT_EVENT", "TOPICS", "JobHang", "JobView", "JobWatch",
    "NodeScore", "NodeStreams", "RankScore", "StatScores", "WatchEvent",
    "node_names", "watch",
]

JOB_STRAGGLER_EVENT = "shmstat.job.straggler"
"""A node (``rank`` -1) or a rank slow against the whole job for ``windows`` windows in a row."""
JOB_RECOVERED_EVENT = "shmstat.job.straggler.recovered"
"""A node or rank reported slow scores at or above the threshold again (``reason`` ``recovered``), or no window
scored it for a while (``gone``)."""
JOB_HANG_EVENT = "shmstat.job.hang"
"""The job hangs: the rank holding it (``node``, ``rank``, ``section``; ``rank`` -1 while no node names one) and
the nodes that wait."""
JOB_HANG_RESOLVED_EVENT = "shmstat.job.hang.resolved"
"""No node hangs any more."""
NODE_SILENT_EVENT = "shmstat.job.node_silent"
"""A node heard of sent nothing, not even a heartbeat, for ``silent_after_s``: ``node``, ``silent_s`` (since it was
last heard), ``last_heard_ns`` (on the watcher's clock)."""
NODE_BACK_EVENT = "shmstat.job.node_silent.resolved"
"""A silent node is heard again: ``node``, ``silent_s`` (how long it was silent)."""
DEFAULT_SILENT_AFTER_S = 5.0
"""How long a node may send nothing before it is silent: five heartbeats at the collector's default interval."""
GAP_EVENT = "shmstat.watch.gap"
"""Items a node's heartbeats show lost on the way to the watcher, or dropped before its collector."""
TOPICS = ("stat/", wire.event_topic(HANG_EVENT))
"""What :func:`watch` subscribes to on every endpoint (``event/shmstat.hang`` covers its ``.resolved`` too)."""

_RCVHWM = 256


@dataclass(frozen=True)
class WatchEvent:
    """One job-wide event: its ``name`` (one of this module's ``*_EVENT``), the job, and its data (JSON-ready:
    ``node``, ``rank``, ``group``, ``stat``, ``score``, ``figure``, ``median``, ``line`` ... as the name says)."""

    name: str
    job: str
    data: dict[str, Any]


@dataclass(frozen=True)
class RankScore:
    """One rank in one scored window: its node, its figure, its score against the job-wide median and whether it
    is slow now (reported, or under the threshold in this window)."""

    node: str
    rank: int
    figure: float
    score: float
    slow: bool


@dataclass(frozen=True)
class NodeScore:
    """One node in one scored window: its figure (the median of its ranks'), its score against the job-wide
    median, how many ranks it had there, and whether it is a slow node now."""

    node: str
    figure: float
    score: float
    ranks: int
    slow: bool


@dataclass(frozen=True)
class StatScores:
    """The newest scored window of one stat across the job: the job-wide median, every node and every rank."""

    group: str
    stat: str
    wid: int
    window_ms: int
    median: float
    nodes: tuple[NodeScore, ...]
    ranks: tuple[RankScore, ...]

    @property
    def key(self) -> str:
        """``group/stat``, as ``top`` shows it."""
        return f"{self.group}/{self.stat}"


@dataclass(frozen=True)
class JobHang:
    """A hang across the nodes: the rank holding the job (``node`` "" and ``rank`` -1 while no node names one),
    its section, the nodes whose ranks wait, and the line said."""

    node: str
    rank: int
    section: str
    waiting: tuple[str, ...]
    line: str


@dataclass(frozen=True)
class JobView:
    """One job as :class:`JobWatch` sees it now: the nodes that sent it, each stat's newest scored window, and
    the hang if one is going on."""

    job: str
    nodes: tuple[str, ...]
    stats: tuple[StatScores, ...]
    hang: JobHang | None
    silent: tuple[tuple[str, float], ...] = ()
    """The nodes silent now (:data:`NODE_SILENT_EVENT`), each with the seconds since it was last heard."""


@dataclass
class _Window:
    """One window of one stat gathered across the nodes, until it is scored."""

    first_ns: int
    higher_is_better: bool = False
    figures: dict[tuple[str, int], float] = field(default_factory=dict)  # (node, rank) -> figure


@dataclass
class _Job:
    nodes: dict[str, None] = field(default_factory=dict)  # in the order they were heard
    pending: dict[tuple[str, str, int, int], _Window] = field(default_factory=dict)  # (group, stat, ms, wid)
    newest: dict[tuple[str, str, int], dict[str, int]] = field(default_factory=dict)  # stat -> node -> newest wid
    scored: dict[tuple[str, str, int], int] = field(default_factory=dict)  # stat -> newest wid scored
    views: dict[tuple[str, str], StatScores] = field(default_factory=dict)
    ranks: StragglerDetector | None = None
    nodes_slow: StragglerDetector | None = None
    node_index: dict[str, int] = field(default_factory=dict)
    node_hangs: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its shmstat.hang data
    hang: JobHang | None = None
    hang_since_ns: int | None = None  # the first node's hang of this episode, on the clock


class JobWatch:
    """The job-wide view of several nodes' streams (see the module docstring), without sockets: feed it every
    decoded message with :meth:`take` and call :meth:`tick` now and then; both return the :class:`WatchEvent` s
    found. ``clock`` (ns) times the ``settle_s`` wait of a window whose nodes did not all send a later one, and
    the ``silent_after_s`` a node may send nothing (:meth:`heard`: a heartbeat counts) before it is silent."""

    def __init__(self, *, threshold: float = DEFAULT_THRESHOLD, windows: int = DEFAULT_WINDOWS,
                 settle_s: float = 2.0, silent_after_s: float = DEFAULT_SILENT_AFTER_S,
                 clock: Callable[[], int] = time.time_ns) -> None:
        StragglerDetector(threshold=threshold, windows=windows)  # the same checks, the same sentences
        if not 0 < settle_s <= 3600:
            raise ConfigError(f"settle_s must be more than 0 and at most 3600 seconds, got {settle_s:g}")
        if not 0 < silent_after_s <= 3600:
            raise ConfigError(f"silent_after_s must be more than 0 and at most 3600 seconds, got {silent_after_s:g}")
        self.threshold, self.windows, self.settle_ns, self.clock = threshold, windows, int(settle_s * 1e9), clock
        self.silent_ns = int(silent_after_s * 1e9)
        self._jobs: dict[str, _Job] = {}
        self._heard: dict[str, int] = {}  # node -> when it was last heard, on the clock
        self._silent: dict[str, int] = {}  # node -> when it was last heard, while it is silent
        self._told: dict[str, list[str]] = {}  # silent node -> the jobs told so (told it is back, none other)
        self.late = 0
        """Rows of a rank that arrived after their window was scored (not folded in)."""
        self.lost = 0
        """Items the nodes' heartbeats showed lost (:data:`GAP_EVENT`)."""
        self.undecodable = 0
        """Messages received that did not decode (:func:`shmstat.wire.decode_with_job` refused them: a broken or
        hostile sender on an endpoint), skipped and counted here, as ``shmstat subscribe`` counts them."""
        self.expected: tuple[str, ...] = ()
        """The nodes every window waits for (up to ``settle_s``) besides those that sent its stat: the endpoints
        followed (:class:`NodeStreams` sets them), so that a node whose ranks start late is not scored out."""

    def _job(self, job: str) -> _Job:
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _Job()
            state.ranks = StragglerDetector(job, threshold=self.threshold, windows=self.windows)
            state.nodes_slow = StragglerDetector(job, threshold=self.threshold, windows=self.windows)
        return state

    def take(self, node: str, msg: wire.WireMessage, job: str | None) -> list[WatchEvent]:
        """Account one data message of ``node`` (``job``: the job it names; a per-job endpoint's: None, taken as
        "" ): its ``stat/`` rows gathered, its hang events applied. Returns the events found."""
        name = job or ""
        state = self._job(name)
        state.nodes.setdefault(node, None)
        out = self.heard(node)
        if msg.kind == "stat" and msg.topic.startswith("stat/"):
            for item in msg.items:
                if isinstance(item, dict):
                    self._row(state, node, item)
            return out + self._score_ready(self.clock())  # silence waits for tick(): others' messages may be queued
        if msg.kind == "event":
            for j in range(len(msg.items)):
                rec = item_record(msg, j, name)
                if rec.get("name") in (HANG_EVENT, RESOLVED_EVENT):
                    out.extend(self._hang(name, state, node, rec["name"], rec.get("data") or {}))
        return out

    def heard(self, node: str) -> list[WatchEvent]:
        """Note that ``node`` sent something (any message, a heartbeat too): a silent node is back
        (:data:`NODE_BACK_EVENT`, the events returned)."""
        now = self.clock()
        self._heard[node] = now
        since = self._silent.pop(node, None)
        if since is None:
            return []
        silent_s = (now - since) / 1e9
        return [WatchEvent(NODE_BACK_EVENT, job, {"node": node, "silent_s": round(silent_s, 3), "line": (
            f"node back: job {job}: node {node} heard again after {silent_s:.0f} s silent")})
            for job in self._told.pop(node, [])]

    def ended(self, node: str) -> None:
        """``node``'s collector sent its final heartbeat of a job (it closed, or the job ended there): it may send
        nothing more, and its quiet then says nothing, until it is heard again (:meth:`heard`; a job still running
        there is heard at its next heartbeat)."""
        self._heard.pop(node, None)

    @property
    def followed(self) -> tuple[str, ...]:
        """The nodes that would be silent if they sent nothing for ``silent_after_s``: heard, neither silent nor
        ended since."""
        return tuple(n for n in self._heard if n not in self._silent)

    def _silence(self, now: int) -> list[WatchEvent]:
        """The nodes that went silent since the last look: :data:`NODE_SILENT_EVENT` for each job they sent."""
        out = []
        for node, last in self._heard.items():
            if node in self._silent or now - last < self.silent_ns:
                continue
            self._silent[node] = last
            silent_s = (now - last) / 1e9
            self._told[node] = [job for job, state in sorted(self._jobs.items()) if node in state.nodes]
            out += [WatchEvent(NODE_SILENT_EVENT, job, {
                "node": node, "silent_s": round(silent_s, 3), "last_heard_ns": last, "line": (
                    f"node silent: job {job}: node {node} sent nothing, not even a heartbeat, for {silent_s:.0f} s; "
                    "its windows are left out of the scores")})
                for job in self._told[node]]
        return out

    def gap(self, node: str, job: str, stream: str, items: int) -> WatchEvent:
        """Count ``items`` of ``stream`` lost from ``node`` and say so as a :data:`GAP_EVENT`."""
        self.lost += items
        how = "dropped before its collector" if stream == SENDER_STREAM else "lost on the way here"
        return WatchEvent(GAP_EVENT, job, {"node": node, "stream": stream, "items": items,
                                           "line": f"gap: job {job}: node {node}: {items} {stream} items {how}"})

    def _row(self, state: _Job, node: str, item: dict[str, Any]) -> None:
        rank = item.get("rank")
        group, stat = str(item.get("group", "")), str(item.get("name", ""))
        ms, wid = int(item.get("window_ms", 0)), int(item.get("wid", 0))
        skey = (group, stat, ms)
        newest = state.newest.setdefault(skey, {})
        newest[node] = max(newest.get(node, wid), wid)
        if rank is None or int(rank) < 0 or not _scored(item):
            return
        if wid <= state.scored.get(skey, -1):
            self.late += 1
            return
        f = item.get("p50")
        f = item.get("mean") if f is None else f
        if not isinstance(f, (int, float)) or not math.isfinite(f) or int(item.get("count", 0)) <= 0:
            return
        win = state.pending.get((group, stat, ms, wid))
        if win is None:
            win = state.pending[(group, stat, ms, wid)] = _Window(self.clock(), bool(item.get("higher_is_better")))
        win.figures[(node, int(rank))] = float(f)

    def tick(self) -> list[WatchEvent]:
        """Name the nodes silent for ``silent_after_s`` (call it once every message received was taken: a node's
        may wait in a socket while the watcher was busy), then score every gathered window that is complete (each
        node sending its stat sent a later one) or waited ``settle_s``, in window order; the events found."""
        now = self.clock()
        return self._silence(now) + self._score_ready(now)

    def _score_ready(self, now: int) -> list[WatchEvent]:
        out: list[WatchEvent] = []
        for name, state in self._jobs.items():
            ready = []
            for key, win in state.pending.items():
                group, stat, ms, wid = key
                senders = {n: w for n, w in state.newest.get((group, stat, ms), {}).items() if n not in self._silent}
                # a node not sending yet is waited for too, a silent one not
                heard = all(n in senders for n in self.expected if n not in self._silent)
                if (heard and all(w > wid for w in senders.values())) or now - win.first_ns >= self.settle_ns:
                    ready.append(key)
            for key in sorted(ready, key=lambda k: (k[3], k[0], k[1], k[2])):
                win = state.pending.pop(key)
                group, stat, ms, wid = key
                if wid <= state.scored.get((group, stat, ms), -1):
                    self.late += len(win.figures)
                    continue
                state.scored[(group, stat, ms)] = wid
                out.extend(self._score(name, state, group, stat, ms, wid, win))
            if state.node_hangs:
                out.extend(self._hang_state(name, state))
        return out

    def _score(self, job: str, state: _Job, group: str, stat: str, ms: int, wid: int, win: _Window
               ) -> list[WatchEvent]:
        kept = sorted((f, node, rank) for (node, rank), f in win.figures.items() if node not in self._silent)
        f = np.array([x for x, _, _ in kept], np.float64)
        hib = np.full(len(f), win.higher_is_better)
        median, score, keep = score_blocks(np.zeros(len(f), np.int64), f, hib)
        if not len(f) or not keep.all():
            return []
        job_median = float(median[0])
        by_node: dict[str, list[int]] = {}
        for i, (_, node, _) in enumerate(kept):
            by_node.setdefault(node, []).append(i)
        names = sorted(by_node)
        # each node's own median (its figure) and each rank's score against it, by the same rule: a rank of a node
        # slow as a whole is scored against its node
        order = [i for n in names for i in by_node[n]]  # by node, then figure (kept is sorted by figure)
        blocks = np.array([k for k, n in enumerate(names) for _ in by_node[n]], np.int64)
        node_median, local, _ = score_blocks(blocks, f[order], hib[order])
        local_of = dict(zip(order, zip(local.tolist(), node_median.tolist(), strict=True), strict=True))
        node_fig = np.array([local_of[by_node[n][0]][1] for n in names])
        node_score = score_against(np.full(len(names), job_median), node_fig, np.full(len(names),
                                                                                       win.higher_is_better))
        node_slow_now = {n: s < self.threshold for n, s in zip(names, node_score.tolist(), strict=True)}
        assert state.nodes_slow is not None and state.ranks is not None
        out: list[WatchEvent] = []
        if len(names) >= 2:
            scores = []
            for n, s, fg in zip(names, node_score.tolist(), node_fig.tolist(), strict=True):
                idx = state.node_index.setdefault(n, len(state.node_index))
                scores.append(Score(group, stat, idx, wid, ms, s, fg, job_median))
            index_node = {v: k for k, v in state.node_index.items()}
            for ev in state.nodes_slow.observe(scores):
                node = index_node[int(ev.data["rank"])]
                out.append(_event(ev, job, node, -1, len(by_node.get(node, ()))))
        rank_scores = []
        node_of_rank = {}
        on_slow_node: set[int] = set()
        for i, (fg, node, rank) in enumerate(kept):
            s, against = float(score[i]), job_median
            if node_slow_now[node] and len(names) >= 2:
                s, against = local_of[i] if len(by_node[node]) >= 2 else (1.0, fg)
                on_slow_node.add(rank)
            rank_scores.append(Score(group, stat, rank, wid, ms, s, fg, against))
            node_of_rank[rank] = node
        for ev in state.ranks.observe(sorted(rank_scores, key=lambda x: x.rank)):
            rank = int(ev.data["rank"])
            out.append(_event(ev, job, node_of_rank.get(rank, ""), rank, 1, rank in on_slow_node))
        nodes_slow, ranks_slow = state.nodes_slow, state.ranks
        state.views[(group, stat)] = StatScores(
            group, stat, wid, ms, job_median,
            tuple(NodeScore(n, fg, s, len(by_node[n]),
                            nodes_slow.reported(group, stat, state.node_index.get(n, -1)))
                  for n, fg, s in zip(names, node_fig.tolist(), node_score.tolist(), strict=True)),
            tuple(RankScore(node, rank, fg, float(score[i]), ranks_slow.reported(group, stat, rank))
                  for i, (fg, node, rank) in sorted(enumerate(kept), key=lambda x: x[1][2])))
        return out

    def _hang(self, job: str, state: _Job, node: str, name: str, data: dict[str, Any]) -> list[WatchEvent]:
        if name == RESOLVED_EVENT:
            if data.get("reason") == "changed":  # the node names it again at once, on its new picture
                return []
            state.node_hangs.pop(node, None)
        else:
            state.node_hangs[node] = data
            if state.hang_since_ns is None:
                state.hang_since_ns = self.clock()
        return self._hang_state(job, state)

    def _hang_state(self, job: str, state: _Job) -> list[WatchEvent]:
        """The job hangs once a node names the rank holding it and every node heard hangs too, or ``settle_s`` after
        the first node's hang (nodes notice at their own looks); one event per holder, until no node hangs."""
        if not state.node_hangs:
            state.hang_since_ns = None
            if state.hang is None:
                return []
            state.hang = None
            return [WatchEvent(JOB_HANG_RESOLVED_EVENT, job, {"line": f"hang resolved: job {job}: no node hangs"})]
        settled = state.hang_since_ns is not None and self.clock() - state.hang_since_ns >= self.settle_ns
        if not settled and len(state.node_hangs) < len(state.nodes):
            return []
        hang = _holder(job, state.node_hangs, list(state.nodes))
        if hang is None or (state.hang is not None and (hang.node, hang.rank) == (state.hang.node, state.hang.rank)):
            return []
        state.hang = hang
        return [WatchEvent(JOB_HANG_EVENT, job, {
            "node": hang.node, "rank": hang.rank, "section": hang.section, "waiting": ",".join(hang.waiting),
            "nodes": ",".join(sorted(state.node_hangs)), "line": hang.line})]

    def views(self) -> list[JobView]:
        """Every job heard of, as it stands: its nodes, the newest scored window of each stat, the hang."""
        now = self.clock()
        return [JobView(job, tuple(state.nodes), tuple(self._live(state.views[k]) for k in sorted(state.views)),
                        state.hang, tuple((n, (now - self._silent[n]) / 1e9) for n in state.nodes if n in self._silent))
                for job, state in sorted(self._jobs.items())]

    def _live(self, s: StatScores) -> StatScores:
        """``s`` without the silent nodes and their ranks (their figures are of a window gone by)."""
        if not any(n.node in self._silent for n in s.nodes):
            return s
        return replace(s, nodes=tuple(n for n in s.nodes if n.node not in self._silent),
                       ranks=tuple(r for r in s.ranks if r.node not in self._silent))


def _event(ev: StragglerEvent, job: str, node: str, rank: int, ranks: int, by_node: bool = False) -> WatchEvent:
    """A detector's event as a job-wide one: its node, its rank (-1: the node as a whole) and its line;
    ``by_node``: a rank of a slow node, scored against its node's median (``"against": "node"``)."""
    name = JOB_STRAGGLER_EVENT if ev.name == STRAGGLER_EVENT else JOB_RECOVERED_EVENT
    data: dict[str, Any] = {**ev.data, "node": node, "rank": rank, "against": "node" if by_node else "job"}
    who = f"node {node} ({ranks} ranks)" if rank < 0 else f"rank {rank} on node {node}"
    what = f"{data['group']}/{data['stat']}"
    if name == JOB_STRAGGLER_EVENT:
        median = "its node's median (a slow node)" if by_node else "the job-wide median"
        data["line"] = (f"straggler: job {job}: {who} scores {data['score']:.2f} on {what} against {median} "
                        f"{data['median']:.4g} for {data['windows']} windows")
    else:
        data["line"] = f"recovered: job {job}: {who} on {what} ({data.get('reason', 'recovered')})"
    return WatchEvent(name, job, data)


def _holder(job: str, hangs: dict[str, dict[str, Any]], nodes: list[str]) -> JobHang | None:
    """Who holds the job, from the hang each node names: the rank a node suspects outside every wait section (the
    first node's, by name); None while every hung node points elsewhere and a node has not said it hangs."""
    waiting = tuple(sorted(n for n, d in hangs.items() if d.get("elsewhere")))
    for node in sorted(hangs):
        data = hangs[node]
        if data.get("elsewhere"):
            continue
        for r in str(data.get("suspects", "")).split(","):
            if not r.strip().lstrip("-").isdigit():
                continue
            rank = int(r)
            if data.get(f"rank.{rank}.wait") and data.get(f"rank.{rank}.section"):
                continue
            section = str(data.get(f"rank.{rank}.section", ""))
            age = data.get(f"rank.{rank}.age_s", 0)
            where = f"in {section}" if section else "outside every section"
            waits = f"; nodes {','.join(waiting)} wait" if waiting else ""
            line = (f"hang: job {job}: rank {rank} on node {node} {where} for {float(age):.0f} s holds the job"
                    f"{waits}")
            return JobHang(node, rank, section, waiting, line)
    if len(waiting) < len(nodes):
        return None
    return JobHang("", -1, "", waiting, f"hang: job {job}: every node's ranks wait ({','.join(waiting)}); no node "
                                        "names the rank holding the job")


def _scored(item: dict[str, Any]) -> bool:
    """Whether the straggler rule scores this row's stat (as :meth:`collector.read.columns.Columns.scored_stats`
    says for the collector's own passes)."""
    mask = int(item.get("agg_mask", ~COUNT_ONLY_MASK))
    return bool(mask & ~COUNT_ONLY_MASK) and not item.get("wait") and not is_gpu_stat(
        str(item.get("group", "")), str(item.get("name", "")))


def node_names(endpoints: Sequence[str]) -> list[tuple[str, str]]:
    """``(node, endpoint)`` for each ``NODE=ENDPOINT`` or ``ENDPOINT`` (named by its ``host:port``)."""
    out = []
    for spec in endpoints:
        name, sep, endpoint = spec.partition("=")
        if not sep:
            name, endpoint = spec.split("://", 1)[-1], spec
        if not endpoint.startswith(("tcp://", "ipc://")) or not name:
            raise ConfigError(f"{spec!r} is not a node collector's endpoint: give tcp://HOST:PORT or "
                              "NODE=tcp://HOST:PORT")
        out.append((name, endpoint))
    if len({n for n, _ in out}) != len(out):
        raise ConfigError(f"two endpoints have one node name in {', '.join(endpoints)}: name them NODE=ENDPOINT")
    return out


def watch(endpoints: Sequence[str], *, curve: str | None = None, curve_client: str | None = None,
          threshold: float = DEFAULT_THRESHOLD, windows: int = DEFAULT_WINDOWS, settle_s: float = 2.0,
          silent_after_s: float = DEFAULT_SILENT_AFTER_S, timeout_s: float | None = None,
          clock: Callable[[], int] = time.time_ns,
          state: JobWatch | None = None) -> Iterator[WatchEvent]:
    """Follow node collectors' endpoints and yield the job-wide :class:`WatchEvent` s, until ``timeout_s`` (if
    given) or the caller stops iterating (closing the generator closes the sockets).

    ``endpoints``: one per node, ``tcp://HOST:PORT`` (the node named ``HOST:PORT``) or ``NODE=tcp://HOST:PORT``,
    as their node collectors publish them (``shmstat collect --publish``). ``curve``: a key directory, as
    ``shmstat subscribe --curve DIR`` takes it (``DIR/NAME.key_secret``, ``curve_client`` NAME, default
    ``client``, against ``DIR/server.key``). ``threshold`` and ``windows``: the straggler rule's (under 0.75 for 3
    windows in a row by default). ``settle_s``: how long a window waits for nodes that have not sent a later one.
    ``silent_after_s``: how long a node may send nothing, heartbeats included, before it is silent
    (:data:`NODE_SILENT_EVENT`; give more than five beats of a collector's ``--heartbeat-interval``).
    ``state``: a :class:`JobWatch` to feed (to read its :meth:`~JobWatch.views` meanwhile, as ``top --nodes``
    does); one is made otherwise. Raises :class:`ConfigError` for a bad endpoint or key directory.

    Example::

        for ev in collector.watch(["n1=tcp://10.0.0.1:5600", "n2=tcp://10.0.0.2:5600"], curve="keys"):
            print(ev.name, ev.data["line"])
    """
    jw = state if state is not None else JobWatch(threshold=threshold, windows=windows, settle_s=settle_s,
                                                 silent_after_s=silent_after_s, clock=clock)
    streams = NodeStreams(endpoints, jw, curve=curve, curve_client=curve_client)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            yield from streams.poll(wait)
    finally:
        streams.close()


class NodeStreams:
    """The sockets of :func:`watch`: one CURVE (or plain) ``XSUB`` per node endpoint, subscribed to :data:`TOPICS`
    and the heartbeats, whose messages feed ``jw``. :meth:`poll` waits at most its timeout and returns the events
    found; ``shmstat top --nodes`` polls between its frames."""

    def __init__(self, endpoints: Sequence[str], jw: JobWatch, *, curve: str | None = None,
                 curve_client: str | None = None) -> None:
        named = node_names(endpoints)
        if not named:
            raise ConfigError("name the node collectors' endpoints to watch (tcp://HOST:PORT ...)")
        keys = None
        if curve is not None:
            if any(not ep.startswith("tcp://") for _, ep in named):
                raise ConfigError("--curve connects to collectors' tcp:// endpoints: name them as tcp://HOST:PORT")
            keys = load_client(curve, curve_client or CLIENT)
        elif curve_client is not None:
            raise ConfigError("--curve-client NAME picks a key of a --curve DIR; add --curve DIR")
        self.jw = jw
        self.nodes = [n for n, _ in named]
        jw.expected = tuple(self.nodes)
        self._ctx = zmq.Context()
        self._tracker = GapTracker(followed_kinds(TOPICS))
        self._socks: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        for node, endpoint in named:
            sock = self._ctx.socket(zmq.XSUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD + 1 + (CURVE_FRAME_OVERHEAD if keys else 0))
            if keys is not None:
                secure_client(sock, keys)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                self.close()
                raise ConfigError(f"cannot connect to {endpoint!r}: {exc}") from None
            for topic in (*TOPICS, wire.HEARTBEAT_TOPIC):
                sock.send(b"\x01" + topic.encode())
            self._socks[sock] = node
            self._poller.register(sock, zmq.POLLIN)

    def poll(self, timeout_s: float) -> list[WatchEvent]:
        """Take what the nodes sent within ``timeout_s`` seconds (at least once), then score what is ready."""
        out: list[WatchEvent] = []
        for sock, _ in self._poller.poll(int(timeout_s * 1000)):
            node = self._socks[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg, job = wire.decode_with_job(frames)
                except WireError:
                    self.jw.undecodable += 1
                    continue
                beat = self._tracker.take(f"{node} job {job or ''}", msg)
                if beat is None:
                    out.extend(self.jw.take(node, msg, job))
                    continue
                out.extend(self.jw.heard(node))
                if beat.final:
                    self.jw.ended(node)
                out.extend(self.jw.gap(node, job or "", gap.stream, gap.items) for gap in beat.gaps)
        out.extend(self.jw.tick())
        return out

    def close(self) -> None:
        """Close the sockets."""
        for sock in self._socks:
            sock.close(0)
        self._socks.clear()
        self._ctx.term()
