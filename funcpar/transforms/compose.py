"""Composition of step transforms."""

from __future__ import annotations

from collections.abc import Callable

from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep

__all__ = ["compose"]

Transform = Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]


def compose(*transforms: Transform) -> Transform:
    """One transform applying ``transforms`` left to right:
    ``compose(shard_params(...), data_parallel(...))(step, state)``."""

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        for t in transforms:
            step, state = t(step, state)
        return step, state

    return transform
