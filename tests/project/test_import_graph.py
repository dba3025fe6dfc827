"""The package layering holds and no module-level import circle exists: ``shmstat`` (rank side) <- ``elastic``
<- ``collector`` (node side), no import going upward. Imports inside functions (deliberately late) and under
``TYPE_CHECKING`` count too, except a function-level import may not point upward either."""

from __future__ import annotations

import ast
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("shmstat", "elastic", "collector")
_LAYER = {"shmstat": 0, "elastic": 1, "collector": 2}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(module-level targets, every target) among our modules."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top: set[str] = set()
    every: set[str] = set()

    def resolve(node: ast.AST) -> list[str]:
        out = []
        if isinstance(node, ast.Import):
            out = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` depends on pkg.mod; ``from pkg.mod import name`` on pkg.mod
            out = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        return [m for m in out if m in modules]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            targets = resolve(child)
            every.update(targets)
            if not in_function:
                top.update(targets)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    top.discard(name)
    every.discard(name)
    return top, every


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    paths = [p for pkg in _PACKAGES for p in (_ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in paths}
    top, every = {}, {}
    for p in paths:
        top[_module_name(p)], every[_module_name(p)] = _imports(p, modules)
    return top, every


def test_no_import_goes_upward():
    _, every = _graph()
    upward = [(m, t) for m, targets in every.items() for t in targets
              if _LAYER[t.split(".")[0]] > _LAYER[m.split(".")[0]]]
    assert not upward, f"imports that go upward: {upward}"


def test_no_module_level_import_circle():
    top, _ = _graph()
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(top.get(m, ())):
            if t not in top:
                continue
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t):], t])
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(top):
        if m not in state:
            dfs(m)
    assert not cycles, f"import circles: {cycles}"
