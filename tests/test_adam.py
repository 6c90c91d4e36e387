"""fo.adam (coupled L2, torch.optim.Adam), fo.add_decayed_weights, and eps_root (inside the
square root, as optax / torchopt): against torch.optim.Adam and torchopt 0.7.3, float64."""

from __future__ import annotations

import pytest
import torch

import funcpar.optim as fo
from funcpar.meta import maml_adapt
from funcpar.optim.base import apply_updates, update_params

D = torch.float64


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g, dtype=D), "b": torch.randn(3, generator=g,
                                                                             dtype=D)}


def _grads(t):
    g = torch.Generator().manual_seed(100 + t)
    return {"w": torch.randn(4, 3, generator=g, dtype=D), "b": torch.randn(3, generator=g,
                                                                             dtype=D)}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("how", ["adam", "chain", "apply"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_weight_decay_equals_torch_adam(how, amsgrad):
    kw = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "amsgrad": amsgrad}
    opt = (fo.chain(fo.add_decayed_weights(0.3), fo.adam(**kw)) if how == "chain"
           else fo.adam(weight_decay=0.3, **kw))
    params = _params()
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    torch_opt = torch.optim.Adam(ref.values(), weight_decay=0.3, **kw)
    state = opt.init(params)
    for t in range(6):
        grads = _grads(t)
        if how == "apply":  # the fused-kernel path on CPU (update_params takes apply)
            params, state = update_params(opt, grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = apply_updates(params, updates)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        for k in params:
            # Same ops up to fused multiply-adds: a few ulps (1e-12 relative; measured <= 1e-15).
            assert _rel(params[k], ref[k].detach()) <= 1e-12, (t, k)


def test_add_decayed_weights_mask():
    params, grads = _params(), _grads(0)
    opt = fo.add_decayed_weights(0.5, mask={"w": True, "b": False})
    out, _ = opt.update(grads, opt.init(params), params)
    assert torch.equal(out["w"], grads["w"] + 0.5 * params["w"])
    assert torch.equal(out["b"], grads["b"])


@pytest.mark.parametrize("write", [False, True])
def test_eps_root_equals_torchopt(write, float64_default):
    torchopt = pytest.importorskip("torchopt")
    # Small gradients make eps_root = 1e-4 change the step by ~half: a path that ignored it
    # (a fast path, a kernel) would be far outside the tolerance.
    params = _params()
    opt = fo.adamw(0.01, eps=1e-8, weight_decay=0.0, eps_root=1e-4)
    ref = torchopt.adam(0.01, eps=1e-8, eps_root=1e-4)
    plain = fo.adamw(0.01, eps=1e-8, weight_decay=0.0)
    names = list(params)
    p_ref = tuple(params[k] for k in names)
    state, r_state, p_plain, s_plain = opt.init(params), ref.init(p_ref), params, plain.init(
        params)
    for t in range(4):
        grads = {k: 1e-2 * v for k, v in _grads(t).items()}
        if write:  # apply: on CPU the fused kernel unless eps_root sends it to the reference
            params, state = update_params(opt, grads, state, params)
        else:
            u, state = opt.update(grads, state, params)
            params = apply_updates(params, u)
        p_plain, s_plain = update_params(plain, grads, s_plain, p_plain)
        ru, r_state = ref.update(tuple(grads[k] for k in names), r_state, inplace=False)
        p_ref = torchopt.apply_updates(p_ref, ru, inplace=False)
    for k, r, pl in zip(names, p_ref, (p_plain[k] for k in names)):
        # The same formula, rounded in another order: 1e-10 relative on the displacement.
        assert _rel(params[k] - _params()[k], r - _params()[k]) <= 1e-10, k
        assert _rel(params[k] - _params()[k], pl - _params()[k]) > 1e-3, k  # eps_root mattered


def _relu_mlp(p, x):
    return torch.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


def _relu_theta():
    g = torch.Generator().manual_seed(3)
    b1 = torch.zeros(8, dtype=D)
    b1[:3] = -100.0  # three hidden units dead on every input: their gradient is exactly 0
    return {"w1": torch.randn(2, 8, generator=g, dtype=D), "b1": b1,
            "w2": torch.randn(8, 1, generator=g, dtype=D)}


@pytest.mark.parametrize("eps_root", [0.0, 1e-8])
def test_maml_adam_relu_dead_units(eps_root):
    g = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(6, 2, generator=g, dtype=D), torch.randn(6, 1, generator=g, dtype=D)
    xq, yq = torch.randn(6, 2, generator=g, dtype=D), torch.randn(6, 1, generator=g, dtype=D)
    theta = {k: v.requires_grad_(True) for k, v in _relu_theta().items()}

    def mse(p, x, y):
        return ((_relu_mlp(p, x) - y) ** 2).mean()

    for opt in (fo.adam(0.01, eps_root=eps_root),
                fo.adamw(0.01, weight_decay=0.0, eps_root=eps_root)):
        adapted, _ = maml_adapt(mse, opt, theta, (xs, ys), steps=2)
        grads = torch.autograd.grad(mse(adapted, xq, yq), list(theta.values()))
        finite = all(bool(x.isfinite().all()) for x in grads)
        # The motivation: d sqrt(v)/dv is infinite at v = 0, and inf * 0 = NaN reaches every
        # leaf through the shared loss; eps_root keeps it finite.
        assert finite == (eps_root > 0)
