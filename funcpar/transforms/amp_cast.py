"""``amp_cast``: mixed-precision compute over float32 master parameters.

``step, state = amp_cast("bf16" | "fp16")(step, state)`` keeps ``state.params`` (and so the
optimizer's update and state) in float32 and makes the step compute in half precision
(Micikevicius et al. 2018, "Mixed Precision Training", arXiv 1710.03740):

* inside the step's ``apply_fn`` every floating parameter is cast to the compute dtype
  (``p.to(bf16)``; the cast is differentiable, so the gradient that reaches the float32 master
  leaf is float32), and so is every floating input; integer inputs (token ids), buffers and the
  targets are left alone. The loss must be computed in float32 from the half-precision outputs:
  :func:`funcpar.models.lm_loss` and the vocab-parallel cross-entropy upcast the logits;
* ``keep_fp32`` names leaves that stay float32 in the compute (norm gains, as Apex's
  ``keep_batchnorm_fp32``): the module that owns such a leaf runs in float32 (its floating
  inputs cast up, its floating outputs cast back to the compute dtype, by forward hooks
  installed for the call), so that its neighbours keep seeing one dtype.

fp16 adds dynamic loss scaling (section 3.2 of the paper; the rule of ``torch.amp.GradScaler``):
with ``s`` the loss scale, the backward differentiates ``s * loss`` so that small gradients do
not flush to zero in fp16, and the gradients (float32 after the cast) are unscaled,
``g <- g / s``, after the data-parallel / ZeRO reductions and before the ``grad_norm`` metric,
clipping and the optimizer. If any entry of any gradient is inf or nan - checked on every rank
and agreed across ranks by an all-reduce max over every axis of ``mesh`` - the step is skipped:
params, buffers and optimizer state are returned unchanged, and ``s <- s * backoff_factor``.
After ``growth_interval`` consecutive clean steps ``s <- s * growth_factor``. ``s`` (float32)
and the count of clean steps (int64) live in ``state.extras["loss_scale"]`` and
``state.extras["good_steps"]``, so they are saved with the state. ``state.step`` advances on a
skipped step too (it counts batches consumed); the optimizer's own step count does not, so its
schedule and bias corrections see only the updates made. The metrics gain ``loss_scale`` (the
scale this step used) and ``skipped`` (0-d bool); ``loss`` and ``grad_norm`` are unscaled.
bf16 has float32's exponent range and needs no scaling: no extras, no check.

Composition: amp_cast touches only the ``apply_fn`` (wrapped outermost or innermost, both
compute the same thing), the step's ``loss_scaler`` and ``state.extras``, so it may be applied
before or after :func:`~funcpar.transforms.shard_params`, :func:`~funcpar.transforms.
data_parallel` and :func:`~funcpar.transforms.zero_partition` at stages 1-2. With ZeRO-3 it
must come after (the recommended order in general: last): its casts then see the parts, so a
ZeRO-3 parameter gather travels in half precision (as FSDP's ``param_dtype``); applied before,
ZeRO-3 would install its gathered float32 leaves past the casts, and building that step is a
ValueError. Gradient reductions are float32 in every order (the gradients of the float32
leaves); tensor-parallel activation collectives run in the compute dtype. Applying it twice is
a ValueError. Under more than one process fp16 needs ``mesh=`` (the mesh the other transforms
use) for the agreed check; it is refused without one, before any compute.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, named_leaves, tree_flatten, tree_unflatten
from funcpar.train.finite import all_finite, check_agreement_mesh
from funcpar.train.step import TrainStep

__all__ = ["PRECISIONS", "DynamicLossScaler", "amp_cast"]

PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

KeepFp32 = Callable[[str], bool] | str | Iterable[str] | None


@dataclasses.dataclass(frozen=True)
class DynamicLossScaler:
    """fp16 dynamic loss scaling as a :class:`~funcpar.train.step.LossScaler` (module
    docstring); its state is ``extras["loss_scale"]`` and ``extras["good_steps"]``."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    mesh: DeviceMesh | None = None

    def scale(self, extras: dict[str, Tensor]) -> Tensor:
        return extras["loss_scale"]

    def unscale(self, grads: Tree, extras: dict[str, Tensor]) -> tuple[Tree, Tensor]:
        leaves, spec = tree_flatten(grads)
        # The scale is a power of two (init, growth and backoff are, by default), so this
        # multiplication is exact: the unscaled gradients are those of the unscaled loss up to
        # the fp16 round-off of the backward itself.
        inv = extras["loss_scale"].double().reciprocal().float()
        out = [g if g is None else g * inv.to(g.device) for g in leaves]
        # Every rank gets the same verdict, so every rank skips together (funcpar.train.finite).
        return tree_unflatten(spec, out), all_finite(out, self.mesh, "amp fp16 inf/nan check",
                                                     device=inv.device)

    def update(self, extras: dict[str, Tensor], finite: Tensor) -> dict[str, Tensor]:
        scale, good = extras["loss_scale"], extras["good_steps"]
        # Selected with torch.where, not branched on the host: no device sync per step, and the
        # rule traces into a compiled step. Each product is a power of two times the scale
        # (exact), so the selected values are those of the branching rule, bit for bit.
        finite = finite.to(scale.device)
        counted = torch.where(finite, good + 1, torch.zeros_like(good))
        grow = counted >= self.growth_interval
        scale = torch.where(finite, torch.where(grow, scale * self.growth_factor, scale),
                            scale * self.backoff_factor)
        good = torch.where(grow, torch.zeros_like(good), counted)
        return {**extras, "loss_scale": scale, "good_steps": good}

    def metrics(self, extras: dict[str, Tensor], finite: Tensor) -> dict[str, Tensor]:
        return {"loss_scale": extras["loss_scale"], "skipped": torch.logical_not(finite)}


