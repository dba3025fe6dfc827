"""The C extensions take their shared constants from one source: ``shmstat/_c/layout.h``, generated from the Python
modules (``shmstat._clayout``). The committed header must be what the Python constants say now, and no C file
may define one of those names itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from kit.procs import REPO

from shmstat import _clayout
from shmstat.shm import layout

C_SOURCES = sorted([*Path(REPO, "shmstat").glob("*.c"), *Path(REPO, "shmstat", "_c").glob("*.h"),
                    *Path(REPO, "collector").glob("*.c")])


def test_the_committed_header_is_what_the_python_constants_say() -> None:
    assert _clayout.HEADER_PATH.read_text() == _clayout.render(), "run: python -m shmstat._clayout"
    r = subprocess.run([sys.executable, "-m", "shmstat._clayout", "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_changed_python_constant_is_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "HIST_SIZE", layout.HIST_SIZE + 8)
    assert "#define HIST_SIZE 2248\n" in _clayout.render()
    assert _clayout.main(["--check"]) == 1
    assert _clayout.HEADER_PATH.read_text() != _clayout.render()


def test_no_c_file_defines_a_generated_constant_itself() -> None:
    generated = {name for _, values in _clayout.constants() for name, _ in values} | {"KIND_NAMES_INIT"}
    assert {"BANK_SIZE", "HIST_SIZE", "HIST_M", "MAX_TOPIC", "MAX_PAYLOAD", "MAX_OPEN", "K_EVENT"} <= generated
    sources = [p for p in C_SOURCES if p != _clayout.HEADER_PATH]
    assert len(sources) >= 7
    for path in sources:
        defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", path.read_text(), re.MULTILINE))
        assert not defined & generated, (path.name, defined & generated)
    users = [p.name for p in sources if '_c/layout.h"' in p.read_text()]
    assert sorted(users) == ["_fastpath.c", "_intake.c", "_pubfast.c"]
