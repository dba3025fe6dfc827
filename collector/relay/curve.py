"""CURVE on a collector's publish socket: its streams only for the holders of a key.

**Keys** (``shmstat keys DIR``: :mod:`collector.cli.keys`), as :func:`zmq.auth.create_certificates` writes them:
``server.key``/``server.key_secret`` (the collector's pair), ``NAME.key``/``NAME.key_secret`` per subscriber. Secret
files must be the user's and 0600 or tighter, the directory the user's and writable by nobody else (whoever can add
a ``.key`` is let in): checked before a socket is bound, a problem one sentence (:class:`~shmstat.errors.ConfigError`).

**Server** (:class:`CurveServer`). The publish socket is a CURVE server: frames are encrypted and a client must know
``server.key``. libzmq then asks a ZAP handler (:class:`zmq.auth.thread.ThreadAuthenticator`, credentials-callback
API, domain :data:`DOMAIN`, enforced: with no handler libzmq refuses) about the client's public key: allowed are
exactly the keys of the directory's ``*.key`` files other than ``server.key`` (the server's own key is refused,
whatever file holds it). Keys are compared as bytes; nothing from the wire is evaluated.

**Revoking** is deleting a ``.key`` (adding one: ``shmstat keys DIR --client NAME``). Every handshake compares the
directory's stat with what was read (4 µs here; re-reading 100 keys takes 3 ms) and reads the keys again when it
changed, or while it changed within the last 2 s (file times tick coarsely): a revoked key makes no new connection.
A subscriber connected with it is cut off too: once per heartbeat interval the relay calls
:meth:`CurveServer.revoked` (a scan of every key file: 0.7 ms for 100 keys); when an allowed key is gone, the relay
binds its publish socket anew (counted in ``revocations``), the others reconnect and their heartbeats tell what they
missed meanwhile.

**Counting.** A socket monitor counts ``refused`` handshakes (the ZAP handler said no) and ``failed`` ones (not
CURVE, another server key, broken); clients retry, so these count attempts. libzmq stops its I/O thread while a
monitor's queue is full, so a thread of its own drains it. The first 64 refused keys are logged once each. A
subscriber learns why it is turned away from a monitor of its own (:func:`handshake_failures`).

**Frame size.** libzmq counts CURVE's :data:`CURVE_FRAME_OVERHEAD` bytes against ``MAXMSGSIZE`` (libzmq 4.3.5: a
512-byte subscription needs 555), so a secured socket's limit grows by as much.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from shmstat.errors import ConfigError

__all__ = ["CLIENT", "CURVE_FRAME_OVERHEAD", "DOMAIN", "SERVER", "ClientKeys", "CurveServer", "HandshakeCounts",
           "KeyPair", "check_key_dir", "check_server_dir", "client_keys", "handshake_failures", "load_client",
           "read_pair", "read_public", "require_curve", "secure_client", "watch_client"]

SERVER = "server"  # the collector's pair: server.key (for subscribers), server.key_secret (the collector's)
CLIENT = "client"  # the subscriber pair shmstat keys DIR writes first
DOMAIN = "shmstat"  # the ZAP domain of a secured socket
CURVE_FRAME_OVERHEAD = 42
"""Bytes CURVE adds to a frame as libzmq counts it against ``MAXMSGSIZE`` (measured, libzmq 4.3.5)."""
MAX_KEY_FILE_BYTES = 64 * 1024
MAX_CLIENT_KEYS = 4096  # allowed at most (the first by file name): re-reading them all stays a matter of ms

_RACY_NS = 2_000_000_000  # a directory changed this recently may change again within the same file-time tick
_MAX_LOGGED_KEYS = 64
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_log = logging.getLogger("shmstat.collector")


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves Z85 (40 characters)."""

    public: bytes
    secret: bytes


@dataclass
class HandshakeCounts:
    """Handshakes a secured publish socket turned away, and the times it cut its subscribers off."""

    refused: int = 0  # the ZAP handler said no: a key not in the directory, a revoked one, the server's own
    failed: int = 0  # a client not CURVE, with another server key, or a broken handshake
    revocations: int = 0  # times the publish socket was bound anew because a key that was allowed was gone


def require_curve() -> None:
    """Raise :class:`ConfigError` if this libzmq was built without CURVE."""
    if not zmq.has("curve"):
        raise ConfigError(f"--curve needs a libzmq built with CURVE (libsodium); {zmq.zmq_version()} here has none")