def amp_cast(
    precision: str,
    *,
    keep_fp32: KeepFp32 = None,
    mesh: DeviceMesh | None = None,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The mixed-precision transform (module docstring).

    ``precision``: ``"bf16"`` or ``"fp16"``. ``keep_fp32``: leaves computed in float32, as a
    predicate of the leaf's dotted name or glob patterns over the names (``"*norm*"``; each
    must match a leaf). ``mesh``: the mesh of the parallel transforms, for fp16's cross-rank
    inf/nan check (required under more than one process). The scaling parameters are fp16's
    (``torch.amp.GradScaler``'s defaults); they are validated for bf16 too but unused.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"amp_cast: unknown precision {precision!r}; use one of "
                         f"{sorted(PRECISIONS)} (float32 training needs no amp_cast)")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"amp_cast: init_scale must be a finite number > 0, got {init_scale}")
    if not growth_factor > 1:
        raise ValueError(f"amp_cast: growth_factor must be > 1, got {growth_factor}")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"amp_cast: backoff_factor must be in (0, 1), got {backoff_factor}")
    if isinstance(growth_interval, bool) or not (isinstance(growth_interval, int)
                                                  and growth_interval >= 1):
        raise ValueError(f"amp_cast: growth_interval must be an int >= 1, got "
                         f"{growth_interval!r}")
    dtype = PRECISIONS[precision]

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if step.precision is not None:
            raise ValueError(f"amp_cast is already applied (precision {step.precision!r}): "
                             "apply it once")
        named = named_leaves(state.params)
        for name, x in named:
            if torch.is_tensor(x) and x.is_floating_point() and x.dtype != torch.float32:
                raise ValueError(f"amp_cast keeps float32 master params, but {name!r} is "
                                 f"{x.dtype}: build the model in float32")
        keep = _keep_mask([n for n, _ in named], keep_fp32)
        module = getattr(step.apply_fn, "module", None)
        if any(keep) and module is None:
            raise TypeError("amp_cast(keep_fp32=...) needs a step built on "
                            "functionalize(module)'s apply_fn: it hooks the owning modules")
        owners = _owners(module, [n for (n, _), k in zip(named, keep) if k]) if any(keep) else []
        changes: dict[str, Any] = {
            "apply_fn": _cast_apply(step.apply_fn, dtype, keep, owners), "precision": precision,
        }
        extras = dict(state.extras or {})
        if precision == "fp16":
            taken = [k for k in ("loss_scale", "good_steps") if k in extras]
            if taken:
                raise ValueError(f"amp_cast: state.extras already holds {taken}")
            if step.loss_scaler is not None:  # it would be replaced, its guard lost
                raise ValueError(f"amp_cast('fp16'): the step already has a loss scaler "
                                 f"({type(step.loss_scaler).__name__}, e.g. skip_nonfinite's): "
                                 "apply amp_cast first, then skip_nonfinite (which wraps fp16's)")
            check_agreement_mesh(mesh, "amp_cast('fp16')")
            device = _device_of(named)
            extras["loss_scale"] = torch.tensor(float(init_scale), dtype=torch.float32,
                                                device=device)
            extras["good_steps"] = torch.zeros((), dtype=torch.int64, device=device)
            changes["loss_scaler"] = DynamicLossScaler(growth_factor, backoff_factor,
                                                       growth_interval, mesh)
        return dataclasses.replace(step, **changes), state._replace(extras=extras)

    return transform


