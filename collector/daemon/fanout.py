"""The one fan-out of a collector pass: :class:`FanOut` calls every registered
:class:`~collector.read.passes.PassConsumer` once per :class:`~collector.read.passes.Pass`.

The loop makes the pass and calls :meth:`FanOut.take` once. Consumers that run on the loop are called there, in
the order registered; each other consumer has a thread of its own fed by a bounded queue (:data:`PASS_QUEUE`
passes; one that does not fit is dropped and counted in :attr:`FanOut.dropped`). A consumer on a thread that
raises is counted (:attr:`FanOut.errors`) and logged once per consumer and type, and takes the next pass; one on
the loop raises into the loop, as any step of it would. Adding a consumer is one class and one
:meth:`FanOut.register`.
"""

from __future__ import annotations

import collections
import logging
import threading

from ..read.passes import Pass, PassConsumer, Wanted

__all__ = ["PASS_QUEUE", "FanOut"]

_log = logging.getLogger("shmstat.collector")

PASS_QUEUE = 64
"""Passes queued at most for a consumer on a thread of its own before new ones are dropped (and counted)."""

_STOP = None


class _Threaded:
    """A consumer on a thread of its own, fed by a bounded queue of passes."""

    def __init__(self, consumer: PassConsumer, owner: FanOut) -> None:
        self.consumer = consumer
        self.owner = owner
        self.queue: collections.deque[Pass | None] = collections.deque()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"shmstat-consumer-{type(consumer).__name__}",
                                       daemon=True)
        self.thread.start()

    def put(self, pass_: Pass) -> bool:
        """Queue ``pass_``; False when the queue was full (dropped)."""
        with self.cond:
            if len(self.queue) >= PASS_QUEUE:
                return False
            self.queue.append(pass_)
            self.cond.notify()
        return True

    def stop(self, timeout_s: float) -> bool:
        """Let the thread take what is queued, then end it, within ``timeout_s``; whether it ended."""
        with self.cond:
            self.queue.append(_STOP)
            self.cond.notify()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                pass_ = self.queue.popleft()
            if pass_ is None:
                return
            self.owner._call(self.consumer, pass_)


class FanOut:
    """Every consumer of a collector's passes, called once per pass (see the module docstring)."""

    def __init__(self) -> None:
        self._consumers: list[PassConsumer] = []
        self._on_loop: list[PassConsumer] = []
        self._threaded: list[_Threaded] = []
        self.dropped = 0
        """Passes a consumer on a thread of its own could not queue (its queue was full)."""
        self.errors = 0
        """Calls of a threaded consumer's ``take`` that raised."""
        self._warned: set[tuple[int, type]] = set()
        self._lock = threading.Lock()  # errors are counted from the consumers' threads too

    def register(self, consumer: PassConsumer) -> None:
        """Hand every pass from now on to ``consumer`` (where its :attr:`~PassConsumer.on_loop` says)."""
        self._consumers.append(consumer)
        if consumer.on_loop:
            self._on_loop.append(consumer)
        else:
            self._threaded.append(_Threaded(consumer, self))

    @property
    def threaded(self) -> bool:
        """Whether a consumer runs on a thread of its own (then :attr:`dropped` counts)."""
        return bool(self._threaded)

    def wants(self, group: str, what: Wanted) -> bool:
        """Whether any consumer has a use for ``group``'s windows or points."""
        return any(c.wants(group, what) for c in self._consumers)

    def take(self, pass_: Pass) -> None:
        """Hand ``pass_`` to every consumer, once: those on the loop now, in order, then the others' queues."""
        for consumer in self._on_loop:
            consumer.take(pass_)
        for threaded in self._threaded:
            if not threaded.put(pass_):
                self.dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the consumers' threads once they took what is queued (a consumer still busy after ``timeout_s``
        is left behind: its thread is a daemon)."""
        threaded, self._threaded = self._threaded, []
        self._consumers = [c for c in self._consumers if c.on_loop]
        for t in threaded:
            if not t.stop(timeout_s):
                _log.warning("pass consumer %r did not finish within %.1f s; leaving it behind", t.consumer,
                             timeout_s)

    def _call(self, consumer: PassConsumer, pass_: Pass) -> None:
        try:
            consumer.take(pass_)
        except Exception as exc:  # one consumer's trouble stops neither the others nor the loop
            with self._lock:
                self.errors += 1
                first = (id(consumer), type(exc)) not in self._warned
                self._warned.add((id(consumer), type(exc)))
            if first:
                _log.error("pass consumer %r raised %r (counted; further ones not logged)", consumer, exc)
