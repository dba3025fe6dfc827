"""No room: a /dev/shm too small for the segment gives one sentence and a non-zero exit and leaves nothing
behind; a full rank or stat table is a clear error that corrupts nothing. The small /dev/shm is a private tmpfs
in a user+mount namespace, so the real one is never filled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from kit.procs import REPO

from shmstat.errors import CapacityError
from shmstat.job.rank import RankAttachment
from shmstat.shm import layout as L
from shmstat.shm.segment import Segment


def _in_small_shm(script: str, size: str = "256k") -> subprocess.CompletedProcess:
    """Run ``script`` (sh) with a private /dev/shm of ``size``; the listing of /dev/shm afterwards is printed
    after a ``--ls--`` line."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PY=sys.executable)
    body = f"mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99\n{script}\necho --ls--\nls -A /dev/shm\n"
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", body],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def _namespaces_work() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    out = _in_small_shm("true")
    if out.returncode != 0:
        return f"cannot mount a private tmpfs on /dev/shm here: {out.stderr.strip()[:200]}"
    return None


_SKIP = _namespaces_work()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def test_collect_on_a_too_small_dev_shm_fails_in_one_sentence_and_leaves_nothing():
    out = _in_small_shm('"$PY" -m collector collect --job noroom --max-ranks 64 --max-stats 1024 '
                        '--status-interval 0; echo "rc=$?"')
    stdout, listing = out.stdout.split("--ls--\n")
    rc = int(stdout.strip().splitlines()[-1].removeprefix("rc="))
    assert rc != 0
    err = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "No space left on device" in err[0] and "Traceback" not in out.stderr, out.stderr
    assert "--max-ranks" in err[0]  # it says what to change
    assert listing.strip() == ""  # no segment, no lock file


def test_segment_open_on_a_too_small_dev_shm_raises_segment_error_and_leaves_nothing():
    script = textwrap.dedent("""
        "$PY" - <<'EOF'
        from shmstat.shm import layout as L
        from shmstat.errors import SegmentError
        from shmstat.shm.segment import Segment
        try:
            Segment.open("noroom", geometry=L.Geometry(max_ranks=64, max_stats=1024))
        except SegmentError as exc:
            print("refused:", exc)
        small = Segment.open("fits", geometry=L.Geometry(max_ranks=1, max_stats=1))
        print("fits:", small.geometry.total_size)
        EOF
    """)
    out = _in_small_shm(script)
    stdout, listing = out.stdout.split("--ls--\n")
    assert "refused: cannot allocate" in stdout, out.stderr
    assert "fits:" in stdout
    # only the job that fitted is there: nothing of the refused one
    assert sorted(listing.split()) == ["shmstat.fits", "shmstat.fits.lock"]


def test_full_rank_and_stat_tables_are_clear_errors_that_corrupt_nothing(job):
    seg = Segment.open(job, geometry=L.Geometry(max_ranks=2, max_stats=2))
    try:
        att = RankAttachment.register(seg, rank=0, local_rank=0)
        with pytest.raises(CapacityError, match="--max-ranks"):
            RankAttachment.register(seg, rank=5, local_rank=2)
        att.allocate_stat("a", "g", 100, 0, 1)
        att.allocate_stat("b", "g", 100, 0, 1)
        before = bytes(seg.buf)
        with pytest.raises(CapacityError, match="--max-stats"):
            att.allocate_stat("c", "g", 100, 0, 1)
        assert bytes(seg.buf) == before  # nothing written by the refused allocation
        again = Segment.open(job, create=False)  # still a valid segment
        assert [d.name for d in again.descriptors(0)] == ["a", "b"]
        again.close()
    finally:
        seg.close()


_FULL_JOB = """
import multiprocessing as mp
import shmstat
from shmstat import Aggregation as A

def work(n):
    stat = shmstat.Stat("w", [A.COUNT], 60.0)
    for _ in range(n):
        stat.add(1.0)

if __name__ == "__main__":
    work(10)
    for method in ("spawn", "spawn", "forkserver", "fork"):
        p = mp.get_context(method).Process(target=work, args=(10,))
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
    print("ran on")
"""


def test_a_rank_and_its_workers_on_a_full_dev_shm_warn_once_for_the_job_and_run_on(tmp_path):
    rank = tmp_path / "full_job.py"
    rank.write_text(_FULL_JOB)
    out = _in_small_shm(f'SHMSTAT_JOB=full SHMSTAT_RANK=0 "$PY" {rank}')
    stdout, listing = out.stdout.split("--ls--\n")
    assert "ran on" in stdout, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("cannot attach to job 'full'") == 1, out.stderr  # the rank's, not one per worker
    assert listing.strip() == ""  # nothing left behind