def _keep_mask(names: list[str], keep: KeepFp32) -> list[bool]:
    if keep is None:
        return [False] * len(names)
    if callable(keep):
        return [bool(keep(n)) for n in names]
    patterns = [keep] if isinstance(keep, str) else list(keep)
    for pat in patterns:
        if not isinstance(pat, str):
            raise TypeError(f"amp_cast keep_fp32: patterns must be strings, got {pat!r}")
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise ValueError(f"amp_cast keep_fp32: {pat!r} matches no parameter (e.g. "
                             f"{names[:3]})")
    return [any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in names]


def _owners(module: nn.Module, names: list[str]) -> list[nn.Module]:
    """The distinct modules owning the leaves ``names``."""
    out: dict[int, nn.Module] = {}
    for n in names:
        prefix = n.rpartition(".")[0]
        m = module.get_submodule(prefix) if prefix else module
        out[id(m)] = m
    return list(out.values())


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, [x.to(dtype) if torch.is_tensor(x) and x.is_floating_point()
                                 else x for x in leaves])


def _cast_apply(apply_fn: Callable, dtype: torch.dtype, keep: list[bool],
                owners: list[nn.Module]) -> Callable:
    def up(mod: nn.Module, args: Any, kwargs: Any) -> Any:
        return _cast(args, torch.float32), _cast(kwargs, torch.float32)

    def down(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return _cast(output, dtype)

    def apply(params: Tree, buffers: Tree, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten(params)
        if len(leaves) != len(keep):
            raise ValueError(f"amp_cast: params of {len(leaves)} leaves, planned for "
                             f"{len(keep)}")
        cast = [x if k or not (torch.is_tensor(x) and x.is_floating_point()) else x.to(dtype)
                for x, k in zip(leaves, keep)]
        handles = []
        for m in owners:
            # Prepended: the module's own hooks see what it computes on and returns.
            handles.append(m.register_forward_pre_hook(up, with_kwargs=True, prepend=True))
            handles.append(m.register_forward_hook(down, with_kwargs=True, prepend=True))
        try:
            # A flat dict is rebuilt by hand: under torch.compile, dynamo's optree polyfill
            # cannot unflatten the spec (optree orders dict leaves by sorted key).
            flat = type(params) is dict and all(torch.is_tensor(v) for v in params.values())
            new = dict(zip(sorted(params), cast)) if flat else tree_unflatten(spec, cast)
            return apply_fn(new, buffers, *_cast(args, dtype), **_cast(kwargs, dtype))
        finally:
            for h in handles:
                h.remove()

    apply.module = getattr(apply_fn, "module", None)
    apply.keep_fp32 = keep  # per flat leaf; offload's master params read it
    apply.remat = getattr(apply_fn, "remat", False)  # see funcpar.train.whole_step.applies
    if hasattr(apply_fn, "remat_modules"):  # what the plan counts twice (funcpar.presets.plan)
        apply.remat_modules = apply_fn.remat_modules
    apply.precision = {v: k for k, v in PRECISIONS.items()}[dtype]  # see TrainStep.__post_init__
    return apply


def _device_of(named: list[tuple[str, Any]]) -> torch.device:
    for _, x in named:
        if torch.is_tensor(x):
            return x.device
    return torch.device("cpu")
