"""The three packages are typed: mypy (configured in pyproject.toml's ``[tool.mypy]``) reports no error over them,
and each ships a ``py.typed`` marker (PEP 561) as package data, so users' type checkers read our hints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("shmstat", "collector", "elastic")


def test_mypy_reports_no_error(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    # a cache of this test's own: parallel workers and the developer's .mypy_cache never share one
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout


def test_mypy_checks_the_three_packages_and_each_ships_py_typed() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    config = tomllib.loads((_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert sorted(config["tool"]["mypy"]["files"]) == sorted(_PACKAGES)
    package_data = config["tool"]["setuptools"]["package-data"]
    for package in _PACKAGES:
        assert (_ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in package_data[package], package
