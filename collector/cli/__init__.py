"""The ``shmstat`` command line: the parser and its subcommands (``main``, the console script's entry point).

- :mod:`~collector.cli.command`: ``main`` and the subcommands; :mod:`~collector.cli.options`: the collector's
  options shared by ``collect`` and ``run``;
- :mod:`~collector.cli.run`: ``shmstat run``, the per-node agent (:mod:`collector.launch`) with its collector;
- :mod:`~collector.cli.subscribe` (where it finds collectors: :mod:`~collector.cli.served_jobs`),
  :mod:`~collector.cli.top` (its data read by :mod:`~collector.cli.top_snapshot`, shown by
  :mod:`~collector.cli.top_live`),
  :mod:`~collector.cli.admin` (``ls``, ``clean``) and :mod:`~collector.cli.demo`: the other commands.
"""

from __future__ import annotations

from .command import COMMANDS, main

__all__ = ["COMMANDS", "main"]
