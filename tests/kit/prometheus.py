"""A real Prometheus for the exporter's tests: Debian's ``prometheus`` (2.42) started on a free loopback port with
the scrape configurations a test gives, and its HTTP API read back (tests skip with a clear reason without it)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

needs_prometheus = pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="needs Debian's prometheus package "
                                      "(apt-get install -y --no-install-recommends prometheus; .ci/run does it "
                                      "as root)")


def free_port() -> int:
    """A loopback port free right now (for Prometheus' own listener: it takes no port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def file_sd_job(sd_dir: Path | str, name: str = "shmstat", extra: str = "") -> str:
    """A scrape configuration (YAML, one list item) of the ``file_sd`` files in ``sd_dir``, read every second;
    ``extra`` is more of its YAML keys, each line indented by four spaces."""
    return (f"  - job_name: {name}\n    honor_labels: true\n{extra}"
            f"    file_sd_configs:\n      - files: ['{sd_dir}/*.json']\n        refresh_interval: 1s\n")


def static_job(targets: list[str], name: str = "shmstat") -> str:
    """A scrape configuration (YAML, one list item) of fixed ``targets`` (``HOST:PORT``)."""
    return (f"  - job_name: {name}\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n")


def prometheus_command(tmp_path: Path, scrape_configs: str, listen: str,
                       rule_files: list[Path] | None = None) -> list[str]:
    """The command line of a Prometheus listening on ``listen`` (``HOST:PORT``), scraping and evaluating
    ``rule_files`` every second with ``scrape_configs`` (YAML list items); its configuration and TSDB go in
    ``tmp_path``."""
    rules = f"rule_files: {json.dumps([str(p) for p in rule_files])}\n" if rule_files else ""
    return _command(tmp_path, "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n" + rules
                    + "scrape_configs:\n" + scrape_configs, listen)


def _command(tmp_path: Path, config: str, listen: str) -> list[str]:
    path = tmp_path / "prometheus.yml"
    path.write_text(config)
    return [PROMETHEUS, f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={listen}"]


def start_prometheus(tmp_path: Path, scrape_configs: str) -> tuple[subprocess.Popen, str]:
    """A real Prometheus scraping every second with ``scrape_configs`` (YAML list items); returns it and its base
    URL. Its log is ``tmp_path / "prometheus.log"``; the caller terminates it."""
    listen = f"127.0.0.1:{free_port()}"
    return _started(tmp_path, prometheus_command(tmp_path, scrape_configs, listen), listen)


def start_prometheus_as_written(tmp_path: Path, config: str) -> tuple[subprocess.Popen, str]:
    """A real Prometheus with ``config`` as its whole ``prometheus.yml``: Prometheus' own defaults for what it
    leaves out, as a user's copy of a page gets them (a scrape a minute). Returns it and its base URL."""
    listen = f"127.0.0.1:{free_port()}"
    return _started(tmp_path, _command(tmp_path, config, listen), listen)


def _started(tmp_path: Path, command: list[str], listen: str) -> tuple[subprocess.Popen, str]:
    prom = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "w"))  # noqa: SIM115
    return prom, f"http://{listen}"


def query(base: str, promql: str) -> list[dict]:
    """The result vector of an instant query."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        doc = json.load(r)
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def value(base: str, promql: str) -> float | None:
    """The first value of an instant query (None: no series)."""
    result = query(base, promql)
    return float(result[0]["value"][1]) if result else None


def scraping(base: str, job: str = "shmstat") -> bool:
    """Whether Prometheus is up and has scraped a target of scrape job ``job`` successfully."""
    try:
        return bool(query(base, f'up{{job="{job}"}} == 1'))
    except urllib.error.URLError:  # not listening yet
        return False
