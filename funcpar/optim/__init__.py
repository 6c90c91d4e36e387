"""Optimizers as pure ``init``/``update`` pairs over pytrees (optax's shape)."""

from funcpar.optim.accumulate import AccumulateState, accumulate
from funcpar.optim.adafactor import AdafactorState, adafactor
from funcpar.optim.adafactor_torch import adafactor_torch
from funcpar.optim.adamw import AdamWState, adam, adamw
from funcpar.optim.base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    chain,
    identity,
    update_params,
)
from funcpar.optim.came import CAMEState, came
from funcpar.optim.clip import clip_by_global_norm, global_norm, reuse_global_norm
from funcpar.optim.decay import add_decayed_weights
from funcpar.optim.galore import (
    GaLoreAdafactorState,
    GaLoreAdamWState,
    GaLoreConfig,
    galore_adafactor,
    galore_adamw,
    galore_param_groups,
)
from funcpar.optim.hyperparams import (
    HyperState,
    get_hyperparams,
    inject_hyperparams,
    set_hyperparams,
)
from funcpar.optim.lamb import LambState, lamb
from funcpar.optim.masks import matrices_only
from funcpar.optim.memory import format_state_report, state_bytes, state_bytes_by_leaf
from funcpar.optim.schedules import constant, cosine, linear, linear_warmup, warmup_cosine
from funcpar.optim.sgd import SGDState, sgd

__all__ = [
    "AccumulateState",
    "AdafactorState",
    "AdamWState",
    "CAMEState",
    "EmptyState",
    "GaLoreAdafactorState",
    "GaLoreAdamWState",
    "GaLoreConfig",
    "GradientTransformation",
    "HyperState",
    "LambState",
    "SGDState",
    "accumulate",
    "adafactor",
    "adafactor_torch",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "came",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine",
    "format_state_report",
    "galore_adafactor",
    "galore_adamw",
    "galore_param_groups",
    "get_hyperparams",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "lamb",
    "linear",
    "linear_warmup",
    "matrices_only",
    "reuse_global_norm",
    "set_hyperparams",
    "sgd",
    "state_bytes",
    "state_bytes_by_leaf",
    "update_params",
    "warmup_cosine",
]
