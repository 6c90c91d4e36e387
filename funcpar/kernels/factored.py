"""Passes of the factored optimizers (Adafactor, CAME): Triton kernels and plain-torch references.

Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) and CAME (Luo et al. 2023, arXiv 2307.02047)
keep, for a leaf ``W`` of shape ``(..., n, m)``, row and column statistics of ``x = g^2 + eps1``
and precondition the gradient with ``rsqrt(R / mean(R)) (x) rsqrt(C)`` (an outer product over the
last two dims). Their steps are cut here into *passes* over the leaf, each reading the big tensors
once; between passes only O(n + m) vectors and 0-d scalars are touched, which is where
:mod:`funcpar.shard.reduce` completes the sums over the shards of a TP/ZeRO-split leaf. The
algorithms themselves (which pass, in which order, with which reductions between) are written once
in :mod:`funcpar.optim.factored`, :mod:`funcpar.optim.adafactor` and :mod:`funcpar.optim.came`.

The passes (local: they see this process's shard only):

* :func:`sq_row_col_sums`: ``sum_{-1}(g^2 + eps)`` and ``sum_{-2}(g^2 + eps)`` (statistics pass);
* :func:`scaled_norm`: ``||g * rsqrt(R / mu) (x) rsqrt(C)||`` (the update's norm, for clipping);
* :func:`full_moment`: an unfactored leaf's ``V <- d V + (1-d)(g^2 + eps)`` and ``||g rsqrt(V)||``
  in one pass;
* :func:`came_residual`: CAME's ``u = g * rsqrt(V) / clip``, ``M <- b1 M + (1-b1) u`` and the row/
  column sums of ``(u - M)^2 + eps2`` in one pass;
* :func:`precond_apply`: the update pass, ``y = x * rsqrt(V)`` (factored, full or none), ``/ clip``,
  ``* pre``, optional momentum ``M <- b1 M + (1-b1) y; y = M``, ``* post``, then either ``y``
  itself, or ``W' = W - c W - y`` (decoupled weight decay ``c``) as the new parameter or as
  ``W' - W``.

Each is a dispatcher: the Triton kernel when :func:`funcpar.kernels.dispatch.use_kernels` says so
for the leaf's tensors (CUDA in ``auto`` mode) and the leaf's dtype is float32 / bfloat16 /
float16 (computed in float32; float64 leaves, the exactness tests' dtype, always take the
reference), else the ``*_reference`` function, which performs exactly the torch operations the
optimizers performed before kernels existed (same order, same roundings), so a reference step is
bit-identical to the pre-kernel implementation. Where no kernel runs (CPU; CUDA without Triton)
and the step need not be differentiable, the eager path of
:mod:`funcpar.kernels.foreach_factored` runs those same operations into buffers and in place
under donation (the references' bits). A kernel differs from its reference by summation
order (tile sums, then a sum of the tile partials) and, on a GPU, by fused multiply-adds: a few
float32 ulps.

**Batched.** Each pass also has a ``*_batch`` form taking the calls of many leaves (a list of
``(args, kwargs)``); the optimizers' phased steps ask for passes
(:class:`funcpar.shard.reduce.Pass`) and :func:`funcpar.shard.reduce.run_phased` hands all
leaves' calls of a round to one ``*_batch`` call (:func:`execute_batched`): the leaves that take
the reference run it one by one, exactly as the one-leaf dispatcher would, the others share one
multi-leaf launch per launch group (same device, dtypes and tile width; see
``_factored_triton``). The one-leaf dispatchers are the one-call case. The small work between
the passes (:func:`factor_ema_reference`, :func:`clip_divisor_reference`) is batched the same
way, with foreach ops and one segment sum on the fast path.

Kernel layout: a leaf is viewed as ``(B, n, m)`` (its last two dims; unfactored leaves flat) and
cut into ``BR x BC`` tiles; a tile table maps each program to its leaf and tile, a leaf table
holds each leaf's geometry, flags and tensor addresses. Row and column sums are written as
per-tile partials and summed by a segment-sum kernel in a fixed order (deterministic: no
atomics, so a step is reproducible). Per-leaf scalars go as one float32 table built without a
host sync (host values rounded on the host, device values stacked on the device).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.kernels import foreach_factored as _ff
from funcpar.kernels.dispatch import current_mode, use_kernels
from funcpar.kernels.foreach_factored import scratch_scope

__all__ = [
    "KERNEL_DTYPES",
    "Factors",
    "came_residual",
    "came_residual_batch",
    "came_residual_reference",
    "clip_divisor_batch",
    "clip_divisor_reference",
    "compute_dtype",
    "decoupled_decay",
    "decoupled_decay_",
    "ema",
    "execute_batched",
    "factor_ema_batch",
    "factor_ema_reference",
    "full_moment",
    "full_moment_batch",
    "full_moment_reference",
    "inverse_sqrt",
    "precond_apply",
    "precond_apply_batch",
    "precond_apply_reference",
    "scaled_norm",
    "scaled_norm_batch",
    "scaled_norm_reference",
    "scratch_scope",
    "sq_row_col_sums",
    "sq_row_col_sums_batch",
    "sq_row_col_sums_reference",
]

#: Leaf dtypes the kernels take (all computed in float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_MODES = ("direction", "update", "param")

# Tests set this to fill every buffer a kernel writes with NaN first, so an element a kernel
# forgets to write shows up as a NaN.
_POISON = False


class Factors(NamedTuple):
    """A factored second moment in the leaf's coordinates: ``row`` ``(..., n, 1)``, ``col``
    ``(..., 1, m)`` and ``row_mean = mean(row)`` over the rows (whole leaf) ``(..., 1, 1)``."""

    row: Tensor
    col: Tensor
    row_mean: Tensor


# --------------------------------------------------------------------------------------------
# Shared elementwise math (the references use these; the optimizers re-export them)
# --------------------------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the factored optimizers compute and keep statistics in: float32 for half
    precision leaves (as Hugging Face and came-pytorch do), the leaf's own dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ema(avg: Tensor, new: Tensor, decay: float | Tensor) -> Tensor:
    """``decay * avg + (1 - decay) * new``, rounded as the references'
    ``avg.mul_(decay).add_(new, alpha=1 - decay)`` round it (the add is fused)."""
    # Hyperparameters are 0-d float64 tensors: cast them, or a 0-d leaf would be promoted.
    decay = torch.as_tensor(decay, dtype=torch.float64)
    return torch.addcmul(avg * decay.to(avg.dtype), new, (1 - decay).to(avg.dtype))


def decoupled_decay(p: Tensor, coeff: float | Tensor) -> Tensor:
    """``p - coeff * p``, rounded as the references' ``p.add_(p, alpha=-coeff)`` (fused)."""
    return torch.addcmul(p, p, torch.as_tensor(-coeff, dtype=torch.float64).to(p.dtype))


