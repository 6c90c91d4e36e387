"""``pipeline_split``: pipeline parallelism over a mesh axis as a transform of step and state.

``step, state = pipeline_split(mesh, microbatches=8, schedule="1f1b")(step, state)`` cuts the
model into ``S = pp * virtual_stages`` stages at block boundaries (:mod:`funcpar.pipeline.stages`:
explicit ``cuts`` or balanced by parameter count; the embedding on the first stage, final norm
and LM head on the last), keeps in ``state.params`` only the leaves of this rank's stages, and
makes the step run a pipeline schedule (:mod:`funcpar.pipeline.schedules`: ``gpipe``,
``1f1b`` or ``interleaved`` with ``virtual_stages`` per rank) over ``microbatches`` equal
micro-batches of the (data-parallel local) batch, activations and their gradients moving by
point-to-point transfers over ``axis`` (:mod:`funcpar.pipeline.runtime`).

What the step computes is the single-process step on the whole batch:

* the loss is the mean of the micro-batch losses (the full-batch loss for a mean loss over
  equal micro-batches), reported on every rank; the gradients are those of that mean, summed
  over micro-batches in this rank's leaves; a weight tied between the first and last stage
  gets the sum of both stages' gradients on both;
* an MoE model's router losses: each stage's MoE blocks' weighted router losses enter the
  loss where they are computed - a stage before the last returns them as a side loss
  (:class:`funcpar.pipeline.stages.SideLoss`) that its backward differentiates with its
  output, the last stage's are in the output its ``loss_fn`` (``moe_lm_loss``) adds - and
  the loss reported adds every stage's (the pp all-reduce of the loss). Routing is per
  sequence, so micro-batching changes neither the routing nor the capacity; the
  load-balancing loss (a mean over sequences) and the z-loss (a mean over tokens) of the full
  batch are the means of the equal micro-batches' (docs/MOE.md, "Pipelines");
* the ``grad_norm`` metric and the norm that ``clip_by_global_norm`` clips by are over *all*
  stages' leaves: the optimizer's ``update``/``apply`` and the metric run under
  :func:`funcpar.shard.reduce.tree_split_over` (the tree is split over ``pp`` by leaf), so
  :func:`~funcpar.shard.reduce.total_sum_of_squares` - the one tree-wide reduction the
  optimizers make - adds one all-reduce of its sum over ``pp``, a tied leaf counted on its
  first holder only. Every per-leaf reduction (Adafactor's factored statistics, LAMB's trust
  ratio, GaLore's projections) is unchanged, since each leaf lives whole on its stage. The
  optimizer sees this rank's leaves with their own names, nothing added, so its state and
  masks are those of these leaves (a mask given as a predicate over names works as is; see
  docs/PIPELINE.md for masks given as whole-model trees).

Composition: apply ``pipeline_split`` **first**, on the freshly built step (whole model, step
0): it cuts the model, and the transforms after it - :func:`shard_params` (tensor parallel
inside each stage), :func:`expert_parallel` (the experts of this rank's stages' MoE blocks over
``ep``), :func:`context_parallel` (each stage's attention over ``cp``, the activations sent
between stages each rank's sequence chunk), :func:`data_parallel`, :func:`zero_partition`
(per stage, over the ranks of the same pipeline coordinate), :func:`amp_cast` - see a step over
this rank's stages like any other.
The mesh holds ``pp`` with the other axes (``DeviceMesh.from_env(pp=2, dp=2, tp=2)``); the pp
fibres (ranks that differ only in their pp coordinate) carry the transfers.

Checkpoints: :func:`funcpar.state.save` / :func:`~funcpar.state.load` take the split state as
is - every leaf keeps the name it has in one process, so the checkpoint holds each leaf once
(a tied weight from its first holder) and loads into any layout (docs/CHECKPOINTS.md,
"Pipelined states").

Not supported: ``compile=True`` (the schedule runs eagerly), overlapping the data-parallel
gradient reduction with the backward (it runs after the last micro-batch), and parameters
that are 0-d.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from funcpar.optim.base import GradientTransformation
from funcpar.pipeline.runtime import Pipeline
from funcpar.pipeline.schedules import SCHEDULES, build_schedule
from funcpar.pipeline.stages import StagedModel, plan_stages, stage_apply, staged_model_for
from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree
from funcpar.train.step import TrainStep
from funcpar.transforms.compose import require_fresh

__all__ = ["pipeline_split"]


def pipeline_split(
    mesh: DeviceMesh,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    cuts: Sequence[int] | None = None,
    axis: str = "pp",
    stages: StagedModel | None = None,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The pipeline-parallel transform over mesh axis ``axis`` (see the module docstring).

    ``microbatches``: how many micro-batches each step's (local) batch is cut into; the batch
    must divide into them. ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``
    (with ``virtual_stages`` >= 1 stages per rank). ``cuts``: the block indices where stages
    2..S begin (default: balanced by parameter count). ``stages``: how to run the model
    piecewise (default: known for :class:`funcpar.models.Llama`).
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r}: its axes are {mesh.axis_names}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")
    for name, x in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"pipeline_split: {name} must be an int >= 1, got {x!r}")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ValueError(f"pipeline_split: virtual_stages={virtual_stages} needs "
                         f"schedule='interleaved', got {schedule!r}")
    p = mesh.size(axis)

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if step.pipeline is not None:
            raise ValueError("pipeline_split is already applied: apply it once")
        later = [what for what, on in (
            ("shard_params", step.layouts is not None), ("zero_partition",
                                                          step.partition is not None),
            ("data_parallel", step.dp_axis is not None), ("amp_cast", step.precision is not None),
            ("a loss scaler", step.loss_scaler is not None),
            ("context_parallel", getattr(step.apply_fn, "context_parallel", None) is not None))
            if on]
        if later:
            raise ValueError(f"apply pipeline_split first: the step already has {later}, which "
                             "must apply per stage, after the model is cut")
        require_fresh(state, "pipeline_split", remedy="")
        module = getattr(step.apply_fn, "module", None)
        if module is None:
            raise TypeError("pipeline_split needs a step built on functionalize(module)'s "
                            "apply_fn")
        if not isinstance(state.params, dict):
            raise TypeError("pipeline_split needs state.params as functionalize's dict")
        staged = staged_model_for(module, stages)
        if (staged.side_losses is not None and staged.side_losses(module)
                and getattr(step.loss_fn, "extra_loss", None) is None):
            raise ValueError(
                f"pipeline_split: the stages of this {type(module).__name__} add side losses "
                "(an MoE model's router losses, funcpar.pipeline.stages.SideLoss) to the "
                f"loss, but loss_fn {getattr(step.loss_fn, '__name__', step.loss_fn)!r} does "
                "not declare that it adds the output's own as a plain term "
                "(loss_fn.extra_loss): use funcpar.models.moe_lm_loss, or declare it")
        plan = plan_stages(module, staged, p, virtual_stages, cuts)
        known = {n for ns in plan.names for n in ns}
        if set(state.params) != known:
            raise ValueError(f"state.params does not match the model's parameters: missing "
                             f"{sorted(known - set(state.params))[:5]}, unexpected "
                             f"{sorted(set(state.params) - known)[:5]}")
        rank = mesh.rank(axis)
        actions = build_schedule(schedule, p, microbatches, virtual_stages)[rank]
        params = {n: state.params[n] for n in plan.names_of(rank)}
        pipeline = Pipeline(mesh, axis, plan, schedule, microbatches, actions)
        optimizer = step.optimizer if p == 1 else _over_stages(step.optimizer, pipeline)
        new_step = dataclasses.replace(step, apply_fn=stage_apply(module, staged, plan),
                                       optimizer=optimizer, pipeline=pipeline)
        return new_step, state._replace(params=params, opt_state=optimizer.init(params))

    return transform


def _over_stages(inner: GradientTransformation, pipeline: Pipeline) -> GradientTransformation:
    """``inner`` on this rank's leaves, its tree-wide norms over every stage's (module
    docstring), and the leaves held by several ranks (tied weights) given the first holder's
    update. ``init`` is ``inner``'s; ``apply`` exists when ``inner``'s does, so the fused
    step the one-process run takes is taken here too."""

    def check(grads: Any) -> None:
        if not isinstance(grads, dict):
            raise TypeError(f"pipeline_split's optimizer expects dict trees (functionalize's "
                            f"params), got {type(grads).__name__}")

    def update(grads: Tree, state: Any, params: Tree | None = None, *,
               layouts: Tree | None = None) -> tuple[Tree, Any]:
        check(grads)
        with pipeline.norms_over_stages(grads):
            updates, state = inner.update(grads, state, params, layouts=layouts)
        return pipeline.same_as_first_holder(dict(updates)), state

    if inner.apply is None:
        return GradientTransformation(inner.init, update)

    def apply(grads: Tree, state: Any, params: Tree, *,
              layouts: Tree | None = None) -> tuple[Tree, Any]:
        check(grads)
        with pipeline.norms_over_stages(grads):
            params, state = inner.apply(grads, state, params, layouts=layouts)
        return pipeline.same_as_first_holder(dict(params)), state

    return GradientTransformation(inner.init, update, apply)
