"""Buffer donation: a step that consumes its input state and returns the new one in its storage.

JAX's ``donate_argnums`` lets a pure function reuse its arguments' buffers for its results;
afterwards the donated arrays are unusable ("buffer has been donated"). funcpar does the same
for a :class:`~funcpar.state.TrainState`: :func:`donate_into` writes each new leaf into the
storage of the old leaf it replaces, hands back *fresh* tensor objects aliasing that storage,
and marks the old tensor objects donated (an attribute on the Python object, not on the
storage), so that :func:`check_not_donated` — called at step entry and by ``save`` — refuses
the consumed state with an error that names donation instead of computing on overwritten
values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from funcpar.state.tree import Tree, named_leaves, tree_flatten, tree_unflatten

__all__ = ["DonatedError", "check_not_donated", "donate_into", "mark_donated"]

_MARK = "_funcpar_donated"


class DonatedError(RuntimeError):
    """A tensor of a TrainState that was donated to a step (consumed) was used again."""


def mark_donated(tree: Tree) -> None:
    """Mark every tensor leaf of ``tree`` as donated (consumed by a step)."""
    _mark(tree_flatten(tree)[0])


def _mark(leaves: list[Any]) -> None:
    for leaf in leaves:
        if torch.is_tensor(leaf):
            setattr(leaf, _MARK, True)


def check_not_donated(state: Any, where: str, leaves: list[Any] | None = None) -> None:
    """Raise :class:`DonatedError` naming the first donated leaf of ``state`` (a TrainState or
    any tree). ``where`` names the caller ("TrainStep", "save"); ``leaves``: every leaf of
    ``state``, when the caller has flattened it already (a train step, every call)."""
    # The fast scan runs every step; the leaf names are built only for the error.
    if leaves is None:
        leaves = tree_flatten(tuple(state))[0]
    if not any(getattr(x, _MARK, False) for x in leaves):
        return
    named = state._asdict() if hasattr(state, "_asdict") else state  # 'params.w', not '0.w'
    for name, leaf in named_leaves(named):
        if torch.is_tensor(leaf) and getattr(leaf, _MARK, False):
            raise DonatedError(
                f"{where}: leaf {name!r} of this TrainState has been donated to a step "
                "(donate=True) and its storage now holds the next state: use the state that "
                "step returned, or build the step with donate=False to keep the input")


def _reusable(old: Any, new: Any) -> bool:
    # Write into the old storage only where it is a plain dense tensor that can hold the new
    # value bit for bit; a meta leaf (offload), another layout, dtype or device keeps the new one.
    return (torch.is_tensor(old) and torch.is_tensor(new) and old is not new
            and old.shape == new.shape and old.dtype == new.dtype
            and old.device == new.device and old.device.type != "meta"
            and old.layout == torch.strided and old.stride() == new.stride()
            and not old.requires_grad)


def donate_into(old: Tree, new: Tree, *, old_flat: tuple[list[Any], Any] | None = None) -> Tree:
    """``new`` moved into ``old``'s storage where shapes, dtypes and devices match.

    Returns a tree of fresh tensor objects (``detach()`` aliases: same storage, new Python
    object) with ``new``'s values; every tensor leaf of ``old`` is then marked donated. Leaves
    of ``new`` that are ``old``'s very objects (a skipped step, an unchanged hyper-parameter)
    are aliased as they are, so their values stay exactly as they were. When the two trees'
    structures differ, ``new`` is returned as computed (aliased), and ``old`` is still marked;
    for two tuples of as many trees (a step's params, buffers and optimizer state, donated in
    one call: two flattens instead of six) that holds tree by tree. ``old_flat``: ``old``
    flattened (``tree_flatten(old)``) by the caller already.
    """
    old_leaves, old_spec = tree_flatten(old) if old_flat is None else old_flat
    new_leaves, new_spec = tree_flatten(new)
    same = old_spec == new_spec and len(old_leaves) == len(new_leaves)
    if (not same and isinstance(old, tuple) and isinstance(new, tuple)
            and len(old) == len(new)):
        return type(new)(*map(donate_into, old, new)) if hasattr(new, "_fields") else tuple(
            map(donate_into, old, new))
    out = [n.detach() if isinstance(n, Tensor) else n for n in new_leaves]
    if same:
        kept: set[int] | None = None  # ids of the new leaves, built when first needed
        dst, src = [], []
        for i, (o, n) in enumerate(zip(old_leaves, new_leaves)):
            # The in-place paths hand back the old objects themselves: nothing to move.
            if o is n or not isinstance(n, Tensor) or not _reusable(o, n):
                continue
            if kept is None:
                # An old tensor object the new state still holds (elsewhere) keeps its value.
                kept = {id(x) for x in new_leaves}
            if id(o) in kept:
                continue
            if o.data_ptr() != n.data_ptr():  # not already written in place (in the backward)
                dst.append(o)
                src.append(n)
            out[i] = o.detach()
        if dst:
            with torch.no_grad():
                # One multi-tensor copy (per tensor in list order, as copy_ one by one).
                torch._foreach_copy_(dst, src)
    _mark(old_leaves)  # the leaves in hand: no second walk of old
    return tree_unflatten(new_spec, out)


def is_donated(t: Tensor) -> bool:
    """Whether the tensor object ``t`` was donated."""
    return bool(getattr(t, _MARK, False))
