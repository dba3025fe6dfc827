"""torchelastic's metrics API (``torch.distributed.elastic.metrics.api``), routed to the collector when attached:
configure a group's handler, and emit metrics to it (``put_metric``, ``@prof``, ``getStream``). Importable by
torchelastic's path too: :mod:`elastic.metrics.api` is this very module.

Same names, signatures and behaviour as torchelastic: a metric is a ``(group, name)`` time series; each
group maps to a :class:`MetricHandler` set with :func:`configure`; :func:`put_metric` looks the handler up
on every call; :func:`getStream` binds it when called; ``@prof`` records success/failure and duration.

What we add: the built-in default handler (in force for every group that was not configured in this
process, and as long as ``configure(handler)`` was not called for the default) behaves like torchelastic's
:class:`NullMetricHandler` when the process is not attached to a job, and publishes each metric to the
node's collector (topic ``metric/<group>/<name>``) when it is. The process attaches from the environment
on the first metric (see :func:`shmstat.job.attach.ensure_init`), never at import. A handler configured in
this process always wins over routing. The collector then dispatches the metric to the handler its own
configuration gives the group.

Differences from torchelastic, all deliberate:

- ``put_metric`` and ``@prof`` are several times cheaper (the null case builds no record at all);
- ``@prof`` measures duration on the monotonic clock, so a wall-clock step cannot make it negative;
  a handler that raises while recording ``.success`` is not reported as a ``.failure`` of the function;
- ``profile`` warns once, when it decorates, instead of three times on every call of the function;
- :func:`configure` refuses an object without a callable ``emit`` (torchelastic fails later, at emit time);
- :func:`initialize_metrics` attaches to the job from the environment right away (torchelastic: no-op);
- routed values must be numbers: numeric types the wire lacks are converted, anything else (text, None) is
  dropped, counted and logged once (see :mod:`elastic.metrics._routing`).
"""

from __future__ import annotations

import functools
import sys
import time
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, overload

from shmstat._backend import backend
from shmstat.job._state import STATE
from shmstat.names import KNOWN, check_metric
from shmstat.publish.events import log_event as _log_event

from ._data import MetricData, StatMetricData
from ._handlers import ConsoleMetricHandler, MetricHandler, NullMetricHandler
from ._registry import REGISTRY
from ._registry import publisher as _publisher
from ._routing import publish as _publish

__all__ = [
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "MetricStream",
    "MetricsConfig",
    "NullMetricHandler",
    "StatMetricData",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]

F = TypeVar("F", bound=Callable[..., Any])

_handlers = REGISTRY.handlers  # mutated in place only, so this alias stays valid across resets
_metrics_map = _handlers
"""torchelastic's name for the ``group -> handler`` map (semi-public there: code and tests read it)."""


def __getattr__(name: str) -> Any:
    """``_default_metrics_handler`` as torchelastic has it: the handler ``configure(handler)`` set, or the
    built-in default (which, unlike torchelastic's null handler, publishes to the collector when attached)."""
    if name == "_default_metrics_handler":
        return REGISTRY.default if REGISTRY.default is not None else _BUILTIN_DEFAULT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_time = time.time
_clock = time.perf_counter
_KNOWN_NAMES, _KNOWN_GROUPS = KNOWN  # names and groups found valid (put_metric's inline lookups)


class MetricsConfig:
    """Configuration for :func:`initialize_metrics`: a dict of string parameters (``{}`` when None)."""

    __slots__ = ["params"]

    def __init__(self, params: dict[str, str] | None = None) -> None:
        """Keep ``params`` (a new empty dict when None)."""
        self.params: dict[str, str] = {} if params is None else params


class _DefaultHandler(NullMetricHandler):
    """The built-in default: a null handler that publishes to the collector when the process is attached."""

    def emit(self, metric_data: MetricData) -> None:
        """Publish ``metric_data`` to the node's collector when attached; otherwise drop it."""
        CollectorMetricHandler.emit(self, metric_data)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return "<elastic.metrics built-in default handler (null, or the collector when attached)>"


_BUILTIN_DEFAULT = _DefaultHandler()


class CollectorMetricHandler(MetricHandler):
    """Publishes every data point to the node's collector (``metric/<group>/<name>``); drops it when unattached.

    Configure it in any torchelastic-compatible registry — ours, or PyTorch's own
    ``torch.distributed.elastic.metrics.configure(CollectorMetricHandler(), group)`` — to have that code's
    metrics dispatched by the collector's per-group handlers. Attaches from the environment on first use.
    """

    def emit(self, metric_data: MetricData) -> None:
        """Publish ``metric_data`` (never blocks; values the wire cannot carry are converted or counted); raises
        :class:`~shmstat.errors.ConfigError` if its name or group breaks the name rule (:mod:`shmstat.names`)."""
        check_metric(metric_data.name, metric_data.group_name)
        pub = _publisher()
        if pub is not None:
            ts, group, name, value = metric_data
            _publish(pub, group, name, value, ts)


