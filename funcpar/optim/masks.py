"""Which leaves a hyperparameter applies to (weight decay, above all).

A mask is ``None`` (every leaf), a predicate ``fn(name, param) -> bool`` over the dotted leaf
name and the tensor, or a tree of bools with the structure of ``params``. A flat dict mask may
name more leaves than ``params`` holds (a pipeline stage sees its own leaves of a mask built for
the whole model): :func:`restrict_to` keeps the entries of the leaves present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from funcpar.state.tree import (
    Tree,
    leaves_like,
    leaves_up_to,
    named_leaves,
    tree_flatten,
    tree_unflatten,
)

__all__ = ["Mask", "mask_flags", "matrices_only", "resolve_mask", "restrict_to"]

Mask = None | Callable[[str, Tensor], bool] | Tree


def matrices_only(name: str, param: Tensor) -> bool:
    """The usual decay mask: decay weights with >= 2 dims, not biases, norms or scalars."""
    return param.dim() >= 2


def restrict_to(mask: Any, params: Tree) -> Any:
    """A flat dict ``mask`` cut down to the keys of a flat dict ``params`` it covers; any other
    mask unchanged (a missing key is then the usual structure error, naming it)."""
    if isinstance(mask, dict) and isinstance(params, dict) and set(params) < set(mask):
        return {k: mask[k] for k in params}
    return mask


def resolve_mask(mask: Mask, params: Tree, *, what: str = "weight_decay_mask") -> Tree:
    """A tree of bools with the structure of ``params``."""
    spec = tree_flatten(params)[1]
    if mask is None:  # every leaf: no names needed (this runs every update)
        return tree_unflatten(spec, [True] * spec.num_leaves)
    return tree_unflatten(spec, _flags(mask, params, what))


def mask_flags(mask: Mask, params: Tree, spec: Any, *,
               what: str = "weight_decay_mask") -> list[bool]:
    """:func:`resolve_mask`'s flags lined up with the leaves of ``spec`` (the gradients'
    structure, as :func:`~funcpar.optim.base.leaf_columns` lines up the other trees); for
    ``None`` (every leaf, what most runs use) no tree is built."""
    if mask is None:
        return [True] * spec.num_leaves
    return leaves_up_to(spec, resolve_mask(mask, params, what=what), what=what,
                        against="grads")


def _flags(mask: Mask, params: Tree, what: str) -> list[bool]:
    named = named_leaves(params)
    if callable(mask):
        out = []
        for name, p in named:
            v = mask(name, p)
            if not isinstance(v, bool):
                raise TypeError(f"{what} predicate returned {type(v).__name__} for {name!r}, "
                                "expected bool")
            out.append(v)
        return out
    flags = leaves_like(params, restrict_to(mask, params), what=what, against="params")
    for (name, _), v in zip(named, flags):
        if not isinstance(v, bool):
            raise TypeError(f"{what} leaf {name!r} is {type(v).__name__}, expected bool")
    return flags
