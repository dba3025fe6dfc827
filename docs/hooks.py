"""mkdocs hooks (mkdocs.yml ``hooks:``): pages that are generated from the code at build time, so they cannot drift.

- ``<!-- cli-reference -->`` becomes the reference of every ``shmstat`` command and option, walked from the very
  argparse parser the ``shmstat`` console script parses with (``collector.cli.command``).
- ``<!-- docstring: MODULE -->`` becomes that module's docstring (read from its source, not imported), its
  reStructuredText literal blocks and tables turned into fenced blocks: the wire format
  (``shmstat/wire/__init__.py``) and the segment layout (``shmstat/shm/layout.py``) are drawn there, once.
- Sphinx roles left in docstrings rendered by mkdocstrings (``:class:`X``` shows as ``X``) are dropped.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import textwrap
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
_CLI_MARKER = "<!-- cli-reference -->"
_DOCSTRING_MARKER = re.compile(r"<!-- docstring: ([A-Za-z_][\w.]*) -->")
_ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj|const):(?=<code>)")
_ROLE_TEXT = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj|const):`~?([^`]+)`")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Expand the markers of a page before it is converted."""
    if _CLI_MARKER in markdown:
        markdown = markdown.replace(_CLI_MARKER, cli_reference())
    return _DOCSTRING_MARKER.sub(lambda m: module_docstring(m.group(1)), markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Drop Sphinx roles from rendered docstrings (``:class:<code>X</code>`` -> ``<code>X</code>``)."""
    return _ROLE.sub("", html).replace("<code>~", "<code>")


# --- the command line -------------------------------------------------------------------------------------------


def shmstat_parser() -> argparse.ArgumentParser:
    """The parser of the ``shmstat`` console script (``pyproject.toml``: ``shmstat = "collector.cli:main"``)."""
    from collector.cli import command

    return command._parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s subcommands by name, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _about(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.option_strings:
            names = ", ".join(action.option_strings)
            if action.nargs != 0:
                names += " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
        else:
            names = formatter._format_args(action, formatter._get_default_metavar_for_positional(action))
        what = formatter._expand_help(action) if action.help else ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS or default == []
        shown = "" if unset or action.nargs == 0 else f"`{default}`"
        rows.append(f"| `{_cell(names)}` | {shown} | {_cell(what)} |")
    return rows


def cli_reference() -> str:
    """Markdown for every command of ``shmstat``: its usage line, what it does and a table of its options."""
    os.environ["COLUMNS"] = "110"  # argparse wraps usage lines to the terminal's width
    parser = shmstat_parser()
    about = _about(parser)
    out = [
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        f"{parser.description}",
        "",
        "| option | default | what |",
        "|---|---|---|",
        *_option_rows(parser),
        "",
        "| command | what |",
        "|---|---|",
        *(f"| [`{name}`](#shmstat-{name}) | {_cell(text)} |" for name, text in about.items()),
        "",
    ]
    for name, sub in subcommands(parser).items():
        out += [
            f"## shmstat {name}",
            "",
            f"{about.get(name, '')[:1].upper()}{about.get(name, '')[1:]}.",
            "",
            "```text",
            sub.format_usage().strip(),
            "```",
            "",
            "| option | default | what |",
            "|---|---|---|",
            *_option_rows(sub),
            "",
        ]
    return "\n".join(out)


# --- module docstrings ------------------------------------------------------------------------------------------


def _module_path(module: str) -> Path:
    """The source file of ``module`` in this checkout (found, not imported)."""
    base = _ROOT.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    raise ValueError(f"docs: no module {module} under {_ROOT}")


def module_docstring(module: str) -> str:
    """``module``'s docstring as Markdown: literal blocks (``::``) and simple tables fenced as text."""
    tree = ast.parse(_module_path(module).read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    if not doc:
        raise ValueError(f"docs: {module} has no docstring")
    return rst_to_markdown(doc)


def rst_to_markdown(doc: str) -> str:
    """The little reStructuredText the project's docstrings use, as Markdown."""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.fullmatch(r"=+( +=+)+ *", line):  # a simple table: fence it whole, as drawn
            border = [j for j in range(i, len(lines)) if re.fullmatch(r"=+( +=+)+ *", lines[j])]
            # two borders, or three when the first row is a header: the table ends at its last border
            last = border[2] if len(border) > 2 and border[1] + 1 < len(lines) and lines[border[1] + 1].strip() \
                and border[2] - border[1] > 1 else border[1]
            end = last + 1
            out += ["```text", *lines[i:end], "```"]
            i = end
            continue
        if line.rstrip().endswith("::") and (i + 1 == len(lines) or not lines[i + 1].strip()):
            text = line.rstrip()[:-2].rstrip()
            if text:
                out.append(_ROLE_TEXT.sub(r"`\1`", text) + ":")
            block: list[str] = []
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith(" ")):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```text", textwrap.dedent("\n".join(block)).strip("\n"), "```", ""]
            i = j
            continue
        out.append(_ROLE_TEXT.sub(r"`\1`", line))
        i += 1
    return "\n".join(out)
