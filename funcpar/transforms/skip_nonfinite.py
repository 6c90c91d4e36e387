"""``skip_nonfinite``: a step whose gradients hold an inf or nan is skipped, counted, and
(optionally) the run stopped after ``k`` such steps in a row.

In float32 or bf16 training a single non-finite gradient entry reaches every parameter through
the optimizer's update (Adam's moments, a global-norm clip) and the run is lost, visible only
in the loss afterwards. fp16's loss scaling already guards against this (Micikevicius et al.
2018, arXiv 1710.03740, section 3.2; ``torch.amp.GradScaler``): ``amp_cast("fp16")`` skips such
a step. This transform gives every precision that guard, through the same machinery: it sets
the step's ``loss_scaler`` (:class:`~funcpar.train.step.LossScaler`) to a
:class:`NonFiniteGuard` whose scale is 1 and whose ``unscale`` only computes ``finite``, so
:class:`~funcpar.train.TrainStep` skips the step exactly as for fp16: params, buffers and
optimizer state come back unchanged, ``state.step`` advances (batches consumed), the
optimizer's own count does not.

With ``g_i`` the gradient leaves after the data-parallel / ZeRO reductions (this rank's shards
under tensor parallelism or ZeRO), a step is finite when

    finite = not max over ranks of max_i any(~isfinite(g_i))

the max taken over every axis of ``mesh`` (an all-reduce each), so every rank gets the same
verdict and they skip together (a rank skipping alone would hang the next collective of the
optimizer it did not run). One 0-d bool is read on the host per step.

``state.extras`` gains ``skipped_steps`` (int64: the steps skipped so far) and
``nonfinite_run`` (int64: the current run of consecutive non-finite steps), checkpointed with
the state; the metrics gain ``skipped`` (0-d bool) and ``skipped_steps``. ``policy="skip"``
skips and counts, and with ``give_up_after=k`` gives up at the ``k``-th non-finite step in a
row (:class:`NonFiniteError`: a run whose every step is skipped trains nothing, and should
say so rather than end as if it had trained); ``policy="raise"`` skips and counts too, and
the ``max_consecutive``-th non-finite step in a row raises :class:`NonFiniteError` (the state
the caller holds is the one before that step, its parameters untouched by any non-finite
gradient).

Composition. After ``amp_cast("fp16")`` (the order that always works puts this last) the guard
wraps fp16's loss scaler: the scaling, the skip and the scale's backoff stay fp16's, and the
guard adds only its counts and the ``raise`` policy (fp16 skips a step with an overflow anyway;
whether the scale or the gradients caused it, ``max_consecutive`` overflows in a row stop the
run). Any other loss scaler already set is wrapped the same way. ``amp_cast("fp16")`` applied
*after* this transform is refused (it would replace the guard): apply it before.
Under more than one process ``mesh=`` (the mesh of the parallel transforms) is required,
refused without one, as for fp16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, device_of, tree_flatten
from funcpar.train.finite import all_finite, check_agreement_mesh
from funcpar.train.step import LossScaler, TrainStep

__all__ = ["NonFiniteError", "NonFiniteGuard", "skip_nonfinite"]

POLICIES = ("skip", "raise")
_EXTRAS = ("skipped_steps", "nonfinite_run")


class NonFiniteError(FloatingPointError):
    """``max_consecutive`` steps in a row had non-finite gradients (``policy="raise"``)."""


@dataclasses.dataclass(frozen=True)
class NonFiniteGuard:
    """A :class:`~funcpar.train.step.LossScaler` that skips non-finite steps (module
    docstring). ``inner``: a loss scaler it wraps (fp16's), or None (scale 1)."""

    policy: str = "skip"
    max_consecutive: int = 1
    mesh: DeviceMesh | None = None
    inner: LossScaler | None = None
    give_up_after: int | None = None

    def scale(self, extras: dict[str, Tensor]) -> Tensor:
        if self.inner is not None:
            return self.inner.scale(extras)
        # 1.0: the loss's backward seed is 1 either way, so the gradients are the unguarded
        # step's to the bit.
        return torch.ones((), dtype=torch.float32, device=extras["skipped_steps"].device)

    def unscale(self, grads: Tree, extras: dict[str, Tensor]) -> tuple[Tree, Tensor]:
        if self.inner is not None:
            return self.inner.unscale(grads, extras)
        return grads, all_finite(tree_flatten(grads)[0], self.mesh)

    def update(self, extras: dict[str, Tensor], finite: Tensor) -> dict[str, Tensor]:
        new = dict(extras) if self.inner is None else self.inner.update(extras, finite)
        skipped, run = extras["skipped_steps"], extras["nonfinite_run"]
        if bool(finite):
            run = torch.zeros_like(run)
        else:
            skipped, run = skipped + 1, run + 1
            if (self.policy == "skip" and self.give_up_after is not None
                    and int(run) >= self.give_up_after):
                raise NonFiniteError(
                    f"skip_nonfinite: {int(run)} consecutive steps had non-finite (inf/nan) "
                    f"gradients ({int(skipped)} skipped in all); giving up, as "
                    f"give_up_after={self.give_up_after} asks: the run is not training. The "
                    "state before this step is intact: lower the learning rate, check the data "
                    "or the loss")
            if self.policy == "raise" and int(run) >= self.max_consecutive:
                raise NonFiniteError(
                    f"skip_nonfinite: {int(run)} consecutive steps had non-finite (inf/nan) "
                    f"gradients ({int(skipped)} skipped in all); stopping, as "
                    f"policy='raise', max_consecutive={self.max_consecutive} asks. The state "
                    "before this step is intact: lower the learning rate, check the data or "
                    "the loss, or use policy='skip'")
        new.update(skipped_steps=skipped, nonfinite_run=run)
        return new

    def metrics(self, extras: dict[str, Tensor], finite: Tensor) -> dict[str, Tensor]:
        out = {} if self.inner is None else dict(self.inner.metrics(extras, finite))
        out["skipped"] = torch.logical_not(finite)
        out["skipped_steps"] = extras["skipped_steps"] + torch.logical_not(finite).long()
        return out


def skip_nonfinite(
    policy: str = "skip",
    *,
    max_consecutive: int = 3,
    mesh: DeviceMesh | None = None,
    give_up_after: int | None = None,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The transform (module docstring). ``policy``: ``"skip"`` (skip and count every
    non-finite step) or ``"raise"`` (skip and count, and raise :class:`NonFiniteError` at the
    ``max_consecutive``-th non-finite step in a row). ``give_up_after`` (``"skip"``): raise
    :class:`NonFiniteError` at that many non-finite steps in a row (None: never). ``mesh``:
    the mesh of the parallel transforms, so that every rank agrees (required under more than
    one process)."""
    if policy not in POLICIES:
        raise ValueError(f"skip_nonfinite: policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(max_consecutive, bool) or not (isinstance(max_consecutive, int)
                                                 and max_consecutive >= 1):
        raise ValueError(f"skip_nonfinite: max_consecutive must be an int >= 1, got "
                         f"{max_consecutive!r}")
    if give_up_after is not None and (isinstance(give_up_after, bool) or not (
            isinstance(give_up_after, int) and give_up_after >= 1)):
        raise ValueError(f"skip_nonfinite: give_up_after must be None or an int >= 1, got "
                         f"{give_up_after!r}")

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if isinstance(step.loss_scaler, NonFiniteGuard):
            raise ValueError("skip_nonfinite is already applied: apply it once")
        extras = dict(state.extras or {})
        taken = [k for k in _EXTRAS if k in extras]
        if taken:
            raise ValueError(f"skip_nonfinite: state.extras already holds {taken}")
        check_agreement_mesh(mesh, "skip_nonfinite")
        device = device_of(state.params)
        for k in _EXTRAS:
            extras[k] = torch.zeros((), dtype=torch.int64, device=device)
        guard = NonFiniteGuard(policy, max_consecutive, mesh, step.loss_scaler, give_up_after)
        return dataclasses.replace(step, loss_scaler=guard), state._replace(extras=extras)

    return transform