def decoupled_decay_(p: Float[Tensor, "*shape"], coeff: float | Tensor) -> Float[Tensor, "*shape"]:
    """:func:`decoupled_decay` in place on ``p`` (the same operation, the same rounding)."""
    return p.addcmul_(p, torch.as_tensor(-coeff, dtype=torch.float64).to(p.dtype))


def inverse_sqrt(precond: Factors | Tensor) -> Tensor:
    """``rsqrt(R / mean(R)) (x) rsqrt(C)`` (fairseq's order of operations, which Hugging Face and
    came-pytorch copy) for :class:`Factors`, ``rsqrt(V)`` for a full second moment."""
    if isinstance(precond, Factors):
        return (precond.row / precond.row_mean).rsqrt() * precond.col.rsqrt()
    return precond.rsqrt()


def _to_compute(x: Tensor) -> Tensor:
    return x.to(compute_dtype(x.dtype))


# --------------------------------------------------------------------------------------------
# References (plain torch)
# --------------------------------------------------------------------------------------------


def sq_row_col_sums_reference(
    g: Float[Tensor, "*batch rows cols"], eps: float
) -> tuple[Float[Tensor, "*batch rows 1"], Float[Tensor, "*batch 1 cols"]]:
    """Sums of ``g^2 + eps`` over the last dim and over the second-last (``keepdim``)."""
    g = _to_compute(g)
    x = g * g + eps
    return x.sum(-1, keepdim=True), x.sum(-2, keepdim=True)


def scaled_norm_reference(g: Float[Tensor, "*batch rows cols"], factors: Factors) -> Tensor:
    """``||g * inverse_sqrt(factors)||`` (0-d; the local part of the update's norm)."""
    return torch.linalg.vector_norm(inverse_sqrt(factors) * _to_compute(g))


