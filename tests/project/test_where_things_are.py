"""The code map (docs/internals/code-map.md) lists exactly the packages and subpackages that exist, bottom layer
first, and exactly the directories of tests/; tests/collector/ mirrors collector/'s subpackages, and every helper
tests share is in tests/kit/, none loose at the root of tests/."""

from __future__ import annotations

import re
from pathlib import Path

from test_import_graph import _PACKAGES, _SUBPACKAGE_LAYERS

_ROOT = Path(__file__).resolve().parents[2]
_LINE = re.compile(r"^- `([a-z_]+/(?:[a-z_]+/)?)` — ", re.MULTILINE)


def _section() -> str:
    return (_ROOT / "docs" / "internals" / "code-map.md").read_text(encoding="utf-8")


def _listed() -> list[str]:
    return _LINE.findall(_section())


def test_the_section_lists_exactly_the_packages_and_subpackages() -> None:
    listed = [p for p in _listed() if p != "tests/"]
    assert len(listed) == len(set(listed)), "a package is listed twice"
    inits = [init for pkg in _PACKAGES for init in (_ROOT / pkg).rglob("__init__.py")]
    existing = {f"{init.parent.relative_to(_ROOT).as_posix()}/" for init in inits}
    assert sorted(listed) == sorted(existing)


def test_subpackages_are_listed_bottom_layer_first() -> None:
    for pkg in _PACKAGES:
        subs = [p.split("/")[1] for p in _listed() if p.startswith(f"{pkg}/") and p.count("/") == 2]
        layer = {sub: i for i, subs_of_layer in enumerate(_SUBPACKAGE_LAYERS[pkg]) for sub in subs_of_layer}
        ranks = [layer[s] for s in subs]
        assert ranks == sorted(ranks), f"{pkg}: {subs} is not bottom first"


def test_the_tests_line_names_every_directory_of_tests() -> None:
    (line,) = [chunk for chunk in re.split(r"\n(?=- )", _section()) if chunk.startswith("- `tests/`")]
    named = set(re.findall(r"`([a-z_]+)/`", line)) - {"tests"}
    dirs = {d.name for d in (_ROOT / "tests").iterdir()
            if d.is_dir() and not d.name.startswith((".", "_"))}
    assert named == dirs


def test_tests_of_the_collector_sit_in_the_directory_of_the_subpackage_they_test() -> None:
    tests = _ROOT / "tests" / "collector"
    subpackages = {init.parent.name for init in (_ROOT / "collector").glob("*/__init__.py")}
    assert {d.name for d in tests.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))} == subpackages
    assert sorted(p.name for p in tests.glob("*.py")) == [], "a test of collector/ outside its subpackage's directory"


def test_helpers_live_in_the_kit_not_at_the_root_of_tests() -> None:
    assert sorted(p.name for p in (_ROOT / "tests").glob("*.py")) == ["conftest.py"]
    assert not list((_ROOT / "tests" / "kit").rglob("test_*.py")), "a test file in the kit"
