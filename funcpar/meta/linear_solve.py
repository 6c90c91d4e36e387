"""Matrix-free linear solvers for implicit differentiation: ``A x = b`` given ``A`` as a
matrix-vector product over flat lists of tensors (one per leaf).

Every solver has the signature ``solve(matvec, b, *, rmatvec=None, ...) -> x`` (``rmatvec`` is
``v -> A^T v``; :func:`~funcpar.meta.implicit.custom_root` always passes it) and checks its
answer: the true residual ``||b - A x||`` is recomputed at the end (one more product) and a
residual above ``10 * tol * ||b||`` raises :class:`SolveError` (``on_fail="warn"``: a warning,
and the answer is returned anyway). Which solver for which system:

============================  =================================  ===========================
``A``                         solver                             cost per iteration
============================  =================================  ===========================
symmetric positive definite   :func:`solve_cg` (the default)     one ``matvec``
any nonsingular               :func:`solve_gmres`                one ``matvec``, ``k`` dots
any nonsingular               :func:`solve_normal_cg`            ``matvec`` + ``rmatvec``
============================  =================================  ===========================

CG on a non-symmetric ``A`` does not converge to ``A^{-1} b`` (it minimises nothing there):
the residual check is what refuses its answer. :func:`solve_normal_cg` squares the condition
number (its accuracy degrades first); GMRES does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = ["SolveError", "solve_cg", "solve_gmres", "solve_normal_cg"]

Vec = list[Tensor]
MatVec = Callable[[Vec], Vec]
OnFail = Literal["raise", "warn"]


class SolveError(RuntimeError):
    """A linear solve ended with a residual above its tolerance: its answer would be wrong."""


def _dot(a: Vec, b: Vec) -> Tensor:
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


def _norm(a: Vec) -> Tensor:
    return _dot(a, a).sqrt()


def _axpy(alpha: Tensor, x: Vec, y: Vec) -> Vec:
    return [yi + alpha * xi for xi, yi in zip(x, y, strict=True)]


def _tol(b: Vec, tol: float | None) -> float:
    """The default relative tolerance: 1e-10, or 100 ulps of ``b``'s dtype where that is
    coarser (float32: 1.2e-5; a float32 solve cannot reach 1e-10)."""
    if tol is not None:
        return tol
    eps = max((torch.finfo(t.dtype).eps for t in b if t.is_floating_point()), default=0.0)
    return max(1e-10, 100 * eps)


def check_residual(matvec: MatVec, x: Vec, b: Vec, tol: float, on_fail: OnFail,
                   who: str) -> Vec:
    """``x``, after checking ``||b - A x|| <= 10 tol ||b||`` on the recomputed (not the
    recursively updated) residual; the factor 10 is the slack for rounding between the two.
    Raises :class:`SolveError` or warns (``on_fail``) naming the solver and both numbers."""
    if on_fail not in ("raise", "warn"):
        raise ValueError(f"{who}: on_fail must be 'raise' or 'warn', got {on_fail!r}")
    r = _norm(_axpy(torch.tensor(-1.0, dtype=torch.float64), matvec(x), b))
    bn = _norm(b)
    if bool(r.detach() <= 10 * tol * bn.detach()):
        return x
    msg = (f"{who}: the relative residual ||b - A x|| / ||b|| is {float(r / bn):.3g}, above "
           f"{10 * tol:.3g}: the solve did not converge")
    if who == "solve_cg":
        msg += (" (conjugate gradient needs A symmetric positive definite; for a general "
                "system use solve_gmres or solve_normal_cg)")
    if on_fail == "raise":
        raise SolveError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return x


def _cg(matvec: MatVec, b: Vec, tol: float, maxiter: int) -> Vec:
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


def _size(b: Vec) -> int:
    return sum(t.numel() for t in b)


def solve_cg(matvec: MatVec, b: Vec, *, rmatvec: MatVec | None = None, tol: float | None = None,
             maxiter: int | None = None, on_fail: OnFail = "raise") -> Vec:
    """Conjugate gradient (Hestenes & Stiefel 1952) for symmetric positive definite ``A``,
    from ``x_0 = 0``, until ``||r|| <= tol ||b||`` or ``maxiter`` (default: the size of b)
    iterations, then the residual check (module doc). ``rmatvec`` is not used (``A^T = A``)."""
    tol = _tol(b, tol)
    x = _cg(matvec, b, tol, _size(b) if maxiter is None else maxiter)
    return check_residual(matvec, x, b, tol, on_fail, "solve_cg")


def solve_normal_cg(matvec: MatVec, b: Vec, *, rmatvec: MatVec, tol: float | None = None,
                    maxiter: int | None = None, on_fail: OnFail = "raise") -> Vec:
    """CG on the normal equations ``A^T A x = A^T b``, for any nonsingular ``A``
    (``rmatvec`` is ``v -> A^T v``); the residual check is on ``A x = b`` itself."""
    tol = _tol(b, tol)
    # The normal system's tolerance is tighter by cond(A) in the worst case: iterate to the
    # dtype's limit (a tenth of tol), and let the check on A x = b judge the answer.
    x = _cg(lambda v: rmatvec(matvec(v)), rmatvec(b), tol / 10,
            2 * _size(b) if maxiter is None else maxiter)
    return check_residual(matvec, x, b, tol, on_fail, "solve_normal_cg")


def solve_gmres(matvec: MatVec, b: Vec, *, rmatvec: MatVec | None = None,
                tol: float | None = None, restart: int = 50, maxiter: int | None = None,
                on_fail: OnFail = "raise") -> Vec:
    """Restarted GMRES (Saad & Schultz 1986) for any nonsingular ``A``: each cycle builds an
    orthonormal Krylov basis ``V_k`` of ``A`` from the residual (Arnoldi, modified
    Gram-Schmidt, ``A V_k = V_{k+1} H_k``) and takes ``x + V_k y`` with ``y`` minimising
    ``||beta e_1 - H_k y||`` (a small least-squares solve); cycles of at most ``restart``
    products until ``||r|| <= tol ||b||`` or ``maxiter`` products (default: twice the size
    of b), then the residual check (module doc). ``rmatvec`` is not used."""
    tol = _tol(b, tol)
    n = _size(b)
    maxiter = 2 * n if maxiter is None else maxiter
    bn = _norm(b)
    x = [torch.zeros_like(t) for t in b]
    r, used = list(b), 0
    while used < maxiter:
        beta = _norm(r)
        if bool(beta.detach() <= tol * bn.detach()):
            break
        basis = [[t / beta for t in r]]
        k = min(restart, n, maxiter - used)
        h = torch.zeros(k + 1, k, dtype=torch.float64, device=b[0].device)
        for j in range(k):
            w = matvec(basis[j])
            used += 1
            for i in range(j + 1):
                h[i, j] = _dot(w, basis[i])
                w = _axpy(-h[i, j], basis[i], w)
            h[j + 1, j] = _norm(w)
            # A happy breakdown: the solution lies in the basis already.
            if float(h[j + 1, j].detach()) <= 1e-14 * float(beta.detach()):
                k = j + 1
                break
            basis.append([t / h[j + 1, j] for t in w])
        rhs = torch.zeros(k + 1, dtype=torch.float64, device=b[0].device)
        rhs[0] = beta
        y = torch.linalg.lstsq(h[:k + 1, :k], rhs[:k + 1, None]).solution[:, 0]
        for i in range(k):
            x = _axpy(y[i], basis[i], x)
        r = _axpy(torch.tensor(-1.0, dtype=torch.float64), matvec(x), b)
    return check_residual(matvec, x, b, tol, on_fail, "solve_gmres")
