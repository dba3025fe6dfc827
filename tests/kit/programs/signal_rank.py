"""A rank for the signal tests of ``shmstat run`` (tests/collector/launch/test_run_signals.py).

``MODE=save``: adds to a Stat until interrupted; on KeyboardInterrupt (SIGINT) or SIGTERM it writes
``saved-<rank>`` with the signal's name and how many samples it added, and exits 0.
``MODE=stubborn``: ignores SIGINT and SIGTERM (noting each in ``got-<rank>``), after starting a child in its process
group and a grandchild in a session of its own, both ignoring them too; only SIGKILL ends them.
``MODE=daemons``: first starts two helpers that leave the rank's session and parents, as daemons do (``setsid sleep
600 &`` from a shell, and a double-forked Python process in a session of its own), then behaves as ``save``;
``MODE=daemons-exit`` starts them too, then exits with status ``EXIT_CODE`` once every rank of the node
wrote its ``ready`` file. The helpers carry the rank's
environment (the test marks it) and write their pids to ``daemons-<rank>``.
Every process writes its pid to ``pids-<rank>`` (one per line) and the rank writes ``ready-<rank>`` once it runs.
"""

import os
import signal
import subprocess
import sys
import time

import shmstat
from shmstat import Aggregation

out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
mode = os.environ.get("MODE", "save")

_IGNORE_BOTH = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)")


def note(name: str, text: str) -> None:
    with open(os.path.join(out, f"{name}-{rank}"), "a") as f:
        f.write(text + "\n")


class Terminated(Exception):
    pass


def on_term(_signum, _frame):
    raise Terminated


_DOUBLE_FORK = ("import os, signal, sys, time\n"
                "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                "if os.fork() == 0:\n"
                "    os.setsid()\n"
                "    if os.fork() == 0:\n"
                "        with open(sys.argv[1], 'a') as f: f.write(f'{os.getpid()}\\n')\n"
                "        time.sleep(600)\n"
                "    os._exit(0)\n"
                "os.wait()\n")


def start_daemons() -> None:
    """Two helpers reparented away from the rank at once, each noting its pid in ``daemons-<rank>``."""
    path = os.path.join(out, f"daemons-{rank}")
    subprocess.run(["sh", "-c", f'setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $! >> "{path}"'], check=True)
    subprocess.run([sys.executable, "-c", _DOUBLE_FORK, path], check=True)
    while True:  # the double-forked one writes its pid once it runs
        with open(path) as f:
            if len(f.read().split()) >= 2:
                return
        time.sleep(0.005)


if mode.startswith("daemons"):
    start_daemons()
    if mode == "daemons-exit":
        note("ready", "")
        # every rank's helpers exist before any rank ends (a failed rank stops the others at once)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out, f"ready-{r}")) for r in range(ranks)):
            time.sleep(0.01)
        sys.exit(int(os.environ.get("EXIT_CODE", "0")))

stat = shmstat.Stat("work", [Aggregation.COUNT, Aggregation.SUM], 0.1, group="sig")
note("pids", str(os.getpid()))
if mode == "stubborn":
    signal.signal(signal.SIGINT, lambda s, _f: note("got", signal.Signals(s).name))
    signal.signal(signal.SIGTERM, lambda s, _f: note("got", signal.Signals(s).name))
    child = subprocess.Popen([sys.executable, "-c", _IGNORE_BOTH])
    grandchild = subprocess.Popen([sys.executable, "-c", _IGNORE_BOTH], start_new_session=True)
    note("pids", str(child.pid))
    note("pids", str(grandchild.pid))
    note("ready", "")
    while True:
        stat.add(1.0)
        time.sleep(0.01)

signal.signal(signal.SIGTERM, on_term)
added = 0
note("ready", "")
stopping = {signal.SIGINT, signal.SIGTERM}
try:
    while True:
        signal.pthread_sigmask(signal.SIG_BLOCK, stopping)  # the sample and its tally together, or neither
        stat.add(1.0)
        added += 1
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)
        time.sleep(0.002)
except KeyboardInterrupt:
    note("saved", f"SIGINT {added}")
except Terminated:
    note("saved", f"SIGTERM {added}")
shmstat.shutdown()