def check_key_dir(key_dir: str, flag: str = "--curve") -> str:
    """``key_dir`` if it is a directory of this user that nobody else can write; else :class:`ConfigError`."""
    where = f"{flag} {key_dir}" if flag else key_dir
    try:
        st = os.stat(key_dir)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such directory (make a key set with: shmstat keys {key_dir})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror}") from None
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where}: not a directory (make a key set with: shmstat keys DIR)")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{where}: the directory belongs to another user (uid {st.st_uid})")
    if mode & 0o022:
        raise ConfigError(f"{where}: other users can write to it (mode {mode:04o}), so anyone could add a key; make "
                          f"it owner-only: chmod 700 {key_dir}")
    if not os.access(key_dir, os.R_OK | os.X_OK):
        raise ConfigError(f"{where}: cannot read the directory (mode {mode:04o})")
    return key_dir


def _z85_key(raw: bytes | None) -> bytes | None:
    with contextlib.suppress(KeyError, ValueError, OverflowError, struct.error):
        if raw is not None and len(raw) == 40 and len(z85.decode(raw)) == 32:
            return raw
    return None


def _load(path: str, secret: bool, missing: str) -> tuple[bytes, bytes | None]:
    """The checked (public, secret or None) keys of a key file; :class:`ConfigError` in one sentence."""
    try:
        st = os.stat(path)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif secret and st.st_uid != os.getuid():
            problem = f"belongs to another user (uid {st.st_uid}); a secret key must be yours"
        elif secret and mode & 0o077:
            problem = f"is readable by other users (mode {mode:04o}); make it owner-only: chmod 600 {path}"
        elif st.st_size > MAX_KEY_FILE_BYTES:
            problem = f"is not a CURVE key file ({st.st_size} bytes)"
        else:
            try:
                loaded: tuple[bytes | None, bytes | None] = zmq.auth.load_certificate(path)
            except ValueError:
                loaded = (None, None)
            keys = _z85_key(loaded[0]), _z85_key(loaded[1]) if secret else None
            need = "a public-key and a secret-key line" if secret else "a public-key line"
            if keys[0] is None or (secret and keys[1] is None):
                problem = f"is not a CURVE key file (it needs {need} of 40 Z85 characters, as shmstat keys writes)"
            elif keys[1] is not None and zmq.curve_public(keys[1]) != keys[0]:
                problem = "is not a CURVE key file (its public key is not its secret key's)"
            else:
                return keys[0], keys[1]
    except FileNotFoundError:
        problem = f"is missing ({missing})" if missing else "is missing"
    except OSError as exc:
        problem = f"cannot be read: {exc.strerror}"
    raise ConfigError(f"--curve: {path} {problem}")


def read_public(path: str, missing: str = "") -> bytes:
    """The Z85 public key of a ``.key`` (or ``.key_secret``) file; :class:`ConfigError` if it has none."""
    return _load(path, False, missing)[0]


def read_pair(path: str, missing: str = "") -> KeyPair:
    """The key pair of a ``.key_secret`` file, checked: the user's, owner-only, both keys valid and matching."""
    public, secret = _load(path, True, missing)
    assert secret is not None
    return KeyPair(public, secret)


def client_keys(key_dir: str, server_public: bytes) -> tuple[dict[bytes, str], list[str]]:
    """``{public key: file name}`` of the client keys of ``key_dir`` (every ``*.key`` but ``server.key`` and
    hidden files, at most :data:`MAX_CLIENT_KEYS`, never the server's own key), and a sentence per file skipped."""
    try:
        names = sorted(n for n in os.listdir(key_dir)
                       if n.endswith(".key") and n != f"{SERVER}.key" and not n.startswith("."))
    except OSError as exc:
        return {}, [f"--curve: cannot read {key_dir}: {exc.strerror}; no subscriber is let in"]
    keys: dict[bytes, str] = {}
    problems: list[str] = []
    if len(names) > MAX_CLIENT_KEYS:
        problems.append(f"--curve: {key_dir} holds {len(names)} client keys; only the first {MAX_CLIENT_KEYS} by "
                        "name are allowed")
    for name in names[:MAX_CLIENT_KEYS]:
        try:
            public = read_public(os.path.join(key_dir, name))
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if public != server_public:
            keys.setdefault(public, name)
    return keys, problems


