"""Hyperparameters that live in the optimizer state.

Every funcpar optimizer is built by :func:`inject_hyperparams`: its injectable hyperparameters
(``lr``, ``weight_decay``, ...) are stored as 0-d float64 tensors in a :class:`HyperState` at
the top of its state. A number stays as given until changed; a schedule is evaluated at each
update's count. To change a hyperparameter between steps without rebuilding anything,
``opt_state = set_hyperparams(opt_state, lr=3e-4)``; the state stays a plain pytree, so the
change is checkpointed with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcpar.optim.base import GradientTransformation, check_state
from funcpar.state.tree import Tree, tree_leaves

__all__ = ["HyperState", "get_hyperparams", "inject_hyperparams", "set_hyperparams"]


class HyperState(NamedTuple):
    count: Tensor  # 0-d int64: number of updates done, the schedules' argument
    hyperparams: dict[str, Tensor]  # 0-d float64 each
    inner: Tree


def _value(v: Any, count: Tensor) -> Tensor:
    # A tensor (or a schedule's tensor) keeps its autograd graph: a hyperparameter given as a
    # tensor that requires grad is differentiated through the updates (funcpar.meta,
    # docs/FUNCTIONAL.md). Only Python numbers are converted.
    if callable(v):
        v = v(count)
    if torch.is_tensor(v):
        if v.numel() != 1:
            raise ValueError(f"a hyperparameter must be a scalar, got shape {tuple(v.shape)}")
        return v.to(torch.float64).reshape(())
    return torch.tensor(float(v), dtype=torch.float64)


def inject_hyperparams(
    factory: Callable[..., GradientTransformation],
    injectable: tuple[str, ...],
    **kwargs: Any,
) -> GradientTransformation:
    """``factory(**kwargs)`` with the ``injectable`` ones kept in the state as tensors.

    ``factory`` must build its state without looking at the injectable values (they change
    between updates); it receives them as 0-d float64 tensors.
    """
    dynamic = {k: kwargs[k] for k in injectable if k in kwargs}
    static = {k: v for k, v in kwargs.items() if k not in dynamic}

    def current(count: Tensor) -> dict[str, Tensor]:
        return {k: _value(v, count) for k, v in dynamic.items()}

    def init(params: Tree) -> HyperState:
        count = torch.zeros((), dtype=torch.int64)
        hp = current(count)
        return HyperState(count, hp, factory(**static, **hp).init(params))

    def hyperparams(state: HyperState) -> dict[str, Tensor]:
        # Scheduled values are recomputed from the count; numbers come from the state, where
        # set_hyperparams may have changed them.
        hp = dict(state.hyperparams)
        hp.update({k: _value(v, state.count) for k, v in dynamic.items() if callable(v)})
        return hp

    checked: set = set()  # structures whose state shapes fit the params (check_state's cache)

    def update(grads, state: HyperState, params=None, *, layouts=None):
        hp = hyperparams(state)
        _check_state(params if params is not None else grads, state, hp, layouts)
        updates, inner = factory(**static, **hp).update(grads, state.inner, params, layouts=layouts)
        return updates, HyperState(state.count + 1, hp, inner)

    def _check_state(params, state: HyperState, hp: dict[str, Tensor], layouts) -> None:
        # Every optimizer is built here, so this is the one place that refuses a state built
        # for other shapes (a checkpoint of another model, say) before any update math. Only
        # with every leaf whole: under sharded layouts an optimizer may shape its state for
        # the whole leaves, which init (local shapes only) cannot know (GaLore checks its own).
        if layouts is not None and any(x is not None for x in tree_leaves(layouts)):
            return
        check_state(params, state.inner, lambda p: factory(**static, **hp).init(p), checked,
                    who=getattr(factory, "__name__", "optimizer").strip("_"))

    # Whether the optimizer has a fused apply does not depend on the hyperparameters' values.
    if factory(**static, **current(torch.zeros((), dtype=torch.int64))).apply is None:
        return GradientTransformation(init, update)

    def apply(grads, state: HyperState, params, *, layouts=None):
        hp = hyperparams(state)
        _check_state(params, state, hp, layouts)
        new_params, inner = factory(**static, **hp).apply(grads, state.inner, params,
                                                          layouts=layouts)
        return new_params, HyperState(state.count + 1, hp, inner)

    return GradientTransformation(init, update, apply)


def _walk(state: Tree, fn: Callable[[HyperState], HyperState | None]) -> Tree:
    if isinstance(state, HyperState):
        new = fn(state) or state
        return new._replace(inner=_walk(new.inner, fn))
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_walk(s, fn) for s in state))
    if isinstance(state, (tuple, list)):
        return type(state)(_walk(s, fn) for s in state)
    if isinstance(state, dict):
        return {k: _walk(v, fn) for k, v in state.items()}
    return state


def set_hyperparams(opt_state: Tree, **values: float | Tensor) -> Tree:
    """A copy of ``opt_state`` with the named hyperparameters set in every optimizer that has
    them. Scheduled hyperparameters are recomputed at the next update, so setting one has no
    lasting effect: build that optimizer with a number instead."""
    found: set[str] = set()
    for k, v in values.items():
        x = float(v.detach()) if torch.is_tensor(v) else float(v)  # a tensor keeps its graph
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"hyperparameter {k} must be finite and >= 0, got {v}")

    def setter(s: HyperState) -> HyperState:
        hp = dict(s.hyperparams)
        for k, v in values.items():
            if k in hp:
                hp[k] = _value(v, s.count)
                found.add(k)
        return s._replace(hyperparams=hp)

    new = _walk(opt_state, setter)
    missing = set(values) - found
    if missing:
        have = sorted(get_hyperparams(opt_state))
        raise KeyError(f"no optimizer in this state has hyperparameter(s) {sorted(missing)}; "
                       f"injectable ones are {have}")
    return new


def get_hyperparams(opt_state: Tree) -> dict[str, Tensor]:
    """The hyperparameters used by the last update (0-d tensors; the first optimizer's, by name).

    Right after ``init`` these are the values for step 0.
    """
    out: dict[str, Tensor] = {}
    for s in _hyper_states(opt_state):
        for k, v in s.hyperparams.items():
            out.setdefault(k, v)
    return out


def _hyper_states(state: Tree) -> Iterator[HyperState]:
    """The HyperStates in ``state``, in :func:`_walk`'s order, read without rebuilding the
    tree (TrainStep reads the ``lr`` metric every step): the containers of tensor leaves
    (per-leaf moments, say) are scanned, not walked node by node."""
    if isinstance(state, HyperState):
        yield state
        yield from _hyper_states(state.inner)
    elif isinstance(state, (tuple, list)):
        for s in state:
            if isinstance(s, (tuple, list, dict)):
                yield from _hyper_states(s)
    elif isinstance(state, dict):
        for s in state.values():
            if isinstance(s, (tuple, list, dict)):
                yield from _hyper_states(s)
