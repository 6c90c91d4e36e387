"""Gradient accumulation over k micro-steps (optax's MultiSteps)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from funcpar.optim.base import GradientTransformation, check_grads
from funcpar.state.tree import Tree, tree_map

__all__ = ["AccumulateState", "accumulate"]


class AccumulateState(NamedTuple):
    micro_step: Tensor  # 0-d int64 in [0, k)
    grad_sum: Tree
    inner: Tree


def accumulate(inner: GradientTransformation, every: int) -> GradientTransformation:
    """Run ``inner`` once every ``every`` calls, on the mean of the gradients since.

    The calls in between return zero updates and leave ``inner``'s state untouched, so
    ``every`` micro-batches of size b give the same parameters as one batch of size
    ``every * b`` (for a loss that is a mean over the batch). Which branch runs is read from
    the state on the host: one device sync per call.
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"accumulate: every must be an int >= 1, got {every!r}")

    def init(params: Tree) -> AccumulateState:
        return AccumulateState(
            torch.zeros((), dtype=torch.int64),
            tree_map(torch.zeros_like, params),
            inner.init(params),
        )

    def update(grads, state: AccumulateState, params=None, *, layouts=None):
        check_grads(params, grads)
        total = tree_map(lambda s, g: s + g, state.grad_sum, grads)
        if int(state.micro_step) + 1 < every:
            zeros = tree_map(torch.zeros_like, grads)
            return zeros, AccumulateState(state.micro_step + 1, total, state.inner)
        mean = tree_map(lambda s: s / every, total)
        updates, inner_state = inner.update(mean, state.inner, params, layouts=layouts)
        return updates, AccumulateState(
            torch.zeros_like(state.micro_step), tree_map(torch.zeros_like, total), inner_state
        )

    return GradientTransformation(init, update)
