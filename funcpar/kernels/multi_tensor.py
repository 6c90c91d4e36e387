"""Differentiable multi-tensor arithmetic for the optimizers' reference paths.

The reference step of an optimizer (the path taken when the step must be differentiable:
unrolled meta-learning, hypergradients) is out-of-place torch. Written per leaf, each of its
elementwise ops costs one Python call, one dispatch and one autograd node *per leaf*, and every
0-d hyperparameter is cast to the leaf's dtype per leaf; for small models that overhead, not the
arithmetic, is the step's cost (benchmarks/bench_meta.py). torch's out-of-place
``torch._foreach_*`` ops compute the same elementwise op on every leaf in one call and one
autograd node, and have derivative formulas (double backward included, as MAML's
second-order meta-gradient needs); on CPU they run the per-tensor kernel on each leaf, so the
values are bit for bit those of the per-leaf ops in the same order.

They have no ``torch.func.vmap`` batching rule, so under a torch.func transform (vmap_step) the
per-leaf reference stays; and the per-leaf path keeps the reference's dtype promotions between a
leaf's tensors, which the multi-tensor path (one dtype per leaf) does not reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["add_scaled", "in_dtype", "multi_tensor_ok", "per_dtype"]


def multi_tensor_ok(*columns: Sequence[Tensor | None]) -> bool:
    """Whether out-of-place multi-tensor ops may compute a reference step over these leaf
    columns (one sequence per role, one entry per leaf; ``None`` entries are skipped): some
    leaves, run eagerly (dynamo traces the per-leaf reference), outside torch.func transforms
    (no batching rule), and each leaf's tensors of one real floating dtype."""
    if not columns or not columns[0] or torch.compiler.is_compiling():
        return False
    if torch._C._functorch.maybe_current_level() is not None:
        return False
    for leaf in zip(*columns, strict=True):
        dts = {t.dtype for t in leaf if t is not None}
        if len(dts) != 1 or not next(iter(dts)).is_floating_point:
            return False
    return True


def per_dtype(dtypes: Sequence[torch.dtype], *scalars: Tensor) -> list[list[Tensor]]:
    """For each 0-d ``scalar``, its value in each leaf's dtype (one cast per distinct dtype,
    not per leaf; the graph kept): ``out[k][i]`` is ``scalars[k]`` in ``dtypes[i]``. In the
    leaf's dtype as the per-leaf reference has them: a 0-d float64 scalar would promote a 0-d
    float32 leaf to float64."""
    out = []
    for s in scalars:
        cast = {dt: s.to(dt) for dt in set(dtypes)}
        out.append([cast[dt] for dt in dtypes])
    return out


def in_dtype(dtype: torch.dtype, *scalars: Tensor) -> tuple[Tensor, ...]:
    """The 0-d ``scalars`` cast to ``dtype`` (each value exactly ``scalar.to(dtype)``).

    Under ``torch.compile`` they are first stacked into one small tensor: inductor then
    computes them once into a buffer that the leaf's loop loads. Left as separate 0-d
    expressions it inlines them, bias corrections' float64 ``pow`` included, into the loop
    over every element, which no longer vectorizes: an AdamW step over a 4 M-element leaf took
    23 ms compiled that way on one CPU thread, 3.2 ms with the stack (2026-11-28)."""
    if not torch.compiler.is_compiling():
        return tuple(s.to(dtype) for s in scalars)
    # Through float64, which holds every real scalar exactly: the same values as one cast.
    return torch.stack([s.to(torch.float64) for s in scalars]).to(dtype).unbind()


def add_scaled(xs: Sequence[Tensor], params: Sequence[Tensor], scales: Sequence[Tensor],
               flags: Sequence[bool], *, subtract: bool = False) -> list[Tensor]:
    """``xs[i] + scales[i] * params[i]`` (``-`` with ``subtract``) where ``flags[i]``, ``xs[i]``
    elsewhere, by one multi-tensor multiply and one add: a weight decay under its mask (SGD's
    coupled ``d + wd p``, AdamW's decoupled ``u - lr wd p``), rounded as the per-leaf reference
    rounds it (the product, then the sum)."""
    out = list(xs)
    ids = [i for i, flag in enumerate(flags) if flag]
    if ids:
        scaled = torch._foreach_mul([params[i] for i in ids], [scales[i] for i in ids])
        op = torch._foreach_sub if subtract else torch._foreach_add
        for i, x in zip(ids, op([xs[i] for i in ids], scaled), strict=True):
            out[i] = x
    return out
