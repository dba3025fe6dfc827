"""PyTorch's real torchelastic agent with our handler configured: its platform metrics reach our collector."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kit.procs import REPO, read_jsonl, start_collector
from kit.support import unique_job

from shmstat.shm.segment import Segment

pytest.importorskip("torch.distributed.launcher.api")


def test_torchelastic_agent_metrics_and_worker_stats_flow_through_our_collector(tmp_path):
    job = unique_job("te")
    out = str(tmp_path / "m.jsonl")
    coll = start_collector(job, "--handler", f"*=jsonl:{out}", "--grace-ms", "10")
    try:
        env = dict(os.environ, PYTHONPATH=REPO)
        for var in ("SHMSTAT_JOB", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK"):
            env.pop(var, None)
        r = subprocess.run(
            [sys.executable, os.path.join(REPO, "tests", "kit", "programs", "torch_agent.py"), job,
             os.path.join(REPO, "tests", "kit", "programs", "torch_worker.py"), str(tmp_path)],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=180,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        assert coll.stop() == 0
        Segment.unlink(job)
    rows = read_jsonl(out)
    platform = {row["name"]: row["value"] for row in rows if row["group"] == "torchelastic"}
    assert platform.get("workers.default_role.run_success_no_retries") == 1
    assert platform.get("workers.default_role.run_total") == 1
    assert "workers.default_role.remaining_restarts" in platform
    assert any(name.endswith("_start_workers.success") for name in platform)
    assert all(row["rank"] == 99 for row in rows if row["group"] == "torchelastic")
    steps = sum(row["value"] for row in rows if row["name"] == "step.count" and row["rank"] is None)
    assert steps == 100  # both workers, attached from torchrun's variables alone
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("worker-")) == ["worker-0", "worker-1"]
