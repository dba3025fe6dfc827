"""One switch chooses C or pure Python (``shmstat._backend``): the variable is read there only, once per process,
every twin is asked of it, and a child process makes its own choice from its environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kit.procs import REPO

from shmstat import _backend
from shmstat.publish.outbox import Outbox, new_outbox

_CHOICE = r"""
import json, os
import shmstat
from shmstat import _backend
from shmstat.publish import events
from shmstat.publish.outbox import new_outbox
first = _backend.backend()
os.environ[_backend.VARIABLE] = "0" if first.name == "python" else "1"  # too late: chosen at import
print(json.dumps([first.name, _backend.backend() is first, events.Event.__mro__[1].__module__,
                  events.log_event is events._py_log_event,
                  type(new_outbox(rank=0, pid=1, incarnation=0, batch_max=1, max_items=1, max_bytes=1,
                                  max_batch_bytes=1, metric_bytes=1)).__module__]))
"""


def _choice(value: str | None) -> list:
    env = {k: v for k, v in os.environ.items() if k != _backend.VARIABLE}
    if value is not None:
        env[_backend.VARIABLE] = value
    r = subprocess.run([sys.executable, "-c", _CHOICE], cwd=REPO, env=dict(env, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_process_reads_the_variable_once_and_every_twin_follows() -> None:
    assert _choice("1") == ["python", True, "shmstat.publish.events", True, "shmstat.publish.outbox"]
    if _backend.c_available():
        c = ["c", True, "shmstat._pubfast", False, "shmstat._pubfast"]
        assert _choice(None) == c and _choice("0") == c


def test_only_the_backend_modules_read_the_variable_or_import_an_extension() -> None:
    readers, importers = [], []
    for package in ("shmstat", "collector", "elastic"):
        for path in Path(REPO, package).rglob("*.py"):
            text = path.read_text()
            rel = str(path.relative_to(REPO))
            if _backend.VARIABLE in text:
                readers.append(rel)
            if re.search(r"import (_fastpath|_pubfast|_intake)\b|from \.?_(fastpath|pubfast|intake) import|"
                         r"\"(shmstat\.|collector\.)?_(fastpath|pubfast|intake)\"", text):
                importers.append(rel)
    assert readers == ["shmstat/_backend.py"]
    assert sorted(importers) == ["collector/_backend.py", "shmstat/_backend.py"]


@pytest.mark.skipif(not _backend.c_available(), reason="the C extensions are not built")
def test_the_c_backend_provides_every_name_of_its_api() -> None:
    c = _backend.load("c")
    assert c.is_c and all(getattr(c, name) is not None for name in _backend.FASTPATH_API + _backend.PUBFAST_API)
    assert not [name for name in _backend.FASTPATH_API + _backend.PUBFAST_API if getattr(_backend.load("python"),
                                                                                         name) is not None]


def test_use_switches_what_is_built_afterwards_and_restores(backend: str) -> None:
    args = {"rank": 0, "pid": 1, "incarnation": 0, "batch_max": 1, "max_items": 1, "max_bytes": 1,
            "max_batch_bytes": 1, "metric_bytes": 1}
    assert _backend.backend().name == backend
    built = new_outbox(**args)
    assert (type(built) is Outbox) == (backend == "python")
    other = "c" if backend == "python" else "python"
    with _backend.use(other):  # type: ignore[arg-type]
        assert _backend.backend().name == other
        assert (type(new_outbox(**args)) is Outbox) == (other == "python")
    assert _backend.backend().name == backend
    with pytest.raises(ValueError, match="unknown backend"):
        _backend.load("fortran")  # type: ignore[arg-type]
