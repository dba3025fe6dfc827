"""A simulated cluster on this machine, for multi-node tests: ``with simulated_cluster(workdir) as c`` (or the
``sim_cluster`` fixture) gives hosts that are each a network, mount and UTS namespace of their own: their own
hostname (``node0``, ``node1``, ...), their own tmpfs on ``/dev/shm`` and on a runtime directory
(``XDG_RUNTIME_DIR``, the same path on every host), an ``/etc/hosts`` naming every host, and an interface
``veth0`` with address ``10.77.0.<i+1>/24``. The hosts are joined by veth pairs to a bridge in a namespace of its
own, the ops side (``c.ops``, ``10.77.0.254``, hostname ``ops``), where Prometheus or subscribers run. Files
outside ``/dev/shm`` and the runtime directory are shared with the test (the work directory, the repository).

Isolation: tests may run in parallel and must not touch the machine's network, so nothing is created in the
root network namespace at all (each veth pair is created from the ops side with its peer directly in its host),
and the namespaces have no names (each is held by a process, ``unshare ... sleep``), so nothing can collide.
Teardown, even after a failure: every process the kit started (its process group) is killed, then every
process still in one of the cluster's network namespaces, then the holders; the namespaces, their interfaces
and their tmpfs go with their last process. A holder also exits by itself within a second of the process that
started it dying.

Needs root, ``unshare`` and ``nsenter`` (util-linux) and ``ip`` (iproute2); :func:`require_namespaces` skips
the test with the reason when they are missing or namespaces, veth pairs or bridges are not permitted (probed
once per process); :func:`unavailable_reason` says the same to a script.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

SUBNET = "10.77.0"
OPS_ADDRESS = f"{SUBNET}.254"
INTERFACE = "veth0"
"""Every host's interface on the fabric (namespaces are private, so the same name on every host)."""

_CLONE_NEWNET = 0x40000000
_HOLDER = """set -e
mount -t tmpfs -o size=256m,mode=1777 shm /dev/shm
mount -t tmpfs -o size=16m,mode=0700 run "$CLUSTER_RUN"
mount --bind "$CLUSTER_HOSTS" /etc/hosts
hostname "$CLUSTER_NAME"
ip link set lo up
echo ready
while kill -0 "$CLUSTER_WATCH" 2>/dev/null; do sleep 1; done
"""
_PROBE = ("ip link add b0 type bridge && ip link add v0 type veth peer name v1 && ip link set v0 master b0 "
          "&& mount -t tmpfs tmpfs /dev/shm && hostname probe")
_probed: list[str] = []  # the reason to skip ("" when possible), once probed


def require_namespaces() -> None:
    """Skip the calling test, with the reason, unless simulated hosts can be made here (probed once)."""
    import pytest

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no simulated cluster: {reason}")


def unavailable_reason() -> str:
    """Why simulated hosts cannot be made here, in one sentence, or "" when they can (probed once per process):
    for a script that uses the kit outside pytest (scripts/multinode_bench.py)."""
    if not _probed:
        _probed.append(_why_not())
    return _probed[0]


