"""Pytrees, pure model functions and the training state."""

from funcpar.state.checkpoint import (
    CheckpointError,
    export_params,
    latest_checkpoint,
    leaf_layouts,
    load,
    read_index,
    save,
)
from funcpar.state.ckpt_owner import check_one_run, claim_checkpoint_dir, new_run_id
from funcpar.state.functional import ApplyFn, functionalize
from funcpar.state.train_state import TrainState, generator_state, init_state
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
    "CheckpointError",
    "LeafSpec",
    "TrainState",
    "Tree",
    "check_one_run",
    "claim_checkpoint_dir",
    "export_params",
    "functionalize",
    "generator_state",
    "init_state",
    "latest_checkpoint",
    "leaf_layouts",
    "load",
    "named_leaves",
    "new_run_id",
    "read_index",
    "save",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_map_with_path",
    "tree_shapes",
    "tree_unflatten",
]
