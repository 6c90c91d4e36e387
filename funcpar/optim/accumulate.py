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

    With ``s_0 = 0``, call ``t`` (``k = every``) adds ``s_t = s_{t-1} + g_t``; when ``t`` is a
    multiple of ``k`` the inner optimizer steps on ``mean = s_t / k`` and the sum restarts at
    zero. The calls in between return zero updates and leave ``inner``'s state untouched, so
    ``every`` micro-batches of size b give the same parameters as one batch of size
    ``every * b`` (for a loss that is a mean over the batch; optax's ``MultiSteps``). Which
    branch runs is read from the state on the host: one device sync per call.

    ``apply`` (the new parameters in the same pass, see :mod:`funcpar.optim.base`) exists when
    ``inner``'s does: on the calls in between it returns ``params`` themselves (the same
    tensors), and on the ``every``-th it is ``inner.apply`` on the mean, so a fused inner
    update stays fused under accumulation; the results are those of ``update`` +
    ``apply_updates``. An inner ``clip_by_global_norm`` clips the mean (new tensors), so it
    computes its own norm rather than the step's ``grad_norm`` metric of the last micro-batch.
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"accumulate: every must be an int >= 1, got {every!r}")

    def init(params: Tree) -> AccumulateState:
        return AccumulateState(
            torch.zeros((), dtype=torch.int64),
            tree_map(torch.zeros_like, params),
            inner.init(params),
        )

    def add(grads, state: AccumulateState, params) -> tuple[Tree, Tree | None]:
        """``(s_t, mean)``: ``mean`` None on the calls in between."""
        check_grads(params, grads)
        total = tree_map(lambda s, g: s + g, state.grad_sum, grads)
        if int(state.micro_step) + 1 < every:
            return total, None
        return total, tree_map(lambda s: s / every, total)

    def restarted(state: AccumulateState, total: Tree, inner_state: Tree) -> AccumulateState:
        return AccumulateState(
            torch.zeros_like(state.micro_step), tree_map(torch.zeros_like, total), inner_state
        )

    def update(grads, state: AccumulateState, params=None, *, layouts=None):
        total, mean = add(grads, state, params)
        if mean is None:
            zeros = tree_map(torch.zeros_like, grads)
            return zeros, AccumulateState(state.micro_step + 1, total, state.inner)
        updates, inner_state = inner.update(mean, state.inner, params, layouts=layouts)
        return updates, restarted(state, total, inner_state)

    if inner.apply is None:  # as chain: update + apply_updates is the only path
        return GradientTransformation(init, update)

    def apply(grads, state: AccumulateState, params, *, layouts=None):
        total, mean = add(grads, state, params)
        if mean is None:
            return params, AccumulateState(state.micro_step + 1, total, state.inner)
        new_params, inner_state = inner.apply(mean, state.inner, params, layouts=layouts)
        return new_params, restarted(state, total, inner_state)

    return GradientTransformation(init, update, apply)
