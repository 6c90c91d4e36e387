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

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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


def eager_allowed() -> bool:
    """Whether the eager path may run at all now: not inside ``torch.compile``'s tracing nor
    under a torch.func transform (:func:`funcpar.kernels.inplace.fast_path_ok` with no
    tensors). The same for every leaf of a pass, so asked once per batch."""
    return not torch.compiler.is_compiling() and fast_path_ok()


def eager_leaf_ok(tensors: Sequence[Tensor | None]) -> bool:
    """The per-leaf part of :func:`eager_ok` (differentiability aside): the leaf's tensors
    are non-empty, contiguous and on one device."""
    first = None
    for t in tensors:
        if t is None:
            continue
        if not t.is_contiguous() or t.numel() == 0:
            return False
        if first is None:
            first = t
        elif t.is_cpu is not first.is_cpu or (not t.is_cpu and t.device != first.device):
            return False
    return first is not None


def eager_ok(tensors: Sequence[Tensor | None], hyper: Sequence[Any] = ()) -> bool:
    """Whether a pass over ``tensors`` (its leaf-sized and factor tensors) with the tensor
    hyperparameters ``hyper`` may run here instead of the per-leaf reference:
    :func:`eager_allowed`, :func:`eager_leaf_ok` and nothing to differentiate."""
    live = [t for t in tensors if t is not None]
    return eager_allowed() and eager_leaf_ok(live) and fast_path_ok(*live, *hyper)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # funcpar.kernels.factored.compute_dtype (not imported: factored imports this module).
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _to_compute(x: Tensor) -> Tensor:
    # No call at all when x is in its compute dtype already (the usual case).
    dtype = x.dtype
    return x.to(torch.float32) if dtype is torch.float16 or dtype is torch.bfloat16 else x


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


# The scratch of the current step (scratch_scope), else None: each batch call its own.
_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("funcpar_factored_scratch",
                                                                    default=None)


@contextlib.contextmanager
def scratch_scope() -> Iterator[None]:
    """Let the passes run inside share their scratch buffers (and the views of them in each
    leaf's shape): one buffer per (device, dtype) for the whole step instead of one per pass,
    released when the scope ends. A scope inside another is the outer one. Only the passes'
    own temporaries live there: no pass returns a tensor that aliases the scratch."""
    if _SCOPE.get() is not None:
        yield
        return
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


class _Scratch:
    """One leaf-sized temporary per (device, dtype), as large as the largest leaf of the call,
    viewed in each leaf's shape from offset 0 (so a reduction over it sees the layout a fresh
    contiguous tensor has). Inside :func:`scratch_scope` the buffer and its views are the
    scope's, shared by the step's passes."""

    def __init__(self, like: Sequence[Tensor]) -> None:
        self._size: dict[tuple, int] = {}
        for t in like:
            key = (t.device, _compute_dtype(t.dtype))
            n = t.numel()
            if n > self._size.get(key, 0):
                self._size[key] = n
        scope = _SCOPE.get()
        self._store: dict = {} if scope is None else scope

    def __call__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (device, dtype)
        views = self._store.get(key)
        if views is None or views[None].numel() < self._size[key]:
            # views[None]: the buffer itself; a bigger one drops the views of the old one.
            views = self._store[key] = {None: torch.empty(self._size[key], dtype=dtype,
                                                          device=device)}
        view = views.get(shape)
        if view is None:
            view = views[shape] = views[None][: shape.numel()].view(shape)
        return view


def _rsqrt_factors(precond: Sequence[Any]) -> list[Any]:
    """For each leaf's preconditioner, what :func:`_inverse_sqrt_into` multiplies: the factors'
    ``(rsqrt(R / mean(R)), rsqrt(C))`` (formed by multi-tensor ops over all leaves, the same
    operations as one leaf at a time) or a full ``V`` itself. Inside :func:`scratch_scope`
    they are formed once per :class:`~funcpar.kernels.factored.Factors` for the step (the norm
    pass and the passes after it get the same object): the scope keeps each such object, so
    its ``id`` names it until the scope ends."""
    scope = _SCOPE.get()
    memo = None if scope is None else scope.setdefault("rsqrt", {})
    out = list(precond)
    idx = []
    for i, f in enumerate(precond):
        if f is None or torch.is_tensor(f):
            continue
        hit = None if memo is None else memo.get(id(f))
        if hit is not None and hit[0] is f:
            out[i] = hit[1]
        else:
            idx.append(i)
    if idx:
        rows = torch._foreach_div([precond[i][0] for i in idx], [precond[i][2] for i in idx])
        torch._foreach_rsqrt_(rows)
        cols = torch._foreach_rsqrt([precond[i][1] for i in idx])
        for i, r, c in zip(idx, rows, cols):
            out[i] = (r, c)
            if memo is not None:
                memo[id(precond[i])] = (precond[i], out[i])
    return out