def full_moment_reference(
    g: Float[Tensor, "*shape"], v: Float[Tensor, "*shape"], decay: float | Tensor, eps: float
) -> tuple[Float[Tensor, "*shape"], Tensor]:
    """``V' = ema(V, g^2 + eps, decay)`` and ``||g rsqrt(V')||``."""
    g = _to_compute(g)
    v = ema(v, g * g + eps, decay)
    return v, torch.linalg.vector_norm(v.rsqrt() * g)


def came_residual_reference(
    g: Float[Tensor, "*batch rows cols"],
    factors: Factors,
    clip: Tensor,
    m: Float[Tensor, "*batch rows cols"],
    beta1: float | Tensor,
    eps2: float,
) -> tuple[Float[Tensor, "*batch rows cols"], Float[Tensor, "*batch rows 1"],
           Float[Tensor, "*batch 1 cols"]]:
    """``u = g inverse_sqrt(factors) / clip``; ``M' = ema(M, u, beta1)``;
    ``r = (u - M')^2 + eps2``: ``(M', sum_{-1} r, sum_{-2} r)``."""
    u = inverse_sqrt(factors) * _to_compute(g)
    u = u / clip.to(u.dtype)
    m = ema(m, u, beta1)
    res = (u - m) ** 2 + eps2
    return m, res.sum(-1, keepdim=True), res.sum(-2, keepdim=True)


def _as_tensor(x: float | Tensor) -> Tensor:
    return x if torch.is_tensor(x) else torch.tensor(float(x), dtype=torch.float64)


def precond_apply_reference(
    x: Float[Tensor, "*shape"],
    p: Float[Tensor, "*shape"] | None,
    precond: Factors | Tensor | None,
    *,
    clip: Tensor | None = None,
    pre: float | Tensor | None = None,
    momentum: Float[Tensor, "*shape"] | None = None,
    beta1: float | Tensor | None = None,
    post: float | Tensor | None = None,
    decay: float | Tensor | None = None,
    out: str = "param",
) -> tuple[Tensor, Tensor | None]:
    """The update pass; see :func:`precond_apply`."""
    y = _to_compute(x)
    if precond is not None:
        y = inverse_sqrt(precond) * y
    if clip is not None:
        y = y / clip.to(y.dtype)
    if pre is not None:
        y = y * _as_tensor(pre).to(y.dtype)
    m_new = None
    if momentum is not None:
        m_new = y = ema(momentum, y, beta1)
    if post is not None:
        y = y * _as_tensor(post).to(y.dtype)
    if out == "direction":
        return y, m_new
    p32 = p.to(y.dtype)
    new_p = (p32 if decay is None else decoupled_decay(p32, decay)) - y
    if out == "update":
        return new_p - p32, m_new
    return new_p.to(p.dtype), m_new


# --------------------------------------------------------------------------------------------
# Dispatchers
# --------------------------------------------------------------------------------------------


def _kernel_ok(*tensors: Tensor | None, hyper: Sequence[Any] = ()) -> bool:
    live = [t for t in tensors if t is not None]
    if not use_kernels(*live, hyper=hyper):
        return False
    # float64 (the exactness tests' dtype) and empty shards take the reference.
    return all(t.dtype in KERNEL_DTYPES and t.numel() > 0 for t in live)


def _check_factored(g: Tensor, factors: Factors | None, who: str) -> None:
    shape = g.shape
    if len(shape) < 2:
        raise ValueError(f"{who}: a factored pass needs a leaf with >= 2 dims, got shape "
                         f"{tuple(shape)}")
    if factors is None:
        return
    lead = shape[:-2]
    want = (lead + (shape[-2], 1), lead + (1, shape[-1]), lead + (1, 1))
    for name, t, w in zip(Factors._fields, factors, want):
        if t.shape != w:
            raise ValueError(f"{who}: factors.{name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(w)} for a leaf of shape {tuple(shape)}")


def _check_same(who: str, g: Tensor, *others: tuple[str, Tensor | None]) -> None:
    shape = g.shape
    for name, t in others:
        if t is not None and t.shape != shape:
            raise ValueError(f"{who}: {name} has shape {tuple(t.shape)} but the leaf has "
                             f"{tuple(shape)}")


# The canonical arguments of each pass (what its reference and its kernel take) and the tensors
# that decide whether it may take the kernel, from the dispatcher's own arguments (checked).


