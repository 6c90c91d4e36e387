"""Which leaves a hyperparameter applies to (weight decay, above all).

A mask is ``None`` (every leaf), a predicate ``fn(name, param) -> bool`` over the dotted leaf
name and the tensor, or a tree of bools with the structure of ``params``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from funcpar.state.tree import Tree, leaves_like, named_leaves, tree_flatten, tree_unflatten

__all__ = ["Mask", "matrices_only", "resolve_mask"]

Mask = None | Callable[[str, Tensor], bool] | Tree


def matrices_only(name: str, param: Tensor) -> bool:
    """The usual decay mask: decay weights with >= 2 dims, not biases, norms or scalars."""
    return param.dim() >= 2


def resolve_mask(mask: Mask, params: Tree, *, what: str = "weight_decay_mask") -> Tree:
    """A tree of bools with the structure of ``params``."""
    return tree_unflatten(tree_flatten(params)[1], _flags(mask, params, what))


def _flags(mask: Mask, params: Tree, what: str) -> list[bool]:
    named = named_leaves(params)
    if mask is None:
        return [True] * len(named)
    if callable(mask):
        out = []
        for name, p in named:
            v = mask(name, p)
            if not isinstance(v, bool):
                raise TypeError(f"{what} predicate returned {type(v).__name__} for {name!r}, "
                                "expected bool")
            out.append(v)
        return out
    flags = leaves_like(params, mask, what=what, against="params")
    for (name, _), v in zip(named, flags):
        if not isinstance(v, bool):
            raise TypeError(f"{what} leaf {name!r} is {type(v).__name__}, expected bool")
    return flags
