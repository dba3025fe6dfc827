"""The docs' "Many nodes" recipe (docs/guides/many-nodes.md) as the test that runs it reads it
(tests/system/test_multinode.py): the code blocks of that page before its first subsection, taken from it at test
time, with the operator's addresses and paths swapped for a simulated cluster's. Editing the recipe edits the
test; a recipe the test cannot follow any more fails it.

The README's nodes ``10.0.0.1``, ``10.0.0.2``, ... (``node1``, ``node2``, ... in its certificate loop) are the
cluster's hosts in order; ``/etc/shmstat``, ``/var/lib/shmstat``, ``/shared/shmstat``,
``/etc/prometheus/shmstat`` and ``~/shmstat-keys`` are directories the caller names (:class:`Places`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kit.procs import REPO

_README = Path(REPO) / "docs" / "guides" / "many-nodes.md"
_SHMSTAT = "import sys; from collector.cli.command import main; sys.exit(main())"  # the `shmstat` command


def _section() -> str:
    """The "Many nodes" page up to its first subsection."""
    text = _README.read_text(encoding="utf-8")
    start = text.index("# Many nodes\n")
    return text[start:text.index("\n## ", start + 1)]


def blocks() -> list[tuple[str, str]]:
    """Every fenced code block of README's "Many nodes" section before its subsections: (language, text)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", _section(), re.S | re.M)


def block(lang: str, contains: str) -> str:
    """The one code block of the section in ``lang`` that contains ``contains``."""
    found = [text for language, text in blocks() if language == lang and contains in text]
    assert len(found) == 1, f"README's Many nodes recipe should have one {lang} block with {contains!r}: {found}"
    return found[0]


def operator_address(i: int) -> str:
    """The README's address of its ``i``-th node (from 0)."""
    return f"10.0.0.{i + 1}"


@dataclass
class Places:
    """Where a simulated cluster keeps what the recipe puts in each place, and its hosts' addresses."""

    addresses: list[str]
    admin: Path
    """Where step 1 runs (the admin host's working directory)."""
    shared: Path
    """``/shared/shmstat``."""
    prometheus: Path
    """``/etc/prometheus/shmstat``."""
    subscriber: Path
    """``~/shmstat-keys``."""

    def swap(self, text: str, host: int | None = None, etc: Path | None = None, var: Path | None = None) -> str:
        """``text`` with the README's addresses, and paths (a node's with ``host``, ``etc``, ``var``), swapped."""
        for i, address in enumerate(self.addresses):
            text = re.sub(rf"\b{re.escape(operator_address(i))}\b", address, text)
        text = text.replace("/etc/prometheus/shmstat", str(self.prometheus)).replace(
            "/shared/shmstat", str(self.shared)).replace("~/shmstat-keys", str(self.subscriber))
        if host is not None:
            assert etc is not None and var is not None
            text = text.replace("${ADDR}", self.addresses[host]).replace("/etc/shmstat", str(etc)).replace(
                "/var/lib/shmstat", str(var))
        return text


def run_step_one(places: Places) -> None:
    """Step 1 — keys and certificates — in ``places.admin``, as written (bash; ``shmstat`` this worktree's)."""
    script = block("sh", "openssl req")
    assert script.count("10.0.0.") == len(places.addresses), "the certificate loop names every node"
    places.admin.mkdir(parents=True, exist_ok=True)
    prelude = f'shmstat() {{ "{sys.executable}" -c "{_SHMSTAT}" "$@"; }}\nset -e\n'
    done = subprocess.run(["bash", "-c", prelude + places.swap(script)], cwd=places.admin, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO})
    assert done.returncode == 0, f"step 1 of the recipe failed: {done.stderr}"


def collector_args(places: Places, host: int, name: str, etc: Path, var: Path) -> list[str]:
    """Step 2 — the systemd unit's ``ExecStart`` — for host number ``host`` (named ``name``): the arguments after
    the ``shmstat`` program."""
    unit = block("ini", "ExecStart=")
    for line in ("Restart=on-failure", "KillSignal=SIGTERM", "TimeoutStopSec="):
        assert line in unit, f"the recipe's unit lacks {line}"
    line = next(x for x in unit.replace("\\\n", " ").splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(places.swap(line[len("ExecStart="):].replace("%H", name), host, etc, var))
    assert argv[0].endswith("/shmstat") and argv[1] == "collect", argv
    return argv[1:]


def torchrun_args(places: Places, host: int) -> list[str]:
    """Step 3 — torchrun on node number ``host`` — as written: the arguments after ``torchrun``, the script
    last."""
    lines = [x for x in block("sh", "torchrun --nnodes").splitlines() if x.strip()]
    argv = shlex.split(places.swap(lines[host]), comments=True)
    assert argv[0] == "torchrun", argv
    return argv[1:]


def scrape_configs(places: Places) -> str:
    """Step 4 — Prometheus' scrape configuration — as YAML list items (what follows ``scrape_configs:``)."""
    yaml = places.swap(block("yaml", "tls_config"))
    head = "scrape_configs:\n"
    assert yaml.startswith(head), yaml
    return yaml[len(head):]


def subscribe_args(places: Places) -> list[str]:
    """Step 5 — the subscriber — as written: the arguments after ``shmstat``."""
    argv = shlex.split(places.swap(block("sh", "shmstat subscribe --curve").strip()))
    assert argv[:2] == ["shmstat", "subscribe"], argv
    return argv[1:]
