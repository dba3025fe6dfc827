"""A small DDP training job as torchrun starts it (gloo, CPU), its loop instrumented in one call
(``shmstat.torch.instrument``), with a fault injected into one rank: ``SLOW_RANK`` is the rank, ``SLOW_DATA`` the
factor its data loading is slowed by, ``SLOW_FORWARD`` the factor its forward is slowed by. Loading a batch takes
``DATA_MS`` (a sleep: a slow disk or decode) and the forward computes, then takes ``FORWARD_MS`` more (a sleep: the
heavier part of a real model's forward, which on CPU would make its ranks fight for the cores). ``STEPS`` steps;
the job and rank come from torchrun (and ``SHMSTAT_JOB`` when set), the section windows from
``SHMSTAT_SECTION_WINDOW_S``."""

import os
import time

import torch
import torch.distributed as dist

import shmstat
import shmstat.torch

rank = int(os.environ["RANK"])
slow = int(os.environ.get("SLOW_RANK", "-1"))
data_ms = float(os.environ.get("DATA_MS", "8")) * (float(os.environ.get("SLOW_DATA", "1")) if rank == slow else 1)
forward_ms = float(os.environ.get("FORWARD_MS", "16")) * (float(os.environ.get("SLOW_FORWARD", "1"))
                                                         if rank == slow else 1)
steps = int(os.environ.get("STEPS", "200"))


class Batches(torch.utils.data.IterableDataset):
    """Batches that take ``data_ms`` each to load."""

    def __iter__(self):
        g = torch.Generator().manual_seed(rank)
        while True:
            time.sleep(data_ms / 1000)
            yield torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


class Heavy(torch.nn.Module):
    """The rest of the forward: ``forward_ms`` of it."""

    def forward(self, x):
        time.sleep(forward_ms / 1000)
        return x


dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), Heavy(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(Batches(), batch_size=None)
handle = shmstat.torch.instrument(model, optimizer=opt, loader=loader)
for step, (x, y) in enumerate(handle.loader):
    if step == steps:
        break
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
handle.remove()
dist.destroy_process_group()
shmstat.shutdown()
