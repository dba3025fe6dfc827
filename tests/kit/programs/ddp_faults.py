"""A small DDP training job (gloo, CPU) as torchrun starts it, its loop instrumented in one call
(``shmstat.torch.instrument``: ``data``, ``forward``, ``backward``, ``optimizer``, ``allreduce``), with no shmstat
configuration beyond the job's name; a fault is injected on request. The test's variables (none is shmstat's):

- ``STEPS``: steps every rank trains (the same on every rank: DDP needs it); ``STEP_MS``: each step's base work,
  slept in ``forward``; ``NOISE_MS``: every rank, every step, sleeps a random 0..NOISE_MS more in ``data`` and
  again in ``forward``, and one step in 50 three times that (noisy steps, the same law on every rank);
- ``FAULT`` (``sleep``, ``stop``, ``lock``; unset: a clean job) on rank ``FAULT_RANK`` at step ``FAULT_STEP``
  in section ``FAULT_SECTION`` (``data``: inside the loader's fetch of the batch; ``forward``: inside the model's
  forward). First it writes ``$OUT_DIR/fault.json`` (its rank, pid, section and the wall-clock time), then
  ``sleep`` sleeps ``SLEEP_S`` seconds, ``stop`` sends itself SIGSTOP (the test sends SIGCONT), ``lock`` blocks
  on a lock that another thread of it holds until the file ``$OUT_DIR/release`` exists (the thread then lets it
  go); once past the fault it writes ``$OUT_DIR/resumed.json`` (the time). ``WORKERS``: the DataLoader's
  worker processes (0: the rank loads its batches itself); a ``data`` fault then happens in a worker (the pid
  written is its rank's).

At the end each rank writes ``$OUT_DIR/rank<RANK>.json`` (steps done)."""

import json
import os
import random
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import shmstat.torch

rank = int(os.environ["RANK"])
out_dir = os.environ["OUT_DIR"]
steps = int(os.environ.get("STEPS", "40"))
step_s = float(os.environ.get("STEP_MS", "20")) / 1000
noise_s = float(os.environ.get("NOISE_MS", "0")) / 1000
fault = os.environ.get("FAULT", "") if int(os.environ.get("FAULT_RANK", "-1")) == rank else ""
fault_step = int(os.environ.get("FAULT_STEP", "10"))
fault_section = os.environ.get("FAULT_SECTION", "data")
BATCH = 8
noise = random.Random(1000 + rank)


def _write(name: str, data: dict) -> None:
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _noise() -> None:
    if noise_s:
        time.sleep(noise.uniform(0, noise_s) * (3 if noise.random() < 0.02 else 1))


def _fault(step: int, where: str) -> None:
    if not fault or step != fault_step or where != fault_section:
        return
    in_worker = torch.utils.data.get_worker_info() is not None  # a DataLoader worker: its rank is its parent
    _write("fault.json", {"rank": rank, "pid": os.getppid() if in_worker else os.getpid(), "section": where,
                          "at": time.time()})
    if fault == "sleep":
        time.sleep(float(os.environ.get("SLEEP_S", "10")))
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "lock":
        lock, held = threading.Lock(), threading.Event()

        def holder() -> None:
            with lock:
                held.set()
                while not os.path.exists(os.path.join(out_dir, "release")):
                    time.sleep(0.05)

        threading.Thread(target=holder, daemon=True).start()
        held.wait()
        with lock:  # blocks in the lock's wait until the holder lets go
            pass
    else:
        raise SystemExit(f"unknown FAULT {fault!r}")
    _write("resumed.json", {"at": time.time()})


class Samples(Dataset):
    """Random samples; the first of each batch carries the step's loader noise (and the loader's fault)."""

    def __len__(self) -> int:
        return steps * BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i % BATCH == 0:
            _noise()
            _fault(i // BATCH, "data")
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return x, x.sum(dim=0, keepdim=True)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(step_s)
        _noise()
        _fault(self.step, "forward")
        self.step += 1
        return self.layer(x)


dist.init_process_group("gloo")
torch.manual_seed(0)
net = Net()
model = DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
handle = shmstat.torch.instrument(model, optimizer=optimizer,
                                  loader=DataLoader(Samples(), batch_size=BATCH, shuffle=False,
                                                    num_workers=int(os.environ.get("WORKERS", "0"))))
done = 0
for x, y in handle.loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    done += 1
handle.remove()
dist.destroy_process_group()
_write(f"rank{rank}.json", {"steps": done, "pid": os.getpid()})
