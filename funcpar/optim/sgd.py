"""Stochastic gradient descent with momentum, as torch.optim.SGD."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from funcpar.kernels.sgd import SGDScalars, sgd_step
from funcpar.optim import validate
from funcpar.optim.base import GradientTransformation, check_floating, checked_leaf_columns
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, mask_flags
from funcpar.optim.schedules import ScalarOrSchedule
from funcpar.state.tree import Tree, tree_map, tree_unflatten

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    count: Tensor  # 0-d int64
    momentum_buffer: Tree  # like params; None per leaf without momentum


def _sgd(lr, momentum, weight_decay, *, dampening, nesterov, maximize, weight_decay_mask):
    def init(params: Tree) -> SGDState:
        check_floating(params, who="sgd")
        # Without momentum there is no buffer at all (None per leaf), as in torch.optim.SGD.
        bufs = tree_map(lambda p: torch.zeros_like(p) if momentum else None, params)
        return SGDState(torch.zeros((), dtype=torch.int64), bufs)

    def step(grads, state: SGDState, params, write_params: bool):
        spec, g, (p, bufs) = checked_leaf_columns(grads, params, state.momentum_buffer)
        dec = mask_flags(weight_decay_mask, params, spec)
        scalars = SGDScalars(lr=lr, weight_decay=weight_decay, first=state.count == 0,
                             momentum=momentum, dampening=dampening)
        # The multi-tensor kernel on CUDA, torch's multi-tensor ops elsewhere, the per-leaf
        # reference when differentiated or vmapped (funcpar.kernels).
        out, bufs = sgd_step(g, p, bufs, dec, scalars, nesterov=nesterov, maximize=maximize,
                             write_params=write_params)
        return tree_unflatten(spec, out), SGDState(state.count + 1, tree_unflatten(spec, bufs))

    def update(grads, state: SGDState, params=None, *, layouts=None):
        return step(grads, state, params, write_params=False)

    def apply(grads, state: SGDState, params, *, layouts=None):
        return step(grads, state, params, write_params=True)

    return GradientTransformation(init, update, apply)


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """SGD with (Nesterov) momentum and coupled L2 weight decay, exactly torch.optim.SGD.

    With ``d_t = g_t + weight_decay * w`` (decay only where ``weight_decay_mask`` allows):
    ``b_1 = d_1``, ``b_t = momentum * b_{t-1} + (1 - dampening) * d_t``; the step direction is
    ``d_t + momentum * b_t`` with ``nesterov`` and ``b_t`` otherwise (``d_t`` when
    ``momentum == 0``); ``w <- w - lr * direction``. (Sutskever et al. 2013 for Nesterov's form.)
    ``lr`` and ``weight_decay`` may be schedules; ``momentum`` is fixed (it decides whether a
    buffer exists).
    """
    who = "sgd"
    validate.nonnegative(who, "lr", lr)
    validate.nonnegative(who, "weight_decay", weight_decay)
    if callable(momentum):
        raise TypeError("sgd: momentum must be a number (it decides whether a buffer exists)")
    validate.structural(who, "momentum", momentum)
    validate.in_unit_interval(who, "momentum", momentum, closed=True)
    validate.in_unit_interval(who, "dampening", dampening, closed=True)
    if nesterov and (validate.schedule_or_number(who, "momentum", momentum) <= 0 or dampening):
        raise ValueError("sgd: nesterov momentum requires momentum > 0 and dampening == 0")
    return inject_hyperparams(
        _sgd,
        ("lr", "weight_decay"),
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
        weight_decay_mask=weight_decay_mask,
    )
