"""The command line is built from the collector's configuration: every collector option's default is
CollectorConfig's (or Geometry's), every subcommand names the function it runs, and a collector started with
``--ready-file`` says where it serves in that file (what the pytest plugin reads instead of its banner)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import zmq
from kit.procs import REPO, start_collector

from collector.cli import command as cli
from collector.cli.options import TUNED, add_collector_options, collector_config, config_default
from collector.daemon.config import CollectorConfig
from shmstat.shm.layout import Geometry


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_subcommand_names_the_function_it_runs():
    subs = _subcommands()
    assert set(subs) == set(cli.COMMANDS)
    for name, parser in subs.items():
        run = parser.get_default("run")
        assert callable(run) and run.__name__ == f"_{name.replace('-', '_')}", name


@pytest.mark.parametrize("argv", [["collect", "--job", "j"], ["run", "--nproc-per-node", "1", "x.py"]])
def test_collector_options_left_out_give_exactly_the_config_defaults(argv):
    args = cli._parser().parse_args(argv)
    got, want = collector_config(args, "j"), CollectorConfig("j")
    for f in dataclasses.fields(CollectorConfig):
        if f.name != "clock":
            assert getattr(got, f.name) == getattr(want, f.name), f.name


def test_walking_the_parser_every_default_and_its_help_come_from_the_config():
    p = argparse.ArgumentParser()
    add_collector_options(p)
    config_fields = {f.name for f in dataclasses.fields(CollectorConfig)}
    tuned = {t.flag: t for t in TUNED}
    capacities = {"--max-ranks": "max_ranks", "--max-stats": "max_stats", "--banks": "banks",
                  "--max-percentile-stats": "hist_slots"}
    seen = set()
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        seen.add(flag)
        if flag in tuned:
            t = tuned[flag]
            assert t.field in config_fields
            assert t.to_config(action.default) == config_default(t.field), flag
            shown = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
            assert action.help.endswith(f"(default {shown})"), (flag, action.help)
        elif flag in capacities:
            assert action.default is None  # None: take an existing segment's capacities
            assert action.help.endswith(f"(default {getattr(Geometry(), capacities[flag])})"), flag
        elif flag == "--handler":
            assert action.default == [] and config_default("handlers") == {}
        elif flag == "--events":
            assert action.default == [] and config_default("events") == []
        elif flag == "--allow-remote-publish":
            assert action.default is False
        elif flag == "--gpu":
            assert action.default == config_default("gpu") == "auto"
        elif flag == "--gpu-extra":
            assert action.default == [] and config_default("gpu_extra") == ()
        else:  # an option named after its field, default None there too
            field = flag.lstrip("-").replace("-", "_")
            assert field in config_fields and action.default == config_default(field) is None, flag
    assert set(tuned) <= seen and set(capacities) <= seen


def test_a_changed_config_default_changes_the_cli_default(monkeypatch):
    fields = {f.name: f for f in dataclasses.fields(CollectorConfig)}
    monkeypatch.setattr(fields["grace_ms"], "default", 33)
    monkeypatch.setattr(fields["publish_queue"], "default", 12)
    args = cli._parser().parse_args(["collect", "--job", "j"])
    assert (args.grace_ms, args.publish_queue) == (33, 12)
    cfg = collector_config(args, "j")
    assert (cfg.grace_ms, cfg.publish_queue) == (33, 12)


def test_the_ready_file_names_the_endpoints_and_goes_when_the_collector_ends(job, tmp_path):
    ready = tmp_path / "ready.json"
    coll = start_collector(job, "--handler", "*=null", "--status-interval", "0", "--ready-file", str(ready))
    try:
        info = json.loads(ready.read_text())
        assert os.stat(ready).st_mode & 0o777 == 0o600
        assert info["job"] == job and info["pid"] == coll.proc.pid and info["prometheus"] is None
        assert info["publish"].startswith("ipc://") and info["ingest"].startswith("ipc://")
        ctx = zmq.Context.instance()  # the endpoint is the collector's: a subscriber is taken in (XPUB says hello)
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(info["publish"])
            assert os.path.exists(info["publish"].removeprefix("ipc://"))
        finally:
            sub.close()
    finally:
        assert coll.stop(signal.SIGTERM, 20) == 0
    assert not ready.exists()


def test_a_node_collector_writes_its_endpoints_to_its_ready_file_and_binds_one_owner_only_endpoint(tmp_path):
    """``collect --publish ENDPOINT`` with several ``--job`` (a node collector of those jobs only): the ready file
    names the node's endpoint, which is owner-only, and both go on a clean exit."""
    from kit.support import unique_job

    jobs = [unique_job("nr"), unique_job("nr")]
    ready, sock = tmp_path / "ready.json", tmp_path / "node.pub"
    coll = start_collector(None, "--job", jobs[0], "--job", jobs[1], "--handler", "*=null", "--status-interval", "0",
                           "--publish", f"ipc://{sock}", "--ready-file", str(ready))
    try:
        assert os.stat(ready).st_mode & 0o777 == 0o600
        assert json.loads(ready.read_text()) == {"pid": coll.proc.pid, "publish": f"ipc://{sock}",
                                                 "prometheus": None, "jobs": jobs}
        assert os.stat(sock).st_mode & 0o077 == 0  # owner-only, as a job's socket
    finally:
        assert coll.stop(signal.SIGTERM, 20) == 0
    assert not ready.exists() and not sock.exists()


def test_a_node_endpoint_that_cannot_be_bound_is_one_sentence(tmp_path):
    from kit.support import unique_job

    done = subprocess.run([sys.executable, "-m", "collector", "collect", "--job", unique_job("nb"), "--job",
                           unique_job("nb"), "--publish", f"ipc://{tmp_path}/no/such/dir/sock", "--ready-file",
                           str(tmp_path / "r.json")], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"shmstat: error: cannot bind the publish endpoint ipc://{tmp_path}/no/such"), line
    assert not (tmp_path / "r.json").exists()


def test_the_plugin_learns_the_endpoint_from_its_ready_file_not_the_banner():
    from shmstat.testing import ShmstatJob

    with ShmstatJob() as j:
        assert j._collector.stdout is None  # the banner goes nowhere: nothing reads it
        assert j.publish_endpoint.startswith(f"ipc://{j.runtime_dir}")


_READ_READY = """
import json, os, sys, time
path, out = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 30
while not os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.01)
if os.environ.get("RANK") == "0":
    with open(out, "w") as f:
        f.write(open(path).read())
"""


def test_shmstat_run_writes_the_ready_file_while_the_job_runs_and_removes_it(job, tmp_path):
    script, ready, seen = tmp_path / "reader.py", tmp_path / "ready.json", tmp_path / "seen.json"
    script.write_text(_READ_READY)
    done = subprocess.run([sys.executable, "-m", "collector", "run", "--job", job, "--nproc-per-node", "2",
                           "--handler", "*=null", "--status-interval", "0", "--ready-file", str(ready),
                           str(script), str(ready), str(seen)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(seen.read_text())  # what a worker read while the job ran
    assert info["job"] == job and info["pid"] > 0
    assert f"collector publish {info['publish']}" in done.stderr
    assert not ready.exists()
