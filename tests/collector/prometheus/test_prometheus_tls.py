"""``/metrics`` over TLS (``--prometheus-tls CERT,KEY[,CLIENT_CA]``), tested as Prometheus and attackers would:
certificates made at test time with ``openssl`` (:mod:`kit.tls`); a real Prometheus (Debian's 2.42) scraping with
``tls_config`` and a client certificate counts every sample exactly, through a static target with ``scheme:
https`` and through the ``file_sd`` file, whose ``__scheme__: https`` is all that tells it to use TLS; plain HTTP,
no client certificate and a certificate of another CA are refused; clients that connect and never finish a
handshake hold up no scrape; bad files are one sentence each and nothing is made."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest
from kit.percentiles import percentile_rank
from kit.procs import REPO, collector_env, spawn, start_collector
from kit.prometheus import needs_prometheus, query, scraping, start_prometheus, value
from kit.support import unique_job, wait_for
from kit.tls import Pki, make_pki, needs_openssl
from prometheus_client import CollectorRegistry, Counter

from collector.prometheus.server import MetricsServer, RenderCache
from collector.prometheus.tls import TLSFiles, parse_tls, server_context
from shmstat.shm.segment import Segment

pytestmark = needs_openssl


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _client(pki: Pki, who: str | None) -> ssl.SSLContext:
    """A scraper's context trusting the test CA, presenting certificate ``who`` (None: none)."""
    ctx = ssl.create_default_context(cafile=pki.crt("ca"))
    if who is not None:
        ctx.load_cert_chain(pki.crt(who), pki.key(who))
    return ctx


