"""The CPU fast optimizer paths (multi-tensor ops) and the in-place contract of
funcpar.kernels.inplace: pure outside inplace_updates(), in place and bit-identical inside."""

from __future__ import annotations

import optree
import pytest
import torch

import funcpar.optim as fo
from funcpar.kernels import adamw as kadamw
from funcpar.kernels.dispatch import fast_path_ok, inplace_allowed, inplace_updates, kernel_mode
from funcpar.kernels.inplace import writable

SHAPES = {"w": (5, 7), "b": (7,), "s": ()}


def _tree(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


def _clone(tree):
    return optree.tree_map(lambda x: x.clone(), tree)


def test_scope_nests_and_restores():
    assert not inplace_allowed()
    with inplace_updates():
        assert inplace_allowed()
        with inplace_updates(False):
            assert not inplace_allowed()
            x = torch.ones(2)
            assert writable([x])[0] is not x
        assert inplace_allowed()
        x = torch.ones(2)
        assert writable([x, None]) == [x, None]
    assert not inplace_allowed()


def test_fast_path_steps_aside_for_autograd_and_vmap():
    x = torch.ones(3)
    assert fast_path_ok(x, 0.5)
    assert not fast_path_ok(x, torch.tensor(0.1, requires_grad=True))
    with torch.no_grad():
        assert fast_path_ok(x, torch.tensor(0.1, requires_grad=True))
    seen = []
    torch.func.vmap(lambda y: seen.append(fast_path_ok(y)) or y)(torch.ones(2, 3))
    assert seen == [False]


OPTS = {
    "adamw": lambda: fo.adamw(lr=0.01, weight_decay=0.1),
    "adamw_ams_max": lambda: fo.adamw(lr=0.01, amsgrad=True, maximize=True),
    "sgd_nesterov": lambda: fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
    "sgd_damp_max": lambda: fo.sgd(lr=0.1, momentum=0.8, dampening=0.3, maximize=True),
    "sgd_plain": lambda: fo.sgd(lr=0.1, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(OPTS))
def test_pure_outside_inplace_inside_bit_identical(name):
    opt = OPTS[name]()
    params = _tree(0)
    state = opt.init(params)
    for step in range(3):
        grads = _tree(10 + step)
        p0, s0, g0 = _clone(params), _clone(state), _clone(grads)
        new_p, new_s = fo.update_params(opt, grads, state, params)
        # Purity: nothing the caller passed changed.
        for a, b in zip(optree.tree_leaves((params, state, grads)),
                        optree.tree_leaves((p0, s0, g0)), strict=True):
            assert torch.equal(a, b)
        with inplace_updates():
            don_p, don_s = fo.update_params(opt, grads, s0, p0)
        # Donated: the same bits, written into the given parameter storage; grads untouched.
        for k in SHAPES:
            assert torch.equal(don_p[k], new_p[k]), (step, k)
            assert don_p[k].data_ptr() == p0[k].data_ptr()
            assert torch.equal(grads[k], g0[k])
        for a, b in zip(optree.tree_leaves(don_s),
                        optree.tree_leaves(new_s), strict=True):
            assert torch.equal(a, b)
        params, state = new_p, new_s


def test_adamw_foreach_equals_per_leaf_reference():
    # float64: the multi-tensor path and the per-leaf reference run the same operations in
    # the same order per element; 1e-15 relative is a few ulps of headroom for the fused ops.
    names = list(SHAPES)
    g, p, m, v = ([t[k] for k in names] for t in (_tree(1), _tree(2), _tree(3), _tree(4)))
    v = [x.abs() for x in v]
    s = kadamw.AdamWScalars(torch.tensor(0.05, dtype=torch.float64),
                            torch.tensor(0.3, dtype=torch.float64), 1e-8, 1e-3, 0.9, 0.999)
    for ams in (False, True):
        vm = [x * 1.5 for x in v] if ams else [None] * 3
        ref = kadamw.adamw_reference(g, p, m, v, vm, [True, False, True], s, amsgrad=ams,
                                     maximize=ams, write_params=True)
        fast = kadamw.adamw_fast(g, p, m, v, vm, [True, False, True], s, amsgrad=ams,
                                 maximize=ams, write_params=True)
        for r, f in zip(ref, fast, strict=True):
            for a, b in zip(r, f, strict=True):
                if a is not None:
                    torch.testing.assert_close(b, a, rtol=1e-15, atol=0)


def test_adamw_differentiable_lr_takes_reference():
    lr = torch.tensor(0.01, dtype=torch.float64, requires_grad=True)
    opt = fo.adamw(lr=lr)
    params = _tree(0)
    new_p, _ = fo.update_params(opt, _tree(1), opt.init(params), params)
    loss = sum(x.sum() for x in new_p.values())
    (dlr,) = torch.autograd.grad(loss, lr)
    assert torch.isfinite(dlr) and dlr != 0


@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=0.1, nesterov=True),
                                dict(momentum=0.8, dampening=0.3, maximize=True)])
def test_sgd_foreach_bits_equal_per_leaf_reference(kw):
    # float32: the multi-tensor path (``update``; ``apply`` runs torch's fused kernel,
    # tests/test_fused_cpu.py) runs sgd_leaf's operations in sgd_leaf's order, so the bits
    # must agree exactly, first step (buffer = d) and later ones alike.
    opt = fo.sgd(lr=0.1, **kw)
    params = _tree(0, torch.float32)
    state = opt.init(params)
    for step in range(3):
        grads = _tree(10 + step, torch.float32)
        fast_u, fast_s = opt.update(grads, state, params)
        fast_p = fo.apply_updates(params, fast_u)
        with kernel_mode("reference"), torch.enable_grad():
            # a parameter that requires grad forces the per-leaf reference (differentiable)
            ref_in = {k: v.clone().requires_grad_() for k, v in params.items()}
            ref_p, ref_s = fo.update_params(opt, grads, state, ref_in)
        for k in SHAPES:
            assert torch.equal(fast_p[k], ref_p[k].detach()), (step, k)
        for a, b in zip(optree.tree_leaves(fast_s), optree.tree_leaves(ref_s), strict=True):
            assert torch.equal(a, b.detach()), step
        params, state = fast_p, fast_s
