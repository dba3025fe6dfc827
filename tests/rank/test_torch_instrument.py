"""``shmstat.torch.instrument``: a real model, loader and optimizer on CPU (each section counted once per step,
``data`` once per batch, every hook gone after ``remove()``), and a real 2-rank DDP job with gloo under a real
collector, where each rank's gradient all-reduce is a wait section."""

from __future__ import annotations

import sys

import pytest

import shmstat
from shmstat.job._state import STATE
from shmstat.shm import layout as L
from shmstat.shm.phase import read_phase

torch = pytest.importorskip("torch", reason="shmstat.torch instruments PyTorch (pip install torch==2.13.0)")


def _section_counts(local_rank: int = 0) -> dict[str, tuple[int, int]]:
    """``{section: (samples, flags)}`` in this process's entry (every bank: the windows are long)."""
    att = STATE.attachment
    assert att is not None
    seg = att.segment
    out = {}
    for desc in seg.descriptors(local_rank):
        if desc.group == "section":
            n = sum(seg.read_bank(local_rank, desc.index, b).count for b in range(seg.geometry.banks))
            out[desc.name] = (n, desc.flags)
    return out


def _hooks(model, optimizer) -> int:
    return (len(model._forward_pre_hooks) + len(model._forward_hooks) + len(optimizer._optimizer_step_pre_hooks)
            + len(optimizer._optimizer_step_post_hooks))


def test_a_cpu_training_loop_gets_each_section_once_per_step_and_remove_leaves_no_hook(job):
    shmstat.init(job, rank=0, world_size=1, publish=False, section_window_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    assert _hooks(model, opt) == 0
    handle = shmstat.torch.instrument(model, optimizer=opt, loader=loader)
    assert len(handle.loader) == 5
    steps = 0
    for _epoch in range(2):
        for x, y in handle.loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    with torch.no_grad():
        model(torch.randn(2, 8))  # an evaluation forward: a forward, no backward
    assert steps == 10
    counts = _section_counts()
    assert {k: n for k, (n, _) in counts.items()} == {"data": 10, "forward": 11, "backward": 10, "optimizer": 10}
    assert not any(flags & L.FLAG_WAIT for _, flags in counts.values())
    phase = read_phase(STATE.attachment.segment, 0)
    assert phase is not None and (phase.section, phase.depth, phase.step) == (None, 0, 10)
    handle.remove()
    assert _hooks(model, opt) == 0
    for x, y in handle.loader:  # after remove(): nothing is timed any more
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert {k: n for k, (n, _) in _section_counts().items()} == {"data": 10, "forward": 11, "backward": 10,
                                                                 "optimizer": 10}


def test_instrument_takes_a_module():
    with pytest.raises(shmstat.ConfigError, match=r"takes a torch\.nn\.Module"):
        shmstat.torch.instrument(object())


_DDP = r"""
import os, sys, time
import torch, torch.distributed as dist
import shmstat, shmstat.torch
rank = int(os.environ["SHMSTAT_RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + sys.argv[1])
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                                                      torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
handle = shmstat.torch.instrument(model, optimizer=opt, loader=torch.utils.data.DataLoader(data, batch_size=8))
for x, y in handle.loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
handle.remove()
dist.destroy_process_group()
"""


def test_a_ddp_job_times_each_ranks_allreduce_as_a_wait_section(shmstat_job, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(_DDP)
    shmstat_job.env["SHMSTAT_SECTION_WINDOW_S"] = "0.5"
    shmstat_job.run_ranks([sys.executable, str(script), str(tmp_path / "rdzv")], 2, timeout=240)
    for name in ("data", "forward", "backward", "optimizer"):  # 6 batches, 6 steps a rank
        shmstat_job.wait_for_rows(name, "count", total=12, timeout=60)
        assert shmstat_job.per_rank(name, "count") == {0: 6, 1: 6}
    shmstat_job.wait_for_rows("allreduce", "count", rank=1, timeout=60)
    per_rank = shmstat_job.per_rank("allreduce", "count")
    assert set(per_rank) == {0, 1} and all(n >= 6 for n in per_rank.values()), per_rank  # >= 1 bucket a step
    assert {r.wait for r in shmstat_job.rows("allreduce", "count")} == {True}
    assert {r.wait for r in shmstat_job.rows("forward", "count")} == {False}
