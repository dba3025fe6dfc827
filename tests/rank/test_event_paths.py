"""The C Event constructor (shmstat._pubfast.EventBase) and the pure-Python one accept, convert and refuse the same
arguments with the same errors: every case below is run in a fresh process on each path and the outcomes must be
identical (types included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kit.procs import REPO

from shmstat import _backend

_CASES = r"""
import collections, datetime, enum, json, sys, types
from shmstat.publish.events import Event

class S(str): pass
class I(int): pass
class F(float): pass
class E(enum.IntEnum):
    A = 3
now = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901)
aware = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
class D(datetime.datetime): pass
cases = [
    ("n", now, {}), ("n", now, {"a": 1, "b": 2.5, "c": "x", "d": True}), (S("n"), now, {"a": 1}),
    (1, now, {}), (None, now, {}), ("n", 5, {}), ("n", "2026", {}), ("n", aware, {"a": 1}),
    ("n", D(2026, 1, 1), {}), ("n", now, {"a": E.A, "b": I(4), "c": F(1.5), "d": S("s")}),
    ("n", now, {S("k"): 1}), ("n", now, {1: 1}), ("n", now, {"a": [1]}), ("n", now, {"a": None}),
    ("n", now, {"a": 1 << 63}), ("n", now, {"a": -(1 << 63)}), ("n", now, {"a": (1 << 63) - 1}),
    ("n", now, types.MappingProxyType({"a": 1})), ("n", now, collections.OrderedDict(a=1)), ("n", now, [("a", 1)]),
    ("n", now, None), ("", now, {"": ""}),
]
out = []
for args in cases:
    try:
        e = Event(*args)
        out.append(["ok", type(e.name).__name__, e.name, repr(e.timestamp), type(e.timestamp).__name__,
                    [[type(k).__name__, k, type(v).__name__, repr(v)] for k, v in e.data.items()],
                    e.data is args[2]])
    except Exception as exc:
        out.append(["error", type(exc).__name__, str(exc)])
for bad in ((), ("n",), ("n", now), ("n", now, {}, 1)):
    try:
        Event(*bad)
        out.append(["ok"])
    except TypeError:
        out.append(["TypeError"])
try:
    Event(name="n", timestamp=now, data={"a": 1})
    out.append(["keywords ok"])
except TypeError as exc:
    out.append(["keywords", str(exc)])
class Sub(Event):
    __slots__ = ()
class WithInit(Event):
    def __init__(self, name, timestamp, data, extra):
        super().__init__(name, timestamp, data)
        self.extra = extra
for make in (lambda: Sub("s", now, {"a": 1}), lambda: Sub("s", now, data={"a": 1}), lambda: Sub(1, now, {}),
             lambda: WithInit("w", now, {"a": 1}, extra=5), lambda: Event("n", timestamp=now, data={})):
    try:
        e = make()
        out.append(["ok", type(e).__name__, e.name, e.data, getattr(e, "extra", None)])
    except Exception as exc:
        out.append(["error", type(exc).__name__, str(exc)])
print(json.dumps(out))
"""


def _outcomes(pure: str) -> list:
    r = subprocess.run([sys.executable, "-c", _CASES], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=REPO, **{_backend.VARIABLE: pure}))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_the_c_and_python_event_constructors_agree():
    c, py = _outcomes("0"), _outcomes("1")
    assert len(c) == len(py) == 32
    for i, (a, b) in enumerate(zip(c, py, strict=True)):
        if a[0] == b[0] == "TypeError" or (a[0] == "error" and b[0] == "error" and a[1] == b[1] == "TypeError"
                                           and "argument" in a[2]):
            continue  # a wrong number of arguments: both refuse, in their own words
        assert a == b, (i, a, b)
    assert c[0][0] == "ok" and c[3] == ["error", "TypeError", "Event name must be a str, not int"]
    assert c[27:] == [["ok", "Sub", "s", {"a": 1}, None], ["ok", "Sub", "s", {"a": 1}, None],
                      ["error", "TypeError", "Event name must be a str, not int"], ["ok", "WithInit", "w", {"a": 1}, 5],
                      ["ok", "Event", "n", {}, None]]


_LOG_CASES = r"""
import datetime, json, logging
import shmstat
from shmstat.publish import events
from shmstat.job._state import STATE
logging.disable(logging.CRITICAL)
out = []
now = datetime.datetime(2026, 1, 2, 3, 4, 5)
seen = []
def ok(e): seen.append(("ok", e.name))
def bad(e): raise ValueError("handler broke")
def reenter(e):
    if e.name == "outer":
        shmstat.log_event(shmstat.Event("inner", now, {}))
    seen.append(("re", e.name))
