"""A DDP training job (gloo) for the three-host alert scenarios (tests/system/test_many_nodes_alerts.py), as torchrun
starts it on each node, with no shmstat option: ``shmstat.torch.instrument(model, optimizer=)`` times each step's
``forward``, ``backward``, ``optimizer`` and DDP's ``allreduce`` (a wait section). The model's compute is simulated:
a layer sleeps ``FORWARD_MS`` (80) in its forward and ``BACKWARD_MS`` (40) in its backward (sections of a steady
length, so a healthy rank's figures agree within a few percent even on a loaded machine).

The test steers every rank through the JSON file ``CONTROL`` (read when it changes): ``{"slow": {"RANK": [forward
factor, backward factor]}, "hold": RANK, "end": true}``: a slowed rank sleeps that much longer, the held rank stays
inside its ``forward`` until the file no longer holds it, ``end`` ends the loop. At the end, or when a collective
fails (another host died), it writes ``$OUT_DIR/rank<RANK>.json``: its host, the job, the forward passes it
completed and how it ended."""

import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shmstat
import shmstat.job._state
import shmstat.torch

FORWARD_MS = float(os.environ.get("FORWARD_MS", "80"))
BACKWARD_MS = float(os.environ.get("BACKWARD_MS", "40"))
CONTROL = os.environ["CONTROL"]
rank = int(os.environ["RANK"])
_control: dict = {}
_control_mtime = 0


def control() -> dict:
    """The test's instructions, read again when the file changed."""
    global _control, _control_mtime
    try:
        mtime = os.stat(CONTROL).st_mtime_ns
    except FileNotFoundError:
        return _control
    if mtime != _control_mtime:
        with open(CONTROL) as f:
            text = f.read()
        if text.endswith("\n"):  # the test writes whole files (replace), ending with a newline
            _control, _control_mtime = json.loads(text), mtime
    return _control


def factors() -> list[float]:
    return control().get("slow", {}).get(str(rank), [1.0, 1.0])


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(BACKWARD_MS * factors()[1] / 1000)
        return grad


class Compute(torch.nn.Module):
    """A linear layer whose forward and backward take a set time (the compute being simulated)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_MS * factors()[0] / 1000)
        while control().get("hold") == rank:  # stopped inside forward, as a rank stuck in its compute
            time.sleep(0.05)
        return _SleepBackward.apply(self.linear(x))


dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(Compute())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
handle = shmstat.torch.instrument(model, optimizer=optimizer)
data = torch.Generator().manual_seed(rank)
forwards = 0
ended = "end"
try:
    while not control().get("end"):
        x = torch.randn(32, 16, generator=data)
        out = model(x)
        forwards += 1
        loss = torch.nn.functional.mse_loss(out, x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()  # DDP's all-reduce over gloo, across the hosts
        optimizer.step()
except RuntimeError as exc:  # a peer's host died: gloo says so here
    ended = f"collective failed: {str(exc).splitlines()[0][:200]}"
attachment = shmstat.job._state.STATE.attachment
job = attachment.segment.job if attachment is not None else None
shmstat.shutdown(flush_timeout_s=20)
out = os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json")
with open(out + ".tmp", "w") as f:
    json.dump({"host": socket.gethostname(), "job": job, "forwards": forwards, "ended": ended}, f)
os.replace(out + ".tmp", out)
if ended == "end":
    dist.destroy_process_group()
os._exit(0)  # after a failed collective gloo's threads may hang the interpreter's exit
