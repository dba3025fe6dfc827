"""What one collector pass produces (:class:`Pass`), and the one interface of what consumes it (:class:`PassConsumer`).

A collector's loop makes one :class:`Pass` per turn that found something: the windows it read (as
:class:`collector.read.columns.Columns`), the put metrics it took (a rank's ``put_metric`` points, and the metrics
made in the collector's own process), and the collector's own points (its usage figures, the straggler scores and
flags). It hands the pass to one fan-out (:class:`collector.daemon.fanout.FanOut`), which calls every registered
consumer once with it. A consumer declares where it runs (:attr:`PassConsumer.on_loop`), which groups it has a
use for (:meth:`PassConsumer.wants`: the loop reads and decodes nothing nobody wants) and takes the pass
(:meth:`PassConsumer.take`). The handlers' dispatcher, the relay's ``stat/`` topics, the Prometheus exporter and
the straggler scorer are such consumers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

from elastic.metrics import MetricData, StatMetricData

if TYPE_CHECKING:
    from .columns import Columns

__all__ = ["Flag", "Pass", "PassConsumer", "Put", "RankScore", "Wanted"]

Wanted = Literal["windows", "puts", "usage"]
"""What of a group a consumer is asked whether it wants: its windows, its put metrics, or (the collector's own
group) the collector's usage figures."""

EventData = dict[str, str | int | float | bool]


class Put(NamedTuple):
    """A put metric taken by the loop: a rank's ``put_metric`` point, or a metric made in the collector's own
    process (the launcher's agent: ``rank`` None, ``here`` True)."""

    metric: MetricData
    rank: int | None
    """The rank that put it (None: this process)."""
    here: bool = False
    """Made in this process: no rank message carried it, so the pass's consumers publish it themselves."""


class Flag(NamedTuple):
    """A straggler flagged or recovered in this pass: the event's name and data, as published."""

    name: str
    data: EventData


class RankScore(Protocol):
    """One rank's straggler score in one window (:class:`collector.daemon.straggler.Score`)."""

    @property
    def group(self) -> str: ...

    @property
    def stat(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def score(self) -> float: ...

    def metric(self, group: str, job: str) -> StatMetricData:
        """The score as a metric of ``group``."""
        ...


@dataclass(slots=True)
class Pass:
    """One collector pass of one job: what the loop hands to every consumer, once.

    Consumers on the loop are called in the order they were registered; what the straggler scorer, registered
    first, finds (:attr:`scores`, :attr:`flags`) is in the pass when the others take it. A consumer on a thread of
    its own gets the pass once every consumer on the loop took it, and must not change it."""

    job: str
    now_ns: int
    """The collector's clock when the pass was made."""
    columns: Columns | None = None
    """The windows the pass read (None: a pass of points only)."""
    puts: list[Put] = field(default_factory=list)
    """The put metrics the loop took since the last pass, in the order taken."""
    usage: list[StatMetricData] = field(default_factory=list)
    """The collector's own figures in its platform group (every rank's CPU and RSS, its counters)."""
    scores: list[RankScore] = field(default_factory=list)
    """The straggler scores of :attr:`columns` (every score when someone wants them all, else those that can
    change a rank's state)."""
    flags: list[Flag] = field(default_factory=list)
    """The stragglers flagged or recovered by :attr:`columns`, in the order found."""

    def __bool__(self) -> bool:
        """Whether the pass holds anything."""
        return bool((self.columns is not None and len(self.columns)) or self.puts or self.usage or self.scores
                    or self.flags)


@runtime_checkable
class PassConsumer(Protocol):
    """What consumes a collector pass: register one with :meth:`collector.daemon.fanout.FanOut.register`."""

    on_loop: bool
    """True: :meth:`take` runs on the collector's loop (it must be cheap; what it reads stays consistent with the
    loop, e.g. a Prometheus scrape). False: on a thread of its own, fed by a bounded queue (a pass that does not
    fit is dropped, counted in ``consumer_passes_dropped``)."""

    def wants(self, group: str, what: Wanted) -> bool:
        """Whether this consumer has a use for ``group``'s windows, put metrics or usage figures (asked on the
        loop, before it reads, decodes or makes them: what no consumer wants is never built)."""
        ...

    def take(self, pass_: Pass) -> None:
        """Take one pass (called once per pass; a raise is counted and logged, never stops the loop)."""
        ...
