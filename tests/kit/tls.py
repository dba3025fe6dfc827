"""Certificates for the TLS tests, made at test time with the ``openssl`` command (EC P-256 keys, valid two days):
a CA, a server certificate for 127.0.0.1 (``subjectAltName IP:127.0.0.1``) and a client certificate it signed,
and a client certificate signed by another CA. Tests skip with a clear reason when ``openssl`` is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

OPENSSL = shutil.which("openssl")

needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command to make test certificates "
                                   "(apt-get install -y --no-install-recommends openssl; .ci/run does it as root)")


class Pki(NamedTuple):
    """Where the PEM files of :func:`make_pki` are."""

    root: Path

    def crt(self, name: str) -> str:
        """The certificate ``name`` (``ca``, ``server``, ``client``, ``other_ca``, ``stranger``)."""
        return str(self.root / f"{name}.crt")

    def key(self, name: str) -> str:
        """The private key of the certificate ``name``."""
        return str(self.root / f"{name}.key")

    def tls_arg(self, *, client_ca: bool = True) -> str:
        """``--prometheus-tls`` for the server certificate (with ``ca`` as the client CA unless told not)."""
        return ",".join([self.crt("server"), self.key("server"), *([self.crt("ca")] if client_ca else [])])


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    r = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"openssl {' '.join(args)}: {r.stderr}"


def _ca(root: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=shmstat test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=root)


def _leaf(root: Path, name: str, ca: str, ext: str) -> None:
    (root / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=shmstat test {name}", cwd=root)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=root)


def make_pki(root: Path) -> Pki:
    """Make, under ``root``: ``ca`` (the CA), ``server`` (127.0.0.1, signed by ``ca``), ``client`` (signed by
    ``ca``), ``other_ca`` and ``stranger`` (a client signed by ``other_ca``); each as ``NAME.crt`` and
    ``NAME.key`` (owner-only)."""
    root.mkdir(parents=True, exist_ok=True)
    _ca(root, "ca")
    _ca(root, "other_ca")
    _leaf(root, "server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
                                "basicConstraints=CA:FALSE")
    _leaf(root, "client", "ca", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE")
    _leaf(root, "stranger", "other_ca", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE")
    for key in root.glob("*.key"):
        os.chmod(key, 0o600)
    return Pki(root)