def _why_not() -> str:
    if os.getuid() != 0:
        return "needs root (network, mount and UTS namespaces, veth pairs, a bridge)"
    missing = [tool for tool in ("unshare", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install util-linux iproute2)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--propagation", "private", "sh", "-c", _PROBE],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"namespaces, veth pairs or bridges are not permitted here: {probe.stderr.strip()}"
    return ""


@dataclass
class Proc:
    """A process the kit started in a host, its stdout and stderr in files (read them any time)."""

    name: str
    popen: subprocess.Popen
    out: Path
    err: Path

    def output(self) -> str:
        """Everything it wrote to stdout so far."""
        return self.out.read_text(errors="replace")

    def notes(self) -> str:
        """Everything it wrote to stderr so far (a collector's notes)."""
        return self.err.read_text(errors="replace")

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of its stderr and stdout, for a failure message."""
        parts = []
        for what, path in (("stderr", self.err), ("stdout", self.out)):
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            if text:
                parts.append(f"--- {self.name} {what} (last {len(text)} lines) ---\n" + "\n".join(text))
        code = self.popen.poll()
        state = "running" if code is None else f"exit code {code}"
        return f"=== {self.name}: {state} ===\n" + ("\n".join(parts) or "(no output)")

    def wait(self, timeout: float) -> int:
        """Its exit code; fails with its output's tail when it has not exited within ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout} s\n{self.tail()}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` (if it still runs) and return its exit code (bounded by ``timeout``)."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL its process group (it and whatever it started that stayed in it) unless it was reaped: then
        its id may be another process's by now (teardown finds what it left by namespace)."""
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


@dataclass
class Host:
    """One simulated host (or the ops side): run commands in it with :meth:`popen`, functions that use its
    network with :meth:`call`; read its ``/dev/shm`` and runtime directory with :meth:`shm` and
    :meth:`run_files`."""

    name: str
    address: str
    holder: subprocess.Popen
    runtime_dir: str
    logs: Path
    procs: list[Proc]
    netns: str = ""
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """The environment a process of this host starts with: the test's, with the host's runtime directory and
        name, and no shmstat or torchrun variable (each host is a fresh machine)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SHMSTAT_", "TORCHELASTIC_")) and k not in _RANK_VARIABLES}
        env.update(XDG_RUNTIME_DIR=self.runtime_dir, HOSTNAME=self.name)
        return env

    def popen(self, args: Sequence[str], *, name: str, env: dict[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None) -> Proc:
        """Start ``args`` in this host (its network, mounts and hostname) in a process group of its own, with
        ``env`` (default :attr:`env`) and ``cwd`` (default the test's); stdout and stderr go to files named after
        ``name`` in the cluster's log directory. Teardown kills it if it is still running."""
        tag = f"{self.name}.{name}"
        out, err = self.logs / f"{tag}.out", self.logs / f"{tag}.err"
        with open(out, "wb") as o, open(err, "wb") as e:
            popen = subprocess.Popen(self._enter(cwd) + list(args), env=self.env if env is None else env,
                                     stdin=subprocess.DEVNULL, stdout=o, stderr=e, start_new_session=True)
        proc = Proc(tag, popen, out, err)
        self.procs.append(proc)
        return proc

    def run(self, args: Sequence[str], timeout: float = 30.0, stdin: str | None = None) -> str:
        """Run ``args`` in this host to completion (bounded by ``timeout``); its stdout, or a failure with its
        stderr."""
        done = subprocess.run(self._enter(None) + list(args), input=stdin, capture_output=True, text=True,
                              timeout=timeout, env=self.env)
        assert done.returncode == 0, f"{self.name}: {' '.join(args)} failed: {done.stderr.strip()}"
        return done.stdout

    def _enter(self, cwd: str | os.PathLike[str] | None) -> list[str]:
        # entering a mount namespace moves to its root: --wd keeps the directory asked for
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--mount", "--uts", f"--wd={cwd or os.getcwd()}", "--"]

    def call(self, fn: Callable[..., T], *args: object, timeout: float = 30.0) -> T:
        """``fn(*args)`` in a thread of this test process that is in this host's network namespace (sockets it
        makes are this host's: e.g. an HTTP query to a server listening on the fabric); only the network is
        entered, files are the test's."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{self.name}",
                                                initializer=_enter_netns, initargs=(self.holder.pid,))
        return self._executor.submit(fn, *args).result(timeout)

    def crash(self) -> list[int]:
        """SIGKILL every process running in this host but the kit's own holder of its namespaces (the host dies
        as a machine losing power would, its network staying up for the others): the processes it started and
        whatever they started, in any process group. Returns the ids killed."""
        keep = {self.holder.pid}
        killed: list[int] = []
        for _ in range(50):  # until none is left: a process may start another while we kill
            left = [pid for pid in _pids() if _netns(pid) == self.netns and pid not in keep]
            while more := {pid for pid in left if pid not in keep and _ppid(pid) in keep and _holder_part(pid)}:
                keep |= more  # the holder's shell, then its sleep (killing that would end the shell: set -e)
            left = [pid for pid in left if pid not in keep]
            if not left:
                return killed
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.02)
        raise AssertionError(f"processes of {self.name} survive SIGKILL")

    def shm(self) -> list[str]:
        """What is in this host's ``/dev/shm`` now."""
        return sorted(os.listdir(f"/proc/{self.holder.pid}/root/dev/shm"))

    def run_files(self) -> list[str]:
        """Every path under this host's runtime directory now, relative to it."""
        root = f"/proc/{self.holder.pid}/root{self.runtime_dir}"
        return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root)
                      for n in dirs + files)


_RANK_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                   "MASTER_PORT"}


