"""Implicit differentiation of a root (jaxopt's ``custom_root``, Blondel et al. 2022,
arXiv 2105.15183; torchopt's ``custom_root``).

A solver returns ``x*(theta)`` with ``F(x*, theta) = 0`` (``F`` the optimality function, e.g.
the gradient of an inner objective). By the implicit function theorem
``dx*/dtheta = -(dF/dx)^{-1} dF/dtheta``, so for an outer gradient ``v = dL/dx*``:
``dL/dtheta = -(dF/dtheta)^T u`` with ``(dF/dx)^T u = v``. The linear system is solved matrix-free
(vector-Jacobian products of ``F`` by autograd; Hessian-vector products when ``F`` is a gradient)
by conjugate gradient, which needs ``dF/dx`` symmetric positive definite (true when ``F`` is the
gradient of a strictly convex objective); pass ``solve=`` for anything else. The solver itself
runs without a graph: its iterations are never unrolled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from funcpar.meta.linear_solve import solve_cg
from funcpar.state.tree import Tree, tree_flatten, tree_unflatten

__all__ = ["custom_root"]


def custom_root(
    optimality_fn: Callable[..., Tree], solve: Callable[..., list[Tensor]] | None = None,
) -> Callable[[Callable[..., Tree]], Callable[..., Tree]]:
    """Decorate ``solver(x0, *theta) -> x*`` so that ``x*`` is differentiable w.r.t. the tensor
    arguments ``theta`` through ``optimality_fn(x, *theta) = 0`` (same tree as ``x``).

    ``solve(matvec, b) -> u`` solves ``(dF/dx)^T u = b`` on flat leaf lists
    (default :func:`~funcpar.meta.linear_solve.solve_cg`). ``x0`` is not differentiated.
    """
    solve = solve_cg if solve is None else solve

    def decorator(solver: Callable[..., Tree]) -> Callable[..., Tree]:
        @functools.wraps(solver)
        def wrapped(x0: Tree, *theta: Any) -> Tree:
            tensors = [i for i, t in enumerate(theta) if torch.is_tensor(t)]
            holder: dict[str, Any] = {}

            class _Root(torch.autograd.Function):
                @staticmethod
                def forward(ctx, *theta_t: Tensor) -> tuple[Tensor, ...]:
                    with torch.no_grad():
                        x = solver(x0, *theta)
                    leaves, holder["spec"] = tree_flatten(x)
                    ctx.save_for_backward(*leaves, *theta_t)
                    ctx.n = len(leaves)
                    return tuple(leaves)

                @staticmethod
                def backward(ctx, *v: Tensor) -> tuple[Tensor | None, ...]:
                    saved = ctx.saved_tensors
                    xs = [x.detach().requires_grad_(True) for x in saved[:ctx.n]]
                    ths = [t.detach().requires_grad_(True) for t in saved[ctx.n:]]
                    args = list(theta)
                    for i, t in zip(tensors, ths):
                        args[i] = t
                    with torch.enable_grad():
                        f, _ = tree_flatten(optimality_fn(tree_unflatten(holder["spec"], xs),
                                                               *args))
                    if len(f) != len(xs) or any(a.shape != b.shape for a, b in zip(f, xs)):
                        raise ValueError("custom_root: optimality_fn(x, *theta) must have the "
                                         "structure and shapes of x")

                    def rmatvec(u: list[Tensor]) -> list[Tensor]:
                        # (dF/dx)^T u: one vector-Jacobian product through the kept graph.
                        gs = torch.autograd.grad(f, xs, u, retain_graph=True, allow_unused=True)
                        return [g if g is not None else torch.zeros_like(x)
                                for g, x in zip(gs, xs)]

                    vs = [g if g is not None else torch.zeros_like(x) for g, x in zip(v, xs)]
                    u = solve(rmatvec, vs)
                    gt = torch.autograd.grad(f, ths, [-ui for ui in u], allow_unused=True)
                    return tuple(gt)

            theta_t = [theta[i] for i in tensors]
            out = _Root.apply(*theta_t)
            return tree_unflatten(holder["spec"], list(out))

        return wrapped

    return decorator
