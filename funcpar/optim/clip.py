"""Gradient clipping by the global norm (Pascanu et al. 2013, arXiv 1211.5063), and the
step-scoped sharing of that norm between the ``grad_norm`` metric and the clip."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcpar.optim import validate
from funcpar.optim.base import EmptyState, GradientTransformation
from funcpar.shard import reduce as _reduce
from funcpar.shard.layout import Layout
from funcpar.shard.reduce import total_sum_of_squares
from funcpar.state.tree import Tree, leaves_up_to, tree_flatten, tree_map

__all__ = ["clip_by_global_norm", "global_norm", "reuse_global_norm"]


class _Known(NamedTuple):
    """A norm computed inside :func:`reuse_global_norm`, with what it was computed from."""

    tree: Any  # the tree object itself: how a tree without tensor leaves is recognised
    leaves: tuple[Tensor, ...]  # held (not just their ids), so no id is reused meanwhile
    versions: tuple[int, ...]  # autograd's version counters: an in-place change misses
    layouts: tuple[Any, ...]
    split: Any  # the active tree split of funcpar.shard.reduce (pipeline stages), or None
    norm: Tensor | None = None  # None in a key still being looked up


_KNOWN: contextvars.ContextVar[list[_Known] | None] = contextvars.ContextVar(
    "funcpar_known_global_norms", default=None)


@contextlib.contextmanager
def reuse_global_norm() -> Iterator[None]:
    """Within this context, :func:`global_norm` computes the norm of the same gradients once.

    The first call on a tree computes its norm (and issues its all-reduces) as always and
    remembers it; a later call in the context whose gradients are *the same tensors* (by
    identity, none changed in place since: autograd's version counter), with equal layouts
    and under the same tree split (:func:`funcpar.shard.reduce.tree_split_over`: same mesh,
    axes and shared leaves), returns that very tensor - bit-identical, and without any
    collective. Anything else (a transformation before the clip that returned new gradients,
    ZeRO-1's partitioned view, other layouts) misses and computes its own norm, as outside the
    context. :class:`~funcpar.train.TrainStep` enters it around the ``grad_norm`` metric and
    the optimizer, so a ``clip_by_global_norm`` that sees the step's gradients clips by the
    metric's norm instead of reducing again. The remembered norms live as long as the context.

    Whether a call hits is decided on each rank from its own tensors, so - like any collective
    - every rank that takes part in the norm must make the same decision: the transformations
    before the clip must replace the gradients on every rank alike (all ranks or none, as the
    optimizers of :mod:`funcpar.optim` do), never on some ranks only. A tree with no tensor
    leaf is recognised by the identity of the tree object itself.

    While ``torch.compile`` traces (``torch.compiler.is_compiling()``) nothing is remembered or
    reused: the norm is computed as outside the context (identity and version counters are not
    those of the real tensors there). :class:`~funcpar.train.TrainStep`'s whole-step compiled
    region therefore computes the clip's norm in the graph again (the same ops on the same
    gradients: the same value); where it compiles the forward and backward only, the
    optimizer runs eagerly and reuses the metric's norm.
    """
    token = _KNOWN.set([])
    try:
        yield
    finally:
        _KNOWN.reset(token)


def global_norm(tree: Tree, layouts: Tree | None = None) -> Tensor:
    """``sqrt(sum over leaves of ||leaf||^2)`` of the whole (global) tree, as a 0-d tensor.

    The square norms go through the layout-aware reduction, so a sharded leaf counts once,
    whole, and all leaves split over the same mesh axes share one all-reduce. Inside
    :func:`reuse_global_norm` the norm of gradients seen before in the context is reused.
    """
    leaves, spec = tree_flatten(tree)
    pairs = [(g, lay) for g, lay in zip(leaves, leaves_up_to(spec, layouts, what="layouts",
                                                             against="grads"))
             if g is not None]
    known = _KNOWN.get()
    key = None if known is None or torch.compiler.is_compiling() else _key(tree, pairs)
    if key is not None:
        for k in known:
            if _same(k, key):
                return k.norm
    total = total_sum_of_squares([g for g, _ in pairs], [lay for _, lay in pairs],
                                 purpose="global_norm").sqrt()
    if key is not None:
        known.append(key._replace(norm=total))
    return total


def _key(tree: Tree, pairs: list[tuple[Tensor, Any]]) -> _Known | None:
    try:
        versions = tuple(g._version for g, _ in pairs)
    except RuntimeError:  # inference-mode tensors keep no version counter: never reused
        return None
    return _Known(tree, tuple(g for g, _ in pairs), versions, tuple(lay for _, lay in pairs),
                  _active_split())


def _active_split() -> Any:
    # A norm is reusable only under the same tree split (None outside tree_split_over).
    return _reduce.active_tree_split()


def _same(a: _Known, b: _Known) -> bool:
    if not a.leaves and not b.leaves and a.tree is not b.tree:
        return False
    return (len(a.leaves) == len(b.leaves)
            and all(x is y for x, y in zip(a.leaves, b.leaves))
            and a.versions == b.versions
            and all(_same_layout(x, y) for x, y in zip(a.layouts, b.layouts))
            and _same_split(a.split, b.split))


def _same_layout(a: Any, b: Any) -> bool:
    # Equal Layouts (same mesh, global shape and splits; the name only labels messages) give
    # the same reductions in the same order, hence the same bits.
    return a is b or (isinstance(a, Layout) and isinstance(b, Layout) and a == b)


def _same_split(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return (a.mesh is b.mesh and a.axes == b.axes
            and len(a.held_elsewhere) == len(b.held_elsewhere)
            and all(x is y for x, y in zip(a.held_elsewhere, b.held_elsewhere)))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all gradients by ``min(1, max_norm / (||g|| + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does (the 1e-6 guards a zero norm).

    ``||g||`` is :func:`global_norm` over every leaf, whole (layout-aware; under
    ``pipeline_split`` over every stage's leaves): one all-reduce per mesh axis per distinct
    set of splitting axes. Inside :func:`reuse_global_norm` - which a
    :class:`~funcpar.train.TrainStep` enters around its ``grad_norm`` metric and optimizer - a
    clip that receives the step's gradients unchanged (first in a ``chain``, under ZeRO-2/3,
    pipeline stages, offload on the host) takes the metric's norm, the same tensor, and issues
    no message of its own; after a transformation that changed the gradients (or ZeRO-1's
    partitioned view of them) it computes its own, as it does outside the context.
    """
    validate.positive("clip_by_global_norm", "max_norm", max_norm)

    def init(params: Tree) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, *, layouts=None):
        total = global_norm(grads, layouts)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        cast: dict[torch.dtype, Tensor] = {}  # the coefficient in each leaf dtype, cast once

        def scale(g: Tensor | None) -> Tensor | None:
            if g is None:
                return None
            if g.dtype not in cast:
                cast[g.dtype] = coef.to(g.dtype)
            return g * cast[g.dtype]

        return tree_map(scale, grads), state

    return GradientTransformation(init, update)
