"""Optimizers as pure ``init``/``update`` pairs over pytrees (optax's shape)."""

from funcpar.optim.accumulate import AccumulateState, accumulate
from funcpar.optim.adamw import AdamWState, adamw
from funcpar.optim.base import EmptyState, GradientTransformation, apply_updates, chain, identity
from funcpar.optim.clip import clip_by_global_norm, global_norm
from funcpar.optim.hyperparams import HyperState, get_hyperparams, inject_hyperparams, set_hyperparams
from funcpar.optim.masks import matrices_only
from funcpar.optim.schedules import constant, cosine, linear, linear_warmup, warmup_cosine
from funcpar.optim.sgd import SGDState, sgd

__all__ = [
    "AccumulateState",
    "AdamWState",
    "EmptyState",
    "GradientTransformation",
    "HyperState",
    "SGDState",
    "accumulate",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine",
    "get_hyperparams",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "linear",
    "linear_warmup",
    "matrices_only",
    "set_hyperparams",
    "sgd",
    "warmup_cosine",
]
