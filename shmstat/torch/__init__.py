"""A standard PyTorch training loop's sections in one call: :func:`instrument`.

``handle = shmstat.torch.instrument(model, optimizer=opt, loader=loader)`` then ``for batch in handle.loader:``
puts :func:`shmstat.section` ranges around each batch the loader yields (``data``), the model's forward
(``forward``: forward pre and post hooks), the backward pass (``backward``: from the gradient of the model's output
to the last gradient of its parameters, a tensor hook and :func:`torch.autograd.graph.register_multi_grad_hook`),
the optimizer step (``optimizer``: step pre and post hooks; each step also counts one step in the phase word)
and, for a ``DistributedDataParallel`` model, its gradient all-reduce as a wait section (``allreduce``: a
communication hook around DDP's default all-reduce, from each bucket's launch to its completion).
``handle.remove()`` takes every hook off (the communication hook, which DDP cannot unregister, stops timing).
torch is imported when :func:`instrument` is called, never by ``import shmstat``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import ConfigError
from ..writer.sections import advance_step, section

__all__ = ["Instrumented", "instrument"]

DATA, FORWARD, BACKWARD, OPTIMIZER, ALLREDUCE = "data", "forward", "backward", "optimizer", "allreduce"


class _TimedLoader:
    """The loader, each batch's fetch inside the ``data`` section."""

    def __init__(self, loader: Iterable[Any], handle: Instrumented) -> None:
        self._loader = loader
        self._handle = handle

    def __iter__(self) -> Iterator[Any]:
        it = iter(self._loader)
        data = section(DATA)
        while True:
            if self._handle.removed:
                yield from it
                return
            token = data._open()
            try:
                batch = next(it)
            except StopIteration:
                data._close(token, count=False)  # the end of the loader is no batch
                return
            except BaseException:
                data._close(token)
                raise
            data._close(token)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class Instrumented:
    """What :func:`instrument` put in place: :attr:`loader` to iterate, :meth:`remove` to take it all off."""

    def __init__(self) -> None:
        self.loader: Any = None
        """The loader given, wrapped (each batch in the ``data`` section); None if no loader was given."""
        self.removed = False
        self._handles: list[Any] = []
        self._backward: Any = None
        self._lock = threading.Lock()

    def remove(self) -> None:
        """Take every hook off (idempotent); the wrapped loader then yields plainly."""
        self.removed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> Instrumented:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def instrument(model: Any, optimizer: Any = None, loader: Iterable[Any] | None = None) -> Instrumented:
    """Put the ``data``, ``forward``, ``backward``, ``optimizer`` and (DDP) ``allreduce`` sections around a training
    loop with torch's public hooks; returns the :class:`Instrumented` handle (iterate ``handle.loader``)."""
    import torch
    from torch.autograd.graph import register_multi_grad_hook

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"instrument() takes a torch.nn.Module, not {type(model).__name__}")
    handle = Instrumented()
    if loader is not None:
        handle.loader = _TimedLoader(loader, handle)
    forward, backward = section(FORWARD), section(BACKWARD)
    tokens: list[Any] = []

    def forward_pre(module: Any, args: Any) -> None:
        tokens.append(forward._open())

    def forward_post(module: Any, args: Any, output: Any) -> None:
        if tokens:
            forward._close(tokens.pop())
        out = _first_grad_tensor(torch, output)
        if out is not None and not handle.removed:
            out.register_hook(backward_start)

    def backward_start(grad: Any) -> None:
        with handle._lock:
            if handle._backward is None and not handle.removed:
                handle._backward = backward._open()

    def backward_end(grads: Any) -> None:
        with handle._lock:
            token, handle._backward = handle._backward, None
        if token is not None:
            backward._close(token)

    handle._handles.append(model.register_forward_pre_hook(forward_pre))
    handle._handles.append(model.register_forward_hook(forward_post, always_call=True))
    params = [p for p in model.parameters() if p.requires_grad]
    if params:
        handle._handles.append(register_multi_grad_hook(params, backward_end, mode="all"))
    if optimizer is not None:
        step = section(OPTIMIZER)
        steps: list[Any] = []

        def step_pre(opt: Any, args: Any, kwargs: Any) -> None:
            steps.append(step._open())

        def step_post(opt: Any, args: Any, kwargs: Any) -> None:
            if steps:
                step._close(steps.pop())
            advance_step()

        handle._handles.append(optimizer.register_step_pre_hook(step_pre))
        handle._handles.append(optimizer.register_step_post_hook(step_post))
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        _time_allreduce(model, handle)
    return handle


def _time_allreduce(model: Any, handle: Instrumented) -> None:
    """DDP's default all-reduce, each bucket from launch to completion inside the ``allreduce`` wait section."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    allreduce = section(ALLREDUCE, wait=True)

    def timed_allreduce(state: Any, bucket: Any) -> Any:
        if handle.removed:
            return allreduce_hook(state, bucket)
        token = allreduce._open()
        fut = allreduce_hook(state, bucket)

        def done(f: Any) -> Any:
            allreduce._close(token)
            return f.value()

        return fut.then(done)

    # DDP checks the hook's annotations as objects (this module's are strings: postponed evaluation)
    import torch
    import torch.distributed as dist

    timed_allreduce.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}
    try:
        model.register_comm_hook(model.process_group, timed_allreduce)
    except RuntimeError as exc:  # the model has a communication hook already: DDP takes one
        warnings.warn(f"shmstat.torch.instrument: the DDP all-reduce is not timed ({exc})", stacklevel=3)


def _first_grad_tensor(torch: Any, output: Any) -> Any:
    """The first tensor of a forward's output that takes part in autograd, or None."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        found = _first_grad_tensor(torch, value)
        if found is not None:
            return found
    return None
