"""Composition of step transforms."""

from __future__ import annotations

from collections.abc import Callable

from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep

__all__ = ["compose", "require_before_partition", "require_fresh"]

Transform = Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]


def compose(*transforms: Transform) -> Transform:
    """One transform applying ``transforms`` left to right:
    ``compose(shard_params(...), data_parallel(...))(step, state)``."""

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        for t in transforms:
            step, state = t(step, state)
        return step, state

    return transform


def require_fresh(state: TrainState, who: str,
                  remedy: str = "reshard trained states through a checkpoint") -> None:
    """A layout transform takes the state ``init_state`` made (step 0): its optimizer state is
    re-initialised on the new leaves, which would silently drop a trained state's moments."""
    if int(state.step) != 0:
        raise ValueError(f"{who} takes a fresh state (step 0), got step {int(state.step)}"
                         + (f"; {remedy}" if remedy else ""))


def require_before_partition(step: TrainStep, who: str, what: str) -> None:
    """``zero_partition`` cuts the leaves as they stand, so a transform that re-cuts them
    (``what``: the shards it makes) must come first."""
    if step.partition is not None:
        raise ValueError(f"apply {who} before zero_partition: the partition cuts the {what}")
