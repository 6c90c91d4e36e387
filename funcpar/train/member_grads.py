"""Every member's gradients under vmap_step, by ordinary autograd on the stacked tensors.

Under :func:`funcpar.train.vmap.vmap_step` the members' parameters are functorch
BatchedTensors over ordinary ``(N, ...)`` tensors. ``torch.func.grad`` nested inside that vmap
takes every op of the forward and of the backward through two functorch layers (grad's
wrappers, then vmap's batching rules). But ordinary autograd differentiates vmap (the batching
rules run ordinary ops on the stacked tensors), and the members' losses are independent, so

    d (sum_i loss_i) / d stacked[i] = d loss_i / d params_i

is each member's gradient in its own slice, the backward multiplying each loss's cotangent by
exactly 1. So the forward runs at the vmap level on stacked tensors that require grad, and
the backward is ordinary autograd of the summed ``(N,)`` losses *outside* the level, where no
functorch layer sees its ops: the same batched kernels, at about 60 % of the time on the small
MLPs of ``benchmarks/bench_vmap.py`` (2.4-3.1 -> 1.3-1.7 ms for 8 members' forward and
backward, 1 CPU thread).

The backward steps out of the vmap level and back in
(:func:`funcpar.kernels.members.stepped_out`), so this is done only for the level vmap_step
declares its own (:func:`funcpar.kernels.members.owned_level`) and nothing else. It is taken
where it is the same computation: that level is the only torch.func level, every
differentiated leaf is batched at it over a tensor that requires no grad (nothing outside
differentiates through the step: hypergradients of a vmapped run keep ``torch.func.grad``,
whose graph composes with theirs), and dynamo is not tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch as _F

from funcpar.kernels.members import owned_top, stepped_out
from funcpar.state.tree import tree_map

__all__ = ["grads_at_vmap_level"]


def grads_at_vmap_level(
    fn: Callable[[list[Tensor]], tuple[Tensor, Any]], xs: Sequence[Tensor]
) -> tuple[list[Tensor], Any] | None:
    """``torch.func.grad(fn, has_aux=True)(list(xs))`` by the module's route, or ``None`` where
    it does not apply (the caller then takes ``torch.func.grad``). ``fn(xs) -> (loss, aux)``
    with a 0-d (per member) loss; tensors of ``aux`` come back detached, as torch.func.grad's
    auxiliary outputs do."""
    own = owned_top()
    if own is None:
        return None
    inner, dims = [], []
    for x in xs:
        if not (_F.is_batchedtensor(x) and _F.maybe_get_level(x) == own.level):
            return None
        t = _F.get_unwrapped(x)
        if t.requires_grad:
            return None
        inner.append(t)
        dims.append(_F.maybe_get_bdim(x))
    # The stacked tensors are ordinary ones, below the level: marking them is what callers of
    # vmap do outside it (functorch refuses requires_grad_ inside a transform by default).
    allowed = _F.get_inplace_requires_grad_allowed()
    _F.set_inplace_requires_grad_allowed(True)
    try:
        live = [t.detach().requires_grad_() for t in inner]
    finally:
        _F.set_inplace_requires_grad_allowed(allowed)
    with torch.enable_grad():
        loss, aux = fn([_F._add_batch_dim(t, d, own.level) for t, d in zip(live, dims)])
        losses = _F._remove_batch_dim(loss, own.level, own.size, 0)
        with stepped_out(own):
            grads = torch.autograd.grad(losses.sum(), live, allow_unused=True)
    out = [torch.zeros_like(x) if g is None else _F._add_batch_dim(g, d, own.level)
           for x, g, d in zip(xs, grads, dims)]
    return out, tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, aux)
