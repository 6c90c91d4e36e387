"""Implicit differentiation of a root (jaxopt's ``custom_root``, Blondel et al. 2022,
"Efficient and Modular Implicit Differentiation", arXiv 2105.15183; torchopt's ``custom_root``).

A solver returns ``x*(theta)`` with ``F(x*, theta) = 0`` (``F`` the optimality function, e.g.
the gradient of an inner objective). By the implicit function theorem
``dx*/dtheta = -(dF/dx)^{-1} dF/dtheta``, so for an outer gradient ``v = dL/dx*``:
``dL/dtheta = -(dF/dtheta)^T u`` with ``(dF/dx)^T u = v``. The linear system is solved
matrix-free: its product ``u -> (dF/dx)^T u`` is a vector-Jacobian product of ``F`` and its
transpose ``w -> (dF/dx) w`` a Jacobian-vector product (by double VJP, so any ``F`` autograd
can differentiate twice qualifies); the solver gets both (``solve(matvec, b, rmatvec=...)``,
:mod:`funcpar.meta.linear_solve`). The default, conjugate gradient, needs ``dF/dx`` symmetric
positive definite (``F`` the gradient of a strictly convex objective) and refuses, by its
residual check, a system that is not; ``solve_gmres`` or ``solve_normal_cg`` solve any
nonsingular one. The solver itself runs without a graph: its iterations are never unrolled.

The rule is a ``torch.autograd.Function`` with ``setup_context``, so ``torch.func.grad`` and
``torch.func.vjp`` compose with it; under ``torch.func.vmap`` its vmap rule runs the solver and
the backward once per batch member (iterative solvers branch on their residual, which a
batched tensor cannot do), so per-task hypergradients vmap at a loop's speed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from funcpar.meta.linear_solve import solve_cg
from funcpar.state.tree import Tree, tree_flatten, tree_unflatten

__all__ = ["custom_root"]

Solve = Callable[..., list[Tensor]]


def _differentiable(t: Any) -> bool:
    return torch.is_tensor(t) and (t.is_floating_point() or t.is_complex())


def custom_root(
    optimality_fn: Callable[..., Tree], solve: Solve | None = None, *,
    argnums: int | Sequence[int] | None = None, has_aux: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate ``solver(x0, *args, **kwargs) -> x*`` (``(x*, aux)`` with ``has_aux``) so that
    ``x*`` is differentiable through ``optimality_fn(x, *args, **kwargs) = 0`` (``F``, a tree
    of ``x``'s structure and shapes).

    Differentiated: the floating-point tensor leaves of the positional ``args`` selected by
    ``argnums`` (indices into ``args``, ``x0`` not counted; default: all of them) and of every
    keyword argument; each may be a tensor or a pytree of them (a dict of meta-parameters).
    Integer tensors (labels), ``x0`` and unselected arguments (data) are constants: no
    gradient is computed for them. ``aux`` passes through, detached.

    ``solve(matvec, b, *, rmatvec) -> u`` solves ``(dF/dx)^T u = b`` on flat leaf lists,
    ``rmatvec`` the transposed product (default :func:`~funcpar.meta.linear_solve.solve_cg`,
    which raises ``SolveError`` when it does not converge).
    """
    solve = solve_cg if solve is None else solve
    if isinstance(argnums, int):
        argnums = (argnums,)

    def decorator(solver: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(solver)
        def wrapped(x0: Tree, *args: Any, **kwargs: Any) -> Any:
            picked = range(len(args)) if argnums is None else argnums
            bad = [i for i in picked if not -len(args) <= i < len(args)]
            if bad:
                raise ValueError(f"custom_root: argnums {bad} out of range for {len(args)} "
                                 "positional arguments after x0")
            picked = {i % len(args) for i in picked}
            # Every tensor goes through the Function (a constant captured by a closure would
            # escape torch.func's levels); `wants` marks those to differentiate.
            parts = [x0, *args, kwargs]
            flat = [tree_flatten(p) for p in parts]
            wants = [leaf is not None and _differentiable(leaf) and (k - 1 in picked
                                                                     or k == len(parts) - 1)
                     for k, (leaves, _) in enumerate(flat) for leaf in leaves]
            leaves = [leaf for ls, _ in flat for leaf in ls]
            pos = [i for i, t in enumerate(leaves) if torch.is_tensor(t)]
            wants = [wants[i] for i in pos]
            sizes = [len(ls) for ls, _ in flat]

            def rebuild(tensors: Sequence[Tensor]) -> tuple[Tree, list[Any], dict[str, Any]]:
                full = list(leaves)
                for i, t in zip(pos, tensors, strict=True):
                    full[i] = t
                out, at = [], 0
                for (_, spec), n in zip(flat, sizes, strict=True):
                    out.append(tree_unflatten(spec, full[at:at + n]))
                    at += n
                return out[0], out[1:-1], out[-1]

            fn = _root_function(solver, optimality_fn, solve, rebuild, wants, has_aux)
            outs = fn.apply(*(leaves[i] for i in pos))
            x = tree_unflatten(fn.spec["x"], list(outs[:fn.spec["n"]]))
            if not has_aux:
                return x
            aux = list(fn.spec["aux"])
            for i, t in zip(fn.spec["aux_pos"], outs[fn.spec["n"]:], strict=True):
                aux[i] = t.detach()
            return x, tree_unflatten(fn.spec["aux_spec"], aux)

        return wrapped

    return decorator


def _root_function(solver: Callable[..., Any], optimality_fn: Callable[..., Tree],
                   solve: Solve, rebuild: Callable[..., Any], wants: list[bool],
                   has_aux: bool) -> type[torch.autograd.Function]:
    """The autograd.Function for one call: inputs are every tensor of ``(x0, args, kwargs)``,
    outputs ``x*``'s leaves then ``aux``'s tensor leaves; ``spec`` (a class attribute, filled by
    ``forward``) holds the output trees' structure."""

    class _Root(torch.autograd.Function):
        spec: ClassVar[dict[str, Any]] = {}

        @staticmethod
        def forward(*tensors: Tensor) -> tuple[Tensor, ...]:
            x0, args, kwargs = rebuild(tensors)
            with torch.no_grad():
                out = solver(x0, *args, **kwargs)
            x, aux = out if has_aux else (out, None)
            xs, _Root.spec["x"] = tree_flatten(x)
            if not all(torch.is_tensor(t) for t in xs):
                raise TypeError("custom_root: the solver must return a tree of tensors"
                                + (" as the first element of (x, aux)" if has_aux else ""))
            aux_leaves, _Root.spec["aux_spec"] = tree_flatten(aux)
            _Root.spec.update(n=len(xs), aux=aux_leaves,
                              aux_pos=[i for i, t in enumerate(aux_leaves) if torch.is_tensor(t)])
            # Outputs never alias inputs (a solver returning x0 as it is, say).
            return tuple(t.clone() if any(t is s for s in tensors) else t
                         for t in (*xs, *(aux_leaves[i] for i in _Root.spec["aux_pos"])))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, ...]):
            ctx.save_for_backward(*output[:_Root.spec["n"]], *inputs)
            ctx.n = _Root.spec["n"]
            if len(output) > ctx.n:
                ctx.mark_non_differentiable(*output[ctx.n:])

        @staticmethod
        def backward(ctx: Any, *v: Tensor | None) -> tuple[Tensor | None, ...]:
            saved = ctx.saved_tensors
            xs, inputs = list(saved[:ctx.n]), list(saved[ctx.n:])
            which = [i for i, w in enumerate(wants) if w and ctx.needs_input_grad[i]]
            if not which:
                return (None,) * len(inputs)
            spec = _Root.spec["x"]

            def f(x_leaves: list[Tensor], full: list[Tensor]) -> list[Tensor]:
                _, args, kwargs = rebuild(full)
                out, _ = tree_flatten(optimality_fn(tree_unflatten(spec, x_leaves), *args,
                                                    **kwargs))
                if len(out) != len(x_leaves) or any(
                        not torch.is_tensor(a) or a.shape != b.shape
                        for a, b in zip(out, x_leaves)):
                    raise ValueError("custom_root: optimality_fn(x, *args) must have the "
                                     "structure and shapes of x")
                return out

            def with_theta(theta: list[Tensor]) -> list[Tensor]:
                full = list(inputs)
                for i, t in zip(which, theta, strict=True):
                    full[i] = t
                return full

            b = [torch.zeros_like(x) if g is None else g for g, x in zip(v, xs)]
            # The adjoint solve as a Function of its own, every tensor it reads an input:
            # under vmap (per-task hypergradients, vmap over grad) its rule loops too.
            u = _adjoint(f, solve, len(xs), len(inputs))(*xs, *inputs, *b)
            _, vjp_theta = torch.func.vjp(lambda th: f(xs, with_theta(th)),
                                          [inputs[i] for i in which])
            (gt,) = vjp_theta([-ui for ui in u])
            grads: list[Tensor | None] = [None] * len(inputs)
            for i, g in zip(which, gt, strict=True):
                grads[i] = g
            return tuple(grads)

        @staticmethod
        def vmap(info: Any, in_dims: tuple[int | None, ...], *tensors: Tensor) -> Any:
            return _per_member(_Root.apply, info, in_dims, tensors)

    return _Root


