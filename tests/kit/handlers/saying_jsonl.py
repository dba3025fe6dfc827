"""The jsonl handler that also prints the straggler lines of its groups as the default console handler does (a
group's straggler lines go to that group's handler): a test keeps a group's rows and sees its console lines
(loaded by the collector as ``kit.handlers.saying_jsonl:SayingJsonl,path=...``)."""

from __future__ import annotations

import sys

from collector.handlers.console import straggler_line
from collector.handlers.jsonl import JsonlMetricHandler
from collector.handlers.protocol import StragglerLines


class SayingJsonl(StragglerLines, JsonlMetricHandler):
    """:class:`JsonlMetricHandler` printing each straggler line on stdout (:func:`straggler_line`)."""

    def say_straggler(self, name: str, job: str, data) -> None:
        sys.stdout.write(straggler_line(name, data) + "\n")
        sys.stdout.flush()