def check_server_dir(key_dir: str) -> KeyPair:
    """The server pair of ``key_dir``, all a :class:`CurveServer` needs checked first; else :class:`ConfigError`."""
    require_curve()
    check_key_dir(key_dir)
    pair = read_pair(os.path.join(key_dir, f"{SERVER}.key_secret"), f"make a key set with: shmstat keys {key_dir}")
    _, problems = client_keys(key_dir, pair.public)
    if problems:
        raise ConfigError(problems[0])
    return pair


class _Allowed:
    """The client keys of a directory, read again when it changes; asked by the ZAP thread, checked by the loop."""

    def __init__(self, key_dir: str, server_public: bytes) -> None:
        self.key_dir, self.server_public = key_dir, server_public
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._logged: set[bytes] = set()
        self._keys: dict[bytes, str] = {}
        self.gone: dict[bytes, str] = {}  # keys allowed once and removed since (bounded): why a client was refused
        self.revoked = False  # a key that was allowed is gone (taken by CurveServer.revoked)
        self._reload()

    def _dir_stamp(self) -> tuple[int, ...] | None:
        with contextlib.suppress(OSError):
            st = os.stat(self.key_dir)
            return st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size
        return None

    def _file_stamps(self) -> frozenset[tuple[str, int, int, int]] | None:
        with contextlib.suppress(OSError), os.scandir(self.key_dir) as entries:
            return frozenset((e.name, st.st_ino, st.st_mtime_ns, st.st_size)
                             for e in entries if e.name.endswith(".key") for st in (e.stat(),))
        return None

    def _reload(self) -> None:
        self._stamp, self._files = self._dir_stamp(), self._file_stamps()
        self._racy = self._stamp is None or time.time_ns() - max(self._stamp[:2]) < _RACY_NS
        keys, problems = client_keys(self.key_dir, self.server_public)
        for problem in problems:
            if problem not in self._said and len(self._said) < _MAX_LOGGED_KEYS:
                self._said.add(problem)
                _log.warning("%s (skipped)", problem)
        removed = {key: name for key, name in self._keys.items() if key not in keys}
        if removed:
            self.revoked = True
            if len(self.gone) + len(removed) > MAX_CLIENT_KEYS:
                self.gone.clear()
            self.gone.update(removed)
            _log.warning("--curve: %s revoked: no new connection with it, and connected subscribers are cut off",
                         ", ".join(sorted(removed.values())))
        self._keys = keys

    def allows(self, key: bytes) -> bool:
        """Whether ``key`` (Z85) may connect, the directory read again first if it changed (ZAP thread)."""
        with self._lock:
            if self._racy or self._dir_stamp() != self._stamp:
                self._reload()
            return key in self._keys

    def check(self) -> None:
        """Compare every key file with what was read, and read them again if one changed (the loop)."""
        with self._lock:
            if self._racy or self._dir_stamp() != self._stamp or self._file_stamps() != self._files:
                self._reload()

    def callback(self, domain: str, key: bytes) -> bool:
        """The credentials callback :class:`zmq.auth.Authenticator` calls for a CURVE client (ZAP thread)."""
        if domain == DOMAIN and self.allows(key):
            return True
        if len(self._logged) < _MAX_LOGGED_KEYS and key not in self._logged:
            self._logged.add(key)
            gone = self.gone.get(key)
            why = ("the server's own key" if key == self.server_public else f"revoked ({gone} was removed)" if gone
                   else f"not a .key file in {self.key_dir}")
            _log.warning("refused a subscriber with CURVE key %s: %s%s", key.decode("ascii", "replace"), why,
                         "" if len(self._logged) < _MAX_LOGGED_KEYS else " (further refused keys are only counted)")
        return False


class _Watch(threading.Thread):
    """Drains a secured socket's monitor, counting refused and failed handshakes, until it stops."""

    def __init__(self, monitor: zmq.Socket, counts: HandshakeCounts) -> None:
        super().__init__(name="shmstat-curve-monitor", daemon=True)
        self.monitor, self.counts = monitor, counts
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                for kind in handshake_failures(self.monitor) if self.monitor.poll(100) else ():
                    if kind == "stopped":
                        return
                    if kind == "refused":
                        self.counts.refused += 1
                    else:
                        self.counts.failed += 1
        except zmq.ContextTerminated:
            pass
        finally:
            self.monitor.close(0)