def _get(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
        return bytes(r.read())


def _refused(url: str, ctx: ssl.SSLContext | None = None) -> BaseException:
    """The error a scrape of ``url`` ends in (fails the test if it gets metrics)."""
    try:
        body = _get(url, ctx)
    except (urllib.error.URLError, ssl.SSLError, ConnectionError, http.client.HTTPException) as exc:
        return exc
    raise AssertionError(f"{url} answered a scraper it should refuse: {body[:80]!r}")


def _metrics_url(coll) -> str:
    """The collector's ``/metrics`` URL, from its ready file."""
    assert coll.prometheus is not None, "the collector was started without --prometheus"
    return coll.prometheus


@needs_prometheus
def test_a_real_prometheus_scrapes_https_with_a_client_certificate_exactly(tmp_path, pki):
    job = unique_job("tls")
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    sd, ready = sd_dir / "node-a.json", tmp_path / "ready.json"
    coll = start_collector(job, "--handler", "*=null", "--grace-ms", "10", "--prometheus", "127.0.0.1:0",
                           "--prometheus-tls", pki.tls_arg(), "--prometheus-node", "node-a", "--prometheus-sd",
                           str(sd), "--ready-file", str(ready), "--status-interval", "0")
    url = _metrics_url(coll)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert url == f"https://127.0.0.1:{port}/metrics"
    tls = (f"    tls_config:\n      ca_file: {pki.crt('ca')}\n      cert_file: {pki.crt('client')}\n"
           f"      key_file: {pki.key('client')}\n")
    # two scrape jobs over the one endpoint: a static target with scheme: https, and the file_sd target, which
    # has no scheme line (its file's __scheme__ label is what makes Prometheus use https)
    prom, base = start_prometheus(tmp_path, (
        f"  - job_name: static\n    scheme: https\n{tls}    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        f"  - job_name: sd\n{tls}    file_sd_configs:\n      - files: ['{sd_dir}/*.json']\n"
        "        refresh_interval: 1s\n"))
    n, window_ms = 2000, 100
    try:
        assert json.loads(sd.read_text()) == [{"targets": [f"127.0.0.1:{port}"],
                                               "labels": {"node": "node-a", "__scheme__": "https"}}]
        assert json.loads(ready.read_text())["prometheus"] == url  # where start_collector read it
        assert coll.lines_seen("Prometheus endpoint").split()[-1] == url  # and what it printed at start
        procs = [spawn(percentile_rank, job, r, 2, n, window_ms, str(tmp_path / f"r{r}.json")) for r in range(2)]
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        for scrape_job in ("static", "sd"):
            # honor_labels is off here: the scrape job is `job`, shmstat's job id `exported_job`
            merged = f'sum(shmstat_stat_count_total{{job="{scrape_job}",stat="step_ms",rank=""}})'
            wait_for(lambda m=merged: value(base, m) == 2 * n, 60,
                     what=f"Prometheus ({scrape_job}) to see all {2 * n} samples over https "
                          f"(log: {tmp_path / 'prometheus.log'})")
            per_rank = query(base, f'shmstat_stat_count_total{{job="{scrape_job}",stat="step_ms",rank!=""}}')
            assert sorted((r["metric"]["rank"], r["metric"]["exported_job"], float(r["value"][1]))
                          for r in per_rank) == [("0", job, n), ("1", job, n)]
            assert scraping(base, scrape_job)
            assert {r["metric"]["instance"] for r in query(base, f'up{{job="{scrape_job}"}}')} == {
                f"127.0.0.1:{port}"}
        assert _refused(url.replace("https:", "http:")) is not None  # and plain HTTP gets nothing
    finally:
        prom.terminate()
        prom.wait(30)
        coll.stop()
        Segment.unlink(job)
    assert not sd.exists() and not ready.exists(), "a clean exit removes the file_sd and ready files"


def test_only_clients_with_the_cas_certificate_get_metrics(job, pki):
    coll = start_collector(job, "--handler", "*=null", "--prometheus", "127.0.0.1:0", "--prometheus-tls",
                           pki.tls_arg(), "--status-interval", "0")
    try:
        url = _metrics_url(coll)
        assert b"shmstat_collector_" in _get(url, _client(pki, "client"))
        plain = _refused(url.replace("https:", "http:"))
        assert isinstance(plain, urllib.error.HTTPError) and plain.code == 400
        assert b"speaks HTTPS" in plain.read()
        _refused(url, _client(pki, None))  # no client certificate
        _refused(url, _client(pki, "stranger"))  # a certificate another CA signed
        not_trusted = _refused(url, ssl.create_default_context())  # a scraper that does not trust our CA
        assert "CERTIFICATE_VERIFY_FAILED" in str(not_trusted)
        assert b"shmstat_collector_" in _get(url, _client(pki, "client"))  # and good scrapes go on

        def failed() -> float:  # the handshakes refused above, counted for the node's operator to alert on
            for line in _get(url, _client(pki, "client")).decode().splitlines():
                if line.startswith("shmstat_node_metrics_tls_handshakes_failed_total{"):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        wait_for(lambda: failed() >= 3, 20, what="the failed TLS handshakes on /metrics (rendered within 10 s)")
    finally:
        coll.stop()


def test_clients_that_never_finish_a_handshake_hold_up_no_scrape(job, pki):
    coll = start_collector(job, "--handler", "*=null", "--prometheus", "127.0.0.1:0", "--prometheus-tls",
                           pki.tls_arg(), "--status-interval", "0")
    hung: list[socket.socket] = []
    try:
        url = _metrics_url(coll)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        for first_bytes in (b"", b"\x16\x03\x01"):  # silent, and a ClientHello that stops after three bytes
            for _ in range(20):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(first_bytes)
                hung.append(s)
        # the server's handshake timeout is 10 s; every scrape here is answered well within its own 5 s
        for _ in range(3):
            assert b"shmstat_collector_" in _get(url, _client(pki, "client"), timeout=5)
    finally:
        for s in hung:
            s.close()
        coll.stop()


def _server(files: TLSFiles, **kw) -> tuple[MetricsServer, RenderCache]:
    registry = CollectorRegistry(auto_describe=True)
    Counter("tls_test_scrapes", "a counter", registry=registry).inc(3)
    cache = RenderCache(registry)
    return MetricsServer(cache, "127.0.0.1", 0, tls=server_context(files), **kw), cache


def test_a_hung_handshake_is_closed_after_its_timeout_and_counted(pki):
    server, cache = _server(TLSFiles(pki.crt("server"), pki.key("server"), pki.crt("ca")),
                            handshake_timeout_s=0.05)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"\x16\x03\x01")
            assert s.recv(1) == b"", "the server closes a handshake that does not finish"
        wait_for(lambda: server.handshake_failures == 1, 10, what="the failed handshake counted")
        url = f"https://127.0.0.1:{server.port}/metrics"
        assert b"tls_test_scrapes_total 3.0" in _get(url, _client(pki, "client"))
    finally:
        server.close()
        cache.close()


