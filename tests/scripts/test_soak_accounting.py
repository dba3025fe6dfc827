"""scripts/soak.py's end check reads the collector's files right: per sender, every event kept once, gap-recorded,
lost or doubled; a collector counter summed over runs that each count from 0."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _soak():
    spec = importlib.util.spec_from_file_location("soak_script", REPO / "scripts" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = module
    spec.loader.exec_module(module)
    return module


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_events_file_is_read_per_sender_with_gaps_and_copies(tmp_path: Path) -> None:
    soak = _soak()
    events = tmp_path / "events.jsonl"
    step = {"name": "soak.step", "job": "j", "timestamp": 1.0, "data": {}, "incarnation": 1}
    _write(events, [
        *({**step, "rank": 0, "pid": 10, "seq": q} for q in (0, 1, 2, 2, 5)),  # seq 2 twice, 3..4 gap-recorded
        {"gap": 2, "job": "j", "rank": 0, "pid": 10, "incarnation": 1, "from_seq": 3, "to_seq": 4, "at": "rank",
         "timestamp": 2.0},
        {**step, "rank": 1, "pid": 11, "seq": 0},
        {"name": "rank/joined", "job": "j", "rank": None, "timestamp": 1.0, "data": {"rank": 0}, "seq": 0,
         "pid": 99, "incarnation": 0},  # the collector's own: not a rank's stream
    ])
    senders, bad = soak.read_events(str(events))
    assert bad == 0
    assert set(senders) == {(0, 10), (1, 11)}
    s = senders[(0, 10)]
    assert dict(s.seqs) == {0: 1, 1: 1, 2: 2, 5: 1}
    assert s.gaps == {3, 4}
    assert s.top == 6
    assert senders[(1, 11)].top == 1


def test_a_cut_last_line_is_counted_not_taken(tmp_path: Path) -> None:
    soak = _soak()
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"name": "soak.step", "rank": 0, "pid": 1, "seq": 0}) + "\n{\"name\": \"soak",
                      encoding="utf-8")
    senders, bad = soak.read_events(str(events))
    assert bad == 1 and senders[(0, 1)].top == 1


def test_collector_counter_sums_runs_that_each_count_from_zero(tmp_path: Path) -> None:
    soak = _soak()
    own = tmp_path / "collector.jsonl"
    row = {"group": "shmstat", "name": "collector.windows_overwritten", "rank": None}
    other = {"group": "shmstat", "name": "collector.seq_gaps", "rank": None, "value": 7}
    _write(own, [{**row, "value": v} for v in (0, 3, 5)] + [other] + [{**row, "value": v} for v in (0, 0, 4)])
    assert soak.collector_counter(str(own), "windows_overwritten") == 5 + 4
    assert soak.collector_counter(str(own), "seq_gaps") == 7
    assert soak.collector_counter(os.path.join(tmp_path, "absent.jsonl"), "seq_gaps") == 0
