"""Every test README.md or a docs page names as the proof of a guarantee exists: a renamed or deleted test fails
here.

They name a test by its file name only (``test_file.py::test_name``); the file is looked up anywhere under
tests/, whose test file names are unique."""

from __future__ import annotations

import ast
import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_REF = re.compile(r"`(test_[A-Za-z0-9_]+\.py)(?:::(test_[A-Za-z0-9_]+))?`")


def _named_tests() -> list[tuple[str, str | None]]:
    pages = [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    return [(m.group(1), m.group(2)) for m in _REF.finditer(text)]


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


def test_readme_names_tests() -> None:
    assert len(_named_tests()) >= 10, "docs/guarantees.md should name the tests that show them"


def _test_files() -> dict[str, Path]:
    """Every test file under tests/, by file name."""
    return {p.name: p for p in (_ROOT / "tests").rglob("test_*.py")}


def test_test_file_names_are_unique() -> None:
    names = [p.name for p in (_ROOT / "tests").rglob("test_*.py")]
    assert len(names) > 50, "the tests moved out of tests/?"
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_every_test_readme_names_exists() -> None:
    files = _test_files()
    missing = []
    for file_name, test_name in _named_tests():
        path = files.get(file_name)
        if path is None:
            missing.append(file_name)
        elif test_name is not None and test_name not in _test_functions(path):
            missing.append(f"{file_name}::{test_name}")
    assert not missing, f"README names tests that do not exist: {missing}"
