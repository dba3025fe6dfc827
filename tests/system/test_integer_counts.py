"""A count is an int wherever it is written: the jsonl sink (``"value": 500``, not ``500.0``), the stat items of
``shmstat subscribe`` (the msgpack item carries an int), and the pytest plugin's queries (``per_rank()`` is
``{0: 500, 1: 500}``); real ranks, the plugin's real collector, the real ``shmstat subscribe`` command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

from kit.procs import REPO, read_jsonl
from kit.support import wait_for

SAMPLES = 500


def count_rank(rank: int) -> None:
    """Adds SAMPLES samples of ``rank + 1.5`` to ``train/step_ms`` over several windows."""
    import shmstat
    from shmstat import Aggregation as A

    step = shmstat.Stat("step_ms", [A.COUNT, A.SUM, A.MEAN], 0.05, group="train")
    for i in range(SAMPLES):
        step.add(rank + 1.5)
        if i % 50 == 49:
            time.sleep(0.01)


def _lines_of(proc: subprocess.Popen) -> list[dict]:
    """Every JSON line ``proc`` prints, collected by a thread as they come."""
    lines: list[dict] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_count_is_an_int_in_jsonl_subscribe_and_the_plugin_queries(shmstat_job_factory, tmp_path):
    out = str(tmp_path / "m.jsonl")
    job = shmstat_job_factory(collector_args=["--handler", f"train=jsonl:{out}"])
    sub = subprocess.Popen([sys.executable, "-m", "collector", "subscribe", job.publish_endpoint, "--topic", "stat/"],
                           stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        printed = _lines_of(sub)
        wait_for(lambda: printed, 20, what="the subscriber connected (the collector's usage, every second)")
        job.run_ranks(count_rank, 2)
        job.wait_for_rows("step_ms", "count", total=2 * SAMPLES)

        per_rank = job.per_rank("step_ms")
        assert per_rank == {0: SAMPLES, 1: SAMPLES}
        assert all(type(n) is int for n in per_rank.values()), per_rank
        merged = job.merged("step_ms")
        assert merged == 2 * SAMPLES and type(merged) is int
        counts = job.rows("step_ms", "count")
        assert counts and all(type(r.value) is int for r in counts)
        assert all(type(r.value) is float for r in job.rows("step_ms", "sum"))
        assert job.per_rank("step_ms", "sum") == {0: 1.5 * SAMPLES, 1: 2.5 * SAMPLES}

        def jsonl_counts() -> list[dict] | None:
            rows = [r for r in read_jsonl(out) if r["name"] == "step_ms.count" and r["rank"] is None]
            return rows if sum(r["value"] for r in rows) == 2 * SAMPLES else None

        rows = wait_for(jsonl_counts, 20, what="every window in jsonl")
        assert all(type(r["value"]) is int for r in rows), rows
        with open(out, encoding="utf-8") as f:
            text = f.read()
        assert re.search(r'"name": "step_ms\.count", "value": \d+, ', text)  # written as 36, not 36.0
        assert not re.search(r'"name": "step_ms\.count", "value": \d+\.', text)
        assert not [r for r in read_jsonl(out) if r["name"] == "step_ms.count" and type(r["value"]) is not int]
        assert all(type(r["value"]) is float for r in read_jsonl(out) if r["name"] == "step_ms.sum")

        def windows() -> list[dict] | None:
            items = [it for m in list(printed) if m["topic"] == "stat/train/step_ms" for it in m["items"]]
            merged = [it for it in items if it["rank"] is None]
            return items if sum(it["count"] for it in merged) == 2 * SAMPLES else None

        items = wait_for(windows, 20, what="every window on shmstat subscribe")
        assert all(type(it["count"]) is int for it in items), items
        assert sum(it["count"] for it in items if it["rank"] is not None) == 2 * SAMPLES
    finally:
        sub.terminate()
        sub.wait(10)
        if sub.stdout is not None:
            sub.stdout.close()