def test_without_a_client_ca_any_https_client_scrapes_and_plain_http_does_not(pki):
    server, cache = _server(TLSFiles(pki.crt("server"), pki.key("server")))
    url = f"https://127.0.0.1:{server.port}/metrics"
    try:
        assert b"tls_test_scrapes_total 3.0" in _get(url, _client(pki, None))
        assert isinstance(_refused(url.replace("https:", "http:")), urllib.error.HTTPError)
    finally:
        server.close()
        cache.close()


# -- bad input: one sentence, exit status 2, nothing made ---------------------------------------------------------

def _bad_files(pki: Pki, root: Path) -> dict[str, tuple[str, str]]:
    """Broken variants of the good files: ``{case: (--prometheus-tls value, what the error says)}``."""
    crt, key, ca = pki.crt("server"), pki.key("server"), pki.crt("ca")
    root.mkdir(exist_ok=True)
    der = root / "server.der"
    subprocess.run(["openssl", "x509", "-in", crt, "-outform", "der", "-out", str(der)], check=True)
    encrypted = root / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", str(encrypted)],
                   check=True)
    os.chmod(encrypted, 0o600)
    shared = root / "shared.key"
    shared.write_bytes(Path(key).read_bytes())
    os.chmod(shared, 0o644)
    return {
        "missing cert": (f"{root}/nope.crt,{key}", "cannot read the certificate file"),
        "key is a directory": (f"{crt},{root}", "cannot read the key file"),
        "DER cert": (f"{der},{key}", "is not a PEM certificate"),
        "key of another cert": (f"{crt},{pki.key('client')}", "does not match the certificate"),
        "cert as key": (f"{crt},{crt}", "is not a PEM private key"),
        "encrypted key": (f"{crt},{encrypted}", "is encrypted"),
        "key every user reads": (f"{crt},{shared}", "may be read or written by every user"),
        "client CA not PEM": (f"{crt},{key},{key}", "client CA"),
        "missing client CA": (f"{crt},{key},{root}/nope-ca.crt", "cannot read the client CA file"),
        "one file": (crt, "is not CERT,KEY or CERT,KEY,CLIENT_CA"),
        "four files": (f"{crt},{key},{ca},{ca}", "is not CERT,KEY or CERT,KEY,CLIENT_CA"),
    }


def test_bad_tls_files_are_one_sentence_each_and_nothing_is_made(pki, tmp_path):
    for case, (spec, says) in _bad_files(pki, tmp_path / "bad").items():
        job = unique_job("tlsbad")
        r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--prometheus",
                            "127.0.0.1:0", "--prometheus-tls", spec], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (case, r.stderr)
        assert not [f for f in os.listdir("/dev/shm") if job in f], case


def test_tls_without_prometheus_is_one_sentence(job, pki):
    r = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", job, "--prometheus-tls",
                        pki.tls_arg()], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--prometheus-tls needs --prometheus" in r.stderr and "Traceback" not in r.stderr
    assert not [f for f in os.listdir("/dev/shm") if job in f]


