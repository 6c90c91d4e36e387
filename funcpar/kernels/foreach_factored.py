"""The eager fast path of the factored optimizers' passes (Adafactor, CAME): in-place plain torch.

Where no Triton kernel runs (CPU, or a GPU without Triton) the passes of
:mod:`funcpar.kernels.factored` would run their ``*_reference`` one leaf at a time, each torch
operation allocating a leaf-sized result. The functions here compute *the same torch
operations in the same order* (so the same bits: every rounding of the references is kept, and
the exactness tests against transformers / came-pytorch hold unchanged) but write into
buffers instead of fresh tensors:

* the leaf-sized temporaries of a pass (``g^2 + eps``, the preconditioned update whose norm is
  taken, CAME's residual) go to one scratch buffer per batch call, reused leaf after leaf;
* running statistics (a full second moment ``V``, the momentum ``M``) and, for the update pass
  with ``out="param"``, the parameter itself are updated in place inside
  :func:`funcpar.kernels.inplace.inplace_updates` (a donated step), else written to fresh
  tensors by the same operations (``torch.mul(a, b, out=...)`` is ``a * b`` bit for bit), so
  donated and undonated steps are bit-identical ("one maths path").

One deliberate difference from the references: a decoupled weight decay whose coefficient is
exactly 0 (Adafactor's default ``weight_decay=0.0``) is skipped, as transformers' Adafactor
and came-pytorch skip it; the reference's ``p + (-0) p`` differs from ``p`` only for ``p = -0``
and non-finite ``p``.

:func:`eager_ok` says when a leaf may take this path (:func:`funcpar.kernels.inplace.fast_path_ok`:
never when the step must be differentiable, hyperparameters included, nor under a torch.func
transform or inside ``torch.compile``'s tracing; contiguous, non-empty leaf tensors on one
device). Each ``*_fast`` takes the canonical arguments of many leaves (as the ``many`` of
:func:`funcpar.kernels.factored.execute_batched`) and returns their results in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from funcpar.kernels.inplace import fast_path_ok, inplace_allowed

__all__ = [
    "came_residual_fast",
    "eager_ok",
    "factor_ema_fast",
    "full_moment_fast",
    "host_equals",
    "precond_apply_fast",
    "scaled_norm_fast",
    "sq_row_col_sums_fast",
]


def eager_ok(tensors: Sequence[Tensor | None], hyper: Sequence[Any] = ()) -> bool:
    """Whether a pass over ``tensors`` (its leaf-sized and factor tensors) with the tensor
    hyperparameters ``hyper`` may run here instead of the per-leaf reference."""
    live = [t for t in tensors if t is not None]
    if not live or torch.compiler.is_compiling() or not fast_path_ok(*live, *hyper):
        return False
    return (len({t.device for t in live}) == 1
            and all(t.is_contiguous() and t.numel() > 0 for t in live))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # funcpar.kernels.factored.compute_dtype (not imported: factored imports this module).
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _to_compute(x: Tensor) -> Tensor:
    return x.to(_compute_dtype(x.dtype))


class _Scalars:
    """Hyperparameters as the references cast them (``torch.as_tensor(x, float64).to(dtype)``),
    converted once per value and dtype for all leaves of a call."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, torch.dtype], tuple[Any, Tensor]] = {}
        self._derived: dict[tuple[int, str], tuple[Any, Tensor]] = {}

    def __call__(self, x: Any, dtype: torch.dtype) -> Tensor:
        key = (id(x), dtype)
        hit = self._memo.get(key)
        if hit is None:
            # x is kept alive in the memo, so its id is not reused while the memo lives.
            hit = (x, torch.as_tensor(x, dtype=torch.float64).to(dtype))
            self._memo[key] = hit
        return hit[1]

    def derived(self, x: Any, how: str, dtype: torch.dtype) -> Tensor:
        """``1 - x`` (``how="one_minus"``, :func:`funcpar.kernels.factored.ema`'s weight) or
        ``-x`` (``"neg"``, :func:`funcpar.kernels.factored.decoupled_decay`'s), formed in
        float64 and then cast, as the references form them."""
        key = (id(x), how)
        hit = self._derived.get(key)
        if hit is None:
            x64 = torch.as_tensor(x, dtype=torch.float64)
            hit = (x, 1 - x64 if how == "one_minus" else -x64)
            self._derived[key] = hit
        return self(hit[1], dtype)