class CurveServer:
    """CURVE and the ZAP handler for publish sockets of one context, with the keys of ``key_dir``.

    :meth:`secure` a socket before binding it, :meth:`release` it before closing it, :meth:`close` at the end
    (before the context is terminated). Raises :class:`ConfigError` for a bad key directory."""

    def __init__(self, ctx: zmq.Context, key_dir: str, counts: HandshakeCounts | None = None) -> None:
        self.key_dir = key_dir
        self.pair = check_server_dir(key_dir)
        self.allowed = _Allowed(key_dir, self.pair.public)
        self.counts = counts if counts is not None else HandshakeCounts()
        self._watches: dict[zmq.Socket, _Watch] = {}
        self._monitors = 0
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("shmstat.collector.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(DOMAIN, self.allowed)

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not bound yet) a CURVE server whose clients the ZAP handler vets; watch its handshakes."""
        sock.curve_secretkey = self.pair.secret
        sock.curve_publickey = self.pair.public
        sock.curve_server = True
        sock.zap_domain = DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        limit = sock.getsockopt(zmq.MAXMSGSIZE)
        if isinstance(limit, int) and limit >= 0:
            sock.setsockopt(zmq.MAXMSGSIZE, limit + CURVE_FRAME_OVERHEAD)
        events = zmq.EVENT_HANDSHAKE_FAILED_AUTH | _FAILED | zmq.EVENT_MONITOR_STOPPED
        self._monitors += 1  # an address of its own: a closed socket's may still be registered a moment
        watch = _Watch(sock.get_monitor_socket(events, f"inproc://shmstat-curve-{id(self)}-{self._monitors}"),
                       self.counts)
        watch.start()
        self._watches[sock] = watch

    def release(self, sock: zmq.Socket) -> None:
        """Stop watching ``sock`` (call before closing it)."""
        watch = self._watches.pop(sock, None)
        if watch is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            watch.stopping.set()
            watch.join(5)

    def revoked(self) -> bool:
        """Whether a key that was allowed is gone since the last call (the key files compared first); counted in
        ``counts.revocations`` — the caller binds its socket anew."""
        self.allowed.check()
        revoked, self.allowed.revoked = self.allowed.revoked, False
        self.counts.revocations += revoked
        return revoked

    def close(self) -> None:
        """Stop every watch and the ZAP handler."""
        for sock in list(self._watches):
            self.release(sock)
        self.auth.stop()


class ClientKeys(NamedTuple):
    """What a CURVE client needs: its own pair and the server's public key."""

    pair: KeyPair
    server: bytes


def load_client(key_dir: str, name: str = CLIENT) -> ClientKeys:
    """``key_dir/NAME.key_secret`` and ``key_dir/server.key``, checked; :class:`ConfigError` for a bad one."""
    require_curve()
    check_key_dir(key_dir)
    pair = read_pair(os.path.join(key_dir, f"{name}.key_secret"),
                     f"the collector's operator makes it with: shmstat keys DIR --client {name}")
    server = read_public(os.path.join(key_dir, f"{SERVER}.key"), "copy the collector's server.key there")
    return ClientKeys(pair, server)


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client with ``keys``."""
    sock.curve_secretkey = keys.pair.secret
    sock.curve_publickey = keys.pair.public
    sock.curve_serverkey = keys.server


def watch_client(sock: zmq.Socket) -> zmq.Socket:
    """A monitor of ``sock``'s failed handshakes to drain often with :func:`handshake_failures` (libzmq stops its
    I/O thread while its queue is full); ``sock.disable_monitor()`` and close it before closing ``sock``."""
    return sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | _FAILED)


def handshake_failures(monitor: zmq.Socket) -> list[str]:
    """The failed handshakes ``monitor`` holds now, oldest first: ``refused`` (the ZAP handler said no to the
    key), ``mismatch`` (one side CURVE, the other not) or ``failed`` (another server key, a broken handshake); and
    ``stopped`` when the monitor ends."""
    kinds: list[str] = []
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return kinds
        event, value = struct.unpack_from("<HI", frames[0]) if len(frames[0]) >= 6 else (0, 0)  # libzmq's own
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            kinds.append("refused")
        elif event & _FAILED:
            kinds.append("mismatch" if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH else "failed")
        elif event == zmq.EVENT_MONITOR_STOPPED:
            kinds.append("stopped")

