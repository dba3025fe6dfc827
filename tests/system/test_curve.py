"""Streams across hosts with CURVE, as users and attackers meet it: a collector started with ``--publish
tcp://127.0.0.1:0 --curve DIR`` and real ``shmstat subscribe`` processes. A holder of a client key receives every
event exactly; a subscriber with no keys, one with a key pair not in DIR, one using the server's own pair, and one
whose key was revoked receive nothing, each says why on stderr, and every refused attempt is counted by the
collector (its counters, read from the authorised subscriber's own stream of ``stat/shmstat/usage``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from kit.procs import REPO, spawn, start_collector
from kit.support import wait_for

K = 200


def _keys(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "collector", "keys", *args], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert done.returncode == 0, done.stderr


def _subscriber_dir(path, server_key: str, secret: str, name: str = "client") -> str:
    """An owner-only directory as a subscriber's host holds it: the collector's server.key and one secret."""
    os.mkdir(path, 0o700)
    shutil.copy(server_key, path / "server.key")
    shutil.copy(secret, path / f"{name}.key_secret")
    os.chmod(path / f"{name}.key_secret", 0o600)
    return str(path)


def _subscribe(tmp_path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    out = str(tmp_path / f"{name}.out")
    with open(out, "w") as stdout, open(tmp_path / f"{name}.err", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "collector", "subscribe", "--json", *args], cwd=REPO,
                                stdout=stdout, stderr=stderr, env=dict(os.environ, PYTHONPATH=REPO))
    return proc, out


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def _counter(path: str, name: str) -> int:
    """The collector's newest ``collector.<name>`` as the subscriber at ``path`` received it (-1: none yet)."""
    values = [it["value"] for line in _lines(path) if line.get("topic") == "stat/shmstat/usage"
              for it in line["items"] if it["name"] == f"collector.{name}"]
    return values[-1] if values else -1


def _beats(path: str) -> int:
    return sum(1 for line in _lines(path) if line.get("kind") == "heartbeat")


def _events(path: str) -> list[int]:
    return [it["data"]["i"] for line in _lines(path) if line.get("kind") == "event" for it in line["items"]]


def _log_events(job: str, n: int) -> None:
    import datetime

    import shmstat

    shmstat.init(job, rank=0)
    for i in range(n):
        shmstat.log_event(shmstat.Event("tick", datetime.datetime.now(), {"i": i}))
    shmstat.shutdown(flush_timeout_s=30)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        p.wait(30)


def test_only_a_key_holder_receives_the_stream_and_every_refused_attempt_is_counted(job, tmp_path):
    keys = tmp_path / "keys"
    _keys(str(keys))
    other = tmp_path / "other"  # a key set the collector never saw
    _keys(str(other))
    stranger = _subscriber_dir(tmp_path / "stranger", keys / "server.key", other / "client.key_secret")
    as_server = _subscriber_dir(tmp_path / "as-server", keys / "server.key", keys / "server.key_secret")
    coll = start_collector(job, "--handler", "*=null", "--publish", "tcp://127.0.0.1:0", "--curve", str(keys),
                           "--status-interval", "0", "--heartbeat-interval", "0.2")
    endpoint = coll.publish
    assert endpoint.startswith("tcp://127.0.0.1:")
    good, good_out = _subscribe(tmp_path, "good", "--curve", str(keys), endpoint)
    bad = {name: _subscribe(tmp_path, name, *args) for name, args in {
        "no-keys": (endpoint,),
        "stranger": ("--curve", stranger, endpoint),
        "as-server": ("--curve", as_server, endpoint),
        "other-server": ("--curve", str(other), endpoint),  # its own client key, another collector's server key
    }.items()}
    says = {"no-keys": "lets in only CURVE subscribers", "stranger": "refused this CURVE key",
            "as-server": "refused this CURVE key", "other-server": "the CURVE handshake keeps failing"}
    try:
        # five subscriber processes start at once: on a loaded 2-core machine their imports alone took over 30 s
        wait_for(lambda: _beats(good_out) > 0, 90, 0.05, what="the key holder's first heartbeat")
        # every unauthorised subscriber was turned away and said so (the counters alone do not tell: the one with
        # another server key retries, and its failures alone reach 2 while the one with no keys may still be
        # starting); the stranger's and the server's key by the ZAP handler, the one with no CURVE and the one
        # with another server key in the handshake
        wait_for(lambda: all(line in (tmp_path / f"{name}.err").read_text() for name, line in says.items()),
                 60, 0.05, what="every turned-away subscriber saying why")
        wait_for(lambda: _counter(good_out, "handshakes_refused") >= 2 and _counter(good_out, "handshakes_failed") >= 2,
                 30, 0.05, what="the collector counting the refused handshakes")
        p = spawn(_log_events, job, K)
        p.join(120)
        assert p.exitcode == 0
        wait_for(lambda: len(_events(good_out)) >= K, 30, 0.05, what=f"the key holder's {K} events")
    finally:
        _stop(good, *(proc for proc, _ in bad.values()))
        assert coll.stop() == 0
    assert sorted(_events(good_out)) == list(range(K))  # every event, exactly once
    for name, (_, out) in bad.items():
        assert _lines(out) == [], f"{name} received something"
    for name, line in says.items():  # each turned-away subscriber says why, once
        err = (tmp_path / f"{name}.err").read_text()
        assert err.count(line) == 1, (name, err)
    assert not [line for line in _lines(good_out) if line.get("record") == "gap"]


