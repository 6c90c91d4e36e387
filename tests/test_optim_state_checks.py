"""What an optimizer's update refuses (issue 20, item 6b-c): a state built for parameters of
other shapes (checked once per structure, in inject_hyperparams, for every optimizer), and
gradients of another dtype than their parameters (check_grads, one rule for all)."""

from __future__ import annotations

import pytest
import torch

from funcpar.optim import adafactor, adamw, came, lamb, sgd, update_params
from funcpar.optim import base as base_mod

OPTIMIZERS = {
    "sgd": lambda: sgd(lr=0.1, momentum=0.9),
    "adamw": lambda: adamw(lr=1e-2),
    "adafactor": lambda: adafactor(),
    "came": lambda: came(lr=1e-2),
    "lamb": lambda: lamb(lr=1e-2),
}


def _params(rows):
    g = torch.Generator().manual_seed(rows)
    return {"w": torch.randn(rows, 4, generator=g), "b": torch.randn(4, generator=g)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_for_other_shapes_is_refused(name):
    opt = OPTIMIZERS[name]()
    params = _params(3)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    good = opt.init(params)
    new_p, _ = update_params(opt, grads, good, params)  # the right state passes
    assert new_p["w"].shape == (3, 4)
    wrong = opt.init(_params(1))  # state for w of (1, 4), params of (3, 4)
    with pytest.raises(ValueError, match=r"state leaf '.*w.*' has shape \(1,?\s?4?\)?.*, but "
                                         r"for these params its init gives \(3"):
        update_params(opt, grads, wrong, params)
    with pytest.raises(ValueError, match=r"has shape .*but for these params"):
        opt.update(grads, wrong, params)


def test_state_check_runs_once_per_structure(monkeypatch):
    opt = adamw(lr=1e-2)
    params = _params(3)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = opt.init(params)
    calls = []
    real = torch.empty_like

    def counting(x, *a, **kw):
        if kw.get("device") == "meta":
            calls.append(1)
        return real(x, *a, **kw)

    monkeypatch.setattr(base_mod.torch, "empty_like", counting)
    for _ in range(3):
        params, state = update_params(opt, grads, state, params)
    assert len(calls) == 2  # two leaves, meta-copied at the first update only


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_grads_of_another_dtype_are_refused(name):
    opt = OPTIMIZERS[name]()
    params = _params(3)
    state = opt.init(params)
    grads = {k: torch.ones_like(v, dtype=torch.float64) for k, v in params.items()}
    with pytest.raises(TypeError, match=r"grads leaf '(w|b)' has dtype torch.float64 but the "
                                        r"parameter has torch.float32"):
        update_params(opt, grads, state, params)
