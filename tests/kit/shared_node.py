"""A shared node in a private /dev/shm (a mount namespace): root and a second local user (uid 65534) each leave
entries named like shmstat's, and every command runs as each of them: ``python tests/kit/shared_node.py WORK``.

Run as root. The second user's processes are forked from this one and drop privileges (setresuid), so no
interpreter needs to be executable by that user; every module a command uses is imported before forking (the
interpreter's own files may be unreadable to that user). Writes ``WORK/result.json``: each command's exit
status, stdout and stderr, and which entries exist at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import collector.cli.admin  # noqa: E402  (every command's modules, imported before a child drops privileges)
import collector.cli.command  # noqa: E402
import collector.cli.subscribe  # noqa: E402
import collector.cli.top  # noqa: E402
import collector.cli.top_live  # noqa: E402
import collector.daemon.collector  # noqa: E402
import collector.daemon.node  # noqa: E402
import collector.prometheus.exporter  # noqa: E402
import collector.relay.relay  # noqa: E402
import shmstat  # noqa: E402
import shmstat.job.rank  # noqa: E402
import shmstat.publish.publisher  # noqa: E402
import shmstat.shm.layout  # noqa: E402

OTHER = 65534
SHM = "/dev/shm"


def drop_to_other() -> None:
    os.setgroups([])
    os.setresgid(OTHER, OTHER, OTHER)
    os.setresuid(OTHER, OTHER, OTHER)


def holder(job: str, *, other: bool, stay: bool) -> int:
    """A process (of the other user if ``other``) registered as rank 0 of ``job``: it stays until killed
    (``stay``), or exits at once without detaching, leaving an idle segment whose rank entry names a dead pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            if other:
                drop_to_other()
            shmstat.init(job, rank=0, local_rank=0, world_size=1, publish=False)
            os.write(w, b"1")
            if stay:
                signal.pause()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)  # no atexit: the rank entry stays as a SIGKILL leaves it
    os.close(w)
    assert os.read(r, 1) == b"1", f"the holder of {job} did not register"
    os.close(r)
    if not stay:
        os.waitpid(pid, 0)
    return pid


def run_cli(work: str, name: str, argv: list[str], *, other: bool, runtime: str, until: str | None = None,
            timeout_s: float = 60.0) -> dict:
    """``shmstat ARGV`` in a forked child (as the other user if ``other``); with ``until``, it is stopped with
    SIGTERM once its output holds that text. Its exit status, stdout and stderr."""
    out_path, err_path = os.path.join(work, name + ".out"), os.path.join(work, name + ".err")
    out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.environ["SHMSTAT_RUNTIME_DIR"] = runtime
            os.environ.pop("XDG_RUNTIME_DIR", None)
            if other:
                drop_to_other()
            code = collector.cli.command.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    os.close(out_fd)
    os.close(err_fd)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if until is not None:
            with open(out_path) as f, open(err_path) as g:
                if until in f.read() + g.read():
                    os.kill(pid, signal.SIGTERM)
                    until = None
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    with open(out_path) as f, open(err_path) as g:
        return {"argv": argv, "other": other, "code": os.waitstatus_to_exitcode(status), "out": f.read(),
                "err": g.read()}


def main(work: str) -> None:
    root_rt = tempfile.mkdtemp(prefix="rt-root-", dir="/tmp")
    other_rt = tempfile.mkdtemp(prefix="rt-other-", dir="/tmp")
    os.chown(other_rt, OTHER, OTHER)
    holders: list[int] = []
    runs: dict[str, dict] = {}
    try:
        # the other user's entries: a directory, a FIFO, a link, a directory named like a lock file, a live
        # segment (its process runs) and an idle one (its process is gone)
        pid = os.fork()
        if pid == 0:
            drop_to_other()
            os.mkdir(f"{SHM}/shmstat.o-dir")
            os.mkfifo(f"{SHM}/shmstat.o-fifo")
            os.symlink("/etc/passwd", f"{SHM}/shmstat.o-link")
            os.mkdir(f"{SHM}/shmstat.o-dir2.lock")
            os.mkdir(f"{other_rt}/p.publish")
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        holders.append(holder("o-live", other=True, stay=True))
        holder("o-idle", other=True, stay=False)
        # root's: a live segment, an idle one; odd entries in both runtime directories
        holders.append(holder("r-live", other=False, stay=True))
        holder("r-dead", other=False, stay=False)
        os.mkdir(f"{root_rt}/x.ingest")
        os.chown(f"{root_rt}/x.ingest", OTHER, OTHER)
        os.mkfifo(f"{root_rt}/y.publish")
        os.symlink("/etc/passwd", f"{root_rt}/z.collector.lock")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(f"{root_rt}/w.collector.lock")  # a socket where a regular file is expected
        open(f"{root_rt}/v.ingest", "w").close()
        os.chown(f"{root_rt}/v.ingest", OTHER, OTHER)
        open(f"{other_rt}/q.ingest", "w").close()  # root's file in the other user's runtime directory
        runs["start"] = {"entries": sorted(os.listdir(SHM))}

        def root(name: str, argv: list[str], **kw) -> None:
            runs[name] = run_cli(work, name, argv, other=False, runtime=root_rt, **kw)

        def other(name: str, argv: list[str], **kw) -> None:
            runs[name] = run_cli(work, name, argv, other=True, runtime=other_rt, **kw)

        root("root_ls", ["ls"])
        root("root_top", ["top", "--once"])
        root("root_top_other", ["top", "--once", "--job", "o-live"])
        root("root_subscribe", ["subscribe", "--job", "y", "--timeout", "0.2"])
        root("root_collect_dir", ["collect", "--job", "o-dir"])
        root("root_collect_other", ["collect", "--job", "o-live"])
        root("root_clean_other", ["clean", "o-live"])
        root("root_clean", ["clean"])
        runs["after_root_clean"] = {"entries": sorted(os.listdir(SHM)), "rt": sorted(os.listdir(root_rt))}
        holder("r-dead2", other=False, stay=False)
        root("root_node", ["collect", "--handler", "*=null", "--status-interval", "0"],
             until="job r-dead2's segment removed")
        holder("r-idle", other=False, stay=False)  # root's idle segment, seen by the other user
        other("other_ls", ["ls"])
        other("other_top", ["top", "--once"])
        other("other_subscribe", ["subscribe", "--job", "p", "--timeout", "0.2"])
        other("other_clean_root", ["clean", "r-idle"])
        other("other_node", ["collect", "--handler", "*=null", "--status-interval", "0"],
              until="job o-idle's segment removed")
        other("other_clean", ["clean"])
        runs["end"] = {"entries": sorted(os.listdir(SHM)), "root_rt": sorted(os.listdir(root_rt)),
                       "other_rt": sorted(os.listdir(other_rt))}
    finally:
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(root_rt, ignore_errors=True)
        shutil.rmtree(other_rt, ignore_errors=True)
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main(sys.argv[1])