def _enter_netns(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the network namespace of {pid}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Cluster:
    """Simulated hosts joined by a bridge on the ops side (see the module's doc)."""

    hosts: list[Host]
    ops: Host
    logs: Path

    def tails(self, lines: int = 15) -> str:
        """The output tail of every process started in any host, for a failure message."""
        return "\n".join(p.tail(lines) for h in [*self.hosts, self.ops] for p in h.procs)


@contextlib.contextmanager
def simulated_cluster(workdir: str | os.PathLike[str], hosts: int = 2) -> Iterator[Cluster]:
    """``hosts`` simulated hosts and the ops side (skips the test where they cannot be made); on exit, everything
    is removed. ``workdir`` (created) holds the log files of every process started in a host."""
    require_namespaces()
    assert 1 <= hosts <= 250
    logs = Path(workdir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run = tempfile.mkdtemp(prefix="cl", dir="/tmp")  # short: ipc:// socket paths are limited to 107 bytes
    etc_hosts = Path(workdir) / "hosts"
    names = {f"node{i}": f"{SUBNET}.{i + 1}" for i in range(hosts)} | {"ops": OPS_ADDRESS}
    etc_hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in names.items()))
    made: list[Host] = []
    try:
        for name, address in names.items():
            made.append(_start_host(name, address, run, etc_hosts, logs))
        *nodes, ops = made
        _wire(nodes, ops)
        cluster = Cluster(nodes, ops, logs)
        yield cluster
    except BaseException:
        # pytest shows this output only for a failing test
        print("\n".join(p.tail() for h in made for p in h.procs))
        raise
    finally:
        _teardown(made)
        with contextlib.suppress(OSError):
            os.rmdir(run)


def _start_host(name: str, address: str, run: str, etc_hosts: Path, logs: Path) -> Host:
    env = dict(os.environ, CLUSTER_NAME=name, CLUSTER_RUN=run, CLUSTER_HOSTS=str(etc_hosts),
               CLUSTER_WATCH=str(os.getpid()))
    err = open(logs / f"{name}.holder.err", "wb")  # noqa: SIM115 - the holder keeps it
    holder = subprocess.Popen(["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--fork",
                               "--kill-child", "sh", "-c", _HOLDER], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    err.close()
    host = Host(name, address, holder, run, logs, [])
    assert holder.stdout is not None
    ready, _, _ = select.select([holder.stdout], [], [], 30)
    line = holder.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        holder.kill()
        holder.wait(10)
        reason = (logs / f"{name}.holder.err").read_text(errors="replace").strip()
        raise AssertionError(f"simulated host {name} did not start: {reason or 'no ready line within 30 s'}")
    host.netns = os.readlink(f"/proc/{holder.pid}/ns/net")
    return host


def _wire(nodes: list[Host], ops: Host) -> None:
    """A bridge on the ops side, and per host a veth pair made there with its peer created in the host."""
    lines = ["link add br0 type bridge", f"addr add {OPS_ADDRESS}/24 dev br0", "link set br0 up"]
    for i, host in enumerate(nodes):
        lines += [f"link add vh{i} type veth peer name {INTERFACE} netns {host.holder.pid}",
                  f"link set vh{i} master br0", f"link set vh{i} up"]
    ops.run(["ip", "-batch", "-"], stdin="\n".join(lines) + "\n")
    for host in nodes:
        host.run(["ip", "-batch", "-"], stdin=f"addr add {host.address}/24 dev {INTERFACE}\n"
                                              f"link set {INTERFACE} up\n")


def _teardown(hosts: list[Host]) -> None:
    for host in hosts:
        for proc in host.procs:
            proc.kill()
        if host._executor is not None:
            host._executor.shutdown(wait=False)
    for host in hosts:
        if host.holder.returncode is None:  # not reaped: its id is still the holder's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(host.holder.pid, signal.SIGKILL)
    for host in hosts:
        with contextlib.suppress(subprocess.TimeoutExpired):
            host.holder.wait(10)
        if host.holder.stdout:
            host.holder.stdout.close()
    _kill_rest({h.netns for h in hosts if h.netns})


def _kill_rest(namespaces: set[str]) -> None:
    """SIGKILL every process still in one of ``namespaces`` (something started in a host that left the process
    group the kit knew), until none is left (bounded)."""
    deadline = time.monotonic() + 10
    while namespaces:
        left = [pid for pid in _pids() if _netns(pid) in namespaces]
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {left} of a simulated host survive SIGKILL")
        for pid in left:
            try:
                fd = os.pidfd_open(pid)  # the process itself from here on, whatever reuses its id
            except OSError:  # gone
                continue
            try:
                if _netns(pid) in namespaces:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.02)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _holder_part(pid: int) -> bool:
    """Whether ``pid`` is the holder's shell or its ``sleep`` (the commands of :data:`_HOLDER`)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() in ("sh", "sleep")
    except OSError:
        return False


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid()]


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a kernel thread
        return ""
