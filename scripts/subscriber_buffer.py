"""What a stopped subscriber keeps of ``--publish-queue``, and what it is told it lost.

    python scripts/subscriber_buffer.py [--events 200] [--bytes 1000000] [--queue 128]

Starts ``shmstat collect --job`` for a fresh job and ``shmstat subscribe --job JOB --json --topic event/``,
stops the subscriber (SIGSTOP) once it has had a heartbeat, has one rank log ``--events`` events of ``--bytes``
each, resumes the subscriber, stops the collector (the subscriber ends with the job) and prints what the
subscriber kept, what it was told it lost on the way and what the rank dropped itself, which add up to what was
logged. Uses your runtime directory and ``/dev/shm`` like any job; leaves nothing behind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--bytes", type=int, default=1_000_000)
    ap.add_argument("--queue", type=int, default=128)
    args = ap.parse_args()
    import shmstat
    from shmstat.job import _state
    from shmstat.shm.segment import Segment

    job = f"buffer-{uuid.uuid4().hex[:8]}"
    work = tempfile.mkdtemp(prefix="shmstat-buffer-")
    cmd = [sys.executable, "-m", "collector"]
    env = dict(os.environ, PYTHONPATH=REPO)
    ready = os.path.join(work, "ready.json")
    coll = subprocess.Popen([*cmd, "collect", "--job", job, "--handler", "*=null", "--status-interval", "0",
                             "--publish-queue", str(args.queue), "--ready-file", ready],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    out = os.path.join(work, "sub.out")
    with open(out, "w") as stdout:  # the child keeps its own copy
        sub = subprocess.Popen([*cmd, "subscribe", "--job", job, "--json", "--topic", "event/"], env=env,
                               cwd=REPO, stdout=stdout, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not any(line.get("kind") == "heartbeat" for line in _lines(out)):
            if time.monotonic() > deadline:
                raise SystemExit("no heartbeat reached the subscriber in 30 s")
            time.sleep(0.05)
        os.kill(sub.pid, signal.SIGSTOP)
        with open(ready) as f:
            ingest = json.load(f)["ingest"]
        shmstat.init(job, rank=0, endpoint=ingest)
        pad = "x" * args.bytes
        for i in range(args.events):
            shmstat.log_event(shmstat.Event("big", datetime.datetime.now(), {"i": i, "pad": pad}))
        publisher = _state.STATE.publisher
        shmstat.shutdown(flush_timeout_s=60)
        dropped = publisher.stats().dropped
        time.sleep(1.0)  # the subscriber stays stopped a moment after the last event
    finally:
        os.kill(sub.pid, signal.SIGCONT)
        coll.send_signal(signal.SIGTERM)
        coll.wait(60)
    sub.wait(60)
    Segment.unlink(job)
    lines = _lines(out)
    kept = sum(len(line["items"]) for line in lines if line.get("kind") == "event")
    gaps = [line for line in lines if line.get("record") == "gap"]
    on_the_way = sum(g["items"] for g in gaps if g["stream"] == "event")
    by_rank = sum(g["items"] for g in gaps if g["stream"] == "sender")
    mib = kept * args.bytes / 2**20
    print(f"--publish-queue {args.queue}: kept {kept} of {args.events} events of {args.bytes} bytes "
          f"({mib:.1f} MiB); told {on_the_way} lost on the way and {by_rank} dropped by the rank "
          f"(the rank counted {dropped}); kept + told = {kept + on_the_way + by_rank}")
    return 0 if kept + on_the_way + by_rank == args.events else 1


if __name__ == "__main__":
    sys.exit(main())
