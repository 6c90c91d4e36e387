"""The differentiable multi-tensor reference of AdamW and SGD (funcpar.kernels.multi_tensor):
the per-leaf reference's values bit for bit, and its first and second derivatives.

The multi-tensor path runs the per-leaf ops (``adamw_leaf``/``sgd_leaf``) in the same order as
``torch._foreach_*`` ops, which on CPU apply the per-tensor kernel to each leaf: the values are
compared with ``torch.equal``. Derivatives w.r.t. a hyperparameter shared by every leaf sum the
leaves' contributions in the autograd engine's order, which may differ between one node per leaf
and one node per op: float64, 1e-12 relative (the summation order's round-off, ~1e-16).
"""

from __future__ import annotations

import pytest
import torch

from funcpar.kernels.adamw import AdamWScalars, adamw_leaf, adamw_reference
from funcpar.kernels.multi_tensor import multi_tensor_ok
from funcpar.kernels.sgd import SGDScalars, sgd_leaf, sgd_reference

SHAPES = [(7, 5), (5,), (), (3, 2, 4)]
DECAY = [True, False, True, True]


def _leaves(dtype, seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]
    return [x.abs() for x in out] if positive else out


def _adamw_scalars(lr):
    t = torch.tensor(3.0, dtype=torch.float64)
    return AdamWScalars(step_size=lr / (1 - 0.9**t), bc2_sqrt=(1 - 0.999**t).sqrt(),
                        eps=torch.tensor(1e-8, dtype=torch.float64), lr_wd=lr * 0.1,
                        beta1=0.9, beta2=0.999)


def _adamw_per_leaf(g, p, m, v, vmax, s, amsgrad, maximize, write_params):
    outs = [adamw_leaf(*xs, dec, s, amsgrad=amsgrad, maximize=maximize)
            for *xs, dec in zip(g, p, m, v, vmax, DECAY)]
    u, m, v, vmax = (list(c) for c in zip(*outs))
    return [pi + ui for pi, ui in zip(p, u)] if write_params else u, m, v, vmax


def _sgd_per_leaf(g, p, b, s, nesterov, maximize, write_params):
    outs = [sgd_leaf(gi, pi, bi, dec, s, nesterov=nesterov, maximize=maximize)
            for gi, pi, bi, dec in zip(g, p, b, DECAY)]
    u, b = (list(c) for c in zip(*outs))
    return [pi + ui for pi, ui in zip(p, u)] if write_params else u, b


def _inputs(dtype, n_states, requires_grad):
    g, p = _leaves(dtype, 0), _leaves(dtype, 1)
    states = [_leaves(dtype, 2 + k, positive=k > 0) for k in range(n_states)]
    if requires_grad:
        for x in [*g, *p, *(y for st in states for y in st)]:
            x.requires_grad_(True)
    return g, p, states


def _equal(a, b):
    for x, y in zip(a, b, strict=True):
        for xi, yi in zip(x, y, strict=True):
            assert (xi is None and yi is None) or torch.equal(xi, yi)


@pytest.mark.parametrize("amsgrad, maximize, write_params", [
    (False, False, False), (True, True, True), (False, False, True),
])
def test_adamw_multi_tensor_is_the_per_leaf_reference(amsgrad, maximize, write_params):
    g, p, (m, v, vmax) = _inputs(torch.float32, 3, requires_grad=False)
    s = _adamw_scalars(torch.tensor(1e-2, dtype=torch.float64))
    vmax = vmax if amsgrad else [None] * len(g)
    assert multi_tensor_ok(g, p, m, v, vmax)
    got = adamw_reference(g, p, m, v, vmax, DECAY, s, amsgrad=amsgrad, maximize=maximize,
                          write_params=write_params)
    _equal(got, _adamw_per_leaf(g, p, m, v, vmax, s, amsgrad, maximize, write_params))


@pytest.mark.parametrize("nesterov, maximize, first, dampening", [
    (False, False, False, 0.0), (True, True, False, 0.0), (False, False, True, 0.3),
    (False, False, False, 0.3),
])
def test_sgd_multi_tensor_is_the_per_leaf_reference(nesterov, maximize, first, dampening):
    g, p, (b,) = _inputs(torch.float32, 1, requires_grad=False)
    s = SGDScalars(torch.tensor(0.05, dtype=torch.float64), 0.01, torch.tensor(first), 0.9,
                   dampening)
    for write_params in (False, True):
        got = sgd_reference(g, p, b, DECAY, s, nesterov=nesterov, maximize=maximize,
                            write_params=write_params)
        _equal(got, _sgd_per_leaf(g, p, b, s, nesterov, maximize, write_params))
    no_momentum = s._replace(momentum=0.0)
    _equal(sgd_reference(g, p, b, DECAY, no_momentum),
           _sgd_per_leaf(g, p, b, no_momentum, False, False, False))


def _second_order(step):
    """d/d(lr, inputs) of sum(out^2 + 3 state^2), then d/d(lr, inputs) of the sum of those
    first derivatives: MAML's second-order path through one step."""
    lr = torch.tensor(0.03, dtype=torch.float64, requires_grad=True)
    leaves, outs = step(lr)
    loss = sum((o**2).sum() for o in outs[0]) + sum(3 * (x**2).sum() for x in outs[1])
    first = torch.autograd.grad(loss, [lr, *leaves], create_graph=True)
    second = torch.autograd.grad(sum(f.sum() for f in first), [lr, *leaves])
    return first, second


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_derivatives_equal_the_per_leaf_reference(opt):
    def run(per_leaf):
        def step(lr):
            if opt == "adamw":
                g, p, (m, v) = _inputs(torch.float64, 2, requires_grad=True)
                s = _adamw_scalars(lr)
                none = [None] * len(g)
                out = (_adamw_per_leaf(g, p, m, v, none, s, False, False, True) if per_leaf
                       else adamw_reference(g, p, m, v, none, DECAY, s, write_params=True))
                return [*g, *p, *m, *v], (out[0], out[1])
            g, p, (b,) = _inputs(torch.float64, 1, requires_grad=True)
            s = SGDScalars(lr, lr * 0.1, torch.tensor(False), 0.9, 0.0)
            out = (_sgd_per_leaf(g, p, b, s, True, False, True) if per_leaf
                   else sgd_reference(g, p, b, DECAY, s, nesterov=True, write_params=True))
            return [*g, *p, *b], out

        return _second_order(step)

    (f_multi, s_multi), (f_leaf, s_leaf) = run(False), run(True)
    for a, b in zip([*f_multi, *s_multi], [*f_leaf, *s_leaf], strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (a, b)
    assert s_multi[0].abs() > 0  # a real second derivative in lr


def test_multi_tensor_steps_aside():
    a, b = torch.ones(3), torch.ones(3, dtype=torch.float64)
    assert not multi_tensor_ok([a], [b])  # one leaf, two dtypes: the reference's promotions
    assert not multi_tensor_ok([torch.ones(2, dtype=torch.complex64)])
    assert not multi_tensor_ok([])
    seen = []
    torch.func.vmap(lambda x: seen.append(multi_tensor_ok([x])) or x)(torch.ones(2, 3))
    assert seen == [False]  # no batching rule for foreach ops: the per-leaf reference