def test_a_revoked_key_cannot_connect_anew_and_its_connected_holder_is_cut_off(job, tmp_path):
    keys = tmp_path / "keys"
    _keys(str(keys))
    _keys(str(keys), "--client", "alice")
    alice_dir = _subscriber_dir(tmp_path / "alice", keys / "server.key", keys / "alice.key_secret", "alice")
    coll = start_collector(job, "--handler", "*=null", "--publish", "tcp://127.0.0.1:0", "--curve", str(keys),
                           "--status-interval", "0", "--heartbeat-interval", "0.2")
    bob, bob_out = _subscribe(tmp_path, "bob", "--curve", str(keys), coll.publish)
    alice, alice_out = _subscribe(tmp_path, "alice", "--curve", alice_dir, "--curve-client", "alice", coll.publish)
    late = None
    try:
        wait_for(lambda: _beats(bob_out) > 0 and _beats(alice_out) > 0, 30, 0.05, what="both subscribers' heartbeats")
        os.unlink(keys / "alice.key")
        wait_for(lambda: _counter(bob_out, "key_revocations") >= 1 and _counter(bob_out, "handshakes_refused") >= 1,
                 30, 0.05, what="the collector cutting alice off and refusing her reconnection")
        alice_seen = len(_lines(alice_out))
        bob_beats = _beats(bob_out)
        wait_for(lambda: _beats(bob_out) > bob_beats + 1, 30, 0.05, what="bob reconnected")
        late, late_out = _subscribe(tmp_path, "alice-again", "--curve", alice_dir, "--curve-client", "alice",
                                    coll.publish)  # a fresh connection with the revoked key
        refused = _counter(bob_out, "handshakes_refused")
        wait_for(lambda: _counter(bob_out, "handshakes_refused") > refused, 30, 0.05, what="the new attempt refused")
        p = spawn(_log_events, job, K)
        p.join(120)
        assert p.exitcode == 0
        wait_for(lambda: len(_events(bob_out)) >= K, 30, 0.05, what=f"bob's {K} events")
    finally:
        _stop(bob, alice, *([late] if late is not None else []))
        assert coll.stop() == 0
    assert sorted(_events(bob_out)) == list(range(K))
    assert _lines(alice_out)[alice_seen:] == [] and _events(alice_out) == []
    assert _lines(late_out) == []


def test_a_key_added_while_the_collector_runs_is_let_in_at_once(job, tmp_path):
    keys = tmp_path / "keys"
    _keys(str(keys))
    coll = start_collector(job, "--handler", "*=null", "--publish", "tcp://127.0.0.1:0", "--curve", str(keys),
                           "--status-interval", "0", "--heartbeat-interval", "0.2")
    try:
        _keys(str(keys), "--client", "carol")
        carol, out = _subscribe(tmp_path, "carol", "--curve", str(keys), "--curve-client", "carol", coll.publish)
        try:
            wait_for(lambda: _beats(out) > 0, 30, 0.05, what="carol's first heartbeat")
        finally:
            _stop(carol)
    finally:
        assert coll.stop() == 0
