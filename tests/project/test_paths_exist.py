"""Every repository path, file name and module a comment, a docstring or a document names exists.

Where names are looked for: the comments and docstrings of every tracked ``*.py`` file (``setup.py`` included;
docstrings of modules, classes and functions, and the string statements that document attributes), the comments
and string literals of every ``*.c`` and ``*.h`` file (where the strings are docstrings and messages), and the whole
text of the :data:`DOCUMENTS` (README, BENCHMARKS and CHANGELOG, those there are) and of every page under docs/ (code
blocks included). String literals of Python code are not read: they may name files on purpose that do not exist (a
test's missing file).

What counts as a name, and the rule each must follow:

1. a **path**: a token starting with one of the repository's top-level directories followed by ``/``
   (``shmstat/``, ``collector/``, ``elastic/``, ``tests/``, ``scripts/``, ``docs/``, ``.ci/``), not preceded by a
   letter, digit, ``.``, ``/`` or ``-`` (so ``/dev/shm/shmstat.x`` and URLs are not paths), up to the first
   character that is none of letters, digits, ``_ . / - * { } ,``; trailing ``.`` and ``,`` are dropped. It must
   exist in the checkout (a file or a directory); ``*`` is a glob that must match something, ``{a,b}`` must
   exist for each choice.
2. a **file name**: a bare ``<name>.py``, ``<name>.c``, ``<name>.h`` or ``<name>.md`` (no directory in front)
   must be the name of some tracked file, wherever it is, unless it is in :data:`NOT_OURS` (a user's script in
   examples, ``train.py``, and a placeholder).
3. a **module**: a dotted name starting with ``shmstat.``, ``collector.`` or ``elastic.`` that is a code
   reference: inside a Sphinx role (``:mod:`collector.read.columns```, ``:func:`~shmstat.names.group_problem```)
   anywhere, or anywhere in a C comment or string literal. Its longest leading part that is a module or package must
   exist, and
   the next name, if any, must be defined at the top level of that module (a class, function, assignment or
   import), so ``collector.read.merge.merge`` fails once ``merge`` moves away. Dotted names elsewhere are not
   checked: most are the names of counters and events (``collector.handler_dropped``, ``shmstat.straggler``).

A renamed or moved file then fails here until every mention is updated.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]

TOP_DIRS = ("shmstat", "collector", "elastic", "tests", "scripts", "docs", ".ci")
"""The top-level directories a path starts with."""

NOT_OURS = frozenset({"train.py", "test_file.py"})
"""File names that are not files of this repository on purpose: ``train.py``, the user's script in the guides'
examples; ``test_file.py``, the placeholder in how a guarantee names its test (``test_file.py::test_name``)."""

DOCUMENTS = ("README.md", "BENCHMARKS.md", "CHANGELOG.md")
"""The documents read whole (besides every page under docs/)."""

_TOP = "|".join(re.escape(d) for d in TOP_DIRS)
_PATH = re.compile(rf"(?<![\w./-])((?:{_TOP})/[\w./*{{}},-]*)")
_FILE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|c|h|md))(?![\w/])")
_MODULE = re.compile(r"(?<![\w./-])((?:shmstat|collector|elastic)(?:\.[A-Za-z_]\w*)+)")
_ROLE = re.compile(r":[a-z]+:`~?(?:[^`<>]*<)?([^`<>]+)>?`")
_C_TEXT = re.compile(r"""(/\*.*?\*/|//[^\n]*)|"((?:[^"\\\n]|\\.)*)"|'(?:[^'\\\n]|\\.)*'""", re.DOTALL)
_C_ESCAPE = re.compile(r"\\(.)")


@cache
def _tracked() -> tuple[str, ...]:
    """The repository's files: git's list, or (no git, e.g. an unpacked sdist) every file outside build output."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=_ROOT, capture_output=True, text=True, check=True).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "site", "__pycache__"}
        names = [p.relative_to(_ROOT).as_posix() for p in _ROOT.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(_ROOT).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return tuple(name for name in names if (_ROOT / name).is_file())


def _python_text(source: str) -> str:
    """The comments and docstrings of a Python module, one after another."""
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            parts.append(node.value.value)
    return "\n".join(parts)


def _c_text(source: str) -> str:
    """The comments and string literals of a C source, one after another (a string's escapes decoded, so ``\\n``
    does not glue the next word to an ``n``); character literals are skipped, so a ``'"'`` opens no string."""
    parts = []
    for m in _C_TEXT.finditer(source):
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            parts.append(_C_ESCAPE.sub(lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), m.group(2)))
    return "\n".join(parts)


def _texts() -> list[tuple[str, str, str]]:
    """``(file, the text of it that is read, the part of it where dotted names are code references)`` for every
    file read (see the module docstring)."""
    out = []
    for name in _tracked():
        path = _ROOT / name
        if name.endswith(".py"):
            text = _python_text(path.read_text(encoding="utf-8"))
        elif name.endswith((".c", ".h")):
            text = _c_text(path.read_text(encoding="utf-8"))
            out.append((name, text, text))
            continue
        elif name in DOCUMENTS or (name.startswith("docs/") and name.endswith(".md")):
            text = path.read_text(encoding="utf-8")
        else:
            continue
        out.append((name, text, "\n".join(m.group(1) for m in _ROLE.finditer(text))))
    return out


def _expand(path: str) -> list[str]:
    """``a/{b,c}/d`` as ``[a/b/d, a/c/d]``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m is None:
        return [path]
    return [x for choice in m.group(1).split(",") for x in _expand(path[: m.start()] + choice + path[m.end():])]


def _path_exists(path: str) -> bool:
    if "{" in path and "}" not in path:  # a brace cut off at the end of the token
        path = path[: path.index("{")]
    for one in _expand(path):
        one = one.rstrip("/") or one
        if "*" in one:
            if not any(_ROOT.glob(one)):
                return False
        elif not (_ROOT / one).exists():
            return False
    return True


@cache
def _basenames() -> frozenset[str]:
    return frozenset(name.rsplit("/", 1)[-1] for name in _tracked())


@cache
def _top_level_names(module_file: Path) -> frozenset[str]:
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING imports, optional imports
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return frozenset(names)


def _module_problem(dotted: str) -> str | None:
    """Why ``dotted`` names nothing (None if it names a module, or a name one defines)."""
    parts = dotted.split(".")
    module_file: Path | None = None
    for i in range(1, len(parts) + 1):
        base = _ROOT.joinpath(*parts[:i])
        if (base / "__init__.py").exists():
            module_file = base / "__init__.py"
        elif base.with_suffix(".py").exists():
            module_file = base.with_suffix(".py")
        elif base.with_suffix(".c").exists():  # a C extension: its names are not checked
            return None
        else:
            assert module_file is not None
            if parts[i - 1] in _top_level_names(module_file):
                return None
            return f"{'.'.join(parts[:i - 1])} has no module or name {parts[i - 1]!r}"
    return None


def _problems() -> list[str]:
    found = []
    for name, text, references in _texts():
        for m in _PATH.finditer(text):
            path = m.group(1).rstrip(".,")
            if path.rstrip("/") in TOP_DIRS:
                continue
            if not _path_exists(path):
                found.append(f"{name}: path {path} does not exist")
        for m in _FILE.finditer(text):
            if m.group(1) not in _basenames() and m.group(1) not in NOT_OURS:
                found.append(f"{name}: file name {m.group(1)} is no file of the repository")
        for m in _MODULE.finditer(references):
            dotted = m.group(1)
            problem = _module_problem(dotted)
            if problem is not None:
                found.append(f"{name}: {dotted}: {problem}")
    return found


def test_every_named_path_file_and_module_exists() -> None:
    problems = _problems()
    assert problems == [], "\n".join(problems)


def test_the_rules_catch_what_they_are_for() -> None:
    text = ("see shmstat/layout.py and shmstat/shm/layout.py, shmstat/_c/*.h, collector/{read,relay}/, outbox.py, "
            "nothing_here.py, train.py, :mod:`shmstat._state`, :func:`collector.read.columns.merge_parts`, "
            "/dev/shm/shmstat.x and https://example.org/docs/x.md")
    paths = [m.group(1).rstrip(".,") for m in _PATH.finditer(text)]
    assert paths == ["shmstat/layout.py", "shmstat/shm/layout.py", "shmstat/_c/*.h", "collector/{read,relay}/"]
    assert [_path_exists(p) for p in paths] == [False, True, True, True]
    files = [m.group(1) for m in _FILE.finditer(text)]
    assert [f for f in files if f not in _basenames() and f not in NOT_OURS] == ["nothing_here.py"]
    modules = [m.group(1) for m in _MODULE.finditer(text)]
    assert [d for d in modules if _module_problem(d)] == ["shmstat._state"]


def test_c_comments_and_string_literals_are_read() -> None:
    source = ('/* see shmstat/x.py */ char q = \'"\'; m = "Optional (see collector/intake.py).\\ncollector/y.py";'
              ' // and tests/z.py\n if (a /* "docs/w.md" */) f("x/* not a comment */");')
    text = _c_text(source)
    paths = [m.group(1).rstrip(".,") for m in _PATH.finditer(text)]
    assert paths == ["shmstat/x.py", "collector/intake.py", "collector/y.py", "tests/z.py", "docs/w.md"]
    assert "not a comment" in text