class _Scratch:
    """One leaf-sized temporary per (device, dtype), as large as the largest leaf of the call,
    viewed in each leaf's shape from offset 0 (so a reduction over it sees the layout a fresh
    contiguous tensor has)."""

    def __init__(self, like: Sequence[Tensor]) -> None:
        self._size: dict[tuple, int] = {}
        for t in like:
            key = (t.device, _compute_dtype(t.dtype))
            self._size[key] = max(self._size.get(key, 0), t.numel())
        self._buf: dict[tuple, Tensor] = {}

    def __call__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (device, dtype)
        buf = self._buf.get(key)
        if buf is None:
            buf = self._buf[key] = torch.empty(self._size[key], dtype=dtype, device=device)
        return buf[: shape.numel()].view(shape)


def _ema(avg: Tensor, new: Tensor, decay: Any, sc: _Scalars, *, state: bool) -> Tensor:
    """:func:`funcpar.kernels.factored.ema` (``addcmul(avg * d, new, 1 - d)``): in place on a
    state ``avg`` inside inplace_updates, else into a fresh tensor, by the same operations."""
    d, omd = sc(decay, avg.dtype), sc.derived(decay, "one_minus", avg.dtype)
    out = avg.mul_(d) if state and inplace_allowed() else torch.mul(avg, d)
    return out.addcmul_(new, omd)


def _inverse_sqrt_into(buf: Tensor, precond: Any) -> Tensor:
    """``inverse_sqrt(precond)`` (the outer product ``rsqrt(R / mean(R)) rsqrt(C)`` or
    ``rsqrt(V)``) written into ``buf``."""
    if torch.is_tensor(precond):
        return torch.rsqrt(precond, out=buf)
    row, col, row_mean = precond
    return torch.mul((row / row_mean).rsqrt(), col.rsqrt(), out=buf)


def sq_row_col_sums_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.sq_row_col_sums_reference` for many leaves
    (``(g, eps)`` each), ``g^2 + eps`` in the scratch buffer."""
    scratch = _Scratch([c[0] for c in calls])
    out = []
    for g, eps in calls:
        g = _to_compute(g)
        x = torch.mul(g, g, out=scratch(g.shape, g.dtype, g.device)).add_(eps)
        out.append((x.sum(-1, keepdim=True), x.sum(-2, keepdim=True)))
    return out


def scaled_norm_fast(calls: list[tuple]) -> list[Tensor]:
    """:func:`funcpar.kernels.factored.scaled_norm_reference` for many leaves
    (``(g, factors)`` each), ``inverse_sqrt(factors) * g`` in the scratch buffer."""
    scratch = _Scratch([c[0] for c in calls])
    out = []
    for g, factors in calls:
        g = _to_compute(g)
        u = _inverse_sqrt_into(scratch(g.shape, g.dtype, g.device), factors).mul_(g)
        out.append(torch.linalg.vector_norm(u))
    return out


def full_moment_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.full_moment_reference` for many leaves
    (``(g, v, decay, eps)`` each): ``V`` updated in place when donated."""
    scratch = _Scratch([c[0] for c in calls])
    sc = _Scalars()
    out = []
    for g, v, decay, eps in calls:
        g = _to_compute(g)
        x = torch.mul(g, g, out=scratch(g.shape, g.dtype, g.device)).add_(eps)
        v = _ema(v, x, decay, sc, state=True)
        u = torch.rsqrt(v, out=x).mul_(g)
        out.append((v, torch.linalg.vector_norm(u)))
    return out


def came_residual_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.came_residual_reference` for many leaves
    (``(g, factors, clip, m, beta1, eps2)`` each): ``M`` updated in place when donated, ``u``
    and then the residual ``(u - M')^2 + eps2`` in the scratch buffer."""
    scratch = _Scratch([c[0] for c in calls])
    sc = _Scalars()
    out = []
    for g, factors, clip, m, beta1, eps2 in calls:
        g = _to_compute(g)
        u = _inverse_sqrt_into(scratch(g.shape, g.dtype, g.device), factors).mul_(g)
        if not host_equals(clip, 1.0):
            u = u.div_(clip.to(u.dtype))
        m = _ema(m, u, beta1, sc, state=True)
        res = u.sub_(m).pow_(2).add_(eps2)
        out.append((m, res.sum(-1, keepdim=True), res.sum(-2, keepdim=True)))
    return out


