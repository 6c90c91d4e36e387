"""Adafactor, torch's variant: exactly ``torch.optim.Adafactor`` (torch >= 2.5).

Shazeer & Stern 2018 (arXiv 1804.04235). The Hugging Face / fairseq variant is
:func:`funcpar.optim.adafactor.adafactor`; :func:`adafactor_torch` documents what differs. Every
whole-dim reduction (row and column means, the mean of the row factor, RMS of the update and of
the parameter) goes through :mod:`funcpar.shard.reduce` with the leaf's layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from funcpar.kernels import factored as kernels
from funcpar.kernels.foreach_factored import host_equals
from funcpar.kernels.inplace import fast_path_ok, inplace_allowed
from funcpar.optim import validate
from funcpar.optim.adafactor import AdafactorState
from funcpar.optim.base import GradientTransformation, check_floating, checked_leaf_columns
from funcpar.optim.factored import (
    MomentNames,
    eps_pair,
    init_moment,
    is_factored,
    no_grad_unless_needed,
    one_pass,
)
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.shard.reduce import (
    Partial,
    Reducible,
    global_shape,
    local_sum_of_squares,
    run_phased,
    together,
)
from funcpar.state.tree import Tree, tree_map, tree_unflatten

__all__ = ["adafactor_torch"]


_TORCH_NAMES = MomentNames("row_var", "col_var", "variance")


def _clamp_min(x: float | Tensor, low: float) -> float | Tensor:
    """``x.clamp(min=low)`` for a tensor; the same for a host float (NaN kept)."""
    if torch.is_tensor(x):
        return x.clamp(min=low)
    return low if x < low else x


def _rms_f64_phases(x: Tensor, layout: Reducible | None, purpose: str, host: bool):
    """``RMS(x)`` as torch.optim.Adafactor forms it (the norm in the leaf's dtype, divided by
    ``sqrt(numel)`` in Python floats, i.e. float64), as a phased step: one phase completing the
    sum of squares of a sharded leaf. ``host``: as a Python float (a CPU leaf on the eager
    path: torch itself reads these norms to the host; the same float64 arithmetic, without a
    tensor operation per step), else a 0-d float64 tensor (no device sync)."""
    n = math.prod(global_shape(x, layout))
    if layout is None:
        norm = torch.linalg.vector_norm(x)
    else:
        (sq,) = yield [Partial(local_sum_of_squares(x), layout, None, purpose)]
        norm = sq.sqrt()
    return (float(norm) if host else norm.to(torch.float64)) / math.sqrt(n)


def _row_col_mean_squares_phases(g: Tensor, layout: Reducible | None):
    """torch's squared norms of ``g`` over its last dim and over its second-last (keepdim),
    completed over the shards in one phase; :func:`_moments_batch` divides them by the global
    size of the dim."""
    dims = (g.ndim - 1, g.ndim - 2)
    done = [torch.linalg.vector_norm(g, dim=d, keepdim=True).square() for d in dims]
    if layout is not None:  # whole leaves: nothing to complete, no round of their own
        done = yield [Partial(x, layout, d, f"factored {what} mean")
                      for x, d, what in zip(done, dims, ("row", "column"))]
    return done


def _moments_reference(row_sq: Tensor, col_sq: Tensor, row: Tensor, col: Tensor, w: Tensor,
                       n: int, m: int, local_sum: bool) -> tuple[Tensor, Tensor, Tensor]:
    """torch.optim.Adafactor's factors from the completed squared norms of a leaf of global
    last dims ``(n, m)``: ``R' = lerp(R, row_sq / m, w)``, ``C' = lerp(C, col_sq / n, w)``, and
    ``mean_{-2}(R')`` (``local_sum``: this shard's sum of ``R'`` over its rows, to complete
    over the shards and divide by ``n``)."""
    row = torch.lerp(row, row_sq / m, w)
    col = torch.lerp(col, col_sq / n, w)
    d = row.ndim - 2
    return row, col, (row.sum(dim=d, keepdim=True) if local_sum
                      else row.mean(dim=d, keepdim=True))


def _moments_many(calls: list[tuple], into_state: bool = False
                  ) -> list[tuple[Tensor, Tensor, Tensor]]:
    # The divisions and the lerps of all leaves' factors as multi-tensor ops (per weight:
    # one per leaf dtype), then each leaf's mean of R': the reference's operations.
    # into_state: the factors are lerped in place where that keeps their dtype (the same
    # kernel, the same bits).
    out: list[Any] = [None] * len(calls)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault(id(c[4]), []).append(i)
    for idx in groups.values():
        cs = [calls[i] for i in idx]
        k = len(cs)
        means = torch._foreach_div([c[0] for c in cs] + [c[1] for c in cs],
                                   [c[6] for c in cs] + [c[5] for c in cs])
        factors = [c[2] for c in cs] + [c[3] for c in cs]
        weights = [cs[0][4]] * (2 * k)
        if into_state and all(f.dtype == x.dtype == cs[0][4].dtype
                              for f, x in zip(factors, means)):
            torch._foreach_lerp_(factors, means, weights)
            new = factors
        else:
            new = torch._foreach_lerp(factors, means, weights)
        for j, (i, c) in enumerate(zip(idx, cs)):
            row = new[j]
            d = row.ndim - 2
            out[i] = (row, new[k + j], row.sum(dim=d, keepdim=True) if c[7]
                      else row.mean(dim=d, keepdim=True))
    return out


def _moments_eager(calls: list[tuple]) -> list[tuple[Tensor, Tensor, Tensor]]:
    # Inside inplace_updates the factors are the donated state's own storage.
    return _moments_many(calls, into_state=inplace_allowed())


def _moments_batch(calls):
    """:func:`_moments_reference` for many leaves (a few multi-tensor ops for all)."""
    return kernels.execute_batched(calls, lambda *a: (a, a[:4]), _moments_reference,
                                   _moments_many, _moments_eager)


def _adafactor_torch(lr, weight_decay, *, beta2_decay, eps, d, maximize, weight_decay_mask):
    eps1, eps2 = eps

    def init(params: Tree) -> AdafactorState:
        check_floating(params, who="adafactor_torch")
        stats = tree_map(
            lambda p: None if p is None else init_moment(
                p.shape, dtype=p.dtype, device=p.device, names=_TORCH_NAMES,
                factored=is_factored(p.shape), keepdim=True,
            ),
            params,
        )
        return AdafactorState(torch.zeros((), dtype=torch.int64), stats)

    def step(grads, state: AdafactorState, params, layouts, out):
        count = state.count + 1
        t = count.to(torch.float64)
        one_minus_beta2 = t**beta2_decay
        rho = torch.minimum(lr, 1.0 / t.sqrt())
        # What is the same for every leaf, asked once: whether the in-place path may run at
        # all (the hyperparameters, compilation, transforms; the leaves' own tensors are asked
        # per leaf) and the averaging weight in each leaf dtype.
        eager_step = fast_path_ok(lr, weight_decay) and not torch.compiler.is_compiling()
        grad_on = torch.is_grad_enabled()
        weights: dict[torch.dtype, Tensor] = {}
        zero_decay = host_equals(weight_decay, 0.0)
        kept: dict[torch.dtype, Tensor] = {}

        def keep(dtype: torch.dtype) -> Tensor:
            # 1 - lr wd in a leaf dtype (what the decay multiplies by), once per dtype.
            if dtype not in kept:
                kept[dtype] = (1 - lr * weight_decay).to(dtype)
            return kept[dtype]

        # The eager path of CPU leaves forms the step's scalars in host floats, as torch does.
        host_step = eager_step and rho.device.type == "cpu"
        rho_host = float(rho) if host_step else None

        def leaf(g, p, st, use_decay, layout):
            # A phased step (funcpar.shard.reduce.run_phased): the parameter's RMS and the
            # row/column sums in one phase, the row factor's mean in a second, the update's RMS
            # in a third (phases only for sharded leaves), each for all leaves at once.
            if g is None:
                return (None if out == "update" else p), st
            # The same operations in place on this step's own temporaries (and, donated, on
            # p) where nothing must be differentiated: the same bits, fewer allocations.
            eager = eager_step and not (grad_on and (g.requires_grad or p.requires_grad))
            if maximize:
                g = -g
            e1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
            w = weights.get(g.dtype)
            if w is None:
                w = weights[g.dtype] = one_minus_beta2.to(g.dtype)
            host = eager and host_step and p.device.type == "cpu" and g.device.type == "cpu"
            if _TORCH_NAMES.row in st:
                p_rms, (row_sq, col_sq) = yield from together(
                    _rms_f64_phases(p, layout, "param rms", host),
                    _row_col_mean_squares_phases(g, layout))
                shape = global_shape(g, layout)
                row, col, part = yield from one_pass(
                    _moments_batch, row_sq, col_sq, st[_TORCH_NAMES.row], st[_TORCH_NAMES.col],
                    w, shape[-2], shape[-1], layout is not None)
                if layout is None:
                    mean = part
                else:
                    (total,) = yield [Partial(part, layout, g.ndim - 2,
                                              "factored mean of row stats")]
                    mean = total / shape[-2]
                var = row @ col
                var = var.div_(mean.clamp(min=e1)) if eager else var / mean.clamp(min=e1)
                new = {_TORCH_NAMES.row: row, _TORCH_NAMES.col: col}
            else:
                p_rms = yield from _rms_f64_phases(p, layout, "param rms", host)
                full = st[_TORCH_NAMES.full]
                # In place on the donated state where that keeps its dtype (same bits).
                var = (full.lerp_(g * g, w)
                       if eager and inplace_allowed() and full.dtype == g.dtype == w.dtype
                       and full.is_contiguous() and not full.requires_grad
                       else torch.lerp(full, g * g, w))
                new = {_TORCH_NAMES.full: var}
            alpha = _clamp_min(p_rms, eps2) * (rho_host if host else rho)
            if eager:  # var is a temporary here unless it is the (full) state
                u = var.clamp(min=e1 * e1) if _TORCH_NAMES.full in new else var.clamp_(min=e1 * e1)
                u = u.rsqrt_().mul_(g)
            else:
                u = var.clamp(min=e1 * e1).rsqrt() * g
            # torch folds the clipping into the step size, in float64.
            u_rms = yield from _rms_f64_phases(u, layout, "update rms", host)
            coef = -alpha / _clamp_min(u_rms / d, 1.0)
            # (a host float rounds to the dtype as the tensor's .to() rounds it)
            coef = (torch.scalar_tensor(coef, dtype=u.dtype) if host
                    else coef.to(u.dtype))
            if out == "param" and eager:
                # The new parameter (p * (1 - lr wd), then + coef u) in place when donated;
                # a decay of exactly 0 (p * 1) skipped.
                decays = use_decay and not zero_decay
                if inplace_allowed():
                    new_p = p.mul_(keep(p.dtype)) if decays else p
                    return new_p.addcmul_(u, coef), new
                new_p = p * keep(p.dtype) if decays else p
                return torch.addcmul(new_p, u, coef), new
            new_p = p * keep(p.dtype) if use_decay else p
            new_p = torch.addcmul(new_p, u, coef)
            # (new param - param) is exact while the step is under half the parameter, so
            # apply_updates reproduces torch's rounding of the new parameter (apply: new_p).
            return (new_p - p if out == "update" else new_p.to(p.dtype)), new

        spec, g_leaves, (p_leaves, stats, lays) = checked_leaf_columns(
            grads, params, state.stats, layouts)
        decay = mask_flags(weight_decay_mask, params, spec)
        with no_grad_unless_needed(g_leaves, p_leaves, stats, lr, weight_decay):
            outs = run_phased([leaf(*row) for row in zip(g_leaves, p_leaves, stats, decay,
                                                          lays)])
        updates, stats = (tree_unflatten(spec, [o[i] for o in outs]) for i in range(2))
        return updates, AdafactorState(count, stats)

    def update(grads, state: AdafactorState, params=None, *, layouts=None):
        return step(grads, state, params, layouts, "update")

    def apply(grads, state: AdafactorState, params, *, layouts=None):
        return step(grads, state, params, layouts, "param")

    return GradientTransformation(init, update, apply)


def adafactor_torch(
    lr: Any = 1e-2,
    beta2_decay: float = -0.8,
    eps: Sequence[float | None] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: Any = 0.0,
    *,
    maximize: bool = False,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """Adafactor, exactly ``torch.optim.Adafactor`` (torch >= 2.5).

    Shazeer & Stern 2018 (arXiv 1804.04235), torch's variant. Defaults (torch's): ``lr=1e-2``,
    ``beta2_decay=-0.8``, ``eps=(None, 1e-3)``, ``d=1.0``, ``weight_decay=0.0``. Tested step by
    step against torch.optim.Adafactor (tests/test_adafactor.py: measured 3.7e-16 in float64,
    1.4e-7 in float32).

    For each leaf ``W`` with gradient ``g`` at step ``t`` (from 1), ``eps1`` defaulting to the
    machine epsilon of ``W``'s dtype::

        rho_t   = min(lr, 1/sqrt(t));   alpha_t = max(eps2, RMS(W)) rho_t
        W <- W - lr weight_decay W
        >= 2 dims:  R <- lerp(R, mean_{-1}(g^2), t^beta2_decay)
                    C <- lerp(C, mean_{-2}(g^2), t^beta2_decay)
                    V = R C^T / max(mean_{-2}(R), eps1)
        otherwise:  V <- lerp(V, g^2, t^beta2_decay)
        u = g / sqrt(max(V, eps1^2))
        W <- W - alpha_t u / max(1, RMS(u) / d)

    What differs from :func:`adafactor` (Hugging Face): ``lr`` is the cap of the relative step
    (there is no ``relative_step`` / ``scale_parameter`` switch: both are always on, with
    ``lr=1e-2`` giving the paper's cap); ``beta2_decay`` is ``decay_rate`` but the average is a
    ``lerp`` with weight ``t^beta2_decay``; ``eps1`` is not added to ``g^2`` but clamps the
    normaliser ``mean(R)`` from below (by ``eps1``) and ``V`` (by ``eps1^2``), and defaults to
    the dtype's epsilon; the estimate is formed as ``R C^T / mean(R)`` and then inverted (not as a
    product of inverse square roots); the clipping threshold is ``d`` (>= 1); there is no first
    moment; the weight decay is scaled by ``lr`` (not ``alpha_t``) and applied before the step
    (the step size still uses ``RMS`` of the pre-decay ``W``); statistics keep torch's
    ``keepdim`` shapes ``(..., n, 1)`` / ``(..., 1, m)`` under torch's names ``row_var``,
    ``col_var``, ``variance``. ``lr`` and ``weight_decay`` may be schedules.
    """
    who = "adafactor_torch"
    validate.nonnegative(who, "lr", lr)
    eps1, eps2 = eps_pair(who, eps)
    if eps1 is not None:
        validate.positive(who, "eps[0]", eps1)
    # eps2 > 0 (torch accepts 0): the floor of RMS(W) in alpha_t; 0 freezes a zero leaf.
    validate.positive(who, "eps[1]", eps2)
    if callable(beta2_decay) or not (math.isfinite(float(beta2_decay)) and beta2_decay <= 0):
        raise ValueError(f"{who}: beta2_decay must be a number <= 0, got {beta2_decay!r}")
    if callable(d) or not (math.isfinite(float(d)) and d >= 1.0):
        raise ValueError(f"{who}: the clipping threshold d must be a number >= 1, got {d!r}")
    validate.nonnegative(who, "weight_decay", weight_decay)
    return inject_hyperparams(
        _adafactor_torch,
        ("lr", "weight_decay"),
        lr=lr,
        weight_decay=weight_decay,
        beta2_decay=float(beta2_decay),
        eps=(None if eps1 is None else float(eps1), float(eps2)),
        d=float(d),
        maximize=bool(maximize),
        weight_decay_mask=weight_decay_mask,
    )
