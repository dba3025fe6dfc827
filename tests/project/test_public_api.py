"""Each package's ``__all__`` is exactly its public names, and every public name of the modules we stand in for
(``torch.monitor``, torchelastic's metrics and events, and the semi-public names their tests use) exists in ours
with the same parameters."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

import collector
import elastic
import shmstat


@pytest.mark.parametrize("package", [shmstat, elastic, collector], ids=lambda p: p.__name__)
def test_all_is_exactly_the_public_names(package):
    public = {n for n, v in vars(package).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"}
    if package is elastic:
        public |= {"events", "metrics"}
    assert sorted(package.__all__) == sorted(public)
    assert len(package.__all__) == len(set(package.__all__))


# theirs -> ours; names that differ on purpose are listed in README "Where we still differ"
_PAIRS = [
    ("torch.monitor", "shmstat", {"TYPE_CHECKING", "_WaitCounter", "_WaitCounterTracker"}),
    ("torch.distributed.elastic.metrics", "elastic.metrics", {"Optional"}),
    ("torch.distributed.elastic.metrics.api", "elastic.metrics.api", {"abc", "deprecated", "namedtuple", "wraps"}),
    ("torch.distributed.elastic.events", "elastic.events", {"Optional", "inspect"}),
    ("torch.distributed.elastic.events.api", "elastic.events.api", {"Union"}),
    ("torch.distributed.elastic.events.handlers", "elastic.events.handlers", set()),
]


@pytest.mark.parametrize(("theirs", "ours", "not_ours"), _PAIRS, ids=[p[1] for p in _PAIRS])
def test_every_name_of_the_reference_module_exists_in_ours_with_the_same_parameters(theirs, ours, not_ours):
    pytest.importorskip("torch", reason="the reference modules come with PyTorch")
    ref, mine = importlib.import_module(theirs), importlib.import_module(ours)
    names = {n for n in dir(ref) if not n.startswith("__")} - not_ours
    missing = sorted(n for n in names if not hasattr(mine, n))
    assert missing == []
    for n in sorted(names):
        a, b = getattr(ref, n), getattr(mine, n)
        if not callable(a) or isinstance(a, types.ModuleType) or not callable(b):
            continue
        try:
            sa, sb = inspect.signature(a), inspect.signature(b)
        except (TypeError, ValueError):  # a C builtin without a signature
            continue
        assert list(sa.parameters) == list(sb.parameters), n
        assert [p.default for p in sa.parameters.values()] == [p.default for p in sb.parameters.values()], n


def test_torchelastics_module_paths_are_the_modules_themselves() -> None:
    """``elastic.metrics.api`` and ``elastic.events.api`` (torchelastic's paths) are the renamed modules, not copies:
    a name replaced there is the one the code looks up, and each package has its ``api`` attribute."""
    import elastic.events.api
    import elastic.events.event_types
    import elastic.metrics.api
    import elastic.metrics.emitting

    assert elastic.metrics.api is elastic.metrics.emitting is elastic.metrics.__dict__["api"]
    assert elastic.events.api is elastic.events.event_types is elastic.events.__dict__["api"]
