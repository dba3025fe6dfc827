"""The performance figures the pages quote are BENCHMARKS.md's latest run, not a memory of an older one.

Which pages: :data:`PAGES` whole, and the "Why" section of :data:`WHY_PAGES`. What a figure is: a number followed by
``ns`` or ``µs`` (a cost), by ``x`` (a ratio) or by ``million events`` (a rate); a ``2^62 ns`` is a limit, not a
figure. Where it must appear: in the latest run (between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``), as
printed there, rounded the way the page rounds it:

- a cost in ns: a number printed in the run (``105``, ``1,598``, ``81.8``);
- a cost in µs: a number of ns printed in the run that rounds to it (``1.4 µs``: ``1,440``);
- a ratio: a ratio printed in the run (``4.17x``) that rounds to it (``4.2x``);
- a rate in million events: a number printed in the run that rounds to it (``3.4 million``: ``3,414,306``).

A ratio or a range a page works out itself is not a figure of the run: the page quotes the run's figures instead.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]

PAGES = ("docs/design.md", "docs/guides/from-torch-monitor.md")
"""Pages read whole."""

WHY_PAGES = ("README.md", "docs/index.md")
"""Pages of which the "Why" section is read."""

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_FIGURE = re.compile(rf"(?<![\w.,^])({_NUMBER})(?:[\u2013-]({_NUMBER}))?\s*(ns|µs|x|million events)(?!\w)")
_PRINTED = re.compile(rf"(?<![\w.^])({_NUMBER})(x?)(?!\w)")


def _latest_run() -> str:
    text = (_ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    return text[text.index("<!-- bench:begin -->"):text.index("<!-- bench:end -->")]


def _why(text: str) -> str:
    m = re.search(r"^## Why\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m is not None, "no '## Why' section"
    return m.group(1)


def _quoted() -> list[tuple[str, str, str]]:
    """``(page, number, unit)`` of every figure the pages quote (both ends of a range)."""
    out = []
    for name in PAGES + WHY_PAGES:
        text = (_ROOT / name).read_text(encoding="utf-8")
        if name in WHY_PAGES:
            text = _why(text)
        for m in _FIGURE.finditer(text):
            out += [(name, n, m.group(3)) for n in (m.group(1), m.group(2)) if n is not None]
    return out


def _value(number: str) -> Decimal:
    return Decimal(number.replace(",", ""))


def _rounds_to(printed: Decimal, quoted: str, scale: Decimal = Decimal(1)) -> bool:
    """Whether ``printed / scale`` rounded to the decimals of ``quoted`` is ``quoted``."""
    places = len(quoted.partition(".")[2])
    return (printed / scale).quantize(Decimal(1).scaleb(-places)) == _value(quoted)


def _in_run(number: str, unit: str, run: str) -> bool:
    printed = [(_value(m.group(1)), m.group(2) == "x") for m in _PRINTED.finditer(run)]
    if unit == "ns":
        return any(v == _value(number) for v, ratio in printed if not ratio)
    if unit == "x":
        return any(_rounds_to(v, number) for v, ratio in printed if ratio)
    scale = Decimal(1000) if unit == "µs" else Decimal(1_000_000)
    return any(_rounds_to(v, number, scale) for v, ratio in printed if not ratio)


def test_every_quoted_figure_is_in_the_latest_run() -> None:
    run = _latest_run()
    quoted = _quoted()
    assert quoted, "no figure found: the pattern no longer matches the pages"
    wrong = [f"{page}: {number} {unit}" for page, number, unit in quoted if not _in_run(number, unit, run)]
    assert wrong == [], "figures not in BENCHMARKS.md's latest run: " + ", ".join(wrong)


def test_the_rule_reads_figures_as_printed() -> None:
    run = "| Stat.add attached | 105 | 1,440 | 4.17x | 15.16x | 3,414,306 |"
    found = [(m.group(1), m.group(2), m.group(3)) for m in _FIGURE.finditer(
        "costs 105 ns (4.2x), about 60\u2013110 ns, 1.4 µs, 15x, 3.4 million events a second, up to 2^62 ns, 1 ms")]
    assert found == [("105", None, "ns"), ("4.2", None, "x"), ("60", "110", "ns"), ("1.4", None, "µs"),
                     ("15", None, "x"), ("3.4", None, "million events")]
    assert [_in_run(n, u, run) for n, u in [("105", "ns"), ("4.2", "x"), ("15", "x"), ("1.4", "µs"),
                                            ("3.4", "million events"), ("110", "ns"), ("4.1", "x"), ("1.5", "µs")]] \
        == [True, True, True, True, True, False, False, False]
