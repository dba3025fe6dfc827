"""Command-line rough edges a new user hits: any bad option of any command is one sentence on stderr and exit
status 2, never a traceback; subscribe says when nothing answers; -v works after the command; --version."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kit.procs import REPO


def _shmstat(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (("demo", "--window-ms", "0"), "--window-ms"),
    (("demo", "--ranks", "0"), "--ranks"),
    (("collect", "--job", "{job}", "--publish", "tcp://127.0.0.1:99999"), "65535"),
    (("collect", "--job", "{job}", "--publish", "bogus"), "ipc:// or tcp://"),
    (("collect", "--job", "{job}", "--max-ranks", "0"), "--max-ranks"),
    (("collect", "--job", "{job}", "--grace-ms", "-1"), "--grace-ms"),
    (("collect", "--job", "bad/job"), "job id"),
    (("top", "--job", "{job}", "--iterations", "1"), "no shared memory segment"),
    (("clean", "{job}"), "no segment"),
    (("run", "--job", "{job}", "--nproc-per-node", "0", "tests/kit/programs/elastic_job.py"), "--nproc-per-node"),
    (("run", "--job", "{job}", "--nproc-per-node", "2", "--monitor-interval", "0", "tests/kit/programs/elastic_job.py"),
     "--monitor-interval"),
    (("run", "--job", "{job}", "--nproc-per-node", "2", "--stop-grace", "-1", "tests/kit/programs/elastic_job.py"),
     "--stop-grace"),
    (("collect", "--job", "{job}", "--handler", "*=compactt"), "use compact, console, null"),
    (("collect", "--job", "{job}", "--handler", "*=jsnl:x"), "unknown handler kind 'jsnl'"),
    (("collect", "--job", "{job}", "--handler", "*=jsnl:/tmp/x"), "unknown handler kind 'jsnl'"),
    (("collect", "--job", "{job}", "--handler", "rank0=console"), "--handler group 'rank0' reads as rank<N>"),
    (("run", "--job", "{job}", "--nproc-per-node", "1", "--role", "a\tb", "tests/kit/programs/elastic_job.py"),
     "the name rule"),
    (("top", "--job", "{job}", "--interval", "-1"), "--interval"),
    (("top", "--job", "{job}", "--once"), "no shared memory segment"),
    (("top", "--job", "{job}", "--sort", "bogus"), "--sort must be one of name, count, mean, p99, spread"),
    (("top", "--job", "{job}", "--stat", "no-group"), "--stat takes GROUP/NAME"),
    (("top", "--job", "{job}", "--iterations", "0"), "--iterations"),
    (("top", "--job", "bad/job", "--once"), "job id"),
    (("top", "--nodes", "bogus", "--once"), "is not a node collector's endpoint"),
    (("top", "--nodes", "a=tcp://127.0.0.1:1", "a=tcp://127.0.0.1:2", "--once"), "one node name"),
    (("top", "--curve", "keys", "--once"), "add --nodes ENDPOINT"),
    (("top", "--nodes", "tcp://127.0.0.1:1", "--curve", "/nonexistent-keys", "--once"), "no such directory"),
    (("top", "--nodes", "tcp://127.0.0.1:1", "--silent-after", "0", "--once"), "--silent-after must be more than 0"),
    (("top", "--nodes", "tcp://127.0.0.1:1", "--silent-after", "nan", "--once"), "--silent-after must be more than 0"),
    (("top", "--nodes", "tcp://127.0.0.1:1", "--silent-after", "5000", "--once"), "at most 3600 seconds"),
    (("top", "--job", "{job}", "--silent-after", "3", "--once"), "--silent-after is how long a node of --nodes"),
    (("collect", "--job", "{job}", "--straggler-threshold", "1"), "--straggler-threshold"),
    (("collect", "--job", "{job}", "--straggler-threshold", "0"), "--straggler-threshold"),
    (("collect", "--job", "{job}", "--straggler-windows", "0"), "--straggler-windows"),
    (("collect", "--job", "{job}", "--straggler-windows", "1001"), "--straggler-windows"),
    (("collect", "--job", "{job}", "--commit-wait", "0"), "--commit-wait"),
    (("collect", "--job", "{job}", "--commit-wait", "nan"), "--commit-wait"),
    (("run", "--job", "{job}", "--nproc-per-node", "2", "--straggler-threshold", "nan",
      "tests/kit/programs/elastic_job.py"), "--straggler-threshold"),
    (("collect", "--job", "{job}", "--heartbeat-interval", "0"), "--heartbeat-interval"),
    (("collect", "--job", "{job}", "--heartbeat-interval", "nan"), "--heartbeat-interval"),
    (("subscribe", "--follow"), "--follow keeps following a --job"),
    (("subscribe", "--job", "bad/job"), "job id"),
])
def test_a_bad_option_is_one_sentence_and_exit_2(job, args, says):
    done = _shmstat(*(a.format(job=job) for a in args))
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmstat: error: ") and says in lines[0], done.stderr
    assert len(lines[0]) - len("shmstat: error: ") < 160, lines[0]  # one short sentence
    assert "ingest" not in lines[0]
    assert not [n for n in os.listdir("/dev/shm") if job in n], "a bad command left something in /dev/shm"


def test_subscribe_to_nothing_says_so_and_fails_when_the_count_is_not_reached(tmp_path):
    done = _shmstat("subscribe", f"ipc://{tmp_path}/nobody.sock", "--count", "1", "--timeout", "0.3")
    assert done.returncode == 1
    assert "nothing received" in done.stderr and "0 of 1" in done.stderr
    assert done.stdout == ""


def test_version_and_verbose_after_the_command():
    version = _shmstat("--version")
    assert version.returncode == 0 and version.stdout.startswith("shmstat ")
    listed = _shmstat("ls", "-v")
    assert listed.returncode == 0, listed.stderr
