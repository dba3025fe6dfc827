"""TLS for ``/metrics`` (``--prometheus-tls CERT,KEY[,CLIENT_CA]``): the files, checked, and the server's
:class:`ssl.SSLContext`.

The context has the semantics of prometheus_client's ``start_http_server(certfile=, keyfile=, client_cafile=,
client_auth_required=True)``: ``PROTOCOL_TLS_SERVER`` with TLS 1.2 at least (set here, whatever the
interpreter's default), the server's certificate chain and key, and, given a client CA, every client must present
a certificate it signed (``CERT_REQUIRED``). It is built here
with the standard library because prometheus_client builds it only in a private helper (``_get_ssl_ctx``) and
``start_http_server`` serves a registry rendered on every scrape, with the handshake made by the thread that
accepts connections, where one client that connects and never speaks holds up every other scrape. Ours is made
in each connection's own thread, under a timeout (:mod:`collector.prometheus.server`).

Every mistake is one sentence (:class:`ConfigError`) before anything starts: a file missing or unreadable, a
certificate or CA file that is not PEM, a key that is encrypted, not PEM or not the certificate's, and a key any
other user may read (refused, as ssh refuses such a key; a key its group may read, as Debian's ``ssl-cert``
group arranges, is served with a warning).
"""

from __future__ import annotations

import os
import ssl
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass

from shmstat.errors import ConfigError

__all__ = ["TLSFiles", "parse_tls", "server_context", "warn_on_stderr"]

_FLAG = "--prometheus-tls"
_CERT_MARK = "-----BEGIN CERTIFICATE-----"
_MAX_PEM_BYTES = 1 << 20  # a certificate chain or key file larger than this is not one


@dataclass(frozen=True)
class TLSFiles:
    """The PEM files ``/metrics`` serves TLS with."""

    cert: str
    """The server's certificate (then any intermediate certificates), PEM."""
    key: str
    """The certificate's private key, PEM, unencrypted, readable by its owner (and at most its group)."""
    client_ca: str | None = None
    """CA certificates, PEM: when given, a client must present a certificate one of them signed."""


def parse_tls(text: str) -> TLSFiles:
    """``CERT,KEY[,CLIENT_CA]`` as :class:`TLSFiles` (the files are not read: :func:`server_context` does)."""
    parts = text.split(",")
    if len(parts) not in (2, 3) or not all(p.strip() for p in parts):
        raise ConfigError(f"{_FLAG} {text!r} is not CERT,KEY or CERT,KEY,CLIENT_CA (two or three PEM file paths, "
                          "comma-separated)")
    cert, key, *ca = (p.strip() for p in parts)
    return TLSFiles(cert, key, ca[0] if ca else None)


def server_context(files: TLSFiles, *, warn: Callable[[str], None] | None = None) -> ssl.SSLContext:
    """The server-side context for ``files``, every file checked first (see the module docstring); the warning for a
    key its group may read goes to ``warn`` (None: nowhere; the CLI checks the files once quietly, then warns when
    it serves)."""
    cert_text = _read(files.cert, "certificate")
    if _CERT_MARK not in cert_text:
        raise ConfigError(f"{_FLAG} certificate {files.cert!r} is not a PEM certificate (no {_CERT_MARK} line; "
                          "convert a DER one with: openssl x509 -inform der -in CERT -out CERT.pem)")
    key_text = _read(files.key, "key")
    if "ENCRYPTED" in key_text:
        raise ConfigError(f"{_FLAG} key {files.key!r} is encrypted; serve with an unencrypted key (openssl pkey -in "
                          "KEY -out PLAIN.key) kept owner-only")
    if "-----BEGIN" not in key_text or "PRIVATE KEY-----" not in key_text:
        raise ConfigError(f"{_FLAG} key {files.key!r} is not a PEM private key (no -----BEGIN ... PRIVATE KEY----- "
                          "line)")
    _check_key_mode(files.key, warn)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # said, not left to the interpreter: Debian's python3 defaults to MINIMUM_SUPPORTED, and a node whose
    # openssl.cnf lowers the security level then served TLS 1.0 and 1.1
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # a password callback that refuses: OpenSSL would otherwise prompt on the terminal for a key it finds
        # encrypted after all
        ctx.load_cert_chain(files.cert, files.key, password=_no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ConfigError(f"{_FLAG} key {files.key!r} does not match the certificate {files.cert!r}") from None
        raise ConfigError(f"{_FLAG} cannot load the certificate {files.cert!r} with the key {files.key!r}: "
                          f"{exc.reason or exc}") from None
    except _Encrypted:
        raise ConfigError(f"{_FLAG} key {files.key!r} is encrypted; serve with an unencrypted key kept "
                          "owner-only") from None
    if files.client_ca is not None:
        if _CERT_MARK not in _read(files.client_ca, "client CA"):
            raise ConfigError(f"{_FLAG} client CA {files.client_ca!r} is not a PEM certificate (no {_CERT_MARK} "
                              "line)")
        try:
            ctx.load_verify_locations(cafile=files.client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"{_FLAG} cannot load the client CA {files.client_ca!r}: {exc.reason or exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _Encrypted(Exception):
    pass


def _no_password() -> bytes:
    raise _Encrypted


def _read(path: str, what: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{_FLAG} cannot read the {what} file {path!r}: {exc.strerror}") from None
    if len(data) > _MAX_PEM_BYTES:
        raise ConfigError(f"{_FLAG} {what} file {path!r} is over {_MAX_PEM_BYTES >> 20} MiB: not a PEM file")
    return data.decode("ascii", errors="replace")


def warn_on_stderr(text: str) -> None:
    """Print ``shmstat: warning: TEXT`` on stderr (what :func:`server_context` is given when serving)."""
    print(f"shmstat: warning: {text}", file=sys.stderr, flush=True)


def _check_key_mode(path: str, warn: Callable[[str], None] | None) -> None:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(f"{_FLAG} key {path!r} may be read or written by every user (mode {stat.filemode(mode)}); "
                          f"make it owner-only: chmod 600 {path}")
    if mode & (stat.S_IRGRP | stat.S_IWGRP) and warn is not None:
        warn(f"{_FLAG} key {path} may be read or written by its group (mode {stat.filemode(mode)}); chmod 600 "
             f"{path} unless that group is meant to")