def _ema(avg: Tensor, new: Tensor, decay: Any, sc: _Scalars, *, state: bool) -> Tensor:
    """:func:`funcpar.kernels.factored.ema` (``addcmul(avg * d, new, 1 - d)``): in place on a
    state ``avg`` inside inplace_updates, else into a fresh tensor, by the same operations."""
    d, omd = sc(decay, avg.dtype), sc.derived(decay, "one_minus", avg.dtype)
    out = avg.mul_(d) if state and inplace_allowed() else torch.mul(avg, d)
    return out.addcmul_(new, omd)


def _inverse_sqrt_into(buf: Tensor, precond: Any) -> Tensor:
    """``inverse_sqrt(precond)`` (the outer product ``rsqrt(R / mean(R)) rsqrt(C)`` of the
    pair :func:`_rsqrt_factors` formed, or ``rsqrt(V)``) written into ``buf``."""
    if torch.is_tensor(precond):
        return torch.rsqrt(precond, out=buf)
    row_rsqrt, col_rsqrt = precond
    return torch.mul(row_rsqrt, col_rsqrt, out=buf)


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
    for (g, _), pre in zip(calls, _rsqrt_factors([c[1] for c in calls])):
        g = _to_compute(g)
        u = _inverse_sqrt_into(scratch(g.shape, g.dtype, g.device), pre).mul_(g)
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
    ones = _host_equal_all([c[2] for c in calls], 1.0)
    out = []
    for (g, _, clip, m, beta1, eps2), pre, one in zip(
            calls, _rsqrt_factors([c[1] for c in calls]), ones):
        g = _to_compute(g)
        u = _inverse_sqrt_into(scratch(g.shape, g.dtype, g.device), pre).mul_(g)
        if not one:
            u = u.div_(clip.to(u.dtype))
        m = _ema(m, u, beta1, sc, state=True)
        res = u.sub_(m).pow_(2).add_(eps2)
        out.append((m, res.sum(-1, keepdim=True), res.sum(-2, keepdim=True)))
    return out


def host_equals(x: Any, value: float) -> bool:
    """``x`` is a host value equal to ``value`` (read without a device sync). The passes skip
    a division by a clip divisor of exactly 1 (``y / 1`` is ``y``, bit for bit: the update's
    RMS is under the threshold, the common case) and a decay of exactly 0 (module docstring).
    A tensor that cannot be read on the host now (traced by torch.compile or the whole-step
    region's make_fx, or wrapped by a torch.func transform) is never taken as equal: the skip
    is an optimisation, never needed for the result."""
    if torch.is_tensor(x):
        # eager_allowed: float() of a traced or functorch-wrapped tensor fails (or would bake
        # a value into a graph).
        return (x.device.type == "cpu" and x.numel() == 1 and eager_allowed()
                and float(x) == value)
    return float(x) == value


def _host_equal_all(xs: Sequence[Any], value: float) -> list[bool]:
    """:func:`host_equals` of each of ``xs`` (``None``: False), the host tensors among them
    read together (one read instead of one per leaf: the clip divisors of all leaves)."""
    out = [False] * len(xs)
    host = []
    for i, x in enumerate(xs):
        if x is None:
            continue
        if not torch.is_tensor(x):
            out[i] = float(x) == value
        elif x.device.type == "cpu" and x.numel() == 1 and eager_allowed():
            host.append(i)
    if len(host) == 1:
        out[host[0]] = float(xs[host[0]]) == value
    elif host:
        # float64 holds every value of the float dtypes exactly: == compares as float(x) does.
        values = torch.stack([_f64_scalar(xs[i]) for i in host]).tolist()
        for i, v in zip(host, values):
            out[i] = v == value
    return out


def _f64_scalar(x: Tensor) -> Tensor:
    if x.dim():
        x = x.reshape(())
    return x if x.dtype == torch.float64 else x.to(torch.float64)


