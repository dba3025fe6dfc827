"""README's "Many nodes" recipe holds together where its system test (tests/system/test_multinode.py, which runs it
on a simulated cluster) cannot run: every step is where that test looks for it (tests/kit/recipe.py), the
``shmstat`` commands parse with shmstat's own parser, and the container runs exactly the unit's collector."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from kit import recipe as recipe

from collector.cli.command import _parser

_AS_WRITTEN = recipe.Places([recipe.operator_address(0), recipe.operator_address(1)], admin=Path("."),
                            shared=Path("/shared/shmstat"), prometheus=Path("/etc/prometheus/shmstat"),
                            subscriber=Path("~/shmstat-keys"))


def _parses(args: list[str]) -> None:
    try:
        _parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"the recipe's shmstat {shlex.join(args)} does not parse")


def test_every_step_of_the_recipe_is_there_and_its_shmstat_commands_parse() -> None:
    unit = recipe.collector_args(_AS_WRITTEN, 0, "node1", Path("/etc/shmstat"), Path("/var/lib/shmstat"))
    _parses(unit)
    assert {"--publish", "--curve", "--prometheus", "--prometheus-tls"} <= set(unit)
    assert "--allow-remote-publish" not in unit  # CURVE secures the endpoint
    _parses(recipe.subscribe_args(_AS_WRITTEN))
    for node in (0, 1):
        args = recipe.torchrun_args(_AS_WRITTEN, node)
        assert args[args.index("--node-rank") + 1] == str(node)
        assert args[args.index("--master-addr") + 1] == recipe.operator_address(0)  # the same text on every node
    assert "scheme: https" in recipe.scrape_configs(_AS_WRITTEN)
    step_one = recipe.block("sh", "openssl req")
    assert "shmstat keys" in step_one and "--client ops" in step_one


def test_the_container_runs_the_units_collector_with_what_it_needs_of_the_host() -> None:
    docker = shlex.split(recipe.block("sh", "docker run").replace("\\\n", " "))
    at = next(i for i in range(len(docker)) if docker[i:i + 2] == ["shmstat", "collect"])
    run, collect = docker[:at], docker[at + 1:]
    unit = recipe.collector_args(_AS_WRITTEN, 0, "$(hostname)", Path("/etc/shmstat"), Path("/var/lib/shmstat"))
    node = collect.index("--prometheus-node")
    assert collect[:node] + collect[node + 2:] == unit
    _parses(collect)
    assert {"--ipc=host", "--pid=host", "--network=host"} <= set(run)
    runtime = next(a.split("=", 1)[1] for a in run if a.startswith("XDG_RUNTIME_DIR="))
    assert f"{runtime}:{runtime}" in run, "the runtime directory is the host's"
