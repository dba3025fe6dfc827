"""The ``--events otlp:ENDPOINT`` sink against a real OTLP/HTTP receiver started by the test (no OTel Collector
binary is available here): events of real rank processes, through a real collector subprocess, arrive as log
records, exactly once each; a failing receiver is counted."""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections import Counter
from typing import Any

import pytest
from kit.procs import spawn, start_collector

from collector.sinks.events import EventRecord, GapRecord
from collector.sinks.specs import build_event_handler
from shmstat.errors import ConfigError

_HAVE_OTEL = all(importlib.util.find_spec(m) is not None for m in (
    "opentelemetry.sdk._logs", "opentelemetry.exporter.otlp.proto.http._log_exporter", "opentelemetry.proto"))
needs_otel = pytest.mark.skipif(not _HAVE_OTEL, reason="OpenTelemetry logs SDK, OTLP/HTTP exporter or protos not "
                                                       "installed (pip install -e '.[test]')")


def _value(v: Any) -> Any:
    """An OTLP AnyValue as Python."""
    kind = v.WhichOneof("value")
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def test_without_opentelemetry_the_spec_is_one_sentence_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http._log_exporter", None)
    with pytest.raises(ConfigError) as err:
        build_event_handler("otlp:http://127.0.0.1:4318/v1/logs")
    assert "pip install -U 'shmstat[otlp]'" in str(err.value) and "\n" not in str(err.value)


def _otlp_rank(job: str, rank: int, n: int) -> None:
    import datetime

    import shmstat
    from elastic import events

    shmstat.init(job, rank=rank, local_rank=rank, world_size=2)
    for i in range(n):
        shmstat.log_event(shmstat.Event("otlp.log", datetime.datetime.now(), {"i": i, "ok": True, "x": 1.5}))
        events.record(events.Event(name="otlp.rec", source=events.EventSource.AGENT, metadata={"i": i}))
    shmstat.shutdown(flush_timeout_s=20)


@needs_otel
def test_events_of_real_ranks_reach_a_real_receiver_as_log_records_exactly_once(job):
    from kit.otlp import receiver

    n = 60
    with receiver() as rx:
        coll = start_collector(job, "--events", f"otlp:{rx.logs_endpoint}", "--handler", "*=null",
                               "--status-interval", "0")
        try:
            procs = [spawn(_otlp_rank, job, r, n) for r in range(2)]
            for p in procs:
                p.join(120)
                assert p.exitcode == 0
        finally:
            assert coll.stop() == 0
        records = rx.log_records()
    assert records
    by_rank: dict[int, list] = {0: [], 1: []}
    own = []
    for res, scope, rec, attrs in records:
        assert res["host.name"] == socket.gethostname() and res["service.name"] == "shmstat"
        assert scope == "shmstat.collector" and attrs["job"] == job
        if "rank" in attrs:
            by_rank[attrs["rank"]].append((rec, attrs))
        else:
            own.append(rec.event_name)
    for got in by_rank.values():
        assert Counter(rec.event_name for rec, _ in got) == {"otlp.log": n, "otlp.rec": n}
        seqs = [attrs["seq"] for _, attrs in got]
        assert len(set(seqs)) == 2 * n  # each event once
        logs = sorted((_value(rec.body)["i"], _value(rec.body)) for rec, _ in got if rec.event_name == "otlp.log")
        assert [i for i, _ in logs] == list(range(n))
        assert all(body == {"i": i, "ok": True, "x": 1.5} for i, body in logs)
        assert all(rec.severity_text == "INFO" and rec.time_unix_nano > 0 for rec, _ in got)
        assert {_value(rec.body)["source"] for rec, _ in got if rec.event_name == "otlp.rec"} == {"AGENT"}
    assert own.count("rank/joined") == 2


@needs_otel
def test_a_failing_receiver_raises_backs_off_then_exports_again():
    from kit.otlp import receiver

    from collector.handlers.otlp import OtlpExportError
    from collector.sinks.otlp_logs import GAP_EVENT_NAME, OtlpEventHandler

    now = [100.0]
    batch = [EventRecord("e", "j", 0, 1_700_000_000_000_000_000, {"a": 1}, 0, 7),
             GapRecord("j", 0, 7, 0, 1, 3, 3, "rank", 1_700_000_000_000_000_000)]
    with receiver() as rx:
        sink = OtlpEventHandler(rx.logs_endpoint, timeout_s=2.0, clock=lambda: now[0])
        rx.status = 500
        with pytest.raises(OtlpExportError, match="failed"):
            sink.emit_events(batch)
        rx.status = 200
        with pytest.raises(OtlpExportError, match="next attempt"):  # backing off: failed at once
            sink.emit_events(batch)
        assert rx.log_records() == []
        now[0] += 1.5
        sink.emit_events(batch)
        got = rx.log_records()
        sink.close()
    assert [rec.event_name for _, _, rec, _ in got] == ["e", GAP_EVENT_NAME]
    gap = got[1][2]
    assert _value(gap.body) == {"gap": 3, "from_seq": 1, "to_seq": 3, "at": "rank"} and gap.severity_text == "WARN"
    assert sink.failures == 2 and sink.exports == 1
