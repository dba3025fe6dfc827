"""Rank bodies for tests/rank/test_testing_plugin.py (spawned: they must live in an importable module)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time

import shmstat
from elastic.metrics import put_metric


def counting_rank(rank: int, samples: int) -> None:
    """Add ``samples`` samples of ``rank + 1`` to ``step_ms``, put one metric, log one event."""
    step = shmstat.Stat("step_ms", [shmstat.Aggregation.COUNT, shmstat.Aggregation.SUM], 0.05, group="train")
    for _ in range(samples):
        step.add(float(rank + 1))
    put_metric("loss", rank * 10, "train")
    shmstat.log_event(shmstat.Event("ckpt.saved", datetime.datetime.now(), {"rank": rank}))


def failing_rank(rank: int) -> None:
    """Rank 1 fails with a message; the others succeed."""
    print(f"rank {rank} starting", flush=True)
    if rank == 1:
        raise RuntimeError("rank 1 lost its data loader")


def forever_rank(rank: int, ready_dir: str) -> None:
    """Attach, say so in ``ready_dir``, then add samples until killed."""
    step = shmstat.Stat("spin", [shmstat.Aggregation.COUNT], 0.05)
    step.add(1.0)
    with open(os.path.join(ready_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        step.add(1.0)
        time.sleep(0.001)


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_for_file(path: str, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def raise_or_block_rank(rank: int, out_dir: str, ignore_sigterm: bool) -> None:
    """Rank 0 raises as soon as the others are blocked; the others block for ever (optionally deaf to SIGTERM)
    with a forked child of their own, as a data loader worker would be. Pids go to ``out_dir``."""
    _write_atomically(os.path.join(out_dir, f"rank{rank}.pid"), str(os.getpid()))
    if rank == 0:
        for r in range(1, int(os.environ["SHMSTAT_WORLD_SIZE"])):
            _wait_for_file(os.path.join(out_dir, f"rank{r}.blocked"))
        _write_atomically(os.path.join(out_dir, "failed_at"), repr(time.time()))
        raise RuntimeError("rank 0 ran out of data")
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(3600)
    _write_atomically(os.path.join(out_dir, f"child{rank}.pid"), str(child))
    _write_atomically(os.path.join(out_dir, f"rank{rank}.blocked"), "")
    threading.Event().wait()


def orphaning_rank(rank: int, out_dir: str) -> None:
    """Fork a child that sleeps for ever, note its pid, and return (exit 0) leaving it behind."""
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(3600)
    _write_atomically(os.path.join(out_dir, f"child{rank}.pid"), str(child))


def gloo_rank(rank: int, out_dir: str) -> None:
    """Ranks 0 and 1 form a gloo group (TCPStore on a port bound to 0, its number passed through ``out_dir``);
    rank 1 blocks in ``all_reduce`` for a rank 0 that blocks in a store wait and never joins; rank 2 raises once
    rank 1 is in the collective."""
    _write_atomically(os.path.join(out_dir, f"rank{rank}.pid"), str(os.getpid()))
    if rank == 2:
        _wait_for_file(os.path.join(out_dir, "rank1.in_collective"))
        _write_atomically(os.path.join(out_dir, "failed_at"), repr(time.time()))
        raise RuntimeError("rank 2 hit a bad batch")
    import torch
    import torch.distributed as dist

    long = datetime.timedelta(hours=1)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=long, wait_for_workers=False)
        _write_atomically(os.path.join(out_dir, "port"), str(store.port))
    else:
        store = dist.TCPStore("127.0.0.1", int(_wait_for_file(os.path.join(out_dir, "port"))), 2, False,
                              timeout=long)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=long)
    if rank == 0:
        store.wait(["never set"])
    else:
        work = dist.all_reduce(torch.ones(4), async_op=True)  # in the collective from here on
        _write_atomically(os.path.join(out_dir, "rank1.in_collective"), "")
        work.wait()


class LoadsOnlyHere:
    """An argument that pickles here but cannot be loaded in a rank (its environment names a rank)."""

    def __reduce__(self) -> tuple:
        return (_load_outside_a_rank, ())


def _load_outside_a_rank() -> LoadsOnlyHere:
    if "SHMSTAT_RANK" in os.environ:
        raise ImportError("this argument cannot be loaded in a rank")
    return LoadsOnlyHere()


def mp_rank(rank: int, samples: int) -> None:
    """A multiprocessing child: the job comes from the environment it inherited, the rank from its argument."""
    shmstat.init(rank=rank, world_size=2)
    step = shmstat.Stat("mp_step", [shmstat.Aggregation.COUNT], 0.05)
    for _ in range(samples):
        step.add(1.0)
    shmstat.shutdown()


def torchrun_main() -> None:
    """A torchrun worker: nothing shmstat-specific but the Stat; job from SHMSTAT_JOB, rank from torchrun's RANK."""
    step = shmstat.Stat("tr_step", [shmstat.Aggregation.COUNT], 0.05)
    for _ in range(300):
        step.add(1.0)
    shmstat.log_event(shmstat.Event("tr.done", datetime.datetime.now(), {"rank": int(os.environ["RANK"])}))
    shmstat.shutdown()


if __name__ == "__main__":  # a script rank: python tests/kit/plugin_ranks.py SAMPLES | torchrun
    if sys.argv[1:] == ["torchrun"]:
        torchrun_main()
    else:
        counting_rank(int(os.environ["SHMSTAT_RANK"]), int(sys.argv[1]))
