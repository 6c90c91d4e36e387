"""A TrainStep whose hyperparameter requires grad keeps no graph across steps: the state it
returns is detached at the step boundary (funcpar.train.step._cut_graph)."""

from __future__ import annotations

import gc
import weakref

import torch

import funcpar.optim as fo
from funcpar.state.train_state import init_state
from funcpar.train import make_train_step


def _apply(p, b, x):
    return torch.tanh(x @ p["w"]) @ p["v"], b


def test_no_graph_outlives_a_step_with_a_grad_requiring_lr():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 8, generator=g), "v": torch.randn(8, 1, generator=g)}
    lr = torch.tensor(1e-2, requires_grad=True)
    opt = fo.adamw(lr=lr)
    step = make_train_step(_apply, lambda o, y: ((o - y) ** 2).mean(), opt)
    state = init_state(params, {}, opt)
    batch = (torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    state, _ = step(state, batch)
    first = weakref.ref(state.params["w"])
    for _ in range(49):
        state, _ = step(state, batch)
    gc.collect()
    # Without the cut, step 50's params held step 49's graph, ... down to step 1's params.
    assert first() is None
    assert all(not t.requires_grad for t in state.params.values())
    assert lr.grad is None