def precond_apply_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor | None]]:
    """:func:`funcpar.kernels.factored.precond_apply_reference` for many leaves
    (``(x, p, precond, kw)`` each). Inside inplace_updates the momentum and, with
    ``out="param"``, the parameter are updated in place (the update itself in the scratch
    buffer); otherwise every result is a fresh tensor written by the same operations."""
    donated = inplace_allowed()
    scratch = _Scratch([c[0] for c in calls])
    sc = _Scalars()
    ones = _host_equal_all([c[3]["clip"] for c in calls], 1.0)
    no_decay = _host_equal_all([c[3]["decay"] for c in calls], 0.0)
    out = []
    for (x, p, _, kw), precond, clip_one, decay_zero in zip(
            calls, _rsqrt_factors([c[2] for c in calls]), ones, no_decay):
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
        if kw["clip"] is not None and not clip_one:
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
        decay = None if decay_zero else kw["decay"]
        if in_place_p:
            if decay is not None:
                p.addcmul_(p, sc.derived(decay, "neg", dt))  # p - decay p, as the reference
            out.append((p.sub_(y), m_new))
            continue
        p32 = p if p.dtype == dt else p.to(dt)
        if decay is None:
            # p - y into y's buffer (an elementwise op may write over its own input).
            new_p = torch.sub(p32, y, out=buf if y is buf else torch.empty_like(y))
        else:
            new_p = torch.addcmul(p32, p32, sc.derived(decay, "neg", dt)).sub_(y)
        if mode == "update":
            out.append((new_p.sub_(p32), m_new))
        else:
            out.append((new_p if new_p.dtype == p.dtype else new_p.to(p.dtype), m_new))
    return out


@functools.lru_cache(maxsize=64)
def _segment_divisors(segments: tuple[tuple[int, int], ...], dtype: torch.dtype,
                      device: torch.device) -> Tensor:
    """A vector holding each ``(length, divisor)`` segment's divisor ``length`` times, in
    ``dtype`` (the divisor as a tensor divided by a Python number casts it): the same leaves
    step after step, so formed once (never written: a read-only operand)."""
    lengths = torch.tensor([n for n, _ in segments])
    divisors = torch.tensor([float(d) for _, d in segments], dtype=torch.float64)
    return torch.repeat_interleave(divisors, lengths).to(device, dtype)


def factor_ema_fast(calls: list[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`funcpar.kernels.factored.factor_ema_reference` for many leaves
    (``(row_sum, col_sum, row, col, decay, n, m, local_sum)`` each): the means and the factors'
    EMAs over all leaves' row and column factors at once (per decay, dtype and device), each
    vector a segment of one flat buffer, then each leaf's ``mean(R')`` (or, ``local_sum``,
    ``sum(R')``). The same elementwise operations as the reference's (an element's rounding
    does not depend on where it lies in a buffer), a handful of calls where one per factor
    and operation cost more than the arithmetic. The new factors of a group are views of
    one fresh buffer (disjoint; the next step reads them, writes new ones), or inside
    :func:`~funcpar.kernels.inplace.inplace_updates` the state's own factors, written."""
    out: list[Any] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault((id(c[4]), c[2].dtype, c[0].dtype, c[2].device), []).append(i)
    sc = _Scalars()
    for (_, dtype, _, device), idx in groups.items():
        cs = [calls[i] for i in idx]
        decay = cs[0][4]
        stats = [c[2] for c in cs] + [c[3] for c in cs]
        # row_sum / m and col_sum / n (the global sizes of the other dim), then
        # ema(avg, mean) = addcmul(avg * d, mean, 1 - d) for rows and columns together.
        means = _flatten_dense_tensors([c[0] for c in cs] + [c[1] for c in cs])
        means.div_(_segment_divisors(
            tuple((c[0].numel(), c[6]) for c in cs) + tuple((c[1].numel(), c[5]) for c in cs),
            means.dtype, device))
        flat = _flatten_dense_tensors(stats).mul_(sc(decay, dtype))
        flat.addcmul_(means, sc.derived(decay, "one_minus", dtype))
        new = _unflatten_dense_tensors(flat, stats)
        if inplace_allowed():
            # Donated: the state's own factors take the new values (one multi-tensor copy)
            # and are returned, rather than the step's donation copying them back leaf by leaf.
            torch._foreach_copy_(stats, new)
            new = stats
        for j, (i, c) in enumerate(zip(idx, cs)):
            row, col = new[j], new[len(cs) + j]
            nd = row.dim()
            part = (row.sum(dim=nd - 2, keepdim=True) if c[7]
                    else row.mean(dim=(nd - 2,), keepdim=True))
            out[i] = (row, col, part)
    return out
