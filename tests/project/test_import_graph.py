"""The package layering holds and no module-level import circle exists: ``shmstat`` (rank side) <- ``elastic``
<- ``collector`` (node side), no import going upward. Imports inside functions (deliberately late) and under
``TYPE_CHECKING`` count too, except a function-level import may not point upward either.

Inside each package the subpackages are layered too (:data:`_SUBPACKAGE_LAYERS`, bottom first): a module imports
only its own subpackage, a lower layer, or the package's root modules (``shmstat.errors``, ``.aggregation``,
``.histogram``: the vocabulary everyone shares, which import no subpackage). Subpackages of one layer do not import
each other. The package's ``__init__`` and ``__main__`` are its faces and may import anything in it. The few
arrows that go up on purpose are listed in :data:`_UPWARD_ON_PURPOSE`, each with its reason.

The C sources are held to the same layering by what they name, since an import graph cannot see what a C function
is handed: a C file of a package names no module or path of a package above it (in code, strings or comments).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("shmstat", "elastic", "collector")
_LAYER = {"shmstat": 0, "elastic": 1, "collector": 2}

_SUBPACKAGE_LAYERS: dict[str, list[set[str]]] = {
    "shmstat": [{"shm", "wire"}, {"job"}, {"publish"}, {"writer", "testing"}, {"torch"}],
    "elastic": [{"metrics"}, {"events"}],
    "collector": [{"gpu"}, {"read", "relay"}, {"handlers", "prometheus"}, {"sinks"}, {"daemon"}, {"launch"}, {"cli"}],
}
_FACES = {"__init__", "__main__"}
_UPWARD_ON_PURPOSE = {
    # the build-time generator of the C extensions' header (shmstat/_c/layout.h) reads the constants of every
    # layer whose bytes C writes: it is a build tool beside the C sources, imported by nothing at run time
    ("shmstat._clayout", "shmstat.shm.layout"),
    ("shmstat._clayout", "shmstat.wire"),
    ("shmstat._clayout", "shmstat.publish.outbox"),
    ("shmstat._clayout", "shmstat.publish.item_sizes"),
    # attaching is the job's business, and it starts the job's publisher (late: the publisher needs the job)
    ("shmstat.job.attach", "shmstat.publish.publisher"),
    # start_exporter(config) is typed with the daemon's CollectorConfig (TYPE_CHECKING only)
    ("collector.prometheus.exporter", "collector.daemon.config"),
}


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
    # C extensions are modules too (``from .. import _fastpath``), named after their source file
    extensions = {_module_name(c) for pkg in _PACKAGES for c in (_ROOT / pkg).rglob("*.c")}
    modules = {_module_name(p) for p in paths} | extensions
    top, every = {}, {}
    for p in paths:
        top[_module_name(p)], every[_module_name(p)] = _imports(p, modules)
    return top, every


def test_no_import_goes_upward():
    _, every = _graph()
    upward = [(m, t) for m, targets in every.items() for t in targets
              if _LAYER[t.split(".")[0]] > _LAYER[m.split(".")[0]]]
    assert not upward, f"imports that go upward: {upward}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t):], t])
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return cycles


def test_no_module_level_import_circle():
    top, _ = _graph()
    cycles = _circles(top)
    assert not cycles, f"import circles: {cycles}"


def test_no_import_circle_through_late_imports_either():
    """A function-level import that closes a circle (``events`` builds the OTLP sink late, the OTLP sink imports
    ``events``) still makes two modules one idea cut in two: each module's imports, late ones included, form no
    circle."""
    _, every = _graph()
    cycles = _circles(every)
    assert not cycles, f"import circles (function-level imports included): {cycles}"


def _unit(module: str) -> tuple[str, str | None]:
    """(package, subpackage) of a module: None for the package's root modules, "" for its faces."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in _FACES:
        return parts[0], ""
    pkg_dir = _ROOT / parts[0] / parts[1]
    return parts[0], parts[1] if pkg_dir.is_dir() else None


def _rank(package: str, sub: str | None) -> int:
    if sub is None:
        return -1
    return next(i for i, layer in enumerate(_SUBPACKAGE_LAYERS[package]) if sub in layer)


def test_every_subpackage_has_a_layer():
    for pkg in _PACKAGES:
        subs = {p.parent.name for p in (_ROOT / pkg).glob("*/__init__.py")}
        declared = set().union(*_SUBPACKAGE_LAYERS[pkg])
        assert subs == declared, f"{pkg}: subpackages {sorted(subs)} but layers for {sorted(declared)}"
        nested = sorted(str(p.parent.relative_to(_ROOT)) for p in (_ROOT / pkg).glob("*/*/__init__.py"))
        assert nested == [], f"a subpackage inside a subpackage needs a layer too: {nested}"


def test_subpackages_import_only_downward():
    _, every = _graph()
    bad, used = [], set()
    for m, targets in every.items():
        pkg, sub = _unit(m)
        for t in targets:
            tpkg, tsub = _unit(t)
            if tpkg != pkg or sub == "" or tsub == sub:
                continue  # across packages: test_no_import_goes_upward; faces may import anything
            if tsub == "":
                ok = False  # nothing imports a package's face from inside it
            elif sub is None:
                ok = tsub is None  # root modules are the bottom: they import only each other
            else:
                ok = _rank(tpkg, tsub) < _rank(pkg, sub)
            if not ok:
                if (m, t) in _UPWARD_ON_PURPOSE:
                    used.add((m, t))
                else:
                    bad.append(f"{m} -> {t}")
    assert not bad, f"imports that go upward or sideways between subpackages: {bad}"
    assert used == _UPWARD_ON_PURPOSE, f"listed as upward on purpose, no longer imported: {_UPWARD_ON_PURPOSE - used}"


def _names_above(package: str, text: str) -> list[str]:
    """The modules, paths and bare package names of packages above ``package`` that ``text`` names."""
    above = [p for p in _PACKAGES if _LAYER[p] > _LAYER[package]]
    if not above:
        return []
    alt = "|".join(above)
    pattern = re.compile(rf'(?<![\w./-])(?:(?:{alt})(?:[./]\w+)+|"(?:{alt})")')
    return pattern.findall(text)


def test_c_sources_name_nothing_above_their_package():
    """The rank side's C is handed callables and plain containers, never a middle-layer module, registry or
    namespace it would look names up in: its text names no ``elastic`` (or ``collector``) module or path."""
    bad = [f"{c.relative_to(_ROOT)}: {name}" for pkg in _PACKAGES for c in sorted((_ROOT / pkg).rglob("*.[ch]"))
           for name in _names_above(pkg, c.read_text(encoding="utf-8"))]
    assert not bad, f"C sources naming a package above their own: {bad}"


def test_the_c_rule_catches_what_it_is_for():
    text = 'static PyObject *pm; /* elastic.metrics.emitting._handlers */ PyImport_ImportModule("elastic");'
    assert _names_above("shmstat", text) == ["elastic.metrics.emitting._handlers", '"elastic"']
    assert _names_above("shmstat", "routed to the collector; shmstat.elastic; torchelastic") == []
    assert _names_above("collector", "see elastic.metrics.api") == []
