"""The relay's publish socket with CURVE (:mod:`collector.relay.curve`), real sockets in this process: who is let
in, how refused handshakes are counted, the subscription limit unchanged by CURVE's bytes, the server's key never
a client's, a revoked key cutting its holder off, and nothing left running after close."""

from __future__ import annotations

import os
import shutil
import threading
import time

import zmq
from kit.support import wait_for

from collector.cli.keys import make_keys
from collector.relay.curve import ClientKeys, client_keys, load_client, read_pair, secure_client
from collector.relay.relay import Relay
from collector.relay.subscriptions import MAX_SUBSCRIPTION_BYTES


def _relay(tmp_path, keys) -> Relay:
    return Relay(f"ipc://{tmp_path}/in.sock", "tcp://127.0.0.1:0", curve=str(keys), heartbeat_interval_s=0.01,
                 job="curve-relay")


_OPEN: list[zmq.Socket] = []  # a socket nobody holds is closed by the garbage collector


def _sub(ctx: zmq.Context, endpoint: str, keys: ClientKeys | None, topic: bytes = b"t") -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    _OPEN.append(sock)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def _seen(relay: Relay, topic: bytes) -> bool:
    for sock in _OPEN:  # a SUB sends its subscriptions again on reconnecting when its own thread looks at it
        sock.poll(0)
    relay.update_subscriptions()
    return topic in relay.prefixes


def test_only_client_keys_are_let_in_and_refused_handshakes_are_counted_by_kind(tmp_path):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    stranger = tmp_path / "stranger"
    make_keys(str(stranger))
    threads = threading.active_count()
    relay = _relay(tmp_path, keys)
    ctx = zmq.Context()
    server = read_pair(str(keys / "server.key_secret"))
    try:
        good = load_client(str(keys))
        counts = relay.counters.handshakes
        _sub(ctx, relay.publish_endpoint, ClientKeys(read_pair(str(stranger / "client.key_secret")), server.public),
             b"stranger")
        _sub(ctx, relay.publish_endpoint, ClientKeys(server, server.public), b"as-server")
        wait_for(lambda: counts.refused >= 2, 10, what="both keys refused by the ZAP handler")
        _sub(ctx, relay.publish_endpoint, None, b"plain")
        wait_for(lambda: counts.failed >= 1, 10, what="the plain client's handshake failing")
        _sub(ctx, relay.publish_endpoint, good, b"good")
        wait_for(lambda: _seen(relay, b"good"), 10, what="the key holder's subscription")
        assert relay.prefixes == {b"good"}
    finally:
        _OPEN.clear()
        ctx.destroy(0)
        relay.close()
    wait_for(lambda: threading.active_count() <= threads, 10, what="the ZAP and monitor threads ending")


def test_a_subscription_at_the_limit_passes_curve(tmp_path):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    relay = _relay(tmp_path, keys)
    ctx = zmq.Context()
    try:
        topic = b"x" * MAX_SUBSCRIPTION_BYTES  # CURVE's bytes on top are allowed for
        _sub(ctx, relay.publish_endpoint, load_client(str(keys)), topic)
        wait_for(lambda: _seen(relay, topic), 10, what="a subscription of the largest size")
    finally:
        _OPEN.clear()
        ctx.destroy(0)
        relay.close()


def test_the_servers_own_key_is_never_a_client_key_whatever_file_holds_it(tmp_path):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    shutil.copy(keys / "server.key", keys / "copy.key")
    shutil.copy(keys / "client.key", keys / ".hidden.key")
    server = read_pair(str(keys / "server.key_secret"))
    allowed, problems = client_keys(str(keys), server.public)
    assert problems == [] and list(allowed.values()) == ["client.key"]
    assert server.public not in allowed


def test_a_revoked_key_is_refused_anew_and_its_holder_cut_off_while_others_reconnect(tmp_path):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    make_keys(str(keys), client="alice")
    relay = _relay(tmp_path, keys)
    ctx = zmq.Context()
    try:
        alice = _sub(ctx, relay.publish_endpoint, load_client(str(keys), "alice"), b"alice")
        _sub(ctx, relay.publish_endpoint, load_client(str(keys)), b"bob")
        wait_for(lambda: _seen(relay, b"alice") and _seen(relay, b"bob"), 10, what="both subscriptions")
        os.unlink(keys / "alice.key")

        def cut() -> bool:
            relay.heartbeat_if_due(time.monotonic())
            return relay.counters.handshakes.revocations == 1

        wait_for(cut, 10, what="the relay binding anew")
        wait_for(lambda: _seen(relay, b"bob"), 10, what="bob subscribing again")
        wait_for(lambda: relay.counters.handshakes.refused >= 1, 10, what="alice's reconnection refused")
        assert not _seen(relay, b"alice")
        relay.publish("alice", "event", [["e", 0, {}]])
        assert alice.poll(200) == 0  # she was cut off: nothing reaches her
        assert relay.counters.subscription_resets == 0  # a revocation is not a subscription flood
    finally:
        _OPEN.clear()
        ctx.destroy(0)
        relay.close()


def test_binding_anew_at_a_tcp_port_just_closed_waits_for_it(tmp_path):
    keys = tmp_path / "keys"
    make_keys(str(keys))
    relay = _relay(tmp_path, keys)
    ctx = zmq.Context()
    try:
        endpoint = relay.publish_endpoint
        _sub(ctx, endpoint, load_client(str(keys)), b"t")
        for _ in range(30):  # at once, the port was still in use about once in fifty
            wait_for(lambda: _seen(relay, b"t"), 10, what="the subscriber (re)connected")
            relay.outlet.rebind()
            assert relay.publish_endpoint == endpoint
    finally:
        _OPEN.clear()
        ctx.destroy(0)
        relay.close()


def test_a_message_of_the_largest_size_reaches_a_curve_subscriber_intact(tmp_path):
    from shmstat import wire

    keys = tmp_path / "keys"
    make_keys(str(keys))
    relay = _relay(tmp_path, keys)
    ctx = zmq.Context()
    try:
        sock = _sub(ctx, relay.publish_endpoint, load_client(str(keys)), b"event/")
        wait_for(lambda: _seen(relay, b"event/"), 10, what="the subscription")
        pad = os.urandom(700_000).hex()  # one item near MAX_MESSAGE_BYTES once encoded
        relay.publish("event/big", "event", [["big", 1, {"pad": pad}]])
        assert sock.poll(10_000), "nothing arrived"
        msg = wire.decode_frames(sock.recv_multipart())
        assert msg.items[0][2]["pad"] == pad
    finally:
        _OPEN.clear()
        ctx.destroy(0)
        relay.close()
