"""The code in README.md and the documentation site (docs/) is code that works.

- Every Python block runs, in a fresh interpreter outside any job, unless an HTML comment right above it says
  ``<!-- docs-test: skip (why) -->`` (a fragment, or it needs torch or a running collector). The Quickstart's
  ``train.py`` (``<!-- docs-test: quickstart -->``) runs as ranks of a real job with a real collector, and its
  samples and events reconcile exactly; a real Prometheus (where installed) scrapes it with the page's
  plain-HTTP ``scrape_configs`` and answers the page's p99 query.
- Every ``shmstat ...`` command line in a shell block, and every inline ```shmstat COMMAND ...``` with arguments,
  parses with the parser the ``shmstat`` console script uses; every inline ```shmstat WORD``` names a command.
- Every JSON block is JSON (one document, or one per line).
- The generated reference (``docs/hooks.py``) has every command and option of the parser and fences the wire and
  layout drawings; the environment reference lists exactly the ``SHMSTAT_*`` variables the packages read.

The pages are read as Markdown text here (no mkdocs needed); the site's build (``mkdocs build --strict`` in .ci/run)
checks links and the generated reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from kit import prometheus as prom
from kit.browser import CHROMIUM, Browser
from kit.procs import REPO, read_jsonl
from kit.support import unique_job, wait_for

from collector.cli.command import COMMANDS, _parser
from shmstat.testing import start_collector

_ROOT = Path(REPO)
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<mark>[a-z]+)(?:\s*\((?P<why>[^)]*)\))?\s*-->\s*$")
_SHELL = {"sh", "bash", "shell", "console", "ini", ""}
_TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "SHMSTAT_JOB", "SHMSTAT_RANK", "SHMSTAT_LOCAL_RANK", "SHMSTAT_WORLD_SIZE")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page."""

    page: str
    line: int
    lang: str
    body: str
    mark: str | None
    """The ``docs-test`` mark on the line above, if any: ``run``, ``skip`` or ``quickstart``."""
    why: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        found.append(Block(str(path.relative_to(_ROOT)), text.count("\n", 0, m.start()) + 1, m.group("lang"),
                           m.group("body"), mark.group("mark") if mark else None,
                           mark.group("why") if mark else None))
    return found


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks_of(p)]


def _python_blocks(mark: str | None = None) -> list[Block]:
    return [b for b in all_blocks() if b.lang == "python" and (mark is None or b.mark == mark)]


def test_the_pages_have_code_and_every_mark_is_known() -> None:
    blocks = all_blocks()
    assert len(_python_blocks()) >= 8 and len(blocks) >= 40, "the docs lost their code blocks?"
    bad = [f"{b.where}: {b.mark}" for b in blocks if b.mark not in (None, "run", "skip", "quickstart")]
    bad += [f"{b.where}: skip without a reason" for b in blocks if b.mark == "skip" and not (b.why or "").strip()]
    assert not bad, bad
    quickstart = {b.body for b in _python_blocks("quickstart")}
    assert len(quickstart) == 1, "README.md and the Quickstart page show one train.py, the one the test runs"


def _clean_env() -> dict[str, str]:
    """The environment of a process in no job: the test's own job variables, if any, removed."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("block", [b for b in _python_blocks() if b.mark in (None, "run")],
                         ids=lambda b: b.where)
def test_every_python_block_runs(block: Block, tmp_path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.body, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"


# --- shmstat command lines --------------------------------------------------------------------------------------


def _is_shmstat(word: str) -> bool:
    """``shmstat``, ``.venv/bin/shmstat``, ``ExecStart=/usr/local/bin/shmstat`` (not ``Description=shmstat``)."""
    if "=" in word:
        word = word.split("=", 1)[1]
        if "/" not in word:
            return False
    return word.rsplit("/", 1)[-1] == "shmstat"


def _simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell snippet, as words (continuations joined, comments dropped)."""
    script = script.replace("\\\n", " ")
    script = re.sub(r"(?<=\s)\d*(?:>>?|<)&?\s*[^\s;&|]+", " ", script)  # redirections: > out, 2>&1, < in
    commands: list[list[str]] = []
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        try:
            words = list(lexer)
        except ValueError:  # an unbalanced quote: not shell
            continue
        for word in words:
            if word and set(word) <= set(";&|"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    return [c for c in commands if c]


def shmstat_invocations(script: str) -> list[list[str]]:
    """The arguments of every ``shmstat`` invocation in a shell snippet: a command whose first word (after
    variable assignments) is shmstat, or ``shmstat COMMAND`` anywhere in it (``docker run ... IMAGE shmstat
    collect ...``)."""
    found = []
    for words in _simple_commands(script):
        first = 0
        while first < len(words) - 1 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[first]) \
                and not _is_shmstat(words[first]):
            first += 1
        if _is_shmstat(words[first]):
            found.append(words[first + 1:])
            continue
        for i, word in enumerate(words[:-1]):
            if word == "shmstat" and words[i + 1] in COMMANDS:
                found.append(words[i + 1:])
                break
    return found


