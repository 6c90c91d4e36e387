"""Schedules: hyperparameters as functions of the step.

A schedule maps the 0-based update count (an int or a 0-d integer tensor) to a value, and is
written in torch ops so that it traces under ``torch.compile`` (values given as tensors keep
their autograd graph: a hypergradient reaches a schedule's peak, docs/FUNCTIONAL.md). Any
optimizer hyperparameter marked injectable (``lr``, ``weight_decay``, ...) accepts a schedule in
place of a number; the value used at update ``t`` (counting from 0) is ``schedule(t)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "ScalarOrSchedule",
    "Schedule",
    "constant",
    "cosine",
    "linear",
    "linear_warmup",
    "warmup_cosine",
]

Schedule = Callable[[Tensor | int], Tensor]
#: What an injectable hyperparameter accepts: a number, a 0-d tensor (kept differentiable), or a
#: schedule of the step.
ScalarOrSchedule = float | Tensor | Schedule


def _step(t: Tensor | int) -> Tensor:
    return torch.as_tensor(t, dtype=torch.float64)


def _check(name: str, value: float | Tensor, *, positive: bool = False) -> None:
    value = float(value.detach()) if torch.is_tensor(value) else value
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"schedule {name} must be finite and {need}, got {value}")


def constant(value: float | Tensor) -> Schedule:
    _check("value", value)
    if torch.is_tensor(value):  # a tensor keeps its graph (hypergradients, docs/FUNCTIONAL.md)
        return lambda t: value.to(torch.float64).reshape(())

    def schedule(t: Tensor | int) -> Tensor:
        return torch.full((), float(value), dtype=torch.float64)

    return schedule


def linear(init: float | Tensor, end: float | Tensor, steps: int) -> Schedule:
    """From ``init`` at step 0 to ``end`` at ``steps``, constant afterwards."""
    _check("init", init)
    _check("end", end)
    _check("steps", steps, positive=True)

    def schedule(t: Tensor | int) -> Tensor:
        frac = torch.clamp(_step(t) / steps, 0.0, 1.0)
        return init + (end - init) * frac

    return schedule


def linear_warmup(peak: float | Tensor, warmup_steps: int, init: float | Tensor = 0.0) -> Schedule:
    """Linear from ``init`` to ``peak`` over ``warmup_steps``, then ``peak``."""
    if warmup_steps == 0:
        return constant(peak)
    return linear(init, peak, warmup_steps)


def cosine(peak: float | Tensor, decay_steps: int, end: float | Tensor = 0.0) -> Schedule:
    """Half a cosine from ``peak`` at step 0 to ``end`` at ``decay_steps``, constant after.

    ``end + (peak - end) * (1 + cos(pi * min(t, T) / T)) / 2`` (Loshchilov & Hutter 2017,
    arXiv 1608.03983, without restarts).
    """
    _check("peak", peak)
    _check("end", end)
    _check("decay_steps", decay_steps, positive=True)

    def schedule(t: Tensor | int) -> Tensor:
        frac = torch.clamp(_step(t) / decay_steps, 0.0, 1.0)
        return end + (peak - end) * 0.5 * (1.0 + torch.cos(math.pi * frac))

    return schedule


def warmup_cosine(
    peak: float | Tensor, warmup_steps: int, decay_steps: int, init: float | Tensor = 0.0,
    end: float | Tensor = 0.0,
) -> Schedule:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine to ``end``.

    ``decay_steps`` counts the whole schedule (warm-up included), as optax does.
    """
    _check("warmup_steps", warmup_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})"
        )
    warm = linear_warmup(peak, warmup_steps, init)
    decay = cosine(peak, decay_steps - warmup_steps, end)

    def schedule(t: Tensor | int) -> Tensor:
        s = _step(t)
        return torch.where(s < warmup_steps, warm(s), decay(s - warmup_steps))

    return schedule
