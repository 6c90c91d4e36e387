"""``accumulate_grads``: gradient accumulation inside one step, reduced once.

``step, state = accumulate_grads(k)(step, state)``: the step cuts the batch it computes (its
data-parallel slice, under ``data_parallel``) into ``k`` equal micro-batches along dim 0 and
runs one forward and backward per micro-batch, summing the gradients of ``loss_j / k``
(:class:`~funcpar.train.step.MicroBatches`, :func:`~funcpar.train.step.loss_and_grads`); then
the step goes on once - the data-parallel reduction, ZeRO's reduce-scatter, the clip and the
optimizer. For a loss that is a mean over equal micro-batches this is the step on the
``k``-times-larger batch, with the activation memory of one micro-batch (float64: equal to
round-off, tests/test_accumulate_grads.py). Under ``data_parallel`` and ZeRO stages 1-2 the
gradients cross the wire once per step (the reduction's hooks run in the last micro-batch's
backward, given the running sum), not once per micro-batch as ``funcpar.optim.accumulate``'s
``k`` separate steps do. ZeRO-3 reduce-scatters each gathered leaf's gradient in every
micro-batch's backward (its params are parts; a whole accumulated gradient is what it avoids
keeping), as DeepSpeed's stage 3 does.

This is the step-level counterpart of :func:`funcpar.optim.accumulate` (optax's MultiSteps),
which accumulates across steps in the optimizer state: one batch per call, ``k`` calls per
update, each of them a synchronised step.

Composition: any order with the other transforms (it wraps whatever ``local_batch`` the step
has, and a later ``data_parallel`` or ``expert_parallel`` splits every micro-batch alike).
Refused: after ``pipeline_split`` (the pipeline's micro-batches are this, already: raise its
``microbatches``) and with ``update_in_backward`` (it updates each leaf in the backward of one
batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from funcpar.pipeline.runtime import split_microbatches
from funcpar.state.train_state import TrainState
from funcpar.train.step import MicroBatches, TrainStep

__all__ = ["accumulate_grads", "micro_batches"]


def micro_batches(batch: Any, k: int) -> MicroBatches:
    """``batch`` cut into ``k`` equal micro-batches along dim 0 of every tensor."""
    return MicroBatches(tuple(split_microbatches(batch, k, "accumulate_grads", "k")))


def accumulate_grads(k: int) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The gradient-accumulation transform over ``k`` micro-batches (module docstring)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"accumulate_grads: k must be an int >= 1, got {k!r}")

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if step.pipeline is not None:
            raise ValueError("accumulate_grads after pipeline_split: the pipeline already runs "
                             "micro-batches and sums their gradients; raise its microbatches "
                             f"(x{k}) instead")
        if step.update_in_backward:
            raise ValueError("accumulate_grads with update_in_backward: the update runs in the "
                             "backward of one batch, so there is no sum to accumulate into")
        if k == 1:
            return step, state
        inner = step.local_batch

        def local_batch(batch: Any) -> Any:
            batch = inner(batch) if inner is not None else batch
            if isinstance(batch, MicroBatches):
                raise ValueError("accumulate_grads is applied twice: apply it once")
            return micro_batches(batch, k)

        return dataclasses.replace(step, local_batch=local_batch), state

    return transform
