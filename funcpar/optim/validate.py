"""Hyperparameter checks shared by the optimizers: a clear error before any update."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "betas_in_range", "in_unit_interval", "nonnegative", "positive", "schedule_or_number",
    "structural",
]


def schedule_or_number(who: str, name: str, value: Any) -> float:
    """The value at step 0 (schedules are evaluated there), as a float."""
    if callable(value):
        value = value(0)
    if hasattr(value, "detach"):
        # A tensor hyperparameter (kept differentiable by inject_hyperparams): check its value.
        value = value.detach()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{who}: {name} must be a number or a schedule, got {value!r}") from None


def nonnegative(who: str, name: str, value: Any) -> None:
    v = schedule_or_number(who, name, value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{who}: {name} must be finite and >= 0, got {v}")


def positive(who: str, name: str, value: Any) -> None:
    v = schedule_or_number(who, name, value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{who}: {name} must be finite and > 0, got {v}")


def in_unit_interval(who: str, name: str, value: Any, *, closed: bool = False) -> None:
    """``0 <= value < 1`` (``<= 1`` when ``closed``)."""
    v = schedule_or_number(who, name, value)
    if not (0.0 <= v <= 1.0) or (v == 1.0 and not closed):
        raise ValueError(f"{who}: {name} must be in [0, 1{']' if closed else ')'}, got {v}")


def structural(who: str, name: str, value: Any) -> None:
    """Refuse a tensor that requires grad for a hyperparameter that is not injectable (it
    shapes the state or is a kernel constant): it cannot be differentiated (docs/FUNCTIONAL.md)."""
    if getattr(value, "requires_grad", False):
        raise TypeError(f"{who}: {name} is structural (fixed when the optimizer is built) and "
                        "cannot be differentiated; give it as a number (differentiable "
                        "hyperparameters: see docs/FUNCTIONAL.md)")


def betas_in_range(who: str, betas: Sequence[float], n: int = 2) -> tuple[float, ...]:
    betas = tuple(betas)
    for i, b in enumerate(betas):
        structural(who, f"betas[{i}]", b)
    if len(betas) != n:
        raise ValueError(f"{who}: betas must have {n} entries, got {len(betas)}")
    for i, b in enumerate(betas):
        in_unit_interval(who, f"betas[{i}]", b)
    return betas