def _per_member(apply: Callable[..., tuple[Tensor, ...]], info: Any,
                in_dims: tuple[int | None, ...], tensors: Sequence[Tensor],
                ) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
    """A vmap rule that runs ``apply`` once per batch member (module doc: the solvers branch
    on their residuals) and stacks the results on dim 0."""
    rows = [apply(*(t if d is None else t.select(d, i) for t, d in zip(tensors, in_dims)))
            for i in range(info.batch_size)]
    outs = tuple(torch.stack(col) for col in zip(*rows))
    return outs, (0,) * len(outs)


def _adjoint(f: Callable[[list[Tensor], list[Tensor]], list[Tensor]], solve: Solve, n: int,
             k: int) -> Callable[..., tuple[Tensor, ...]]:
    """``(*xs, *inputs, *b) -> u`` with ``(dF/dx)^T u = b`` at ``xs`` (``F = f(., inputs)``,
    ``n`` leaves of x, ``k`` inputs): the solver given ``matvec``, a VJP of ``F``, and
    ``rmatvec``, the VJP of that VJP (``(dF/dx) w``)."""

    class _Adjoint(torch.autograd.Function):
        @staticmethod
        def forward(*tensors: Tensor) -> tuple[Tensor, ...]:
            xs, inputs, b = (list(tensors[:n]), list(tensors[n:n + k]),
                             list(tensors[n + k:]))
            _, vjp_x = torch.func.vjp(lambda xl: f(xl, inputs), xs)
            jvp: list[Callable[..., tuple[list[Tensor]]]] = []

            def matvec(u: list[Tensor]) -> list[Tensor]:  # (dF/dx)^T u
                return list(vjp_x(list(u))[0])

            def rmatvec(w: list[Tensor]) -> list[Tensor]:  # (dF/dx) w
                if not jvp:  # linearised once, on the first call (only general solvers ask)
                    jvp.append(torch.func.vjp(matvec, [torch.zeros_like(x) for x in xs])[1])
                return list(jvp[0](list(w))[0])

            return tuple(solve(matvec, b, rmatvec=rmatvec))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, *grads: Tensor) -> Any:
            raise RuntimeError("custom_root: the implicit gradient is not differentiable again")

        @staticmethod
        def vmap(info: Any, in_dims: tuple[int | None, ...], *tensors: Tensor) -> Any:
            return _per_member(_Adjoint.apply, info, in_dims, tensors)

    return _Adjoint.apply
