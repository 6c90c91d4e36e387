"""``zero_partition``: ZeRO stages 1-3 (Rajbhandari et al. 2020, arXiv 1910.02054) over ``dp``.

``step, state = zero_partition(stage, mesh)(step, state)`` partitions, over the ``dp`` axis:

* stage 1: the optimizer state. After the data-parallel gradient mean each rank updates only
  its part of every leaf and the updated parts are all-gathered;
* stage 2: also the gradients: the backward's gradients are reduce-scattered (one collective
  per leaf, started from the backward's hooks as each gradient completes) instead of
  all-reduced, so each rank keeps only its part;
* stage 3: also the parameters: ``state.params`` holds each rank's part, gathered around the
  forward (an all-gather whose backward is the gradient's reduce-scatter).

**How a leaf is partitioned.** Each leaf is cut along one dim, the longest of its local
(tensor-parallel) shape that is not a blocked split and has at least as many entries as ranks,
into ``torch.chunk`` pieces: its :class:`~funcpar.shard.layout.Layout` gains ``dp`` as the
innermost axis of that dim (``layout.split(dim, "dp")``). A leaf that cannot be cut (a scalar, a
dim shorter than ``dp``) stays whole on every rank. Keeping leaves as tensors rather than flat
buffers costs one collective per leaf instead of one per bucket, and buys exactness for free:
the optimizer runs on the parts with their layouts, so every row/column statistic, RMS or norm
it takes through :mod:`funcpar.shard.reduce` is all-reduced over exactly the axes that cut it
(DESIGN principle 2); a factored optimizer keeps its rows and columns. Per rank, a partitioned
leaf holds ``ceil(n / dp)`` of its ``n`` entries along the cut dim at most: the padding bound.

Composition: apply after :func:`~funcpar.transforms.shard_params` (the partition cuts the
tensor-parallel shards); with :func:`~funcpar.transforms.data_parallel` over the same axis in
either order (it splits the batch; the gradient reduction is this transform's from stage 2).
The state must be fresh (step 0). ``step.layouts`` then describes ``state.params`` (partitioned
at stage 3) and ``step.grad_layouts`` the gradients the optimizer sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from funcpar.optim.base import GradientTransformation
from funcpar.shard import comm
from funcpar.shard.layout import Layout
from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, leaves_like, named_leaves, tree_flatten, tree_unflatten
from funcpar.train.step import TrainStep

__all__ = ["ZeroPlan", "plan_partition", "zero_partition"]


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Per flat leaf: the dim cut over ``axis`` (None: whole) and the layout of the part."""

    stage: int
    mesh: DeviceMesh
    axis: str
    names: tuple[str, ...]
    dims: tuple[int | None, ...]
    lengths: tuple[int, ...]  # the local (tensor-parallel) length of the cut dim, or 0
    layouts: tuple[Layout, ...]  # of the parts (the base layout where the leaf is whole)

    def _pieces(self, i: int) -> list[int]:
        return comm.chunk_sizes(self.lengths[i], self.mesh.size(self.axis))

    def part(self, i: int, x: Tensor) -> Tensor:
        """This rank's part of leaf ``i`` (``x`` its local tensor-parallel shard)."""
        d = self.dims[i]
        if d is None:
            return x
        pieces, r = self._pieces(i), self.mesh.rank(self.axis)
        return x.narrow(d, sum(pieces[:r]), pieces[r])

    def gather(self, i: int, x: Tensor, purpose: str) -> Tensor:
        d = self.dims[i]
        if d is None:
            return x
        return comm.all_gather(x, self.mesh, self.axis, dim=d, sizes=self._pieces(i),
                               purpose=f"{self.names[i]}: {purpose}")

    def scatter_mean(self, i: int, g: Tensor) -> Tensor:
        """The mean over ``axis`` of gradient ``g``, of which this rank keeps its part."""
        n, d = self.mesh.size(self.axis), self.dims[i]
        if d is None:
            return comm.all_reduce(g, self.mesh, self.axis,
                                   purpose=f"{self.names[i]}: zero grad (whole)") / n
        return comm.reduce_scatter(g, self.mesh, self.axis, dim=d, sizes=self._pieces(i),
                                   purpose=f"{self.names[i]}: zero grad") / n

    def map(self, fn: Callable[[int, Tensor], Tensor], tree: Tree) -> Tree:
        leaves, spec = tree_flatten(tree)
        if len(leaves) != len(self.dims):
            raise ValueError(f"zero_partition: a tree of {len(leaves)} leaves against a plan "
                             f"of {len(self.dims)}")
        return tree_unflatten(spec, [x if x is None else fn(i, x) for i, x in enumerate(leaves)])

    def to_parts(self, tree: Tree) -> Tree:
        return self.map(self.part, tree)

    def gather_tree(self, tree: Tree, purpose: str) -> Tree:
        return self.map(lambda i, x: self.gather(i, x, purpose), tree)

    def part_layouts(self, like: Tree) -> Tree:
        return tree_unflatten(tree_flatten(like)[1], list(self.layouts))