class MetricStream:
    """A ``(group, handler)`` pair: :meth:`add_value` emits data points of ``group_name`` to ``handler``."""

    def __init__(self, group_name: str, handler: MetricHandler) -> None:
        """Bind ``group_name`` to ``handler`` (the binding does not follow later :func:`configure` calls)."""
        self.group_name = group_name
        self.handler = handler

    def add_value(self, metric_name: str, metric_value: int) -> None:
        """Emit ``MetricData(time.time(), group_name, metric_name, metric_value)`` to the bound handler."""
        self.handler.emit(MetricData(_time(), self.group_name, metric_name, metric_value))


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Send metrics of ``group`` to ``handler``; with ``group=None``, make ``handler`` the default handler.

    The default serves every group that has no handler of its own. Configuring a handler in this process
    (for the group, or as the default) takes the group away from collector routing. Passing back the
    built-in default (as found in ``getStream(g).handler`` before any configuration) restores routing.
    Raises :class:`TypeError` if ``handler`` has no callable ``emit``.
    """
    if not callable(getattr(handler, "emit", None)):
        raise TypeError(f"a metric handler needs an emit(metric_data) method; got {type(handler).__name__}")
    builtin = handler is _BUILTIN_DEFAULT
    if group is None:
        REGISTRY.default = None if builtin else handler
        REGISTRY.on_change()
    elif builtin:
        _handlers.pop(group, None)
    else:
        _handlers[group] = handler


def getStream(group: str) -> MetricStream:
    """A :class:`MetricStream` for ``group``, bound to the handler that serves the group right now."""
    handler = _handlers.get(group)
    if handler is None:
        handler = REGISTRY.default
        if handler is None:
            handler = _BUILTIN_DEFAULT
    return MetricStream(group, handler)


_GET_STREAM = getStream
"""The module's own :func:`getStream`: :func:`put_metric` takes a faster path to the same handler while it is in
place, and goes through ``getStream(group).add_value(...)`` (torchelastic's path) when it was replaced."""


def put_metric(metric_name: str, metric_value: int, metric_group: str = "torchelastic") -> None:
    """Publish one data point of ``(metric_group, metric_name)`` with the current time.

    The handler is looked up on every call (so a later :func:`configure` applies at once). With no handler
    configured for the group or as default, the point goes to the collector when the process is attached
    and nowhere otherwise. Usage: ``put_metric("metric_name", 1)``, ``put_metric("metric_name", 1, "group")``.
    Raises :class:`~shmstat.errors.ConfigError` if the name or group breaks the name rule (:mod:`shmstat.names`;
    a name or group that is not a ``str`` is checked as its ``str``), whichever handler serves the group.
    """
    try:
        known = metric_name in _KNOWN_NAMES and metric_group in _KNOWN_GROUPS
    except TypeError:  # unhashable: checked as its str
        known = False
    if not known:
        check_metric(metric_name, metric_group)  # the name rule (shmstat.names): ConfigError naming it
    if getStream is not _GET_STREAM:  # replaced (as torchelastic's own tests patch it): go through it, as torchelastic
        getStream(metric_group).add_value(metric_name, metric_value)
        return
    handler = _handlers.get(metric_group)
    if handler is None:
        handler = REGISTRY.default
        if handler is None:  # the built-in default: collector or nothing (inlined for speed)
            pub = STATE.publisher
            if pub is None:
                if STATE.auto_init_done:
                    return
                pub = _publisher()
                if pub is None:
                    return
            # the outbox checks, encodes and queues it in one call (not None: its fast path declined it)
            if pub.outbox.metric(metric_group, metric_name, metric_value, _time()) is not None:
                _publish(pub, metric_group, metric_name, metric_value, _time())
            elif not pub.started:
                pub.start()
            return
    handler.emit(MetricData(_time(), metric_group, metric_name, metric_value))


_py_put_metric = put_metric
_C = backend()
_set_c_routes: Callable[..., None] | None = None
if _C.put_metric is not None and _C.set_metric_state is not None and _log_event is _C.log_event:
    # the same function, its common case in C (it reads the C log_event's copy of STATE; the rest comes back here)
    _set_c_routes = _C.set_metric_state
    put_metric = _C.put_metric  # tests/elastic/test_elastic_metrics.py runs both


def _route_c() -> None:
    """Tell the C put_metric which groups this module serves in-process: the configured ones (``_handlers``, read
    live), or every group while a default handler is configured or ``getStream`` is replaced. Called on each change
    of those two; the C side then hands exactly these calls back to :func:`_py_put_metric`."""
    if _set_c_routes is not None:
        everything_local = REGISTRY.default is not None or getStream is not _GET_STREAM
        _set_c_routes(_py_put_metric, _KNOWN_NAMES, _KNOWN_GROUPS, _handlers, everything_local, "torchelastic")


class _Module(types.ModuleType):
    """This module's type: replacing (or restoring) ``getStream`` in it, as torchelastic's tests do through
    ``elastic.metrics.api``, re-routes the C put_metric at once."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "getStream":
            _route_c()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if name == "getStream":
            _route_c()


sys.modules[__name__].__class__ = _Module
REGISTRY.on_change = _route_c
_route_c()


def publish_metric(metric_group: str, metric_name: str, metric_value: int) -> None:
    """Deprecated: ``put_metric(metric_name, metric_value, metric_group)``; warns :class:`FutureWarning`."""
    warnings.warn(
        "Deprecated, use `put_metric(metric_group)(metric_name, metric_value)` instead", FutureWarning, stacklevel=2
    )
    getStream(metric_group).add_value(metric_name, metric_value)


publish_metric.__deprecated__ = "Deprecated, use `put_metric(metric_group)(metric_name, metric_value)` instead"  # type: ignore[attr-defined]


def get_elapsed_time_ms(start_time_in_seconds: float) -> int:
    """Whole milliseconds from ``start_time_in_seconds`` (a :func:`time.time` value) to now, truncated."""
    return int((_time() - start_time_in_seconds) * 1000)


def _get_metric_name(fn: Callable[..., Any]) -> str:
    """``@prof``'s key, named as torchelastic names it: ``__qualname__`` if it has a dot (``Class.method``), else
    ``<module leaf>.<name>`` (the bare name for a function without a module)."""
    qualname: str = fn.__qualname__
    if "." in qualname:
        return qualname
    module = fn.__module__
    return f"{module.rsplit('.', 1)[-1]}.{qualname}" if module else qualname


def _profiled(fn: F, key: str, group: Any) -> F:
    """Wrap ``fn`` to emit ``<key>.success``/``<key>.failure`` = 1 and ``<key>.duration.ms`` to ``group``; the
    names are checked now (name rule, :mod:`shmstat.names`), so the wrapper never raises for them."""
    success, failure, duration = f"{key}.success", f"{key}.failure", f"{key}.duration.ms"
    for name in (success, failure, duration):
        check_metric(name, group)
    clock = _clock

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            result = fn(*args, **kwargs)
        except Exception:
            put_metric(failure, 1, group)
            raise
        else:
            put_metric(success, 1, group)
            return result
        finally:
            put_metric(duration, int((clock() - start) * 1000), group)

    return wrapper  # type: ignore[return-value]


@overload
def prof(fn: F, group: str = "torchelastic") -> F: ...
@overload
def prof(fn: None = None, group: str = "torchelastic") -> Callable[[F], F]: ...
def prof(fn: F | None = None, group: str = "torchelastic") -> F | Callable[[F], F]:
    """Decorator: publish ``<key>.success`` (or ``<key>.failure``, then re-raise) and ``<key>.duration.ms``.

    ``key`` is the function's ``__qualname__`` when it has a dot (``Class.method``), else
    ``<leaf module>.<function>``. Duration is whole milliseconds; it is published even when the function
    raises. Use as ``@prof`` or ``@prof(group="agent")``; metrics go through :func:`put_metric`. A key or group
    that breaks the name rule (:mod:`shmstat.names`) raises :class:`~shmstat.errors.ConfigError` when decorating.
    """

    def wrap(f: F) -> F:
        return _profiled(f, _get_metric_name(f), group)

    return wrap(fn) if fn is not None else wrap


def profile(group: str | None = None) -> Callable[[F], F]:
    """Deprecated (use :func:`prof`): decorator publishing ``<function name>.success/.failure/.duration.ms``.

    Warns :class:`FutureWarning` when called. The key is the bare ``__name__``, as in torchelastic.
    """
    warnings.warn("Deprecated, use `@prof` instead", FutureWarning, stacklevel=2)

    def wrap(func: F) -> F:
        return _profiled(func, func.__name__, group)

    return wrap


profile.__deprecated__ = "Deprecated, use `@prof` instead"  # type: ignore[attr-defined]


def initialize_metrics(cfg: MetricsConfig | None = None) -> None:
    """Attach to the job from the environment now rather than on the first metric (``cfg`` is unused).

    A no-op when no job is configured, as in torchelastic.
    """
    _publisher()
