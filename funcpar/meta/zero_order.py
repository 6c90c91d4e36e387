"""Zero-order gradients: antithetic Gaussian smoothing (Nesterov & Spokoiny 2017, "Random
Gradient-Free Minimization of Convex Functions", Found. Comput. Math.; the mirrored sampling
of evolution strategies, Salimans et al. 2017, arXiv 1703.03864; torchopt's ``zero_order``
with ``method='antithetic'``).

For ``f`` of parameters ``theta`` and ``u ~ N(0, I)`` over all their elements, the smoothed
``f_sigma(theta) = E_u f(theta + sigma u)`` has the gradient
``grad f_sigma(theta) = E_u [(f(theta + sigma u) - f(theta - sigma u)) / (2 sigma) u]``, which
is estimated by the mean over ``num_samples`` draws. Only values of ``f`` are needed (no
autograd through it: a simulator, a non-differentiable metric). For a quadratic ``f`` the
antithetic difference is exactly ``u . grad f``, so the estimate is unbiased for
``grad f`` itself; its standard error falls as ``1 / sqrt(num_samples)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from funcpar.state.tree import Tree, tree_flatten, tree_unflatten

__all__ = ["zero_order"]


def zero_order(
    fn: Callable[..., Tensor], params: Tree, *args: Any, num_samples: int, sigma: float,
    generator: torch.Generator,
) -> Tree:
    """The antithetic estimate of ``grad f_sigma(params)`` (module doc), a tree like
    ``params``, for ``fn(params, *args)`` returning a 0-d tensor. The draws ``u`` come from
    ``generator`` (on the params' device), sample after sample and leaf after leaf in flatten
    order: the estimate is deterministic given its state, and ``num_samples=n`` equals the
    mean of n calls with ``num_samples=1`` on the same generator. Runs without a graph."""
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"zero_order: num_samples must be a positive int, got {num_samples!r}")
    if not sigma > 0:
        raise ValueError(f"zero_order: sigma must be > 0, got {sigma!r}")
    leaves, spec = tree_flatten(params)
    if not all(torch.is_tensor(p) and p.is_floating_point() for p in leaves):
        raise TypeError("zero_order: params must be a tree of floating-point tensors")
    total = [torch.zeros_like(p) for p in leaves]
    with torch.no_grad():
        for _ in range(num_samples):
            u = [torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
                 for p in leaves]
            plus = fn(tree_unflatten(spec, [p + sigma * e for p, e in zip(leaves, u)]), *args)
            minus = fn(tree_unflatten(spec, [p - sigma * e for p, e in zip(leaves, u)]), *args)
            d = (plus - minus) / (2 * sigma)
            total = [t + d * e for t, e in zip(total, u)]
    return tree_unflatten(spec, [t / num_samples for t in total])