def plan_partition(params: Tree, layouts: Tree | None, mesh: DeviceMesh, stage: int,
                   axis: str = "dp") -> ZeroPlan:
    """Choose each leaf's cut dim (see the module docstring)."""
    n = mesh.size(axis)
    names, dims, lengths, parts = [], [], [], []
    lays = leaves_like(params, layouts, what="layouts", against="params")
    for (name, x), lay in zip(named_leaves(params), lays):
        base = lay if lay is not None else Layout(mesh, tuple(x.shape), None, name=name)
        if axis in {a for axes in base.dim_axes for a in axes}:
            raise ValueError(f"{name!r} is already split over {axis!r}: zero_partition once, "
                             "after shard_params")
        local = tuple(x.shape)
        candidates = [d for d in range(len(local))
                      if local[d] >= n and base.dim_blocks[d] == 1]
        d = max(candidates, key=lambda k: (local[k], -k)) if candidates and n > 1 else None
        names.append(name)
        dims.append(d)
        lengths.append(local[d] if d is not None else 0)
        parts.append(base.named(name) if d is None else base.split(d, axis).named(name))
    return ZeroPlan(stage, mesh, axis, tuple(names), tuple(dims), tuple(lengths), tuple(parts))


class _GatherPart(torch.autograd.Function):
    """Forward: the whole leaf from the parts. Backward: the gradient's mean, reduce-scattered
    (each rank's loss is the mean over its part of the batch)."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: ZeroPlan, i: int) -> Tensor:
        ctx.plan, ctx.i = plan, i
        return plan.gather(i, x, "zero3 param gather")

    @staticmethod
    def backward(ctx, g: Tensor):
        return ctx.plan.scatter_mean(ctx.i, g), None, None


class _ScatterGrads:
    """Stage 2/3's gradient reduction, as a :class:`~funcpar.train.step.GradSync`."""

    def __init__(self, plan: ZeroPlan):
        self.plan, self.done = plan, {}

    def _reduce(self, i: int, g: Tensor) -> Tensor:
        if self.plan.stage == 3 and self.plan.dims[i] is not None:
            return g  # _GatherPart's backward has reduce-scattered it already
        return self.plan.scatter_mean(i, g)

    def ready(self, i: int, grad: Tensor) -> None:
        self.done[i] = self._reduce(i, grad)

    def finish(self, grads: Tree) -> Tree:
        return self.plan.map(lambda i, g: self.done[i] if i in self.done else self._reduce(i, g),
                             grads)


def _partitioned(inner: GradientTransformation, plan: ZeroPlan) -> GradientTransformation:
    """``inner`` on this rank's parts; at stages 1-2 the updates are gathered whole again."""

    def init(params: Tree) -> Any:
        return inner.init(params if plan.stage == 3 else plan.to_parts(params))

    def update(grads: Tree, state: Any, params: Tree | None = None, *, layouts: Tree = None):
        del layouts  # the parts' layouts are the plan's
        g = grads if plan.stage >= 2 else plan.to_parts(grads)
        p = params if params is None or plan.stage == 3 else plan.to_parts(params)
        updates, state = inner.update(g, state, p, layouts=plan.part_layouts(grads))
        if plan.stage < 3:
            updates = plan.gather_tree(updates, "zero update gather")
        return updates, state

    return GradientTransformation(init, update)


def zero_partition(
    stage: int, mesh: DeviceMesh, *, axis: str = "dp"
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The ZeRO transform of ``stage`` (1, 2 or 3) over mesh axis ``axis``."""
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_partition stage must be 1, 2 or 3, got {stage!r}")
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r}: its axes are {mesh.axis_names}")

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if step.partition is not None:
            raise ValueError("the step is already partitioned: apply zero_partition once")
        if int(state.step) != 0:
            raise ValueError(f"zero_partition takes a fresh state (step 0), got step "
                             f"{int(state.step)}; repartition trained states via a checkpoint")
        if step.dp_axis not in (None, axis):
            raise ValueError(f"data_parallel is over {step.dp_axis!r} but zero_partition over "
                             f"{axis!r}: they must share the axis")
        plan = plan_partition(state.params, step.layouts, mesh, stage, axis)
        part_layouts = plan.part_layouts(state.params)
        opt = _partitioned(step.optimizer, plan)
        changes: dict[str, Any] = {"optimizer": opt, "partition": plan}
        params = state.params
        if stage >= 2:
            changes["grad_layouts"] = part_layouts
            changes["overlap_grads"] = lambda leaves: _ScatterGrads(plan)
        if stage == 3:
            params = plan.to_parts(params)
            params = plan.map(lambda i, x: x.clone(), params)  # own the parts, free the whole
            changes["layouts"] = part_layouts
            changes["apply_fn"] = _gathered(step.apply_fn, plan)
        new_state = state._replace(params=params, opt_state=opt.init(params))
        return dataclasses.replace(step, **changes), new_state

    return transform


def _gathered(apply_fn: Callable, plan: ZeroPlan) -> Callable:
    def apply(params: Tree, buffers: Tree, *args: Any, **kwargs: Any) -> Any:
        # Whole leaves pass untouched: their gradient mean is _ScatterGrads' all-reduce.
        whole = plan.map(
            lambda i, x: x if plan.dims[i] is None else _GatherPart.apply(x, plan, i), params)
        return apply_fn(whole, buffers, *args, **kwargs)

    apply.module = getattr(apply_fn, "module", None)
    return apply
