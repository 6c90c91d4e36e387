"""Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) in its two maintained variants.

* :func:`adafactor` is the fairseq / Hugging Face / Colossal-AI variant, exactly
  ``transformers.optimization.Adafactor`` (and the inner optimizer of galore-torch's
  ``GaLoreAdafactor``, whose per-leaf math :func:`adafactor_leaf_update` exposes).
* :func:`funcpar.optim.adafactor_torch.adafactor_torch` is exactly ``torch.optim.Adafactor``,
  a different variant, in its own module.

The factored statistics are :mod:`funcpar.optim.factored`'s; every whole-dim reduction (row and
column means, the mean of the row factor, RMS of the update and of the parameter) goes through
:mod:`funcpar.shard.reduce` with the leaf's layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.kernels import factored as kernels
from funcpar.optim import validate
from funcpar.optim.base import (
    GradientTransformation,
    check_floating,
    checked_leaf_columns,
)
from funcpar.optim.factored import (
    SECOND_MOMENT,
    clip_divisor_phases,
    compute_dtype,
    eps_pair,
    init_moment,
    is_factored,
    no_grad_unless_needed,
    one_pass,
    second_moment_phases,
)
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.shard.reduce import (
    Partial,
    Reducible,
    global_shape,
    local_sum_of_squares,
    rms,
    run_phased,
    together,
)
from funcpar.state.tree import Tree, tree_map, tree_unflatten

__all__ = [
    "AdafactorLeafUpdate",
    "AdafactorState",
    "adafactor",
    "adafactor_leaf_init",
    "adafactor_leaf_update",
    "adafactor_step_size",
]


class AdafactorState(NamedTuple):
    """State of both variants: a 0-d int64 count and, per leaf, a dict of statistics.

    :func:`adafactor`: ``{"exp_avg_sq_row", "exp_avg_sq_col"}`` (shapes ``shape[:-1]`` and
    ``shape[:-2] + shape[-1:]``) or ``{"exp_avg_sq"}``, plus ``"exp_avg"`` with ``beta1``.
    :func:`adafactor_torch`: ``{"row_var", "col_var"}`` (shapes ``(..., n, 1)``, ``(..., 1, m)``)
    or ``{"variance"}``. The names are the references' state keys.
    """

    count: Tensor  # 0-d int64: updates done
    stats: Tree  # per leaf: dict[str, Tensor] (None for a None parameter)


# --------------------------------------------------------------------------------------------
# Hugging Face / fairseq variant
# --------------------------------------------------------------------------------------------


def adafactor_leaf_init(
    shape: tuple[int, ...] | torch.Size,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    beta1: float | None = None,
    min_dim_size_to_factor: int = 0,
) -> dict[str, Tensor]:
    """Zero per-leaf state of :func:`adafactor_leaf_update` for a *gradient* of ``shape``.

    Factored (``{"exp_avg_sq_row", "exp_avg_sq_col"}``, O(rows + cols)) when the shape has >= 2
    dims, both of size >= ``min_dim_size_to_factor``; else ``{"exp_avg_sq"}``. ``"exp_avg"`` (the
    shape of the gradient) is added when ``beta1`` is not None. Half-precision ``dtype`` gives
    float32 statistics, as in Hugging Face.
    """
    dtype = compute_dtype(dtype)
    state = init_moment(
        shape,
        dtype=dtype,
        device=device,
        names=SECOND_MOMENT,
        factored=is_factored(shape, min_dim_size_to_factor),
    )
    if beta1 is not None:
        state["exp_avg"] = torch.zeros(tuple(shape), dtype=dtype, device=device)
    return state


def adafactor_step_size(
    step: Tensor,
    param: Tensor,
    *,
    lr: float | Tensor | None = None,
    eps2: float = 1e-3,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
    param_layout: Reducible | None = None,
) -> Tensor:
    """``alpha_t`` as a 0-d float64 tensor (Hugging Face's ``_get_lr``).

    ``rho_t = min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t))`` with ``relative_step``, else
    ``lr``; ``alpha_t = max(eps2, RMS(param)) rho_t`` with ``scale_parameter``, else ``rho_t``.
    ``RMS(param)`` is of the parameter *before* this step's update and decay, over the whole
    (global) leaf.
    """
    rho = _rho(step, lr, relative_step, warmup_init)
    if not scale_parameter:
        return rho
    p_rms = rms(param, layout=param_layout, purpose="param rms")
    return _scaled_step(p_rms, rho, eps2)


def _rho(step: Tensor, lr: float | Tensor | None, relative_step: bool,
         warmup_init: bool) -> Tensor:
    """``rho_t`` (0-d float64): :func:`adafactor_step_size` without ``scale_parameter``."""
    t = step.to(torch.float64)
    if relative_step:
        cap = 1e-6 * t if warmup_init else torch.tensor(1e-2, dtype=torch.float64)
        return torch.minimum(cap, 1.0 / t.sqrt())
    if lr is None:
        raise ValueError("adafactor: lr is required when relative_step=False")
    return torch.as_tensor(lr, dtype=torch.float64)


def _scaled_step(p_rms: Tensor, rho: Tensor, eps2: float) -> Tensor:
    # Hugging Face multiplies in the parameter's dtype when RMS(param) wins the max and in
    # float64 when eps2 does; the float32 rounding is kept so float32 runs match it closely.
    scaled = (p_rms * rho.to(p_rms.dtype)).to(torch.float64)
    return torch.where(p_rms > eps2, scaled, eps2 * rho)


def _step_size_phases(step, param, *, lr, eps2, scale_parameter, relative_step, warmup_init,
                      param_layout, weight_decay=None, rho=None):
    """:func:`adafactor_step_size` as a phased step (funcpar.shard.reduce.run_phased), with the
    weight-decay coefficient: returns ``(alpha_t, weight_decay alpha_t or None)``.

    With ``scale_parameter`` (``RMS(param)`` on the parameter's device) the device work is
    batched over the leaves: a pass for this shard's ``sum(param^2)`` (sharded parameter),
    its completion, and a pass forming ``alpha_t`` (:func:`_step_size_reference`). ``param``
    is in its own dtype (the references compute in :func:`compute_dtype`). ``rho``: ``rho_t``
    when the caller formed it once for all leaves."""
    if rho is None:
        rho = _rho(step, lr, relative_step, warmup_init)
    if not scale_parameter:  # host scalars only
        return _unscaled_step(rho, weight_decay)
    sq = None
    if param_layout is not None:
        # rms()'s arithmetic: the completed sum of squares, rooted, over sqrt(global numel).
        local = yield from one_pass(_param_sq_batch, param)
        (sq,) = yield [Partial(local, param_layout, None, "param rms")]
    return (yield from one_pass(_step_size_batch, param, sq, rho, eps2,
                                math.prod(global_shape(param, param_layout)), weight_decay))


def _unscaled_step(rho, weight_decay):
    """``(alpha_t, weight_decay alpha_t or None)`` without ``scale_parameter``: ``alpha_t`` is
    ``rho_t``."""
    return rho, (None if weight_decay is None else weight_decay * rho)


def _param_sq_reference(param: Tensor) -> Tensor:
    return local_sum_of_squares(param.to(compute_dtype(param.dtype)))


def _param_sq_many(calls: list[tuple]) -> list[Tensor]:
    out: list[Any] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, (p,) in enumerate(calls):
        groups.setdefault((p.device, compute_dtype(p.dtype)), []).append(i)
    for (_dev, cd), idx in groups.items():
        norms = torch._foreach_norm([calls[i][0] for i in idx], 2, dtype=cd)
        sq = torch.stack(norms).square()
        for j, i in enumerate(idx):
            out[i] = sq[j]
    return out


def _param_sq_batch(calls):
    """``sum(param^2)`` of this shard for many leaves (one multi-tensor norm on the fast path)."""
    return kernels.execute_batched(calls, lambda p: ((p,), (p,)), _param_sq_reference,
                                   _param_sq_many)


def _step_size_reference(param, sq, rho, eps2, numel, weight_decay):
    """``alpha_t = max(eps2, RMS(W)) rho_t`` (:func:`_scaled_step`) with ``RMS(W)`` from the
    parameter (whole) or from its completed ``sum(W^2)`` (``sq``), and ``weight_decay alpha_t``:
    the torch ops of :func:`adafactor_step_size`, exactly."""
    if sq is None:
        norm = torch.linalg.vector_norm(param.to(compute_dtype(param.dtype)))
    else:
        norm = sq.sqrt()
    alpha = _scaled_step(norm / math.sqrt(numel), rho, eps2)
    return alpha, (None if weight_decay is None else weight_decay * alpha)


def _host(x: Any) -> bool:
    return not torch.is_tensor(x) or x.device.type == "cpu"


def _step_size_many(calls: list[tuple]) -> list[tuple[Tensor, Tensor | None]]:
    out: list[Any] = [None] * len(calls)
    groups: dict[tuple, list[int]] = {}
    for i, (param, sq, rho, eps2, _numel, wd) in enumerate(calls):
        if not (_host(rho) and _host(wd)):  # host scalars for the vectors below
            out[i] = _step_size_reference(*calls[i])
            continue
        src = param if sq is None else sq
        groups.setdefault((src.device, compute_dtype(src.dtype), sq is None, float(eps2)),
                          []).append(i)
    for (device, cd, from_param, eps2), idx in groups.items():
        if from_param:
            v = torch.stack(torch._foreach_norm([calls[i][0] for i in idx], 2, dtype=cd))
        else:
            v = torch.stack([calls[i][1].reshape(()) for i in idx]).sqrt()
        host = torch.tensor([[math.sqrt(calls[i][4]), float(calls[i][2]),
                              float(0.0 if calls[i][5] is None else calls[i][5])] for i in idx],
                            dtype=torch.float64).to(device, non_blocking=True)
        # _scaled_step's roundings, on vectors.
        p_rms = v / host[:, 0].to(cd)
        scaled = (p_rms * host[:, 1].to(cd)).to(torch.float64)
        alpha = torch.where(p_rms > eps2, scaled, eps2 * host[:, 1])
        decay = host[:, 2] * alpha
        for j, i in enumerate(idx):
            out[i] = (alpha[j], None if calls[i][5] is None else decay[j])
    return out


def _step_size_batch(calls):
    """:func:`_step_size_reference` for many leaves (a few vector ops for all)."""
    return kernels.execute_batched(calls, lambda param, sq, *rest: (
        (param, sq, *rest), (param,) if sq is None else (sq,)), _step_size_reference,
        _step_size_many)


def _step_scalars(step, *, lr, decay_rate, relative_step, warmup_init):
    """``(beta2_t, rho_t)`` of step ``t``: ``1 - t^decay_rate`` and the unscaled step size
    (:func:`adafactor_step_size` without ``scale_parameter``), the same for every leaf."""
    return 1.0 - step.to(torch.float64) ** decay_rate, _rho(step, lr, relative_step, warmup_init)


class AdafactorLeafUpdate(NamedTuple):
    """What :func:`adafactor_leaf_update` returns (a tuple: unpack it or use the names)."""

    update: Tensor  # alpha_t-scaled direction, gradient-shaped; SUBTRACT it from the param
    state: dict[str, Tensor]  # the new per-leaf state
    step_size: Tensor  # alpha_t (0-d float64): the weight decay is weight_decay * alpha_t * param


def adafactor_leaf_update(
    grad: Float[Tensor, "*grad_shape"],
    param: Float[Tensor, "*param_shape"],
    state: dict[str, Tensor],
    step: Tensor,
    *,
    lr: float | Tensor | None = None,
    eps: tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float | Tensor = 1.0,
    decay_rate: float = -0.8,
    beta1: float | None = None,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
    layout: Reducible | None = None,
    param_layout: Reducible | None = None,
) -> AdafactorLeafUpdate:
    """One Hugging Face Adafactor step for one leaf, without the weight decay.

    Arguments:
        grad: the gradient leaf, or any gradient-like tensor the statistics are kept for (a
            GaLore low-rank projection may have another shape than ``param``).
        param: the FULL parameter leaf; used only for ``RMS(param)`` in the step size.
        state: from :func:`adafactor_leaf_init` for ``grad``'s shape (its keys decide whether the
            statistics are factored); not modified.
        step: ``t``, the 1-based step number of this update (0-d integer tensor).
        layout / param_layout: the layouts of ``grad`` and ``param`` for the reductions
            (``None``: whole on this process). ``param_layout`` is only read with
            ``scale_parameter``.
        The rest as in :func:`adafactor`.

    Returns ``AdafactorLeafUpdate(update, state, step_size)``; the caller does
    ``param <- param - weight_decay * step_size * param - project_back(update)`` (that is
    Hugging Face's and galore-torch's order: the decay uses ``alpha_t`` and the pre-update
    ``param``; :func:`funcpar.optim.factored.decoupled_decay` rounds the decay as they do).
    Without a projection, ``grad`` and ``param`` have the same shape and layout.

    Math: ``beta2_t = 1 - t^decay_rate``; with ``x = grad^2 + eps1`` the second moment is
    factored (row/column EMAs of ``x``) or full (EMA of ``x``), giving ``u = grad * V^-1/2``;
    ``u <- u / max(1, RMS(u) / clip_threshold)``; ``u <- alpha_t u``
    (:func:`adafactor_step_size`); with ``beta1``: ``m <- beta1 m + (1 - beta1) u``, ``u = m``.
    """
    out = run_phased([_leaf_step(
        grad, param, state, step, lr=lr, eps=eps, clip_threshold=clip_threshold,
        decay_rate=decay_rate, beta1=beta1, scale_parameter=scale_parameter,
        relative_step=relative_step, warmup_init=warmup_init, layout=layout,
        param_layout=param_layout)])[0]
    return AdafactorLeafUpdate(*out)


def _leaf_step(grad, param, state, step, *, lr, eps, clip_threshold, decay_rate, beta1,
               scale_parameter, relative_step, warmup_init, layout, param_layout,
               target=None, weight_decay=None, out="direction", shared=None):
    """The Hugging Face step as passes over the leaf: statistics, the update's norm, the update.

    A phased step (funcpar.shard.reduce.run_phased), so that the optimizer completes all
    leaves' reductions together and runs each pass for all leaves in one launch: the
    statistics pass (or the full moment's), then the reductions: the parameter's sum of squares
    (``scale_parameter``) with the row and column sums, the sum of the row factor, then the
    norm pass, the update's sum of squares (reductions only for sharded leaves; the row and
    column sums always), and the update pass (``final``: after every leaf's reductions).

    ``out="direction"``: the update to subtract (what :func:`adafactor_leaf_update` returns);
    ``"update"`` / ``"param"``: ``target - weight_decay alpha_t target - update`` as a difference
    or as the new parameter (the weight decay and the subtraction fused into the update pass;
    ``weight_decay=None``: no decay, for leaves the mask leaves out).

    ``shared``: ``(beta2_t, rho_t)`` (:func:`_step_scalars`) formed once for all leaves of a
    step, instead of per leaf (a handful of 0-d ops each).
    """
    eps1, eps2 = eps
    beta2t, rho = shared or _step_scalars(step, lr=lr, decay_rate=decay_rate,
                                          relative_step=relative_step, warmup_init=warmup_init)
    moments = {k: v for k, v in state.items() if k != "exp_avg"}
    moment_phases = second_moment_phases(grad, moments, SECOND_MOMENT, beta2t, eps1,
                                         layout=layout)
    if scale_parameter:
        (alpha, decay), (precond, new_state, local_norm) = yield from together(
            _step_size_phases(step, param, lr=lr, eps2=eps2, scale_parameter=scale_parameter,
                              relative_step=relative_step, warmup_init=warmup_init,
                              param_layout=param_layout, weight_decay=weight_decay, rho=rho),
            moment_phases)
    else:  # no phase of its own (and no generator to relay through)
        alpha, decay = _unscaled_step(rho, weight_decay)
        precond, new_state, local_norm = yield from moment_phases
    clip = yield from clip_divisor_phases(local_norm, clip_threshold,
                                          shape=global_shape(grad, layout), layout=layout)
    if beta1 is not None and "exp_avg" not in state:
        raise KeyError("adafactor: beta1 is set but the state has no 'exp_avg' "
                       "(initialise it with the same beta1)")
    result, m = yield from one_pass(
        kernels.precond_apply_batch, grad, target, precond, final=True, clip=clip, pre=alpha,
        momentum=None if beta1 is None else state["exp_avg"], beta1=beta1,
        decay=decay, out=out,
    )
    if m is not None:
        new_state["exp_avg"] = m
    return result, new_state, alpha


def _adafactor(
    lr=None,
    weight_decay=0.0,
    clip_threshold=1.0,
    *,
    eps,
    decay_rate,
    beta1,
    scale_parameter,
    relative_step,
    warmup_init,
    min_dim_size_to_factor,
    weight_decay_mask,
):
    def init(params: Tree) -> AdafactorState:
        check_floating(params, who="adafactor")
        stats = tree_map(
            lambda p: None if p is None else adafactor_leaf_init(
                p.shape, dtype=p.dtype, device=p.device, beta1=beta1,
                min_dim_size_to_factor=min_dim_size_to_factor,
            ),
            params,
        )
        return AdafactorState(torch.zeros((), dtype=torch.int64), stats)

    def step(grads, state: AdafactorState, params, layouts, out):
        count = state.count + 1
        shared = _step_scalars(count, lr=lr, decay_rate=decay_rate,
                               relative_step=relative_step, warmup_init=warmup_init)

        def leaf(g, p, st, use_decay, layout):
            if g is None:
                return (None if out == "update" else p), st
            # update: (new param - param), exact while the step is under half the parameter,
            # so apply_updates reproduces Hugging Face's rounding of the new one. param: the
            # new parameter itself, in the same pass (GradientTransformation.apply).
            result, st, _ = yield from _leaf_step(
                g, p, st, count, lr=lr, eps=eps, clip_threshold=clip_threshold,
                decay_rate=decay_rate, beta1=beta1, scale_parameter=scale_parameter,
                relative_step=relative_step, warmup_init=warmup_init, layout=layout,
                param_layout=layout, target=p, out=out,
                weight_decay=weight_decay if use_decay else None, shared=shared,
            )
            return result, st

        # All leaves' steps in lockstep: each phase's reductions of the whole tree in one
        # all-reduce per mesh axis (run_phased), not one per leaf and axis.
        spec, g_leaves, (p_leaves, stats, lays) = checked_leaf_columns(
            grads, params, state.stats, layouts)
        decay = mask_flags(weight_decay_mask, params, spec)
        # The eager passes share one scratch buffer; grad mode is off unless an input
        # requires grad (then the passes ask leaf by leaf).
        with kernels.scratch_scope(), no_grad_unless_needed(
                g_leaves, p_leaves, stats, lr, weight_decay, clip_threshold):
            outs = run_phased([leaf(*row) for row in zip(g_leaves, p_leaves, stats, decay,
                                                          lays)])
        results, stats = (tree_unflatten(spec, [o[i] for o in outs]) for i in range(2))
        return results, AdafactorState(count, stats)

    def update(grads, state: AdafactorState, params=None, *, layouts=None):
        return step(grads, state, params, layouts, "update")

    def apply(grads, state: AdafactorState, params, *, layouts=None):
        return step(grads, state, params, layouts, "param")

    return GradientTransformation(init, update, apply)


#: The Adafactor arguments that may be schedules (kept in the state by inject_hyperparams).
ADAFACTOR_INJECTED = ("lr", "weight_decay", "clip_threshold")


def adafactor_hyperparams(
    lr: Any,
    eps: Sequence[float],
    clip_threshold: Any,
    decay_rate: float,
    beta1: float | None,
    weight_decay: Any,
    scale_parameter: bool,
    relative_step: bool,
    warmup_init: bool,
    min_dim_size_to_factor: int,
) -> dict[str, Any]:
    """:func:`adafactor`'s arguments checked (errors name ``adafactor``) and normalised into the
    keyword arguments of ``inject_hyperparams`` for the Adafactor rule: ``lr`` only when given,
    numbers as floats, flags as bools. Shared with ``galore_adafactor``, whose inner rule takes
    the same arguments."""
    who = "adafactor"
    if lr is not None and relative_step:
        raise ValueError(f"{who}: lr cannot be combined with relative_step=True (the step size "
                         "is then relative); pass relative_step=False to use lr")
    if lr is None and not relative_step:
        raise ValueError(f"{who}: lr is required when relative_step=False")
    if warmup_init and not relative_step:
        raise ValueError(f"{who}: warmup_init=True requires relative_step=True")
    if lr is not None:
        validate.nonnegative(who, "lr", lr)
    eps1, eps2 = eps_pair(who, eps)
    validate.positive(who, "eps[0]", eps1)
    # eps2 > 0: it is the floor of RMS(W) in alpha_t, so eps2 = 0 would freeze a zero-initialised
    # leaf forever (Hugging Face accepts it silently).
    validate.positive(who, "eps[1]", eps2)
    validate.positive(who, "clip_threshold", clip_threshold)
    if callable(decay_rate) or not (math.isfinite(float(decay_rate)) and decay_rate <= 0):
        raise ValueError(f"{who}: decay_rate must be a number <= 0 (beta2_t = 1 - t^decay_rate "
                         f"must lie in [0, 1)), got {decay_rate!r}")
    if beta1 is not None:
        if callable(beta1):
            raise TypeError(f"{who}: beta1 must be a number or None (it decides whether a "
                            "first moment exists)")
        validate.in_unit_interval(who, "beta1", beta1)
    validate.nonnegative(who, "weight_decay", weight_decay)
    if not isinstance(min_dim_size_to_factor, int) or min_dim_size_to_factor < 0:
        raise ValueError(f"{who}: min_dim_size_to_factor must be an int >= 0, "
                         f"got {min_dim_size_to_factor!r}")
    kwargs: dict[str, Any] = {} if lr is None else {"lr": lr}
    return dict(
        **kwargs,
        weight_decay=weight_decay,
        clip_threshold=clip_threshold,
        eps=(float(eps1), float(eps2)),
        decay_rate=float(decay_rate),
        beta1=None if beta1 is None else float(beta1),
        scale_parameter=bool(scale_parameter),
        relative_step=bool(relative_step),
        warmup_init=bool(warmup_init),
        min_dim_size_to_factor=min_dim_size_to_factor,
    )


def adafactor(
    lr: Any = None,
    eps: Sequence[float] = (1e-30, 1e-3),
    clip_threshold: Any = 1.0,
    decay_rate: float = -0.8,
    beta1: float | None = None,
    weight_decay: Any = 0.0,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
    *,
    min_dim_size_to_factor: int = 0,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """Adafactor, exactly ``transformers.optimization.Adafactor`` (fairseq's variant).

    Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
    arXiv 1804.04235. Defaults (Hugging Face's): ``lr=None`` with ``relative_step=True``,
    ``eps=(1e-30, 1e-3)``, ``clip_threshold=1.0``, ``decay_rate=-0.8``, ``beta1=None`` (no first
    moment), ``weight_decay=0.0``, ``scale_parameter=True``, ``warmup_init=False``. Tested step by
    step against transformers (tests/test_adafactor.py: max relative error measured 3.7e-16 in
    float64, 5.0e-8 in float32, over 12 steps).

    For each leaf ``W`` with gradient ``g`` at step ``t`` (from 1)::

        rho_t   = min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t))  if relative_step else lr
        alpha_t = max(eps2, RMS(W)) rho_t                          if scale_parameter else rho_t
        beta2_t = 1 - t^decay_rate
        x = g^2 + eps1
        >= 2 dims:  R <- beta2_t R + (1-beta2_t) mean_{-1}(x)
                    C <- beta2_t C + (1-beta2_t) mean_{-2}(x)
                    u = g * rsqrt(R / mean(R)) (x) rsqrt(C)   ((x): outer product, last 2 dims)
        otherwise:  V <- beta2_t V + (1-beta2_t) x;  u = g * rsqrt(V)
        u <- alpha_t u / max(1, RMS(u) / clip_threshold)
        beta1:      M <- beta1 M + (1-beta1) u;  u = M
        W <- W - weight_decay alpha_t W - u

    Hugging Face's quirks, reproduced: ``eps1`` is added to ``g^2`` *before* the averages (not
    to the estimate); ``RMS(W)`` is of the pre-update parameter, ``norm / sqrt(numel)``, and
    ``alpha_t`` uses it even for the first step (``max(eps2, 0)`` for a zero init); the first
    moment averages the already scaled and clipped update; the weight decay is scaled by
    ``alpha_t`` (not ``lr``), uses the pre-update ``W`` and is applied to every leaf (restrict
    it with ``weight_decay_mask``); ``lr`` must be given iff ``relative_step=False`` (Hugging Face
    raises for ``lr`` with ``relative_step`` and fails with a TypeError on ``lr=None`` without;
    here both are a ValueError); ``warmup_init`` requires ``relative_step``. Half-precision
    leaves are computed, and their statistics kept, in float32 (the parameter itself is then
    updated in its own dtype by :func:`~funcpar.optim.base.apply_updates`, where Hugging Face
    adds in float32 and rounds once).

    ``min_dim_size_to_factor`` (not in Hugging Face; default 0 reproduces it): a leaf with >= 2
    dims whose last two dims are not both >= this size keeps a full second moment (as optax's
    option of that name, which however factors the two largest dims). The choice is made at
    ``init`` from the shapes ``init`` sees.

    ``lr``, ``weight_decay`` and ``clip_threshold`` may be schedules; ``eps``, ``decay_rate`` and
    ``beta1`` are fixed. Per-leaf state names and shapes are Hugging Face's
    (see :class:`AdafactorState`); factored leaves cost O(rows + cols).
    """
    return inject_hyperparams(
        _adafactor,
        ADAFACTOR_INJECTED,
        **adafactor_hyperparams(
            lr, eps, clip_threshold, decay_rate, beta1, weight_decay, scale_parameter,
            relative_step, warmup_init, min_dim_size_to_factor,
        ),
        weight_decay_mask=weight_decay_mask,
    )
