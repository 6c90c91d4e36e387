"""Optimizer updates are differentiable: hypergradients through unrolled steps (float64) match
central finite differences; structural hyperparameters and the Triton path refuse clearly."""

from __future__ import annotations

import pytest
import torch

from funcpar.kernels.dispatch import differentiable, kernel_mode
from funcpar.meta import unroll
from funcpar.optim import (
    adafactor,
    adafactor_torch,
    adamw,
    came,
    galore_adafactor,
    galore_adamw,
    lamb,
    sgd,
)

D = torch.float64
OPTS = {
    "sgd_momentum": (lambda lr: sgd(lr, momentum=0.9, weight_decay=0.01), 0.1),
    "sgd_nesterov": (lambda lr: sgd(lr, momentum=0.9, nesterov=True), 0.1),
    "adamw": (lambda lr: adamw(lr, weight_decay=0.1), 0.01),
    "adafactor": (lambda lr: adafactor(lr=lr, relative_step=False, scale_parameter=False,
                                       beta1=0.9), 0.01),
    "adafactor_torch": (lambda lr: adafactor_torch(lr), 0.01),
    "lamb": (lambda lr: lamb(lr), 0.01),
    "came": (lambda lr: came(lr), 0.01),
    # The projector is refreshed at step 2 from a gradient that depends on lr: exact only with
    # the SVD in float64 (svd_dtype=None); the default float32 SVD is accurate to ~1e-5.
    "galore_adamw": (lambda lr: galore_adamw(lr, rank=2, update_proj_gap=2, svd_dtype=None),
                     0.01),
    "galore_adafactor": (lambda lr: galore_adafactor(lr=lr, relative_step=False,
                                                     scale_parameter=False, rank=2,
                                                     update_proj_gap=2, svd_dtype=None), 0.01),
}
#: Other tensor hyperparameters, (factory of the value, value).
OTHERS = {
    "sgd_weight_decay": (lambda v: sgd(0.1, momentum=0.9, weight_decay=v), 0.1),
    "adafactor_weight_decay": (lambda v: adafactor(lr=0.01, relative_step=False,
                                                   scale_parameter=False, weight_decay=v), 0.1),
    "adafactor_torch_weight_decay": (lambda v: adafactor_torch(0.01, weight_decay=v), 0.1),
    "lamb_weight_decay": (lambda v: lamb(0.01, weight_decay=v), 0.1),
    "lamb_eps": (lambda v: lamb(0.01, eps=v), 1e-3),
    "came_weight_decay": (lambda v: came(0.01, weight_decay=v), 0.1),
}


def _problem():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g, dtype=D), torch.randn(8, 2, generator=g, dtype=D)
    params = {"w1": 0.5 * torch.randn(3, 4, generator=g, dtype=D),
              "w2": 0.5 * torch.randn(4, 2, generator=g, dtype=D)}

    def loss(p, xb, yb):  # a small nonlinear model: tanh MLP
        return ((torch.tanh(xb @ p["w1"]) @ p["w2"] - yb) ** 2).mean()

    batches = [(x[:4], y[:4]), (x[4:], y[4:])] * 2  # 4 unrolled steps
    return params, loss, batches, (x, y)


def _val_loss(make, lr):
    params, loss, batches, (x, y) = _problem()
    opt = make(lr)
    params, _, _ = unroll(loss, opt, params, opt.init(params), batches)
    return loss(params, x, y)


def _check_fd(make, lr0, h=1e-6, rtol=1e-6):
    lr = torch.tensor(lr0, dtype=D, requires_grad=True)
    (hyper,) = torch.autograd.grad(_val_loss(make, lr), lr)
    fd = (_val_loss(make, torch.tensor(lr0 + h, dtype=D))
          - _val_loss(make, torch.tensor(lr0 - h, dtype=D))) / (2 * h)
    # Central differences: O(h^2) truncation plus ~eps/h rounding, ~1e-10 relative here.
    assert abs(hyper - fd) <= rtol * abs(fd), (hyper.item(), fd.item())


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw", "adafactor", "lamb", "came"])
def test_lr_hypergradient_matches_finite_differences(name):
    _check_fd(*OPTS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd_nesterov", "adafactor_torch", "galore_adamw",
                                  "galore_adafactor"])