class Stop(BaseException): pass
def stop(e): raise Stop()
hs = [shmstat.register_event_handler(h) for h in (ok, bad, reenter)]
shmstat.log_event(shmstat.Event("outer", now, {"a": 1}))
out.append(seen[:])
out.append(type(STATE).__name__)
for arg in (5, None, "x"):
    try:
        shmstat.log_event(arg)
    except TypeError as exc:
        out.append(str(exc))
h = shmstat.register_event_handler(stop)
try:
    shmstat.log_event(shmstat.Event("x", now, {}))
    out.append("no stop")
except Stop:
    out.append("stop propagated")
shmstat.unregister_event_handler(h)
seen.clear()
shmstat.log_event(event=shmstat.Event("kw", now, {}))
out.append(seen[:])
class StandIn:  # a publisher assigned to STATE directly, as tests and embedders do
    def __init__(self):
        self.got = []
    def publish_event(self, name, ts_ns, data, size):
        self.got.append([name, data])
first, second = StandIn(), StandIn()
STATE.publisher = first
shmstat.log_event(shmstat.Event("to first", now, {"a": 1}))
def swap(e):
    if e.name == "swap":
        STATE.publisher = second
hs.append(shmstat.register_event_handler(swap))
shmstat.log_event(shmstat.Event("swap", now, {}))  # the handler swaps publishers before the event is published
shmstat.log_event(shmstat.Event("to second", now, {}))
from shmstat.job import _state
_state.reset()  # no publisher, no handlers
shmstat.log_event(shmstat.Event("nowhere", now, {}))
out.append([first.got, second.got])
print(json.dumps(out))
"""


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_the_c_and_python_log_event_agree_on_handlers_errors_and_reentry():
    def run(pure: str) -> list:
        r = subprocess.run([sys.executable, "-c", _LOG_CASES], cwd=REPO, capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, PYTHONPATH=REPO, **{_backend.VARIABLE: pure}))
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    c, py = run("0"), run("1")
    assert c == py
    assert c[0] == [["ok", "outer"], ["ok", "inner"], ["re", "inner"], ["re", "outer"]]
    assert "stop propagated" in c and "log_event expects an Event, not int" in c
    assert c[-1] == [[["to first", {"a": 1}]], [["swap", {}], ["to second", {}]]]


_RELOG = r"""
import datetime, json
import shmstat
from shmstat import wire
from shmstat.job import _state
from shmstat.publish.publisher import Publisher

pub = Publisher("ipc:///nonexistent/shmstat-relog.ipc", rank=0)
_state.STATE.publisher = pub  # attached to a collector that never answers: what log_event queued stays here
t0 = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.timezone.utc)
ev = shmstat.Event("relog", t0, {"step": 0, "phase": "a"})
shmstat.log_event(ev)
shmstat.log_event(ev)  # unchanged
for i in range(1, 3):
    ev.data["step"] = i  # the event's own dict, changed in place
    shmstat.log_event(ev)
ev.data.update(phase="b", extra=1.5)
shmstat.log_event(ev)
del ev.data["extra"]
shmstat.log_event(ev)
ev.data = {"new": True}
shmstat.log_event(ev)
ev.name = "renamed"
shmstat.log_event(ev)
ev.timestamp = t0 + datetime.timedelta(seconds=1)
shmstat.log_event(ev)
shmstat.log_event(ev)
items = []
ob = pub.outbox
while (frames := ob.head(wire.MAX_TOPIC)) is not None:
    items += wire.decode(*frames).items
    ob.pop()
print(json.dumps(items))
"""


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_an_event_logged_again_after_a_change_in_place_carries_the_change():
    """The C path queues an event logged again unchanged from the bytes it encoded the first time: a change to its
    data dict in place, or a new name, timestamp or dict, is what the next log carries, on both paths alike."""
    outcomes = []
    for pure in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", _RELOG], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=REPO, **{_backend.VARIABLE: pure}))
        assert r.returncode == 0, r.stderr
        outcomes.append(json.loads(r.stdout))
    ns = 1767323045678901000
    assert outcomes[0] == outcomes[1] == [
        ["relog", ns, {"step": 0, "phase": "a"}], ["relog", ns, {"step": 0, "phase": "a"}],
        ["relog", ns, {"step": 1, "phase": "a"}], ["relog", ns, {"step": 2, "phase": "a"}],
        ["relog", ns, {"step": 2, "phase": "b", "extra": 1.5}], ["relog", ns, {"step": 2, "phase": "b"}],
        ["relog", ns, {"new": True}], ["renamed", ns, {"new": True}],
        ["renamed", ns + 10**9, {"new": True}], ["renamed", ns + 10**9, {"new": True}]]
