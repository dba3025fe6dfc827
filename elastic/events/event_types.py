"""torchelastic's event types (``torch.distributed.elastic.events.api``): :class:`Event`, :class:`RdzvEvent`.
Importable by torchelastic's path too: :mod:`elastic.events.api` is this very module.

Same fields, defaults and JSON shape as torchelastic: ``serialize()`` gives byte-for-byte the string
torchelastic's gives for the same event, and each library's ``deserialize`` reads the other's output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent"]

EventMetadataValue = str | int | float | bool | None
"""A value in :attr:`Event.metadata`: ``str``, ``int``, ``float``, ``bool`` or ``None``."""


class EventSource(str, Enum):
    """Known identifiers of the event producers."""

    AGENT = "AGENT"
    WORKER = "WORKER"


class NodeState(str, Enum):
    """The states a node can be in during rendezvous."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


def _load(data: str | bytes | Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A fresh dict from a JSON document (str or bytes) or a mapping; :class:`TypeError` for anything else."""
    if isinstance(data, (str, bytes, bytearray)):
        loaded = json.loads(data)
        if not isinstance(loaded, dict):
            raise TypeError(f"a serialized {kind} is a JSON object, not {type(loaded).__name__}")
        return loaded
    if isinstance(data, Mapping):
        return dict(data)
    raise TypeError(f"cannot deserialize a {kind} from a {type(data).__name__}")


@dataclass
class Event:
    """Something meaningful that happened during a torchelastic job (worker started, agent restarted, ...).

    Args:
        name: event name.
        source: the event producer, e.g. agent or worker.
        timestamp: when the event occurred, in Unix milliseconds (0: not set; the collector then uses the
            time it was recorded).
        metadata: additional data, values of type :data:`EventMetadataValue`.
    """

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def __str__(self) -> str:
        """The JSON form, as :meth:`serialize`."""
        return self.serialize()

    @staticmethod
    def deserialize(data: str | bytes | Mapping[str, Any] | Event) -> Event:
        """An Event from :meth:`serialize`'s JSON (or from a dict of the same shape); an Event is returned as is.

        ``source`` is looked up by name (``"AGENT"`` -> ``EventSource.AGENT``); an unknown one raises
        :class:`KeyError`, as in torchelastic.
        """
        if isinstance(data, Event):
            return data
        fields = _load(data, "Event")
        fields["source"] = EventSource[fields["source"]]
        return Event(**fields)

    def serialize(self) -> str:
        """The event as a JSON object ``{"name", "source", "timestamp", "metadata"}`` (torchelastic's format)."""
        return json.dumps(asdict(self))


@dataclass
class RdzvEvent:
    """A rendezvous event.

    Args:
        name: event name (e.g. the action being performed).
        run_id: the run id of the rendezvous.
        message: what happened.
        hostname: hostname of the node.
        pid: process id of the node.
        node_state: the state of the node (INIT, RUNNING, SUCCEEDED, FAILED).
        master_endpoint: the master endpoint of the rendezvous store, if known.
        rank: the rank of the node, if known.
        local_id: the local id of the node, if defined by the dynamic rendezvous.
        error_trace: the stack trace, for an error event.
    """

    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: int | None = None
    local_id: int | None = None
    error_trace: str = ""

    def __str__(self) -> str:
        """The JSON form, as :meth:`serialize`."""
        return self.serialize()

    @staticmethod
    def deserialize(data: str | bytes | Mapping[str, Any] | RdzvEvent) -> RdzvEvent:
        """An RdzvEvent from :meth:`serialize`'s JSON (or a dict of that shape); an RdzvEvent is returned as is.

        ``node_state`` is looked up by name; an unknown one raises :class:`KeyError`, as in torchelastic.
        """
        if isinstance(data, RdzvEvent):
            return data
        fields = _load(data, "RdzvEvent")
        fields["node_state"] = NodeState[fields["node_state"]]
        return RdzvEvent(**fields)

    def serialize(self) -> str:
        """The event as a JSON object with one key per field, in field order (torchelastic's format)."""
        return json.dumps(asdict(self))