def _parse_error(args: list[str]) -> str | None:
    """None when ``shmstat ARGS`` parses, else what argparse said."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser().parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def test_the_shell_helper_finds_invocations() -> None:
    assert shmstat_invocations("shmstat collect --job a &  # comment\ntorchrun x.py") == [["collect", "--job", "a"]]
    assert shmstat_invocations("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/shmstat demo") \
        == [["demo"]]
    assert shmstat_invocations("docker run --name shmstat --rm \\\n  IMAGE shmstat ls") == [["ls"]]
    assert shmstat_invocations("ExecStart=/usr/local/bin/shmstat collect --curve /k") == [["collect", "--curve", "/k"]]
    assert shmstat_invocations("SHMSTAT_JOB=x shmstat top --once") == [["top", "--once"]]
    assert shmstat_invocations("pip install 'shmstat[otlp]'") == []
    assert _parse_error(["colect"]) is not None and _parse_error(["top", "--once"]) is None


def _inline_commands(path: Path) -> list[tuple[str, str]]:
    """Inline code spans that start with ``shmstat `` (outside fenced blocks): (where, text)."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    spans = []
    for m in re.finditer(r"(?<!`)`(shmstat [^`\n]+)`(?!`)", text):
        spans.append((f"{path.relative_to(_ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return spans


def test_every_shmstat_command_line_in_the_docs_parses() -> None:
    checked = 0
    failures = []
    for block in all_blocks():
        if block.lang not in _SHELL:
            continue
        for args in shmstat_invocations(block.body):
            checked += 1
            error = _parse_error(args)
            if error:
                failures.append(f"{block.where}: shmstat {shlex.join(args)}: {error}")
    for path in pages():
        for where, span in _inline_commands(path):
            words = span.split()
            if len(words) == 2 and not words[1].startswith("-"):  # a command's name: `shmstat top`
                checked += 1
                if words[1] not in COMMANDS:
                    failures.append(f"{where}: `{span}` names no shmstat command")
                continue
            try:
                args = shlex.split(span)[1:]
            except ValueError:
                failures.append(f"{where}: `{span}` is not a command line")
                continue
            checked += 1
            error = _parse_error(args)
            if error:
                failures.append(f"{where}: `{span}`: {error}")
    assert checked >= 60, f"only {checked} shmstat command lines found"
    assert not failures, "\n".join(failures)


def test_every_json_block_is_json() -> None:
    for block in all_blocks():
        if block.lang != "json":
            continue
        try:
            json.loads(block.body)
        except ValueError:
            for line in block.body.splitlines():
                if line.strip():
                    json.loads(line)  # JSON lines


# --- the Quickstart, for real -----------------------------------------------------------------------------------


def _quickstart_block(lang: str, contains: str) -> str:
    (body,) = [b.body for b in blocks_of(_ROOT / "docs" / "quickstart.md") if b.lang == lang and contains in b.body]
    return body


def test_the_quickstart_train_py_runs_as_a_job_with_a_real_collector(tmp_path) -> None:
    """The Quickstart's train.py, as written, run as 2 ranks — by torchrun when PyTorch is installed, else with
    the variables torchrun sets — with a real ``shmstat collect`` keeping windows and events: every step of every
    rank is counted once, merged and per rank, and every checkpoint event is kept. Where Prometheus is installed,
    one scraping with the Quickstart's plain-HTTP scrape_configs counts every step, and its p99 query answers."""
    code = _python_blocks("quickstart")[0].body
    assert len(code.strip().splitlines()) <= 12, "the Quickstart promises a 10-line train.py"
    steps = int(re.search(r"for step in range\((\d+)\)", code).group(1))
    every = int(re.search(r"if step % (\d+) == 0", code).group(1))
    (tmp_path / "train.py").write_text(code, encoding="utf-8")
    job, ranks = unique_job("quickstart"), 2
    metrics, events, ready = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl", tmp_path / "ready.json"
    env = _clean_env()
    server: subprocess.Popen | None = None
    base = ""
    collector = start_collector(["collect", "--job", job, "--handler", f"*=jsonl:{metrics}", "--events",
                                 f"jsonl:{events}", "--ready-file", str(ready), "--status-interval", "0",
                                 "--prometheus", "127.0.0.1:0"], cwd=str(tmp_path), env=env, timeout_s=60,
                                stdout=subprocess.DEVNULL)
    try:
        if os.path.exists(prom.PROMETHEUS):  # scraping while the job runs, as the Quickstart does
            server, base = _scrape_as_the_quickstart_says(tmp_path, collector.prometheus)
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
        if torchrun and _has_torch():
            # as the Quickstart runs it; SHMSTAT_JOB names the job (torchrun --standalone makes up a random one)
            done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(ranks), "train.py"],
                                  cwd=tmp_path, env=dict(env, SHMSTAT_JOB=job),
                                  capture_output=True, text=True, timeout=180)
            codes = [done.returncode]
            output = done.stdout + done.stderr
        else:
            procs = [subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path,
                                      env=dict(env, TORCHELASTIC_RUN_ID=job, RANK=str(r), LOCAL_RANK=str(r),
                                               WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for r in range(ranks)]
            outs = [p.communicate(timeout=180)[0] for p in procs]
            codes = [p.returncode for p in procs]
            output = "\n".join(outs)
        assert set(codes) == {0}, output
        expected = steps * ranks

        def merged_count() -> int:
            rows = read_jsonl(str(metrics))
            return sum(r["value"] for r in rows if r["name"] == "step_ms.count" and r["rank"] is None)

        # the ranks are gone: the collector emits their windows, the last one at its end plus the grace
        wait_for(lambda: merged_count() >= expected, 30, what=f"{expected} samples in the merged rows")
        if server is not None:
            _check_the_quickstart_queries(tmp_path, base, job, expected)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        collector.stop(signal.SIGTERM, 30)
    rows = read_jsonl(str(metrics))
    counts = [r for r in rows if r["name"] == "step_ms.count"]
    assert all(r["job"] == job and r["group"] == "train" for r in counts)
    assert sum(r["value"] for r in counts if r["rank"] is None) == expected
    for rank in range(ranks):
        assert sum(r["value"] for r in counts if r["rank"] == rank) == steps
    assert any(r["name"] == "step_ms.p99" for r in rows), "P99 is one of the Quickstart's aggregations"
    kept = [e for e in read_jsonl(str(events)) if e.get("name") == "checkpoint"]
    assert sorted((e["rank"], e["data"]["step"]) for e in kept) == sorted(
        (rank, step) for rank in range(ranks) for step in range(0, steps, every))
    _check_the_quickstart_report(tmp_path, env)


def _check_the_quickstart_report(tmp_path: Path, env: dict[str, str]) -> None:
    """The Quickstart ends with ``shmstat report``, run as written on what its collector wrote: a page (and in
    chromium, where installed: drawn without errors or requests, no put metric counted for a script that puts
    none, the one-line p99 chart with its legend)."""
    (collect,) = [a for a in shmstat_invocations(_quickstart_block("sh", "--handler")) if a[0] == "collect"]
    assert "*=jsonl:metrics.jsonl" in collect and "jsonl:events.jsonl" in collect
    (report,) = shmstat_invocations(_quickstart_block("sh", "shmstat report"))
    done = subprocess.run([sys.executable, "-m", "collector", *report], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    if importlib.util.find_spec("plotly") is None:
        assert done.returncode == 2 and "shmstat[report]" in done.stderr, done.stderr
        return
    page = tmp_path / report[report.index("-o") + 1]
    assert done.returncode == 0 and page.exists(), done.stderr
    if not os.path.exists(CHROMIUM):
        return
    with Browser() as browser:
        browser.open(page.as_uri(), "document.body && document.body.dataset.chartsDrawn")
        put = browser.evaluate("document.querySelector('#summary tr[data-name=put_metrics]').dataset.value")
        legends = json.loads(browser.evaluate(
            "JSON.stringify(Array.from(document.querySelectorAll('div.chart')).map(d => [d.dataset.stat, "
            "d.dataset.kind, d.data.length, d.querySelectorAll('g.legend .traces').length]))"))
        log = browser.log
    assert log.errors() == [] and [u for u in log.requests if u != page.as_uri() and not u.startswith("data:")] == []
    assert put == "0"  # train.py puts no metric: the collector's own points are not the job's
    assert ["train/step_ms", "percentiles", 1, 1] in legends, legends  # p99 alone, named in its legend


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# --- the generated reference (docs/hooks.py; the site's build runs it, these run it without mkdocs) -----------


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", _ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_has_every_command_and_option_of_the_parser() -> None:
    hooks = _hooks()
    text = hooks.cli_reference()
    parser = _parser()
    commands = hooks.subcommands(parser)
    assert tuple(commands) == COMMANDS
    for name, sub in commands.items():
        section = text.split(f"## shmstat {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in section or f", {option}" in section, f"shmstat {name} {option}"
    assert "<!-- cli-reference -->" in (_ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")


def test_the_wire_and_layout_pages_render_their_modules_docstrings() -> None:
    hooks = _hooks()
    for module, page, drawn in (("shmstat.wire", "wire.md", '{"v": 1,'), ("shmstat.shm.layout", "layout.md",
                                                                           "rank entry (200 bytes)")):
        assert f"<!-- docstring: {module} -->" in (_ROOT / "docs" / "internals" / page).read_text(encoding="utf-8")
        markdown = hooks.module_docstring(module)
        fenced = re.findall(r"^```text\n(.*?)^```$", markdown, re.S | re.M)
        assert any(drawn in block for block in fenced), f"{module}'s drawing is not in a code block"
        prose = re.sub(r"^```text\n.*?^```$", "", markdown, flags=re.S | re.M)
        assert "::\n" not in prose and not re.search(r":(mod|func|class|data):`", prose), prose


def test_the_environment_page_lists_exactly_the_variables_the_code_reads() -> None:
    """Every ``SHMSTAT_*`` variable the packages name (C header guards aside) is on the environment reference, and
    every one the docs name exists."""
    in_code = set()
    for package in ("shmstat", "collector", "elastic"):
        for path in (_ROOT / package).rglob("*"):
            if path.suffix in (".py", ".c", ".h"):
                in_code |= set(re.findall(r"\bSHMSTAT_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    in_code = {name for name in in_code if not name.endswith("_H")}
    listed = set(re.findall(r"`(SHMSTAT_[A-Z0-9_]+)`",
                            (_ROOT / "docs" / "reference" / "environment.md").read_text(encoding="utf-8")))
    assert listed == in_code
    named = {name for path in pages() for name in re.findall(r"\bSHMSTAT_[A-Z0-9_]+", path.read_text("utf-8"))}
    assert named <= in_code, named - in_code


def _scrape_as_the_quickstart_says(tmp_path: Path, metrics_url: str) -> tuple[subprocess.Popen, str]:
    """A real Prometheus with the Quickstart's scrape_configs (its target swapped for the collector's port)."""
    config = _quickstart_block("yaml", "scrape_configs:")
    assert "127.0.0.1:9464" in config and "tls_config" not in config, "the Quickstart scrapes plain HTTP"
    target = metrics_url.removeprefix("http://").removesuffix("/metrics")
    (tmp_path / "prom").mkdir()
    # the page's file as a whole, as a user copies it: Prometheus' own defaults for the rest (a scrape a minute,
    # which left the page's own rate(...[1m]) query with nothing to answer)
    server, base = prom.start_prometheus_as_written(tmp_path / "prom", config.replace("127.0.0.1:9464", target))
    wait_for(lambda: prom.scraping(base) or server.poll() is not None, 60, interval_s=0.2,
             what="Prometheus to scrape the collector")
    assert server.poll() is None, (tmp_path / "prom" / "prometheus.log").read_text()
    return server, base


def _check_the_quickstart_queries(tmp_path: Path, base: str, job: str, expected: int) -> None:
    """Prometheus counts every step of the job, and the Quickstart's p99 query answers within the windows' p99s."""
    counted = f'sum(shmstat_stat_count_total{{job="{job}", stat="step_ms", rank=""}})'
    wait_for(lambda: prom.value(base, counted) == expected, 60, interval_s=0.2,
             what=f"Prometheus to count {expected} steps")
    promql = _quickstart_block("text", "histogram_quantile").strip()
    wait_for(lambda: prom.value(base, promql) is not None, 60, interval_s=0.5,
             what="the Quickstart's p99 query to answer (two scrapes in its minute)")
    p99 = prom.value(base, promql)
    windows = [r["value"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))
               if r["name"] == "step_ms.p99" and r["rank"] is None]
    # the p99 of all windows lies between the windows' own p99s, give or take the scraped buckets' width
    # (2^(1/4): about 19%)
    assert p99 is not None and min(windows) / 1.2 <= p99 <= max(windows) * 1.2, (p99, windows)
    _check_the_guides_queries(base, job)


def _check_the_guides_queries(base: str, job: str) -> None:
    """Every query of the Prometheus guide's "Useful queries", its ``JOB`` the Quickstart's job, answers against
    the Quickstart's Prometheus, or the paragraph above it says when it returns nothing."""
    text = (_ROOT / "docs" / "guides" / "prometheus.md").read_text(encoding="utf-8")
    useful = text.split("## Useful queries\n", 1)[1].split("\n## ", 1)[0]
    fences = list(re.finditer(r"```text\n(.*?)```", useful, re.S))
    queries = [(useful[(fences[i - 1].end() if i else 0):fence.start()], fence.group(1))
               for i, fence in enumerate(fences)]
    queries += [(before + after, query) for before, query, after
                in re.findall(r"([^.]*?): `(increase\(.*?)`(.*?)\.(?:\n\n|\n?$)", useful, re.S)]
    assert len(queries) >= 5, useful
    for said, query in queries:
        said = " ".join(said.split())
        promql = query.replace("JOB", job).replace("\n", " ").strip()
        answer = prom.query(base, promql)  # parses, whatever it answers
        if "returns nothing" in said or "nothing at all until" in said:
            continue  # and the page says when it returns nothing
        assert answer, f"{promql!r} returns nothing and the guide does not say when"


# --- what a new user meets first on the site (issue 44) -----------------------------------------------------------


def test_the_site_opens_with_commands_and_keeps_internals_out_of_the_user_reference() -> None:
    """The index shows the commands to run before any prose past its first paragraph; the Reference section lists
    what a user calls (CLI, specs, variables, series, API), the internals (wire, segment layout, code map) sit under
    their own heading; the shmstat API page starts with ``Stat`` (``__all__``'s order, not grouped by kind, no
    dunders); code blocks wrap instead of scrolling sideways."""
    index = blocks_of(_ROOT / "docs" / "index.md")
    assert index[0].lang == "sh" and "shmstat demo" in index[0].body, index[0]
    text = (_ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert text.index("```sh") < text.index("## "), "a command before the first section"
    nav = (_ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    reference = nav.split("  - Reference:\n", 1)[1].split("\n  - ", 1)[0]
    internals = nav.split("  - Internals:\n", 1)[1]
    for page in ("wire.md", "layout.md", "code-map.md"):
        assert page not in reference and f"internals/{page}" in internals, page
    import shmstat

    assert shmstat.__all__[0] == "Stat"
    api = (_ROOT / "docs" / "reference" / "api-shmstat.md").read_text(encoding="utf-8")
    assert "members_order: [__all__, source]" in api and "group_by_category: false" in api
    assert 'filters: ["!^_"]' in api
    css = (_ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert "stylesheets/extra.css" in nav and "white-space: pre-wrap" in css
