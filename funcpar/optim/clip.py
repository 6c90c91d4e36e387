"""Gradient clipping by the global norm (Pascanu et al. 2013, arXiv 1211.5063)."""

from __future__ import annotations

import torch
from torch import Tensor

from funcpar.optim import validate
from funcpar.optim.base import EmptyState, GradientTransformation
from funcpar.shard.reduce import total_sum_of_squares
from funcpar.state.tree import Tree, leaves_like, tree_leaves, tree_map

__all__ = ["clip_by_global_norm", "global_norm"]


def global_norm(tree: Tree, layouts: Tree | None = None) -> Tensor:
    """``sqrt(sum over leaves of ||leaf||^2)`` of the whole (global) tree, as a 0-d tensor.

    The square norms go through the layout-aware reduction, so a sharded leaf counts once,
    whole, and all leaves split over the same mesh axes share one all-reduce.
    """
    pairs = [(g, lay) for g, lay in zip(tree_leaves(tree),
                                        leaves_like(tree, layouts, what="layouts",
                                                    against="grads")) if g is not None]
    return total_sum_of_squares([g for g, _ in pairs], [lay for _, lay in pairs],
                                purpose="global_norm").sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all gradients by ``min(1, max_norm / (||g|| + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does (the 1e-6 guards a zero norm)."""
    validate.positive("clip_by_global_norm", "max_norm", max_norm)

    def init(params: Tree) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, *, layouts=None):
        total = global_norm(grads, layouts)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return tree_map(lambda g: None if g is None else g * coef.to(g.dtype), grads), state

    return GradientTransformation(init, update)