def _sq_args(g, eps):
    _check_factored(g, None, "sq_row_col_sums")
    return (g, eps), (g,)


def _norm_args(g, factors):
    _check_factored(g, factors, "scaled_norm")
    return (g, factors), (g, *factors)


def _full_args(g, v, decay, eps):
    _check_same("full_moment", g, ("v", v))
    return (g, v, decay, eps), (g, v)


def _came_args(g, factors, clip, m, beta1, eps2):
    _check_factored(g, factors, "came_residual")
    _check_same("came_residual", g, ("m", m))
    return (g, factors, clip, m, beta1, eps2), (g, m, *factors)


_APPLY_DEFAULTS = dict(clip=None, pre=None, momentum=None, beta1=None, post=None, decay=None,
                       out="param")


def _apply_args(x, p, precond, **kw):
    if kw.keys() != _APPLY_DEFAULTS.keys():
        unknown = kw.keys() - _APPLY_DEFAULTS.keys()
        if unknown:
            raise TypeError(f"precond_apply: unexpected keyword arguments {sorted(unknown)}")
        kw = {**_APPLY_DEFAULTS, **kw}
    out, momentum = kw["out"], kw["momentum"]
    if out not in OUT_MODES:
        raise ValueError(f"precond_apply: out must be one of {OUT_MODES}, got {out!r}")
    if (momentum is None) != (kw["beta1"] is None):
        raise ValueError("precond_apply: momentum and beta1 go together")
    if out == "direction":
        p_read = None
    elif p is None:
        raise ValueError(f"precond_apply: out={out!r} needs the parameter p")
    else:
        p_read = p
    tensors = [x, momentum, p_read]
    if isinstance(precond, Factors):
        _check_factored(x, precond, "precond_apply")
        _check_same("precond_apply", x, ("p", p_read), ("momentum", momentum))
        tensors += precond
    else:
        _check_same("precond_apply", x, ("p", p_read), ("momentum", momentum),
                    ("precond", precond))
        tensors.append(precond)
    return (x, p, precond, kw), tensors


def _apply_reference(x, p, precond, kw):
    return precond_apply_reference(x, p, precond, **kw)


def _tensors_in(args: Any) -> list[Tensor]:
    """Every tensor in ``args`` (nested tuples, lists, dicts, :class:`Factors`): the
    hyperparameters a pass was given count in its differentiability check."""
    out, todo = [], [args]
    while todo:
        a = todo.pop()
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            todo.extend(a)
        elif isinstance(a, Mapping):
            todo.extend(a.values())
    return out


# Argument types that hold no tensor, skipped at once by _requires_grad.
_LEAF_TYPES = frozenset({float, int, bool, str, type(None), torch.dtype})


def _requires_grad(args: Any) -> bool:
    """Whether a tensor in ``args`` (as :func:`_tensors_in` finds them) requires grad: the
    same walk, stopping at the first, with exact-type tests first (it runs for every leaf of
    every pass while grad mode is on)."""
    todo = [args]
    while todo:
        a = todo.pop()
        t = type(a)
        if t in _LEAF_TYPES:
            continue
        if t is Tensor or isinstance(a, Tensor):
            if a.requires_grad:
                return True
        elif t is tuple or t is list or isinstance(a, (tuple, list)):
            todo.extend(a)
        elif t is dict or isinstance(a, Mapping):
            todo.extend(a.values())
    return False


