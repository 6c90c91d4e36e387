"""Coupled weight decay as a block: ``u <- u + weight_decay * w`` (optax's
``add_decayed_weights``), and the per-leaf helper every coupled-L2 optimizer shares.

In front of an adaptive optimizer, ``chain(add_decayed_weights(wd), adam(...))`` is L2
regularisation: the decay enters the moments, as ``torch.optim.Adam(weight_decay=wd)`` (and
``adam(weight_decay=wd)``) has it. Decoupled decay, applied to the step and not seen by the
moments, is :func:`~funcpar.optim.adamw` (Loshchilov & Hutter 2019, arXiv 1711.05101).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from funcpar.kernels.multi_tensor import add_scaled, multi_tensor_ok, per_dtype
from funcpar.optim import validate
from funcpar.optim.base import EmptyState, GradientTransformation, checked_leaf_columns
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.optim.schedules import ScalarOrSchedule
from funcpar.state.tree import Tree, tree_unflatten

__all__ = ["add_decayed_weights", "decayed"]


def decayed(updates: Sequence[Tensor], params: Sequence[Tensor], weight_decay: Tensor,
            flags: Sequence[bool]) -> list[Tensor]:
    """``u_i + weight_decay * p_i`` where ``flags[i]``, ``u_i`` elsewhere; the 0-d float64
    ``weight_decay`` in each leaf's dtype (the product, then the sum, as torch.optim rounds
    it). Multi-tensor ops where they apply, per leaf under torch.func transforms;
    differentiable either way."""
    (wd,) = per_dtype([u.dtype for u in updates], weight_decay)
    if multi_tensor_ok(updates, params):
        return add_scaled(updates, params, wd, flags)
    return [u + w * p if f else u for u, p, w, f in zip(updates, params, wd, flags, strict=True)]


def _add_decayed_weights(weight_decay, *, mask):
    def init(params: Tree) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, *, layouts=None):
        spec, g, (p,) = checked_leaf_columns(grads, params)
        return tree_unflatten(spec, decayed(g, p, weight_decay, mask_flags(mask, params, spec))
                              ), state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0,
                        mask: Mask = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on the leaves ``mask`` allows (a tree of bools, a
    predicate ``(name, param) -> bool`` or ``None``: all); ``weight_decay`` may be a schedule
    or a tensor that requires grad."""
    validate.nonnegative("add_decayed_weights", "weight_decay", weight_decay)
    return inject_hyperparams(_add_decayed_weights, ("weight_decay",),
                              weight_decay=weight_decay, mask=mask)