def test_lr_hypergradient_matches_finite_differences_all(name):
    _check_fd(*OPTS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_hypergradients_match_finite_differences(name):
    _check_fd(*OTHERS[name])


def test_weight_decay_and_eps_hypergradients():
    # adamw's other tensor hyperparameters keep their graph too.
    for kw, v0 in (("weight_decay", 0.1), ("eps", 1e-3)):
        def make(v, kw=kw):
            return adamw(0.01, **{kw: v})
        _check_fd(make, v0)


def test_tensor_hyperparameter_keeps_graph_and_schedule():
    lr = torch.tensor(0.1, dtype=D, requires_grad=True)
    opt = sgd(lambda t: lr * 0.5 ** torch.as_tensor(t, dtype=D))  # a schedule made of tensors
    p = {"w": torch.ones(3, dtype=D)}
    u, _ = opt.update({"w": torch.ones(3, dtype=D)}, opt.init(p), p)
    (g,) = torch.autograd.grad(u["w"].sum(), lr)
    assert g.item() == pytest.approx(-3.0, rel=1e-15)


def test_structural_hyperparameters_refuse_tensors():
    t = torch.tensor(0.9, dtype=D, requires_grad=True)
    with pytest.raises(TypeError, match="momentum"):
        sgd(0.1, momentum=t)
    with pytest.raises(TypeError, match="betas"):
        adamw(0.1, betas=(t, 0.999))


def test_triton_mode_refuses_to_differentiate():
    p = {"w": torch.ones(4)}
    g = {"w": torch.ones(4, requires_grad=True)}
    opt = adamw(0.1)
    assert differentiable(g["w"]) and not differentiable(p["w"], None, 1.0)
    with torch.no_grad():
        assert not differentiable(g["w"])
    with kernel_mode("triton"), pytest.raises(RuntimeError, match="not differentiable"):
        opt.update(g, opt.init(p), p)
    with kernel_mode("auto"):  # auto takes the differentiable reference
        u, _ = opt.update(g, opt.init(p), p)
    assert u["w"].requires_grad


@pytest.mark.parametrize("make", [adamw, lambda lr: sgd(lr, momentum=0.9)], ids=["adamw", "sgd"])
def test_a_hyperparameter_alone_requiring_grad_keeps_the_kernels_out(make):
    """Only ``lr`` requires grad (a first-order hypergradient): the kernels, which would drop
    its graph, are refused in triton mode and skipped in auto, as for a gradient."""
    p, g = {"w": torch.ones(4)}, {"w": torch.full((4,), 0.5)}
    opt = make(torch.tensor(0.1, dtype=D, requires_grad=True))
    with kernel_mode("triton"), pytest.raises(RuntimeError, match="not differentiable"):
        opt.update(g, opt.init(p), p)
    with kernel_mode("auto"):
        u, _ = opt.update(g, opt.init(p), p)
    assert u["w"].requires_grad


def test_structural_message_names_the_argument():
    from funcpar.optim import validate

    t = torch.tensor(0.9, dtype=D, requires_grad=True)
    with pytest.raises(TypeError, match="lamb: betas\\[1\\] is structural .* give it as a number"):
        validate.structural("lamb", "betas[1]", t)


def test_eight_bit_states_refuse_to_differentiate():
    lr = torch.tensor(0.01, dtype=D, requires_grad=True)
    with pytest.raises(RuntimeError, match="8-bit optimizer states are not differentiable"):
        _val_loss(lambda v: galore_adamw(v, rank=2, eight_bit=True, min_8bit_size=1), lr)


def test_schedules_keep_tensor_values_differentiable():
    from funcpar.optim import constant, warmup_cosine

    peak = torch.tensor(0.1, dtype=D, requires_grad=True)
    sched = warmup_cosine(peak, warmup_steps=2, decay_steps=6)
    # At step 3 (cosine phase, 1 of 4 steps): peak * (1 + cos(pi / 4)) / 2.
    (g,) = torch.autograd.grad(sched(3), peak)
    assert g.item() == pytest.approx((1 + 2**-0.5) / 2, rel=1e-14)
    (g,) = torch.autograd.grad(constant(peak)(5), peak)
    assert g.item() == 1.0