def execute_batched(calls: Sequence[tuple[tuple, Mapping[str, Any]]], canonical: Any,
                    reference: Any, many: Any, eager: Any = None) -> list[Any]:
    """Run one pass for many leaves (a batched executor's body); results in call order.

    ``canonical(*args, **kwargs)`` checks a call and returns ``(arguments, tensors)``: the
    arguments ``reference``, ``many`` and ``eager`` take, and the tensors that decide whether
    the call may take a fast path. Every tensor among the arguments (the step's tensor
    hyperparameters: an ``lr`` that requires grad) counts in the differentiability check, so
    a differentiable step never takes a path autograd cannot follow. The calls that
    :func:`_kernel_ok` accepts go together to ``many`` (a list of arguments -> the list of
    results): a function, or the name of one in the Triton kernel module (imported then).
    Of the others (float64, empty, not on CUDA in ``auto`` mode, ``reference`` mode), those
    the eager path takes (:func:`funcpar.kernels.foreach_factored.eager_allowed` for the
    batch, then per leaf :func:`~funcpar.kernels.foreach_factored.eager_leaf_ok` and nothing
    to differentiate) go together to ``eager`` (the in-place plain-torch path, the references'
    operations; ``None``: none); the rest take ``reference(*arguments)`` one by one, exactly
    as a one-leaf call would."""
    canon = [canonical(*args, **kwargs) for args, kwargs in calls]
    results: list[Any] = [None] * len(canon)
    fast, plain = [], []
    # Asked once per batch, not per leaf (this runs for every pass of every step): the mode,
    # whether any tensor can require grad at all, whether the eager path may run at all.
    mode = current_mode()
    grad_on = torch.is_grad_enabled()
    eager_on = eager is not None and _ff.eager_allowed()
    for i, (args, tensors) in enumerate(canon):
        # use_kernels says no in mode "reference", and in "auto" unless the leaf is on CUDA:
        # asked only where it might say yes (or, in mode "triton", raise).
        lead = tensors[0] if tensors and tensors[0] is not None else next(
            (t for t in tensors if t is not None), None)
        if mode == "triton" or (mode == "auto" and lead is not None and lead.is_cuda):
            if _kernel_ok(*tensors, hyper=_tensors_in(args) if grad_on else ()):
                fast.append(i)
                continue
        if (eager_on and _ff.eager_leaf_ok(tensors)
                and not (grad_on and (_requires_grad(args) or any(
                    t is not None and t.requires_grad for t in tensors)))):
            plain.append(i)
        else:
            results[i] = reference(*args)
    for idx, run in ((fast, many), (plain, eager)):
        if idx:
            run = getattr(_tk(), run) if isinstance(run, str) else run
            for i, r in zip(idx, run([canon[i][0] for i in idx])):
                results[i] = r
    return results


# The batched passes: ``calls`` is a list of ``(args, kwargs)``, each what the one-leaf
# dispatcher of the same name takes; they return the list of its results. These are the ``run``
# of the optimizers' pass requests (funcpar.shard.reduce.Pass), so that all leaves' calls of a
# round share one launch.


def sq_row_col_sums_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`sq_row_col_sums` for many leaves (one launch per launch group)."""
    return execute_batched(calls, _sq_args, sq_row_col_sums_reference, "sq_row_col_sums_many",
                           _ff.sq_row_col_sums_fast)


def scaled_norm_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`scaled_norm` for many leaves (two launches per launch group)."""
    return execute_batched(calls, _norm_args, scaled_norm_reference, "scaled_norm_many",
                           _ff.scaled_norm_fast)


def full_moment_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`full_moment` for many leaves (two launches per launch group)."""
    return execute_batched(calls, _full_args, full_moment_reference, "full_moment_many",
                           _ff.full_moment_fast)


def came_residual_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`came_residual` for many leaves (two launches per launch group)."""
    return execute_batched(calls, _came_args, came_residual_reference, "came_residual_many",
                           _ff.came_residual_fast)


