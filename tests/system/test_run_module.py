"""``shmstat run -m MODULE ARGS`` as torchrun's ``-m``: each rank runs ``python -u -m MODULE ARGS`` (a module found
on ``PYTHONPATH``, as an installed package would be), gets its arguments untouched, and its samples reconcile
exactly; ``--nproc-per-node`` is 1 unless given; a module that is not there fails with the rank's exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from kit.procs import REPO, read_jsonl
from kit.support import unique_job
from test_launcher import _left_behind

from shmstat.shm.segment import Segment

_TRAIN = '''"""A rank's module: adds SAMPLES values of rank + 1, says how it was run."""
import json
import os
import sys

import shmstat
from shmstat import Aggregation

rank = int(os.environ["RANK"])
k = int(sys.argv[sys.argv.index("--samples") + 1])
seen = shmstat.Stat("seen", [Aggregation.COUNT, Aggregation.SUM], 0.05, group="mod")
for _ in range(k):
    seen.add(float(rank + 1))
with open(os.path.join(os.environ["OUT_DIR"], f"rank-{rank}.json"), "w") as f:
    json.dump({"argv": sys.argv, "name": __name__, "spec": __spec__.name, "world": os.environ["WORLD_SIZE"]}, f)
shmstat.shutdown()
'''


def _package(tmp_path) -> str:
    """A package of its own name under ``tmp_path / "site"`` with a ``train`` module; returns the package name."""
    pkg = f"shmstat_run_m_{uuid.uuid4().hex[:8]}"
    root = tmp_path / "site" / pkg
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "train.py").write_text(_TRAIN)
    return pkg


def _run(job: str, tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, list[dict], list[str]]:
    out = str(tmp_path / "m.jsonl")
    env = dict(os.environ, OUT_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([REPO, str(tmp_path / "site")]))
    r = subprocess.run([sys.executable, "-m", "collector", "run", "--job", job, "--monitor-interval", "0.05",
                        "--handler", f"*=jsonl:{out}", "--grace-ms", "10", "--status-interval", "0", *argv],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    left = _left_behind(job)
    Segment.unlink(job)
    return r, read_jsonl(out), left


def _counts(rows: list[dict], what: str) -> dict[int | None, float]:
    got: dict[int | None, float] = {}
    for row in rows:
        if row["group"] == "mod" and row["name"] == f"seen.{what}":
            got[row["rank"]] = got.get(row["rank"], 0) + row["value"]
    return got


def test_a_module_run_with_m_gets_its_args_and_its_samples_reconcile_exactly(tmp_path):
    pkg, job, k = _package(tmp_path), unique_job("runm"), 700
    # arguments that look like shmstat's own options are the module's: everything after MODULE is
    args = ["--samples", str(k), "--lr", "0.1", "--handler", "x", "-m", "y"]
    r, rows, left = _run(job, tmp_path, "--nproc-per-node", "3", "-m", f"{pkg}.train", *args)
    assert r.returncode == 0, r.stderr
    assert left == []
    for rank in range(3):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen["argv"][1:] == args
        assert seen["argv"][0] == str(tmp_path / "site" / pkg / "train.py")
        assert (seen["name"], seen["spec"], seen["world"]) == ("__main__", f"{pkg}.train", "3")
    assert _counts(rows, "count") == {None: 3 * k, 0: k, 1: k, 2: k}
    assert _counts(rows, "sum") == {None: 6 * k, 0: k, 1: 2 * k, 2: 3 * k}


def test_nproc_per_node_defaults_to_one_as_torchrun(tmp_path):
    pkg, job, k = _package(tmp_path), unique_job("runm1"), 300
    r, rows, left = _run(job, tmp_path, "--module", f"{pkg}.train", "--samples", str(k))
    assert r.returncode == 0, r.stderr
    assert "1 workers" in r.stderr and left == []
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("rank-")) == ["rank-0.json"]
    assert json.loads((tmp_path / "rank-0.json").read_text())["world"] == "1"
    assert _counts(rows, "count") == {None: k, 0: k}


def test_a_missing_module_fails_with_the_ranks_exit_status(tmp_path):
    job = unique_job("runmx")
    missing = f"no_such_module_{uuid.uuid4().hex[:8]}"
    r, rows, left = _run(job, tmp_path, "--nproc-per-node", "2", "-m", missing)
    # python -m exits 1 naming the module; shmstat run exits with that status and says it failed
    assert r.returncode == 1, r.stderr
    assert f"No module named {missing}" in r.stderr
    assert "shmstat run: failed after 0 restart(s), exit code 1" in r.stderr and "Traceback" not in r.stderr
    assert left == []
    assert [row["value"] for row in rows if row["name"] == "workers.default.run_failed_no_retries"] == [1]


def test_m_with_a_file_or_a_bad_name_is_one_sentence(tmp_path):
    script = os.path.join("tests", "kit", "programs", "elastic_job.py")
    for name, says in ((script, "-m takes a module name, not a file"),
                       ("pkg.not a name", "is not a module name")):
        r = subprocess.run([sys.executable, "-m", "collector", "run", "-m", name], cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
