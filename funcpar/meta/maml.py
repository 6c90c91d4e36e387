"""Model-agnostic meta-learning's inner loop as a function (Finn et al. 2017, arXiv 1703.03400).

``maml_adapt`` starts a fresh optimizer state at the meta-parameters ``theta`` and runs k
:func:`~funcpar.meta.unroll.inner_step` s on the support set: the adapted ``w_k(theta)`` is
differentiable w.r.t. ``theta`` (and any tensor hyperparameter), so the outer loss on the query
set, ``L(w_k(theta))``, back-propagates into ``theta``: the meta-gradient, with the inner
Hessian-vector products (``first_order=True`` drops them: FOMAML).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from funcpar.meta.unroll import unroll
from funcpar.optim.base import GradientTransformation
from funcpar.state.tree import Tree

__all__ = ["maml_adapt"]


def maml_adapt(
    loss_fn: Callable[..., Tensor], opt: GradientTransformation, theta: Tree, support: Any,
    steps: int, *, first_order: bool = False,
) -> tuple[Tree, list[Tensor]]:
    """``(w_k, inner losses)`` after ``steps`` updates of ``opt`` from ``theta`` on ``support``
    (a tuple of ``loss_fn`` arguments after the params, used at every step)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"maml_adapt: steps must be a positive int, got {steps!r}")
    args = support if isinstance(support, tuple) else (support,)
    params, _, losses = unroll(loss_fn, opt, theta, opt.init(theta), [args] * steps,
                               create_graph=not first_order)
    return params, losses
