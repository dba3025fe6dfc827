"""Identity from the environment, automatic attach, and each package's public names."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from kit.support import unique_job

import collector
import elastic
import elastic.metrics
import shmstat
from shmstat.errors import ConfigError
from shmstat.job.identity import identity_from_env
from shmstat.shm.segment import Segment


def test_our_variables_win_over_torchrun_ones():
    env = {"SHMSTAT_JOB": "a", "SHMSTAT_RANK": "3", "TORCHELASTIC_RUN_ID": "b", "RANK": "9", "LOCAL_RANK": "1",
           "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    ident = identity_from_env(env)
    assert ident is not None
    assert (ident.job, ident.rank, ident.local_rank, ident.world_size, ident.local_world_size) == ("a", 3, 1, 16, 8)


def test_torchrun_variables_alone_are_enough():
    ident = identity_from_env({"TORCHELASTIC_RUN_ID": "run7", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert ident is not None and (ident.job, ident.rank, ident.local_rank, ident.world_size) == ("run7", 5, 1, 8)
    assert identity_from_env({"RANK": "0"}) is None


def test_torchruns_default_run_id_becomes_a_job_per_master_address_and_port():
    """``TORCHELASTIC_RUN_ID=none`` (torchrun without --rdzv-id): one job per MASTER_ADDR:MASTER_PORT, the same for
    every rank, local rank and restart of the job; two jobs at once (two ports) differ; our variable still wins."""

    def job(**env: str) -> str:
        ident = identity_from_env({"TORCHELASTIC_RUN_ID": "none", **env})
        assert ident is not None
        return ident.job

    base = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    one = job(**base, RANK="0", LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="0")
    assert one.startswith("none-") and len(one) == len("none-") + 12
    assert job(**base, RANK="7", LOCAL_RANK="3", GROUP_RANK="1", TORCHELASTIC_RESTART_COUNT="2") == one
    assert job(MASTER_ADDR="10.0.0.1", MASTER_PORT="29501") != one
    assert job(MASTER_ADDR="10.0.0.2", MASTER_PORT="29500") != one
    assert job() == "none"  # no address to tell jobs apart: torchrun's id as it is
    ident = identity_from_env({"SHMSTAT_JOB": "mine", "TORCHELASTIC_RUN_ID": "none", **base})
    assert ident is not None and ident.job == "mine"
    ident = identity_from_env({"TORCHELASTIC_RUN_ID": "run7", **base})
    assert ident is not None and ident.job == "run7"  # a run id of its own is kept


@pytest.mark.parametrize("env", [{"SHMSTAT_JOB": "bad job"}, {"SHMSTAT_JOB": "j", "RANK": "x"},
                                 {"SHMSTAT_JOB": "j", "RANK": "-1"}])
def test_bad_environment_is_a_clear_error(env):
    with pytest.raises(ConfigError):
        identity_from_env(env)


def _child(job: str, q) -> None:
    import shmstat as s
    from shmstat import Aggregation as A

    st = s.Stat("auto", [A.COUNT], 1.0)
    st.add(1.0)
    q.put((s.stats().attached, s.stats().job, s.stats().rank))
    s.shutdown()


def _launched(env: dict[str, str], job: str, q) -> None:
    # what a launcher does for a function entrypoint (torchelastic's, mp.spawn's): the rank's variables are set in
    # the rank, not in the launcher (a process started by one that has its rank's variables is that rank's worker)
    os.environ.update(env)
    _child(job, q)


def test_a_rank_attaches_from_the_environment_without_code_changes():
    job = unique_job("env")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env = {"TORCHELASTIC_RUN_ID": job, "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
           "SHMSTAT_KEEP_SEGMENT": "1"}  # kept at the rank's exit, to be read here
    p = ctx.Process(target=_launched, args=(env, job, q))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.get(timeout=5) == (True, job, 2)
    seg = Segment.open(job, create=False)
    assert [(r.rank, r.local_rank, r.world_size) for r in seg.ranks()] == [(2, 0, 4)]
    assert [d.name for d in seg.descriptors(0)] == ["auto"]
    seg.close()
    Segment.unlink(job)


@pytest.mark.parametrize("module", [shmstat, elastic, elastic.metrics, collector])
def test_all_is_exactly_the_public_names(module):
    names = vars(module)
    public = {n for n, v in names.items() if not n.startswith("_") and not isinstance(v, type(os))}
    public -= {"annotations"}
    exported_modules = {n for n in module.__all__ if isinstance(names.get(n), type(os))}
    assert set(module.__all__) - exported_modules == public
    assert all(hasattr(module, n) for n in module.__all__)
