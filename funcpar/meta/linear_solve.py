"""Matrix-free linear solvers for implicit differentiation: ``A x = b`` given ``A`` as a
matrix-vector product over flat lists of tensors (one per leaf)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["solve_cg", "solve_normal_cg"]

Vec = list[Tensor]
MatVec = Callable[[Vec], Vec]


def _dot(a: Vec, b: Vec) -> Tensor:
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


def _axpy(alpha: Tensor, x: Vec, y: Vec) -> Vec:
    return [yi + alpha * xi for xi, yi in zip(x, y, strict=True)]


def solve_cg(matvec: MatVec, b: Vec, *, tol: float = 1e-10, maxiter: int | None = None) -> Vec:
    """Conjugate gradient (Hestenes & Stiefel 1952) for symmetric positive definite ``A``,
    from ``x_0 = 0``, until ``||r|| <= tol * ||b||`` or ``maxiter`` (default: the size of b)
    iterations."""
    n = sum(t.numel() for t in b)
    maxiter = n if maxiter is None else maxiter
    x = [torch.zeros_like(t) for t in b]
    r = list(b)
    p = list(r)
    rs = _dot(r, r)
    stop = tol**2 * rs
    for _ in range(maxiter):
        if rs <= stop:
            break
        ap = matvec(p)
        alpha = rs / _dot(p, ap)
        x = _axpy(alpha, p, x)
        r = _axpy(-alpha, ap, r)
        rs_new = _dot(r, r)
        p = _axpy(rs_new / rs, p, r)
        rs = rs_new
    return x


def solve_normal_cg(matvec: MatVec, b: Vec, *, rmatvec: MatVec, tol: float = 1e-10,
                    maxiter: int | None = None) -> Vec:
    """CG on the normal equations ``A^T A x = A^T b``, for any nonsingular ``A``
    (``rmatvec`` is ``v -> A^T v``)."""
    return solve_cg(lambda v: rmatvec(matvec(v)), rmatvec(b), tol=tol, maxiter=maxiter)
