"""``shmstat keys`` and the ``--curve`` options as a user meets them, each a real ``shmstat`` process: the files
and modes a key set gets, what is never overwritten, and every bad input one sentence with exit status 2, before
anything is bound or left in /dev/shm."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import zmq
import zmq.auth
from kit.procs import REPO, start_collector

from collector.cli.keys import make_keys


def _shmstat(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, timeout=timeout)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _one_error(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmstat: error: ") and says in lines[0], done.stderr


def _contents(directory) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_keys_writes_a_key_set_owner_only_and_never_overwrites_it(tmp_path):
    keys = tmp_path / "new" / "keys"  # created, parents too
    done = _shmstat("keys", str(keys))
    assert done.returncode == 0, done.stderr
    assert "--curve" in done.stdout and "shmstat subscribe --curve" in done.stdout
    assert sorted(os.listdir(keys)) == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert _mode(keys) == 0o700
    assert {name: _mode(keys / name) for name in os.listdir(keys)} == dict.fromkeys(os.listdir(keys), 0o600)
    for name in ("server", "client"):  # zmq.auth reads them, and each secret file holds its matching public key
        public, secret = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
        assert secret is not None and zmq.curve_public(secret) == public
        assert zmq.auth.load_certificate(str(keys / f"{name}.key")) == (public, None)
    before = _contents(keys)
    _one_error(_shmstat("keys", str(keys)), "already holds a key set")
    assert _contents(keys) == before  # nothing was touched

    added = _shmstat("keys", str(keys), "--client", "alice")
    assert added.returncode == 0, added.stderr and "--curve-client alice" in added.stdout
    assert _mode(keys / "alice.key_secret") == 0o600 and _mode(keys / "alice.key") == 0o600
    with_alice = _contents(keys)
    assert {k: v for k, v in with_alice.items() if not k.startswith("alice")} == before
    _one_error(_shmstat("keys", str(keys), "--client", "alice"), "already holds subscriber alice's keys")
    assert _contents(keys) == with_alice and not [n for n in os.listdir(keys) if n.startswith(".")]

    forced = _shmstat("keys", str(keys), "--force")
    assert forced.returncode == 0, forced.stderr
    after = _contents(keys)
    assert after["server.key"] != before["server.key"] and after["alice.key"] == with_alice["alice.key"]


def test_keys_refuses_bad_names_and_directories(tmp_path):
    _one_error(_shmstat("keys", str(tmp_path / "missing"), "--client", "alice"), "make a key set with: shmstat keys")
    (tmp_path / "empty").mkdir(mode=0o700)
    _one_error(_shmstat("keys", str(tmp_path / "empty"), "--client", "alice"), "holds no key set")
    make_keys(str(tmp_path / "k"))
    _one_error(_shmstat("keys", str(tmp_path / "k"), "--client", "server"), "the collector's own key pair")
    _one_error(_shmstat("keys", str(tmp_path / "k"), "--client", "../x"), "letters, digits")
    (tmp_path / "file").write_text("")
    _one_error(_shmstat("keys", str(tmp_path / "file")), "not a directory")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _one_error(_shmstat("keys", str(shared)), "other users can write to it")
    assert os.listdir(shared) == []


def _bad_secret_mode(keys) -> None:
    os.chmod(keys / "server.key_secret", 0o644)


def _garbage(name: str):
    def damage(keys) -> None:
        (keys / name).write_text("metadata\ncurve\n    public-key = \"not a key\"\n")
    return damage


def _mismatched(keys) -> None:
    public, _ = zmq.auth.load_certificate(str(keys / "server.key_secret"))
    _, other_secret = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    assert other_secret is not None
    (keys / "server.key_secret").write_text(
        f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{other_secret.decode()}"\n')


_COLLECT = ("collect", "--job", "{job}", "--publish", "tcp://127.0.0.1:0", "--curve", "{keys}")


@pytest.mark.parametrize("args, damage, says", [
    (("collect", "--job", "{job}", "--curve", "{keys}"), None, "--curve secures a TCP publish endpoint"),
    (("collect", "--job", "{job}", "--publish", "ipc://{keys}/p.sock", "--curve", "{keys}"), None,
     "--curve secures a TCP publish endpoint"),
    (("run", "--job", "{job}", "--nproc-per-node", "1", "--curve", "{keys}", "tests/kit/programs/elastic_job.py"), None,
     "--curve secures a TCP publish endpoint"),
    (("collect", "--job", "{job}", "--publish", "tcp://127.0.0.1:0", "--curve", "{keys}/nope"), None,
     "no such directory"),
    (_COLLECT, lambda keys: os.unlink(keys / "server.key_secret"), "server.key_secret is missing"),
    (_COLLECT, _bad_secret_mode, "is readable by other users (mode 0644)"),
    (_COLLECT, _garbage("server.key_secret"), "is not a CURVE key file"),
    (_COLLECT, _garbage("mallory.key"), "mallory.key is not a CURVE key file"),
    (_COLLECT, _mismatched, "its public key is not its secret key's"),
    (_COLLECT, lambda keys: os.chmod(keys, 0o777), "other users can write to it"),
    (("collect", "--curve", "{keys}"), None, "--curve secures a TCP publish endpoint"),
    (("subscribe", "--curve", "{keys}"), None, "--curve connects to collectors' tcp:// endpoints"),
    (("subscribe", "--curve", "{keys}", "ipc://{keys}/p.sock"), None, "is not one"),
    (("subscribe", "--curve", "{keys}", "--job", "{job}"), None, "--curve connects to collectors' tcp://"),
    (("subscribe", "--curve-client", "alice", "tcp://127.0.0.1:1"), None, "add --curve DIR"),
    (("subscribe", "--curve", "{keys}", "--curve-client", "alice", "tcp://127.0.0.1:1"), None,
     "alice.key_secret is missing"),
    (("subscribe", "--curve", "{keys}", "tcp://127.0.0.1:1"), lambda keys: os.unlink(keys / "server.key"),
     "server.key is missing (copy the collector's server.key there)"),
    (("subscribe", "--curve", "{keys}", "tcp://127.0.0.1:1"), lambda keys: os.chmod(keys / "client.key_secret", 0o640),
     "is readable by other users"),
])
def test_a_bad_curve_option_is_one_sentence_and_exit_2(job, tmp_path, args, damage, says):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    if damage is not None:
        damage(keys)
    _one_error(_shmstat(*(a.format(job=job, keys=keys) for a in args)), says)
    assert not [n for n in os.listdir("/dev/shm") if job in n], "a bad command left something in /dev/shm"


def test_with_curve_a_non_loopback_publish_needs_no_allow_remote_and_says_what_is_protected(job, tmp_path):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    coll = start_collector(job, "--publish", "tcp://0.0.0.0:0", "--curve", str(keys), "--handler", "*=null",
                           "--status-interval", "0")
    try:
        assert coll.publish.startswith("tcp://0.0.0.0:"), coll.publish
    finally:
        code = coll.stop()
    err = "\n".join(coll.lines)  # its notes: what CURVE protects, then where it serves
    assert code == 0, err
    assert "secured with CURVE" in err and "only subscribers whose public key is a *.key file" in err
    assert "--allow-remote-publish" not in err
    refused = _shmstat("collect", "--job", job, "--publish", "tcp://0.0.0.0:0", "--handler", "*=null")
    _one_error(refused, "add --curve DIR")
