"""``shard_params``: tensor parallelism as a transform of the step and the state.

``step, state = shard_params(rules, mesh)(step, state)`` splits each parameter as the rules say
(:mod:`funcpar.shard.rules`) and makes the step compute the same function on the shards:

* column-split linears see their input through :func:`~funcpar.shard.tp_ops.enter_region`
  (once per distinct input tensor, so q/k/v or gate/up share one gradient all-reduce) and
  produce their slice of the outputs; attention then runs on the local heads, since the models
  reshape by ``head_dim`` (``view(b, t, -1, head_dim)``);
* row-split linears sum their partial products with one all-reduce, then add the bias once;
* a vocab-split embedding looks up its slice of the table and sums over ranks;
* a vocab-split LM head keeps its logits split, and the loss becomes
  :func:`~funcpar.shard.tp_ops.vocab_parallel_cross_entropy` (only per-token maxima and sums
  cross the wire). This replaces the step's loss, so the step's loss must be token-mean
  cross-entropy, declared by a ``token_cross_entropy = True`` attribute (``funcpar.models.
  lm_loss`` has it); any other loss needs the ``colwise_gather_output`` style.

The optimizer receives the layouts, so every reduction it makes is global (DESIGN principle 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.layout import shard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import LocalAttr, ModulePlan, Rule, ShardingPlan, plan_sharding
from funcpar.shard.tp_ops import (
    enter_region,
    exit_region,
    gather_last_dim,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep

__all__ = ["logits_of", "shard_params"]


def logits_of(output: Any) -> Tensor:
    """The logits in a model's output: the tensor itself, or ``output.logits`` (Hugging Face)."""
    return output if torch.is_tensor(output) else output.logits


def shard_params(
    rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh, *, axis: str = "tp"
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The tensor-parallel transform over mesh axis ``axis`` (see the module docstring).

    The state must be fresh from ``init_state`` (step 0) and hold whole parameters; its
    optimizer state is re-initialized on the shards (moving a trained state between layouts is
    the checkpoint's job).
    """

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        module = getattr(step.apply_fn, "module", None)
        if module is None:
            raise TypeError("shard_params needs a step built on functionalize(module)'s apply_fn")
        if int(state.step) != 0:
            raise ValueError(f"shard_params takes a fresh state (step 0), got step "
                             f"{int(state.step)}; reshard trained states through a checkpoint")
        if step.layouts is not None:
            raise ValueError("the step is already sharded (it has layouts): "
                             "apply shard_params once")
        plan = plan_sharding(module, rules, mesh, axis)
        layouts = {n: plan.layouts[n] for n in state.params}
        params = shard_tree(state.params, layouts)
        loss_fn = step.loss_fn
        head = plan.vocab_parallel_head
        if head is not None:
            loss_fn = _vocab_parallel_loss(step.loss_fn, head, plan)
        new_step = dataclasses.replace(
            step, apply_fn=_sharded_apply(step.apply_fn, plan), loss_fn=loss_fn, layouts=layouts
        )
        opt_state = step.optimizer.init(params)
        return new_step, state._replace(params=params, opt_state=opt_state)

    return transform


def _vocab_parallel_loss(loss_fn: Callable, head: ModulePlan, plan: ShardingPlan) -> Callable:
    if not getattr(loss_fn, "token_cross_entropy", False):
        raise ValueError(
            f"{head.name!r} is vocab-split (rule {head.rule.pattern!r}), so the loss is computed "
            "vocab-parallel and must be token-mean cross-entropy: use funcpar.models.lm_loss, "
            "or the style 'colwise_gather_output' for another loss"
        )
    lay = plan.layouts[head.weight_name]
    start = lay.local_slices()[0].start
    ignore_index = getattr(loss_fn, "ignore_index", -100)

    def loss(output: Any, targets: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(
            logits_of(output), targets, start, plan.mesh, plan.axis, ignore_index=ignore_index
        )

    return loss


def _sharded_apply(apply_fn: Callable, plan: ShardingPlan) -> Callable:
    def sharded(params, buffers, *args, **kwargs):
        with _installed(plan):
            return apply_fn(params, buffers, *args, **kwargs)

    sharded.module = apply_fn.module
    return sharded


@contextlib.contextmanager
def _installed(plan: ShardingPlan) -> Iterator[None]:
    """The tensor-parallel forwards in place of the matched modules' own, for one call."""
    entered: dict[int, tuple[Tensor, Tensor]] = {}

    def enter(x: Tensor, who: str) -> Tensor:
        # One all-reduce of the input gradient per distinct input, shared by q/k/v (gate/up).
        hit = entered.get(id(x))
        if hit is None or hit[0] is not x:
            hit = (x, enter_region(x, plan.mesh, plan.axis, f"{who}: input grad"))
            entered[id(x)] = hit
        return hit[1]

    for mp in plan.modules:
        mp.module.forward = _forward(mp, plan, enter)
    whole = [(m, attr, getattr(m, attr)) for m, attr, _ in plan.local_attrs]
    for m, attr, local in plan.local_attrs:
        setattr(m, attr, local)
    try:
        yield
    finally:
        for mp in plan.modules:
            del mp.module.forward
        for m, attr, value in whole:
            setattr(m, attr, value)


def _forward(mp: ModulePlan, plan: ShardingPlan, enter: Callable) -> Callable:
    m, mesh, axis, who = mp.module, plan.mesh, plan.axis, mp.name

    def matmul(x: Tensor) -> Tensor:
        # The module's weight is the local shard here (functional_call swapped it in).
        if mp.kind == "conv1d":
            return x @ m.weight
        return F.linear(x, m.weight)

    def add_bias(y: Tensor) -> Tensor:
        return y if m.bias is None else y + m.bias

    if mp.style in ("colwise", "vocab_parallel"):
        return lambda x: add_bias(matmul(enter(x, who)))
    if mp.style == "colwise_gather_output":
        out_dim = 1 if mp.kind == "conv1d" else 0
        sizes = comm.chunk_sizes(plan.layouts[mp.weight_name].global_shape[out_dim],
                                 mesh.size(axis))
        return lambda x: gather_last_dim(add_bias(matmul(enter(x, who))), mesh, axis, sizes,
                                         f"{who}: output")
    if mp.style == "rowwise":
        return lambda x: add_bias(exit_region(matmul(x), mesh, axis, f"{who}: output"))
    if mp.style == "embedding_rowwise":
        start = plan.layouts[mp.weight_name].local_slices()[0].start
        return lambda ids: vocab_parallel_embedding(ids, m.weight, start, mesh, axis, who,
                                                    padding_idx=m.padding_idx)
    raise AssertionError(mp.style)
