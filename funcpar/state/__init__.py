"""Pytrees, pure model functions and the training state."""

from funcpar.state.functional import ApplyFn, functionalize
from funcpar.state.train_state import TrainState, init_state
from funcpar.state.tree import (
    LeafSpec,
    Tree,
    named_leaves,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_map_with_path,
    tree_shapes,
    tree_unflatten,
)

__all__ = [
    "ApplyFn",
    "LeafSpec",
    "TrainState",
    "Tree",
    "functionalize",
    "init_state",
    "named_leaves",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_map_with_path",
    "tree_shapes",
    "tree_unflatten",
]