def test_a_key_its_group_reads_is_served_with_a_warning(pki, tmp_path):
    key = tmp_path / "group.key"
    key.write_bytes(Path(pki.key("server")).read_bytes())
    os.chmod(key, 0o640)
    warnings: list[str] = []
    ctx = server_context(parse_tls(f"{pki.crt('server')},{key}"), warn=warnings.append)
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_NONE
    assert len(warnings) == 1 and "may be read or written by its group" in warnings[0]
    os.chmod(key, 0o600)
    assert server_context(parse_tls(f"{pki.crt('server')},{key}"), warn=warnings.append).verify_mode == ssl.CERT_NONE
    assert len(warnings) == 1, "an owner-only key is not warned about"
    with_ca = server_context(parse_tls(pki.tls_arg()))
    assert with_ca.verify_mode == ssl.CERT_REQUIRED and with_ca.minimum_version >= ssl.TLSVersion.TLSv1_2


# -- TLS 1.2 at least, whatever the interpreter and the node's OpenSSL configuration ------------------------------

# An openssl.cnf as guides for old clients suggest: security level 0, which lets OpenSSL sign a TLS 1.0/1.1
# handshake. Where the server's context leaves its minimum to the library (Debian's python3 says
# MINIMUM_SUPPORTED), such a node served /metrics over TLS 1.0 and 1.1.
_WEAK_OPENSSL_CNF = """openssl_conf = default_conf
[default_conf]
ssl_conf = ssl_sect
[ssl_sect]
system_default = system_default_sect
[system_default_sect]
CipherString = DEFAULT@SECLEVEL=0
"""
_DEBIAN_PYTHON = "/usr/bin/python3"


def _interpreters() -> list:
    """The interpreter running the tests (CI's) and Debian's python3 where there is one and it is another."""
    found = [pytest.param(sys.executable, id="this-python")]
    if os.path.exists(_DEBIAN_PYTHON) and os.path.realpath(_DEBIAN_PYTHON) != os.path.realpath(sys.executable):
        found.append(pytest.param(_DEBIAN_PYTHON, id="usr-bin-python3"))
    return found


def _env_for(python: str, tmp_path: Path) -> dict[str, str]:
    """The environment a collector under ``python`` runs in: the weak OpenSSL configuration and, for another
    interpreter of this one's minor version, this one's site-packages (its compiled dependencies fit that ABI);
    skips the test when ``python`` still cannot import the collector's dependencies."""
    cnf = tmp_path / "weak-openssl.cnf"
    cnf.write_text(_WEAK_OPENSSL_CNF)
    env = dict(os.environ, OPENSSL_CONF=str(cnf))
    if python != sys.executable:
        version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30).stdout.strip()
        if version == str(sys.version_info[:2]):
            paths = sysconfig.get_paths()
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
        else:
            env.pop("PYTHONPATH", None)
    probe = subprocess.run([python, "-c", "import zmq, numpy, posix_ipc, psutil, msgpack, prometheus_client, "
                            "collector.cli"], cwd=REPO, env=collector_env(env), capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import the collector's dependencies: {probe.stderr.strip().splitlines()[-1]}")
    return env


def _old_client(version: ssl.TLSVersion) -> ssl.SSLContext:
    """A client that offers TLS ``version`` at most (and at security level 0, so only the server can refuse)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLSv1 and TLSv1_1 are deprecated names
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = version
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    return ctx


@pytest.mark.parametrize("python", _interpreters())
def test_tls_1_1_and_1_0_clients_are_refused_on_every_interpreter(job, pki, tmp_path, python):
    env = _env_for(python, tmp_path)
    coll = start_collector(job, "--handler", "*=null", "--prometheus", "127.0.0.1:0", "--prometheus-tls",
                           pki.tls_arg(client_ca=False), "--status-interval", "0", env=env, python=python)
    try:
        url = _metrics_url(coll)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        for old in (ssl.TLSVersion.TLSv1_1, ssl.TLSVersion.TLSv1):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s, \
                    pytest.raises(ssl.SSLError) as refused, _old_client(old).wrap_socket(s) as t:
                pytest.fail(f"{python} served {t.version()} to a client offering {old.name} at most")
            assert "PROTOCOL_VERSION" in str(refused.value), (old, refused.value)
        assert b"shmstat_collector_" in _get(url, _client(pki, None))  # TLS 1.2 and later are served
    finally:
        coll.stop()
