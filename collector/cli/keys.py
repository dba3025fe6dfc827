"""``shmstat keys DIR``: the CURVE keys of a collector's TCP streams and of the subscribers it lets in.

Written with :func:`zmq.auth.create_certificates`, so any ZeroMQ tool reads them: ``server.key`` and
``server.key_secret`` (the collector's pair: ``shmstat collect --publish tcp://… --curve DIR``), ``client.key`` and
``client.key_secret`` (a first subscriber's), and with ``--client NAME`` another subscriber's ``NAME.key`` and
``NAME.key_secret``. The collector lets in every public key that is a ``*.key`` file in DIR other than
``server.key``; deleting one revokes it (:mod:`collector.relay.curve`).

Every file is owner-only (0600) and DIR is created 0700 if missing. Nothing is ever overwritten unless ``force``:
the files are made in a private directory inside DIR and linked into place, a link failing if the name exists
(then whatever this call placed is removed again), so two runs at once cannot mix their keys.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

import zmq.auth

from shmstat.errors import ConfigError

from ..relay.curve import CLIENT, SERVER, check_key_dir, require_curve

__all__ = ["instructions", "make_keys"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _make_dir(key_dir: str) -> None:
    if not os.path.lexists(key_dir):
        try:
            os.makedirs(key_dir, mode=0o700)
            os.chmod(key_dir, 0o700)
        except OSError as exc:
            raise ConfigError(f"cannot create {key_dir}: {exc.strerror}") from None
    check_key_dir(key_dir, "")


def _checked_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError(f"--client {name!r}: use 1 to 64 letters, digits, '-', '_' or '.', starting with "
                          "a letter or digit")
    if name == SERVER:
        raise ConfigError(f"--client {SERVER}: that name is the collector's own key pair; pick another")
    return name


def _place(src: str, dst: str, force: bool) -> None:
    if force:
        os.replace(src, dst)
        return
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: create exclusively and copy
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
            out.write(f.read())


def make_keys(key_dir: str, *, client: str | None = None, force: bool = False) -> list[str]:
    """Write a key set into ``key_dir`` (created 0700 if missing): the server pair and the ``client`` pair; or,
    with ``client``, that subscriber's pair only (``key_dir`` must hold a key set). Returns the paths written.

    Raises :class:`ConfigError` (one sentence) if a file to write exists and not ``force``, for a bad name, or for
    a directory that is not the user's or that others can write to."""
    require_curve()
    if client is None:
        names = [SERVER, CLIENT]
        _make_dir(key_dir)
    else:
        names = [_checked_name(client)]
        check_key_dir(key_dir, "")
        if not os.path.exists(os.path.join(key_dir, f"{SERVER}.key")):
            raise ConfigError(f"{key_dir} holds no key set (no {SERVER}.key); make one first with: "
                              f"shmstat keys {key_dir}")
    files = [f"{name}{suffix}" for name in names for suffix in (".key_secret", ".key")]  # a secret before its key
    existing = [f for f in files if os.path.lexists(os.path.join(key_dir, f))]
    if existing and not force:
        raise ConfigError(_exists(key_dir, existing, client))
    tmp = tempfile.mkdtemp(prefix=".keys-", dir=key_dir)
    placed: list[str] = []
    try:
        old_umask = os.umask(0o077)
        try:
            for name in names:
                zmq.auth.create_certificates(tmp, name)
        finally:
            os.umask(old_umask)
        for f in files:
            os.chmod(os.path.join(tmp, f), 0o600)
        for f in files:
            dst = os.path.join(key_dir, f)
            _place(os.path.join(tmp, f), dst, force)
            placed.append(dst)
    except FileExistsError:
        for path in placed:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise ConfigError(_exists(key_dir, [f for f in files if os.path.lexists(os.path.join(key_dir, f))],
                                  client)) from None
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {key_dir}: {exc.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return placed


def _exists(key_dir: str, existing: list[str], client: str | None) -> str:
    what = f"subscriber {client}'s keys" if client else "a key set"
    return (f"{key_dir} already holds {what} ({', '.join(existing)}); nothing was written (--force "
            "replaces them, and whoever holds the old ones is locked out)")


def instructions(key_dir: str, client: str | None) -> str:
    """What to do with the keys just written, for the operator."""
    name = client or CLIENT
    secret = os.path.join(key_dir, f"{name}.key_secret")
    server = os.path.join(key_dir, f"{SERVER}.key")
    option = "" if client is None else f" --curve-client {name}"
    lines = []
    if client is None:
        lines.append(f"  collector:  shmstat collect --publish tcp://ADDRESS:PORT --curve {key_dir}")
    lines += [f"  subscriber{'' if client is None else ' ' + name}: copy {secret} and {server} into an owner-only "
              f"directory on its host, then: shmstat subscribe --curve THAT_DIR{option} tcp://COLLECTOR:PORT",
              f"  more subscribers: shmstat keys {key_dir} --client NAME;  revoke one: rm {key_dir}/NAME.key"]
    return "\n".join(lines)
