"""elastic.events: torchelastic's event API, its reference behaviour, and publishing to the collector."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from enum import IntEnum

import pytest

from elastic import events
from elastic.events import handlers
from shmstat.job._state import STATE
from shmstat.testing import ShmstatJob

PUBLIC = [
    "Event",
    "EventMetadataValue",
    "EventSource",
    "NodeState",
    "RdzvEvent",
    "construct_and_record_rdzv_event",
    "get_logging_handler",
    "record",
    "record_rdzv_event",
]
JOB_VARS = ("SHMSTAT_JOB", "TORCHELASTIC_RUN_ID", "SHMSTAT_RANK", "RANK", "SHMSTAT_LOCAL_RANK", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here inherits a job or a log level from the environment it runs in."""
    for var in (*JOB_VARS, "LOGLEVEL"):
        monkeypatch.delenv(var, raising=False)


class Records(logging.Handler):
    """A logging handler keeping every message."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def rdzv_records(monkeypatch: pytest.MonkeyPatch) -> Iterator[Records]:
    """Make the ``dynamic_rendezvous`` destination keep what it is given (it discards by default)."""
    rec = Records()
    monkeypatch.setitem(handlers._log_handlers, "dynamic_rendezvous", rec)
    monkeypatch.delitem(events._events_loggers, "dynamic_rendezvous", raising=False)
    yield rec
    logging.getLogger("shmstat.elastic.events.dynamic_rendezvous").removeHandler(rec)


# ------------------------------------------------------------------------------------ a real collector socket


@pytest.fixture
def attached(shmstat_job: ShmstatJob) -> ShmstatJob:
    """This process attached as rank 0 of a fresh job with a real collector (the shmstat.testing plugin)."""
    shmstat_job.attach_here()
    return shmstat_job


def marker() -> None:
    """Publish a marker event directly; items leave in publish order, so it arrives after anything before it."""
    assert STATE.publisher is not None
    STATE.publisher.publish_event("marker", time.time_ns(), {})


# ------------------------------------------------------------------------------------ types


def test_all_is_exactly_the_public_names() -> None:
    assert sorted(events.__all__) == sorted(PUBLIC)
    for name in events.__all__:
        assert hasattr(events, name)


def test_enums() -> None:
    assert [s.value for s in events.EventSource] == ["AGENT", "WORKER"]
    assert [s.value for s in events.NodeState] == ["INIT", "RUNNING", "SUCCEEDED", "FAILED"]
    assert events.EventSource.AGENT == "AGENT" and isinstance(events.NodeState.FAILED, str)


def test_event_fields_defaults_and_json_shape() -> None:
    event = events.Event("test_event", events.EventSource.WORKER)
    assert (event.timestamp, event.metadata) == (0, {})
    assert events.Event("a", events.EventSource.AGENT).metadata is not event.metadata
    full = events.Event("e", events.EventSource.AGENT, 1700, {"k": 1, "s": "v", "f": 0.5, "b": True, "n": None})
    text = full.serialize()
    assert str(full) == text
    assert text == (
        '{"name": "e", "source": "AGENT", "timestamp": 1700, '
        '"metadata": {"k": 1, "s": "v", "f": 0.5, "b": true, "n": null}}'
    )
    back = events.Event.deserialize(text)
    assert back == full and back.source is events.EventSource.AGENT
    assert events.Event.deserialize(full) is full
    assert events.Event.deserialize(json.loads(text)) == full
    with pytest.raises(KeyError):
        events.Event.deserialize('{"name": "e", "source": "NOBODY", "timestamp": 0, "metadata": {}}')


def test_rdzv_event_fields_and_json_shape() -> None:
    event = events.RdzvEvent("n", "run", "msg", "host", 12, events.NodeState.RUNNING)
    assert (event.master_endpoint, event.rank, event.local_id, event.error_trace) == ("", None, None, "")
    loaded = json.loads(event.serialize())
    assert list(loaded) == [
        "name",
        "run_id",
        "message",
        "hostname",
        "pid",
        "node_state",
        "master_endpoint",
        "rank",
        "local_id",
        "error_trace",
    ]
    assert loaded["node_state"] == "RUNNING" and loaded["rank"] is None
    back = events.RdzvEvent.deserialize(event.serialize())
    assert back == event and back.node_state is events.NodeState.RUNNING
    assert events.RdzvEvent.deserialize(event) is event
    assert str(event) == event.serialize()


# ------------------------------------------------------------------------------------ destinations


def test_record_console_writes_the_json_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    event = events.Event("to_console", events.EventSource.AGENT, metadata={"x": 1})
    events.record(event, destination="console")
    out = capsys.readouterr()
    assert out.err == event.serialize() + "\n" and out.out == ""


def test_record_null_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    events.record(events.Event("quiet", events.EventSource.AGENT))
    events.record(events.Event("quiet", events.EventSource.AGENT), "null")
    events.record_rdzv_event(events.RdzvEvent("n", "r", "m", "h", 1, events.NodeState.INIT))
    assert capsys.readouterr() == ("", "")
    assert STATE.publisher is None


def test_unknown_destination_raises_key_error() -> None:
    with pytest.raises(KeyError, match="console"):
        events.record(events.Event("e", events.EventSource.AGENT), destination="nowhere")
    with pytest.raises(KeyError):
        events.get_logging_handler("nowhere")


def test_logging_handlers() -> None:
    assert isinstance(events.get_logging_handler(), logging.NullHandler)
    assert isinstance(events.get_logging_handler("dynamic_rendezvous"), logging.NullHandler)
    console = events.get_logging_handler("console")
    assert isinstance(console, logging.StreamHandler) and console is events.get_logging_handler("console")


def test_loggers_do_not_propagate() -> None:
    root, seen = logging.getLogger(), Records()
    root.addHandler(seen)
    try:
        events.record(events.Event("e", events.EventSource.AGENT), "console")
    finally:
        root.removeHandler(seen)
    assert seen.messages == []
    assert logging.getLogger("shmstat.elastic.events.console").propagate is False


def test_construct_and_record_rdzv_event_fills_in_the_caller(rdzv_records: Records) -> None:
    events.construct_and_record_rdzv_event("run-1", "joined", events.NodeState.RUNNING, rank=3)
    (message,) = rdzv_records.messages
    event = events.RdzvEvent.deserialize(message)
    assert event.name == "test_elastic_events.py:test_construct_and_record_rdzv_event_fills_in_the_caller"
    assert (event.run_id, event.message, event.rank, event.local_id) == ("run-1", "joined", 3, None)
    assert event.hostname == socket.getfqdn() and event.pid == os.getpid()
    assert event.node_state is events.NodeState.RUNNING and event.error_trace == ""


def test_construct_and_record_rdzv_event_failed_carries_the_traceback(rdzv_records: Records) -> None:
    try:
        raise ValueError("rendezvous broke")
    except ValueError:
        events.construct_and_record_rdzv_event(
            "run-1", "failed", events.NodeState.FAILED, name="step", hostname="h", pid=7, master_endpoint="m:1"
        )
    event = events.RdzvEvent.deserialize(rdzv_records.messages[0])
    assert event.name == "test_elastic_events.py:step"
    assert (event.hostname, event.pid, event.master_endpoint) == ("h", 7, "m:1")
    assert "ValueError: rendezvous broke" in event.error_trace


def test_construct_and_record_rdzv_event_does_nothing_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "_fqdn", lambda: pytest.fail("should not resolve the host name"))
    events.construct_and_record_rdzv_event("run", "m", events.NodeState.INIT)


# ------------------------------------------------------------------------------------ publishing


def test_recorded_event_is_published_when_attached(attached: ShmstatJob) -> None:
    class Level(IntEnum):
        HIGH = 2

    metadata = {
        "rank": 1,
        "ok": True,
        "t": 0.5,
        "who": "me",
        "none": None,
        "list": [1, 2],
        "lvl": Level.HIGH,
        "huge": 1 << 70,
    }
    events.record(
        events.Event("torchelastic.worker.status.START", events.EventSource.WORKER, 1_700_000_000_123, metadata)
    )
    (ev,) = attached.wait_for_event("torchelastic.worker.status.START")
    assert ev.timestamp_ns == 1_700_000_000_123 * 1_000_000
    assert ev.data == {
        "rank": 1,
        "ok": True,
        "t": 0.5,
        "who": "me",
        "none": "None",
        "list": "[1, 2]",
        "lvl": 2,
        "huge": str(1 << 70),
        "source": "WORKER",
    }


def test_event_without_timestamp_gets_the_recording_time(attached: ShmstatJob) -> None:
    before = time.time_ns()
    events.record(events.Event("now", events.EventSource.AGENT), "console")
    (ev,) = attached.wait_for_event("now")
    assert before <= ev.timestamp_ns <= time.time_ns() and ev.data == {"source": "AGENT"}


def test_rdzv_event_is_published_with_its_fields(attached: ShmstatJob) -> None:
    events.record_rdzv_event(events.RdzvEvent("rdzv", "run", "msg", "host", 12, events.NodeState.SUCCEEDED, rank=0))
    (ev,) = attached.wait_for_event("rdzv")
    assert ev.data == {
        "run_id": "run",
        "message": "msg",
        "hostname": "host",
        "pid": 12,
        "node_state": "SUCCEEDED",
        "master_endpoint": "",
        "rank": 0,
        "local_id": "None",
        "error_trace": "",
    }


def test_construct_and_record_rdzv_event_publishes_when_attached(attached: ShmstatJob) -> None:
    events.construct_and_record_rdzv_event("run", "joined", events.NodeState.RUNNING, name="join", hostname="h")
    (ev,) = attached.wait_for_event("test_elastic_events.py:join")
    assert ev.data["pid"] == os.getpid()


def test_unknown_destination_publishes_nothing(attached: ShmstatJob) -> None:
    with pytest.raises(KeyError):
        events.record(events.Event("lost", events.EventSource.AGENT), "nowhere")
    marker()
    attached.wait_for_event("marker")
    assert [e.name for e in attached.events()] == ["marker"]


# ------------------------------------------------------------------------------------ against torch itself


@pytest.mark.torch
def test_same_names_json_and_log_lines_as_torchelastic() -> None:
    torch_events = pytest.importorskip("torch.distributed.elastic.events")

    modules = {"api", "handlers", "inspect", "logging", "os", "socket", "traceback", "Optional"}
    assert set(events.__all__) == {n for n in dir(torch_events) if not n.startswith("_")} - modules

    meta = {"run_id": "r", "global_rank": 0, "ok": True, "raw_error": None, "t": 1.5}
    ours = events.Event("e", events.EventSource.AGENT, 12, dict(meta))
    theirs = torch_events.Event("e", torch_events.EventSource.AGENT, 12, dict(meta))
    assert ours.serialize() == theirs.serialize()
    assert events.Event.deserialize(theirs.serialize()) == ours
    assert torch_events.Event.deserialize(ours.serialize()) == theirs

    ours_r = events.RdzvEvent("n", "run", "m", "h", 3, events.NodeState.FAILED, "ep", 1, 2, "trace")
    theirs_r = torch_events.RdzvEvent("n", "run", "m", "h", 3, torch_events.NodeState.FAILED, "ep", 1, 2, "trace")
    assert ours_r.serialize() == theirs_r.serialize()
    assert torch_events.RdzvEvent.deserialize(ours_r.serialize()) == theirs_r

    # what each library's console logger is handed for the same record() call
    got: dict[str, Records] = {}
    for label, lib in (("ours", events), ("theirs", torch_events)):
        logger = lib._get_or_create_logger("console")
        got[label] = Records()
        logger.addHandler(got[label])
    try:
        events.record(ours, "console")
        torch_events.record(theirs, "console")
    finally:
        events._get_or_create_logger("console").removeHandler(got["ours"])
        torch_events._get_or_create_logger("console").removeHandler(got["theirs"])
    assert got["ours"].messages == got["theirs"].messages == [theirs.serialize()]
