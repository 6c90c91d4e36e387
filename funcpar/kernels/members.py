"""A step of vmap's members on their physical tensors: torch's fused CPU kernels under vmap_step.

Under :func:`funcpar.train.vmap.vmap_step` the optimizer runs once for all ``n`` members, each
leaf a tensor batched along the member axis. torch's multi-tensor and fused ops have no vmap
batching rule, so the update would run per leaf as a dozen elementwise passes over all
members' memory; torch's fused CPU kernel (``torch._fused_adamw_``) is one pass. Here a step
reaches past the vmap to the tensors it batches (the member axis first) and runs the fused
kernel on each member's slices: per member the very call a step of that member alone makes,
so the member gets the same bits as when it trains on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

__all__ = ["member_scalars", "on_members"]


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
    if not tensors or (torch.is_grad_enabled()
                       and any(t.requires_grad for t in (*tensors, *fields))):
        return None
    if not all(_functorch.maybe_get_level(t) == level for t in tensors):
        return None
    out = fn(*([None if t is None else _physical(t, level) for t in col] for col in columns),
             type(scalars)(*(_physical(v, level) if isinstance(v, Tensor) else v
                             for v in scalars)))
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
