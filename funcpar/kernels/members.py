"""A step of vmap's members on their physical tensors: torch's fused CPU kernels under vmap_step.

Under :func:`funcpar.train.vmap.vmap_step` the optimizer runs once for all ``n`` members, each
leaf a tensor batched along the member axis. torch's multi-tensor and fused ops have no vmap
batching rule, so the update would run per leaf as a dozen elementwise passes over all
members' memory; torch's fused CPU kernel (``torch._fused_adamw_``) is one pass. Here a step
reaches past the vmap to the tensors it batches (the member axis first) and runs the fused
kernel on each member's slices: per member the very call a step of that member alone makes,
so the member gets the same bits as when it trains on its own.

**The owner's level.** vmap_step declares the vmap level it enters as its own
(:func:`owned_level`). Work on the members' plain tensors may then step out of that level and
back in (:func:`stepped_out`: functorch's levels are a stack, so the level re-entered has the
same number and the step's batched tensors keep working): with a level on the stack every
torch op, on plain tensors too, first passes functorch's dispatch, which costs more than these
small ops themselves (the fused update of bench_vmap's 8 members: 1.6 ms of a step inside
the level, 1.2 outside; 0.37 ms on warm caches with no level at all).
The backward of vmap_step's gradients runs outside it the same way (funcpar.train.member_grads).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch

__all__ = ["VmapLevel", "member_scalars", "on_members", "owned_level", "owned_top",
           "stepped_out"]


class VmapLevel(NamedTuple):
    """A vmap level as ``_vmap_increment_nesting(size, randomness)`` entered it."""

    level: int
    size: int
    randomness: str


_OWNED: contextvars.ContextVar[VmapLevel | None] = contextvars.ContextVar(
    "funcpar_owned_vmap_level", default=None)


@contextlib.contextmanager
def owned_level(level: int, size: int, randomness: str) -> Iterator[None]:
    """Declare the vmap level just entered (``_vmap_increment_nesting(size, randomness)``
    returned ``level``) the caller's own: work on the members' plain tensors may step out of
    it (:func:`stepped_out`) while it is the innermost torch.func level."""
    token = _OWNED.set(VmapLevel(level, size, randomness))
    try:
        yield
    finally:
        _OWNED.reset(token)


def owned_top() -> VmapLevel | None:
    """The owned level when it is the only torch.func level, and dynamo is not tracing;
    else ``None``."""
    own = _OWNED.get()
    if (own is None or own.level != 1 or torch.compiler.is_compiling()
            or _functorch.maybe_current_level() != own.level):
        return None
    return own


@contextlib.contextmanager
def stepped_out(own: VmapLevel) -> Iterator[None]:
    """Leave the owned level ``own`` (:func:`owned_top`) for the enclosed work on plain
    tensors and enter it again after, whatever happens."""
    _functorch._vmap_decrement_nesting()
    try:
        yield
    finally:
        again = _functorch._vmap_increment_nesting(own.size, own.randomness)
        if again != own.level:  # cannot happen for the top level; never go on past it
            raise RuntimeError(f"vmap level {own.level} re-entered as {again}")


def on_members(fn: Callable[..., Any], columns: Sequence[Sequence[Tensor | None]],
               scalars: tuple) -> Any:
    """``fn(*physical_columns, physical_scalars)`` with its outputs batched again, or ``None``
    where the members' tensors cannot be used so (then run the per-leaf reference).

    Used when the step runs eagerly, under exactly one torch.func transform and that a vmap
    (vmap_step's update, after its gradients), with nothing requiring grad (no graph to keep
    through unwrapped tensors) and every leaf tensor batched by that vmap. ``fn`` gets each
    leaf as its ``(n, ...)`` tensor and each tensor field of ``scalars`` as ``(n,)`` when it
    differs per member (0-d when the members share it; ``scalars`` is a NamedTuple, rebuilt
    with its type); it returns lists of new leaves
    (``None`` kept), or ``None`` when it cannot run on them. ``fn`` must not write its inputs:
    they are the caller's (the state's) storage.
    """
    top = _functorch.peek_interpreter_stack()
    if (top is None or top.key() != _functorch.TransformType.Vmap or top.level() != 1
            or torch.compiler.is_compiling()):
        return None
    level = top.level()
    tensors = [t for col in columns for t in col if t is not None]
    fields = [v for v in scalars if isinstance(v, Tensor)]
    from funcpar.kernels.dispatch import differentiable  # dispatch imports kernels: at call time

    if not tensors or differentiable(*tensors, *fields):
        return None
    if not all(_functorch.maybe_get_level(t) == level for t in tensors):
        return None
    own = owned_top()
    with contextlib.nullcontext() if own is None else stepped_out(own):
        # Unwrapped out of the level too (movedim on the plain tensors, no functorch dispatch).
        args = [[None if t is None else _physical(t, level) for t in col] for col in columns]
        plain = type(scalars)(*(_physical(v, level) if isinstance(v, Tensor) else v
                                for v in scalars))
        out = fn(*args, plain)
    if out is None:
        return None
    return tuple([None if t is None else _functorch._add_batch_dim(t, 0, level) for t in xs]
                 for xs in out)


def member_scalars(n: int, *values: Tensor | float | int) -> list[tuple[float, ...]]:
    """Per member, the host values of ``values`` (each a number, a 0-d tensor shared by the
    members or an ``(n,)`` tensor of one value per member): ``out[i][k]`` is value ``k`` of
    member ``i``, read once for all members."""
    cols = []
    for v in values:
        if isinstance(v, Tensor) and v.dim():
            cols.append(v.tolist())
        else:
            cols.append([float(v)] * n)
    return list(zip(*cols, strict=True))


def _physical(t: Tensor, level: int) -> Tensor:
    # The tensor vmap batches (member axis first); a tensor the members share as it is.
    if _functorch.maybe_get_level(t) != level:
        return t
    return _functorch.get_unwrapped(t).movedim(_functorch.maybe_get_bdim(t), 0)