def precond_apply_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`precond_apply` for many leaves (one launch per launch group)."""
    return execute_batched(calls, _apply_args, _apply_reference, "precond_apply_many",
                           _ff.precond_apply_fast)


# --------------------------------------------------------------------------------------------
# The small work between the passes (O(n + m) vectors, 0-d scalars), batched the same way: a
# reference per leaf (the optimizers' torch ops before, exactly) and, on the fast path, a few
# multi-tensor torch ops (foreach) and one segment-sum launch for all leaves together, instead
# of a handful of tiny device ops per leaf.
# --------------------------------------------------------------------------------------------


def factor_ema_reference(
    row_sum: Float[Tensor, "*batch rows 1"],
    col_sum: Float[Tensor, "*batch 1 cols"],
    row: Float[Tensor, "*batch rows 1"],
    col: Float[Tensor, "*batch 1 cols"],
    decay: float | Tensor,
    n: int,
    m: int,
    local_sum: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """New factors from the completed row/column sums of ``x`` over a leaf of global last dims
    ``(n, m)``: ``R' = ema(R, sum_{-1}(x) / m)``, ``C' = ema(C, sum_{-2}(x) / n)``; with them
    ``mean(R')`` over the rows (``local_sum``: this shard's ``sum(R')`` over its rows, to
    complete over the shards and divide by ``n``)."""
    row_mean, col_mean = row_sum / m, col_sum / n
    row, col = ema(row, row_mean, decay), ema(col, col_mean, decay)
    nd = row.dim()
    if local_sum:
        return row, col, row.sum(dim=nd - 2, keepdim=True)
    return row, col, row.mean(dim=(nd - 2,), keepdim=True)


def _factor_ema_args(row_sum, col_sum, row, col, decay, n, m, local_sum):
    return (row_sum, col_sum, row, col, decay, n, m, local_sum), (row_sum, col_sum, row, col)


def _host(x: float | Tensor) -> bool:
    return not torch.is_tensor(x) or x.device.type == "cpu"


def _factor_ema_many(calls: list[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    out: list[Any] = [None] * len(calls)
    # foreach ops take their scalars from the host; a decay on the device (no optimizer makes
    # one) would need a sync: such leaves take the reference.
    fast = [i for i, c in enumerate(calls) if _host(c[4])]
    for i in sorted(set(range(len(calls))) - set(fast)):
        out[i] = factor_ema_reference(*calls[i])
    if not fast:
        return out
    cs = [calls[i] for i in fast]
    d = [float(torch.as_tensor(c[4], dtype=torch.float64)) for c in cs]
    means = torch._foreach_div([c[0] for c in cs] + [c[1] for c in cs],
                               [float(c[6]) for c in cs] + [float(c[5]) for c in cs])
    stats = torch._foreach_mul([c[2] for c in cs] + [c[3] for c in cs], d + d)
    torch._foreach_add_(stats, torch._foreach_mul(means, [1.0 - x for x in d] * 2))
    rows, cols = stats[:len(cs)], stats[len(cs):]
    parts = _tk().sum_rows_many(rows, [None if c[7] else c[5] for c in cs])
    for i, r, c, part in zip(fast, rows, cols, parts):
        out[i] = (r, c, part)
    return out


def factor_ema_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`factor_ema_reference` for many leaves (foreach ops and one segment sum)."""
    return execute_batched(calls, _factor_ema_args, factor_ema_reference, _factor_ema_many,
                           _ff.factor_ema_fast)


def clip_divisor_reference(norm: Tensor, threshold: float | Tensor, numel: int,
                           squared: bool) -> Tensor:
    """``max(1, RMS(u) / threshold)`` from ``||u||`` (``squared``: from ``||u||^2``) of an
    update of ``numel`` elements."""
    if squared:
        norm = norm.sqrt()
    return (norm / math.sqrt(numel) / threshold).clamp(min=1.0)


def _clip_args(norm, threshold, numel, squared):
    return (norm, threshold, numel, squared), (norm,)


def _clip_many(calls: list[tuple]) -> list[Tensor]:
    out: list[Any] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    # Per threshold object (the leaves share one): its promoted dtype with each norm dtype
    # and its host value, asked once.
    promoted: dict[tuple, torch.dtype] = {}
    values: dict[int, float] = {}
    for i, (norm, thr, _numel, squared) in enumerate(calls):
        if not _host(thr):
            out[i] = clip_divisor_reference(*calls[i])
            continue
        key = (id(thr), norm.dtype, norm.dim())
        res_dt = promoted.get(key)
        if res_dt is None:
            res_dt = promoted[key] = torch.result_type(norm, thr)
            values[id(thr)] = float(thr)
        groups.setdefault((norm.device, norm.dtype, res_dt, squared), []).append(i)
    for (device, dt, res_dt, squared), idx in groups.items():
        v = torch.stack([n if n.dim() == 0 else n.reshape(()) for n in (calls[i][0] for i in idx)])
        if squared:
            v = v.sqrt()
        # The reference's roundings: sqrt(numel) to the norm's dtype, then the division by the
        # threshold in the promoted dtype (float64 for a 0-d float64 threshold).
        v = (v / _sqrt_numels(tuple(calls[i][2] for i in idx), dt, device)).to(res_dt)
        thr = [values[id(calls[i][1])] for i in idx]
        if all(x == thr[0] for x in thr):  # one threshold (the usual case): a scalar, cast as
            v = v / thr[0]                 # the reference's 0-d threshold is cast
        else:
            v = v / torch.tensor(thr, dtype=torch.float64).to(device, res_dt)
        v = v.clamp(min=1.0)
        for i, vi in zip(idx, v.unbind()):
            out[i] = vi
    return out


@functools.lru_cache(maxsize=64)
def _sqrt_numels(numels: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``sqrt(numel)`` of each leaf (float64, then rounded to ``dtype``): the same leaves step
    after step, so formed once (never written: a read-only operand)."""
    return torch.tensor([math.sqrt(n) for n in numels], dtype=torch.float64).to(device, dtype)


def clip_divisor_batch(calls: Sequence[tuple[tuple, Mapping[str, Any]]]) -> list[Any]:
    """:func:`clip_divisor_reference` for many leaves (a few vector ops for all)."""
    # _clip_many is plain torch (vector ops over the leaves): the eager path too.
    return execute_batched(calls, _clip_args, clip_divisor_reference, _clip_many, _clip_many)


def sq_row_col_sums(
    g: Float[Tensor, "*batch rows cols"], eps: float
) -> tuple[Float[Tensor, "*batch rows 1"], Float[Tensor, "*batch 1 cols"]]:
    """The statistics pass: local sums of ``g^2 + eps`` over the last dim (one per row,
    ``(..., n, 1)``) and over the second-last (one per column, ``(..., 1, m)``), in the compute
    dtype. Complete them over the shards with the leaf's layout before dividing by the dims'
    global sizes."""
    return sq_row_col_sums_batch([((g, eps), {})])[0]


def scaled_norm(g: Float[Tensor, "*batch rows cols"], factors: Factors) -> Tensor:
    """``||g * rsqrt(R / mean(R)) (x) rsqrt(C)||`` over this shard (0-d, compute dtype)."""
    return scaled_norm_batch([((g, factors), {})])[0]


def full_moment(
    g: Float[Tensor, "*shape"], v: Float[Tensor, "*shape"], decay: float | Tensor, eps: float
) -> tuple[Float[Tensor, "*shape"], Tensor]:
    """An unfactored second moment in one pass: ``V' = decay V + (1 - decay)(g^2 + eps)`` and the
    local ``||g rsqrt(V')||``."""
    return full_moment_batch([((g, v, decay, eps), {})])[0]


def came_residual(
    g: Float[Tensor, "*batch rows cols"],
    factors: Factors,
    clip: Tensor,
    m: Float[Tensor, "*batch rows cols"],
    beta1: float | Tensor,
    eps2: float,
) -> tuple[Float[Tensor, "*batch rows cols"], Float[Tensor, "*batch rows 1"],
           Float[Tensor, "*batch 1 cols"]]:
    """CAME's residual pass: ``u = g rsqrt(R / mean(R)) (x) rsqrt(C) / clip``,
    ``M' = beta1 M + (1 - beta1) u``, ``r = (u - M')^2 + eps2``; returns ``M'`` and the local
    row and column sums of ``r``."""
    return came_residual_batch([((g, factors, clip, m, beta1, eps2), {})])[0]


def precond_apply(
    x: Float[Tensor, "*shape"],
    p: Float[Tensor, "*shape"] | None,
    precond: Factors | Tensor | None,
    *,
    clip: Tensor | None = None,
    pre: float | Tensor | None = None,
    momentum: Float[Tensor, "*shape"] | None = None,
    beta1: float | Tensor | None = None,
    post: float | Tensor | None = None,
    decay: float | Tensor | None = None,
    out: str = "param",
) -> tuple[Tensor, Tensor | None]:
    """The update pass, elementwise over the leaf (``None`` arguments skip their step)::

        y = x * inverse_sqrt(precond)        (Factors, a full V, or None: y = x)
        y = y / clip * pre
        momentum:  M' = beta1 M + (1 - beta1) y;  y = M'
        y = y * post
        out="direction": y      out="update": W' - W      out="param": W' (W's dtype)
        with W' = W - decay W - y

    Returns ``(result, M' or None)``. ``result`` is in the compute dtype except for
    ``out="param"``; ``p`` is only read for ``update``/``param``.
    """
    kw = dict(clip=clip, pre=pre, momentum=momentum, beta1=beta1, post=post, decay=decay,
              out=out)
    return precond_apply_batch([((x, p, precond), kw)])[0]


@functools.cache
def _tk():
    # Triton is imported on first use only (and TRITON_INTERPRET is read at that import).
    from funcpar.kernels import _factored_triton

    return _factored_triton