def host_equals(x: Any, value: float) -> bool:
    """``x`` is a host value equal to ``value`` (read without a device sync). The passes skip
    a division by a clip divisor of exactly 1 (``y / 1`` is ``y``, bit for bit: the update's
    RMS is under the threshold, the common case) and a decay of exactly 0 (module docstring)."""
    if torch.is_tensor(x):
        return x.device.type == "cpu" and x.numel() == 1 and float(x) == value
    return float(x) == value


def precond_apply_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor | None]]:
    """:func:`funcpar.kernels.factored.precond_apply_reference` for many leaves
    (``(x, p, precond, kw)`` each). Inside inplace_updates the momentum and, with
    ``out="param"``, the parameter are updated in place (the update itself in the scratch
    buffer); otherwise every result is a fresh tensor written by the same operations."""
    donated = inplace_allowed()
    scratch = _Scratch([c[0] for c in calls])
    sc = _Scalars()
    out = []
    for x, p, precond, kw in calls:
        y_in = _to_compute(x)
        dt = y_in.dtype
        mode = kw["out"]
        in_place_p = donated and mode == "param" and p.dtype == dt
        buf = (scratch(y_in.shape, dt, y_in.device) if in_place_p
               else torch.empty_like(y_in, memory_format=torch.contiguous_format))
        if precond is not None:
            y = _inverse_sqrt_into(buf, precond).mul_(y_in)
        else:
            y = buf.copy_(y_in)
        if kw["clip"] is not None and not host_equals(kw["clip"], 1.0):
            y.div_(kw["clip"].to(dt))
        if kw["pre"] is not None:
            y.mul_(sc(kw["pre"], dt))
        m_new = None
        if kw["momentum"] is not None:
            m_new = y = _ema(kw["momentum"], y, kw["beta1"], sc, state=True)
            if kw["post"] is not None:  # y is the state now: the product goes to buf
                y = torch.mul(m_new, sc(kw["post"], dt), out=buf)
        elif kw["post"] is not None:
            y.mul_(sc(kw["post"], dt))
        if mode == "direction":
            out.append((y, m_new))
            continue
        p32 = p.to(dt)
        decay = kw["decay"]
        if decay is not None and host_equals(decay, 0.0):
            decay = None
        if in_place_p:
            if decay is not None:
                p.addcmul_(p, sc.derived(decay, "neg", dt))  # p - decay p, as the reference
            out.append((p.sub_(y), m_new))
            continue
        if decay is None:
            # p - y into y's buffer (an elementwise op may write over its own input).
            new_p = torch.sub(p32, y, out=buf if y is buf else torch.empty_like(y))
        else:
            new_p = torch.addcmul(p32, p32, sc.derived(decay, "neg", dt)).sub_(y)
        if mode == "update":
            out.append((new_p.sub_(p32), m_new))
        else:
            out.append((new_p.to(p.dtype), m_new))
    return out


def factor_ema_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.factor_ema_reference` for many leaves
    (``(row_sum, col_sum, row, col, decay, n, m, local_sum)`` each): the means and the factors'
    EMAs as multi-tensor ops over all leaves' row and column factors (per decay and dtype),
    then each leaf's ``mean(R')`` (or, ``local_sum``, ``sum(R')``). Small tensors: written
    fresh, the references' operations."""
    out: list[Any] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault((id(c[4]), c[2].dtype), []).append(i)
    sc = _Scalars()
    for (_, dtype), idx in groups.items():
        cs = [calls[i] for i in idx]
        decay = cs[0][4]
        # row_sum / m and col_sum / n (the global sizes of the other dim), then
        # ema(avg, mean) = addcmul(avg * d, mean, 1 - d) for rows and columns together.
        means = torch._foreach_div([c[0] for c in cs] + [c[1] for c in cs],
                                   [float(c[6]) for c in cs] + [float(c[5]) for c in cs])
        stats = torch._foreach_mul([c[2] for c in cs] + [c[3] for c in cs], sc(decay, dtype))
        torch._foreach_addcmul_(stats, means,
                                [sc.derived(decay, "one_minus", dtype)] * len(stats))
        for j, (i, c) in enumerate(zip(idx, cs)):
            row, col = stats[j], stats[len(cs) + j]
            nd = row.dim()
            part = (row.sum(dim=nd - 2, keepdim=True) if c[7]
                    else row.mean(dim=(nd - 2,), keepdim=True))
            out[i] = (row, col, part)
    return out
