"""Pytree helpers over optree.

Every state in funcpar (params, buffers, optimizer states, layouts) is a pytree whose leaves are
tensors. These helpers name leaves by their dotted path (``"layers.0.attn.q.weight"``) so that
reports, masks and sharding rules can speak about leaves the way ``named_parameters`` does.
``None`` is a leaf here (``none_is_leaf=True``): a layouts tree may hold ``None`` for an
unsharded leaf without changing its structure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

__all__ = [
    "LeafSpec",
    "Tree",
    "device_of",
    "leaves_device",
    "leaves_like",
    "leaves_up_to",
    "named_leaves",
    "path_name",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_map_with_path",
    "tree_shapes",
    "tree_structure_check",
    "tree_unflatten",
]

NAMESPACE = "funcpar"

#: A pytree: nested dicts, lists, tuples and NamedTuples with tensors (or None) at the leaves.
Tree = Any


def tree_flatten(tree: Tree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves in a fixed order and the structure to rebuild the tree from them."""
    return optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)


def tree_unflatten(spec: optree.PyTreeSpec, leaves: list[Any]) -> Tree:
    return optree.tree_unflatten(spec, leaves)


def tree_leaves(tree: Tree) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)


def device_of(tree: Tree) -> torch.device:
    """The device of ``tree``'s first tensor leaf (a state's: its params' first), else the
    CPU."""
    return leaves_device(tree_leaves(tree))


def leaves_device(leaves: list[Any]) -> torch.device:
    """:func:`device_of` on leaves already flattened."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """``fn`` applied leaf-wise; ``rest`` must have the structure of ``tree``."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=True, namespace=NAMESPACE)


def path_name(path: tuple[Any, ...]) -> str:
    """``("layers", 0, "weight") -> "layers.0.weight"``."""
    return ".".join(str(p) for p in path)


def tree_map_with_path(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """``fn(name, leaf, *rest_leaves)`` with the leaf's dotted name."""
    return optree.tree_map_with_path(
        lambda path, *xs: fn(path_name(path), *xs),
        tree,
        *rest,
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def named_leaves(tree: Tree) -> list[tuple[str, Any]]:
    """``[(dotted_name, leaf), ...]`` in flattening order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True, namespace=NAMESPACE)
    return [(path_name(p), x) for p, x in zip(paths, leaves)]


class LeafSpec(NamedTuple):
    """Shape and dtype of a tensor leaf (``jax.ShapeDtypeStruct``'s counterpart)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def tree_shapes(tree: Tree) -> Tree:
    """The tree with each tensor replaced by its :class:`LeafSpec`."""
    return tree_map(lambda x: LeafSpec(tuple(x.shape), x.dtype) if torch.is_tensor(x) else x, tree)


def tree_structure_check(reference: Tree, other: Tree, *, what: str, against: str) -> None:
    """Raise a ValueError naming the first differing leaf if ``other``'s structure differs."""
    ref_names = [n for n, _ in named_leaves(reference)]
    other_names = [n for n, _ in named_leaves(other)]
    if ref_names == other_names and tree_flatten(reference)[1] == tree_flatten(other)[1]:
        return
    missing = sorted(set(ref_names) - set(other_names))
    extra = sorted(set(other_names) - set(ref_names))
    detail = []
    if missing:
        detail.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        detail.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    if not detail:
        detail.append("same leaf names but a different container structure")
    raise ValueError(f"{what} does not match the structure of {against}: " + "; ".join(detail))


def leaves_like(reference: Tree, other: Tree | None, *, what: str, against: str) -> list[Any]:
    """The leaves of ``other`` in ``reference``'s order; ``None`` gives a list of ``None``.

    Optimizer states hold one sub-tree per parameter leaf; this is how they are lined up with
    the parameters (``other`` may have whole sub-trees where ``reference`` has leaves).
    """
    return leaves_up_to(tree_flatten(reference)[1], other, what=what, against=against)


def leaves_up_to(spec: optree.PyTreeSpec, other: Tree | None, *, what: str,
                 against: str) -> list[Any]:
    """:func:`leaves_like` given the reference's structure ``spec`` (flattened once by a
    caller that lines up several trees with it)."""
    if other is None:
        return [None] * spec.num_leaves
    try:
        return spec.flatten_up_to(other)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{what} does not match the structure of {against}: {err}") from None
