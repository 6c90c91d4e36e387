"""Layout-aware reductions: the one place where optimizers meet sharding.

Every global quantity an optimizer needs (a row sum, a column mean, a norm, a max) is computed
here from the *local* tensor and the leaf's layout. With ``layout=None`` (a tensor that is whole
on this process) each function is the plain torch op. A layout is any object with

* ``global_shape`` - the shape of the whole tensor, and
* ``all_reduce(t, dims, op, purpose)`` - combine a locally reduced ``t`` over exactly the mesh
  axes that split ``dims`` (a no-op when none does), with ``op`` in ``{"sum", "max"}``.

so optimizer code never asks "which parallelism is this?": it asks for a reduction over dims.
A layout may also offer ``axes_for(dims)`` (the mesh axes that split ``dims``):
:func:`total_sum_of_squares` then sums many leaves with one collective per distinct set of
axes instead of one per leaf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "Reducible",
    "global_shape",
    "norm",
    "reduce_max",
    "reduce_mean",
    "reduce_sum",
    "rms",
    "sum_of_squares",
    "sum_partial",
    "total_sum_of_squares",
]


@runtime_checkable
class Reducible(Protocol):
    """What a reduction needs to know of a leaf's layout."""

    global_shape: tuple[int, ...]

    def all_reduce(self, t: Tensor, dims: tuple[int, ...], op: str, purpose: str) -> Tensor: ...


def _dims(x: Tensor, dims: int | Sequence[int] | None) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(x.dim()))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted(d % x.dim() for d in dims)) if x.dim() else ()


def global_shape(x: Tensor, layout: Reducible | None) -> tuple[int, ...]:
    return tuple(x.shape) if layout is None else tuple(layout.global_shape)


def _finish(
    local: Tensor, dims: tuple[int, ...], layout: Reducible | None, op: str, purpose: str
) -> Tensor:
    if layout is None or not dims:
        return local
    return layout.all_reduce(local, dims, op, purpose)


def reduce_sum(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    layout: Reducible | None = None,
    keepdim: bool = False,
    purpose: str = "sum",
) -> Tensor:
    """Sum of the whole (global) tensor over ``dims``, given this process's shard ``x``."""
    d = _dims(x, dims)
    local = x.sum(dim=d, keepdim=keepdim) if d else x.clone()
    return _finish(local, d, layout, "sum", purpose)


def reduce_mean(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    layout: Reducible | None = None,
    keepdim: bool = False,
    purpose: str = "mean",
) -> Tensor:
    """Mean over ``dims`` of the global tensor: the global sum over the global element count."""
    d = _dims(x, dims)
    if layout is None:
        return x.mean(dim=d, keepdim=keepdim) if d else x.clone()
    shape = global_shape(x, layout)
    count = math.prod(shape[i] for i in d)
    return reduce_sum(x, d, layout=layout, keepdim=keepdim, purpose=purpose) / count


def reduce_max(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    layout: Reducible | None = None,
    keepdim: bool = False,
    purpose: str = "max",
) -> Tensor:
    d = _dims(x, dims)
    if layout is not None and any(x.shape[i] == 0 for i in d):
        # An uneven split can leave this rank an empty shard: it contributes max's identity
        # (amax itself refuses an empty reduced dim).
        shape = [1 if i in d else n for i, n in enumerate(x.shape) if keepdim or i not in d]
        lowest = -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
        local = x.new_full(shape, lowest)
    else:
        local = x.amax(dim=d, keepdim=keepdim) if d else x.clone()
    return _finish(local, d, layout, "max", purpose)


def sum_of_squares(
    x: Tensor, *, layout: Reducible | None = None, purpose: str = "sum_of_squares"
) -> Tensor:
    """``sum(x**2)`` over the whole global tensor, as a 0-d tensor."""
    d = _dims(x, None)
    local = torch.linalg.vector_norm(x).square() if x.numel() else x.new_zeros(())
    return _finish(local, d, layout, "sum", purpose)


def total_sum_of_squares(
    xs: Sequence[Tensor], layouts: Sequence[Reducible | None], *, purpose: str = "sum_of_squares"
) -> Tensor:
    """``sum over leaves of sum(x**2)``, each leaf whole (global), as a 0-d tensor.

    Local sums are accumulated in float32 (float64 for float64 leaves) and grouped by the mesh
    axes that split them, so a tree of sharded leaves costs one all-reduce per distinct set of
    axes (one per leaf for a layout without ``axes_for``), not one per leaf.
    """
    if len(xs) != len(layouts):
        raise ValueError(f"{len(xs)} tensors but {len(layouts)} layouts")
    groups: dict[tuple, tuple[Tensor, Reducible | None, int]] = {}
    for i, (x, lay) in enumerate(zip(xs, layouts)):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        local = torch.linalg.vector_norm(x, dtype=acc).square() if x.numel() else (
            torch.zeros((), dtype=acc, device=x.device))
        dims = tuple(range(x.dim()))
        if lay is None or not dims:
            key: tuple = (acc, ())
        elif hasattr(lay, "axes_for"):
            key = (acc, tuple(lay.axes_for(dims)))
        else:
            key = (acc, ("leaf", i))
        total, rep, nd = groups.get(key, (None, lay, len(dims)))
        groups[key] = (local if total is None else total + local.to(total.device), rep, nd)
    sums = [
        total if rep is None or not key[1] else rep.all_reduce(total, tuple(range(nd)), "sum",
                                                               purpose)
        for key, (total, rep, nd) in groups.items()
    ]
    if not sums:
        return torch.zeros(())
    acc = torch.float64 if any(t.dtype == torch.float64 for t in sums) else torch.float32
    return torch.stack([t.to(acc).to(sums[0].device) for t in sums]).sum()


def norm(x: Tensor, *, layout: Reducible | None = None, purpose: str = "norm") -> Tensor:
    """The Frobenius (L2) norm of the whole global tensor."""
    if layout is None:
        return torch.linalg.vector_norm(x)
    return sum_of_squares(x, layout=layout, purpose=purpose).sqrt()


def rms(x: Tensor, *, layout: Reducible | None = None, purpose: str = "rms") -> Tensor:
    """Root mean square of the whole global tensor: ``norm / sqrt(numel)``."""
    n = math.prod(global_shape(x, layout))
    return norm(x, layout=layout, purpose=purpose) / math.sqrt(n)


def sum_partial(
    x: Tensor,
    dims: int | Sequence[int],
    *,
    layout: Reducible | None = None,
    purpose: str = "partial sum",
) -> Tensor:
    """Complete a contraction over ``dims`` of the leaf that ``layout`` describes.

    ``x`` is what this rank computed from its shard, a product that summed over its local part
    of ``dims`` (say ``P_local^T G_local`` for a contraction over the rows of ``G``); ``x`` need
    not have the leaf's shape. The whole contraction is the sum of these over the axes that
    split ``dims``: one all-reduce per such axis, none when ``dims`` are whole (or no layout).
    """
    d = tuple(sorted({dims} if isinstance(dims, int) else set(dims)))
    return _finish(x, d, layout, "sum", purpose)
