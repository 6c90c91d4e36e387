"""torch's own fused CPU optimizer kernels behind ``apply`` (funcpar.kernels.adamw/sgd):
funcpar's AdamW and SGD equal ``torch.optim.AdamW(fused=True)`` / ``SGD(fused=True)`` bit for
bit, ``apply`` equals ``update`` + ``apply_updates`` to round-off (the contract of
funcpar.optim.base), and the kernels are not taken where they would compute something else."""

from __future__ import annotations

import pytest
import torch
from conftest import max_rel_err

import funcpar.optim as fo
from funcpar.kernels import adamw as kadamw
from funcpar.kernels.inplace import fused_leaves_ok, inplace_updates
from funcpar.state.tree import tree_leaves

# Odd sizes (the kernels' vector bodies and scalar tails), a 0-d leaf, a matrix for the mask.
SHAPES = {"w": (5, 7), "b": (13,), "s": (), "v": (3, 1, 9)}


def _tree(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of the two torch kernels (torch.optim's fused steps call them too: read the
    count around funcpar's steps only)."""
    calls = {"adamw": 0, "sgd": 0}
    real_a, real_s = torch._fused_adamw_, torch._fused_sgd_

    def adamw(*a, **k):
        calls["adamw"] += 1
        return real_a(*a, **k)

    def sgd(*a, **k):
        calls["sgd"] += 1
        return real_s(*a, **k)

    monkeypatch.setattr(torch, "_fused_adamw_", adamw)
    monkeypatch.setattr(torch, "_fused_sgd_", sgd)
    return calls


def _against_torch(ours, torch_opt_of, dtype, fused_calls, which, steps=4):
    """``steps`` of ``ours`` by ``update_params`` against torch's optimizer built by
    ``torch_opt_of(list of params)`` (fused), bit for bit, and the fused kernel ran."""
    params = _tree(0, dtype)
    state = ours.init(params)
    theirs_p = [x.clone().requires_grad_() for x in params.values()]
    theirs = torch_opt_of(theirs_p)
    for i in range(steps):
        grads = _tree(10 + i, dtype)
        before = fused_calls[which]
        params, state = fo.update_params(ours, grads, state, params)
        assert fused_calls[which] > before, "funcpar's step did not run torch's fused kernel"
        for p, g in zip(theirs_p, grads.values(), strict=True):
            p.grad = g.clone()
        theirs.step()
        for k, y in zip(SHAPES, theirs_p, strict=True):
            assert torch.equal(params[k], y.detach()), (i, k)


def _groups(ps, **decay):
    """torch param groups: matrices with the decay, the rest without (fo.matrices_only)."""
    mats = [p for p in ps if p.dim() >= 2]
    rest = [p for p in ps if p.dim() < 2]
    return [{"params": mats, **decay}, {"params": rest, "weight_decay": 0.0}]


ADAMW = {
    "decay": (lambda: fo.adamw(lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)),
    "amsgrad_maximize": (lambda: fo.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
                         lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                      amsgrad=True, maximize=True, fused=True)),
    "mask_betas_eps": (lambda: fo.adamw(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.2,
                                        weight_decay_mask=fo.matrices_only),
                       lambda ps: torch.optim.AdamW(_groups(ps, weight_decay=0.2), lr=3e-3,
                                                    betas=(0.8, 0.99), eps=1e-6, fused=True)),
}

SGD = {
    "nesterov_decay": (lambda: fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
                       lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1,
                                                  nesterov=True, fused=True)),
    "dampening_maximize": (lambda: fo.sgd(lr=0.1, momentum=0.8, dampening=0.3, maximize=True),
                           lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.3,
                                                      maximize=True, fused=True)),
    "plain_mask": (lambda: fo.sgd(lr=0.1, weight_decay=0.01, weight_decay_mask=fo.matrices_only),
                   lambda ps: torch.optim.SGD(_groups(ps, weight_decay=0.01), lr=0.1,
                                              fused=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(ADAMW))
def test_adamw_apply_is_torch_fused_adamw(name, dtype, fused_calls):
    ours, theirs = ADAMW[name]
    _against_torch(ours(), theirs, dtype, fused_calls, "adamw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", list(SGD))
def test_sgd_apply_is_torch_fused_sgd(name, dtype, fused_calls):
    ours, theirs = SGD[name]
    _against_torch(ours(), theirs, dtype, fused_calls, "sgd")


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_apply_equals_update_to_round_off(name):
    # float64, 3 steps: the fused kernel and the multi-tensor update + apply_updates round the
    # new parameter differently (one expression vs p + u: a few ulps of 2^-53 = 1.1e-16 per
    # step, relative to the leaf's largest entry); 1e-14 allows that, nothing more. The states
    # (m, v, the momentum buffer) are computed by the same operations up to an fma: likewise.
    opt = (fo.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True) if name == "adamw"
           else fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True))
    params = _tree(0, torch.float64)
    sa = su = opt.init(params)
    pa = pu = params
    for i in range(3):
        grads = _tree(10 + i, torch.float64)
        pa, sa = opt.apply(grads, sa, pa)
        u, su = opt.update(grads, su, pu)
        pu = fo.apply_updates(pu, u)
    for k in SHAPES:
        assert max_rel_err(pa[k], pu[k]) <= 1e-14, k
    for x, y in zip(tree_leaves(sa), tree_leaves(su), strict=True):
        if torch.is_tensor(x) and x.is_floating_point():
            assert max_rel_err(x, y) <= 1e-14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_sgd_apply_stays_off_torch_fused_sgd(dtype, fused_calls):
    # torch's CPU fused SGD is wrong in half precision (kernels/sgd.py: 3 steps at lr 0.1 land
    # 1.1-2.1 away from float64): funcpar's apply takes the multi-tensor path, whose result
    # stays within the half dtype's round-off of a float64 run of the same steps (bf16: 2^-8
    # relative per operation, a few operations a step, entries up to ~4: 0.1 allows that and
    # catches the fused kernel's error).
    opt = fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.01)
    params, ref = _tree(0, dtype), _tree(0, dtype)
    ref = {k: v.double() for k, v in ref.items()}
    state, ref_state = opt.init(params), opt.init(ref)
    for i in range(3):
        grads = _tree(10 + i, dtype)
        before = fused_calls["sgd"]
        params, state = fo.update_params(opt, grads, state, params)
        assert fused_calls["sgd"] == before
        ref, ref_state = fo.update_params(opt, {k: g.double() for k, g in grads.items()},
                                          ref_state, ref)
    for k in SHAPES:
        assert float((params[k].double() - ref[k]).abs().max()) <= 0.1, k


def test_not_taken_where_it_would_compute_something_else(fused_calls):
    # A dtype mismatch, a non-CPU (meta) tensor: the multi-tensor path, never the fused kernel.
    x = torch.randn(6, 4)
    assert fused_leaves_ok([x], [x.clone()])
    assert fused_leaves_ok([x.t()], [x.t().clone()])  # strided: run on dense copies (below)
    assert not fused_leaves_ok([x], [x.double()])
    assert not fused_leaves_ok([x], [x.to("meta")])
    assert not fused_leaves_ok([x.to(torch.int32)], [x.to(torch.int32)])


def test_strided_leaves_round_as_dense_ones(fused_calls):
    """A strided leaf (a transposed weight; a ZeRO part cut along dim 1) goes through the
    kernel as a dense copy written back (the kernels walk raw storage, so never the view
    itself): bit for bit the step of the same values stored densely, and under donation
    written into the strided tensor itself."""
    w = torch.randn(7, 5).t()
    params = {"w": w, "b": torch.randn(3)}
    grads = {"w": torch.randn(7, 5).t(), "b": torch.randn(3)}
    dense_params = {k: v.contiguous() for k, v in params.items()}
    dense_grads = {k: v.contiguous() for k, v in grads.items()}
    for opt in (fo.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True), fo.sgd(lr=0.1, momentum=0.9)):
        before = fused_calls["adamw"] + fused_calls["sgd"]
        state = opt.init(params)
        new, new_state = fo.update_params(opt, grads, state, params)
        assert fused_calls["adamw"] + fused_calls["sgd"] > before
        ref, ref_state = fo.update_params(opt, dense_grads, opt.init(dense_params),
                                          dense_params)
        for a, b in zip(tree_leaves((new, new_state)), tree_leaves((ref, ref_state)),
                        strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        assert torch.equal(w, dense_params["w"])  # outside donation: inputs untouched
        own = {k: v.clone().t().contiguous().t() if k == "w" else v.clone()
               for k, v in params.items()}
        with inplace_updates():
            donated, _ = fo.update_params(opt, grads, opt.init(own), own)
        assert donated["w"].data_ptr() == own["w"].data_ptr()
        assert donated["w"].stride() == (1, 5) and torch.equal(donated["w"], ref["w"])
    # The kernel reads the step count as float32: past 2^24 it is not exact, so not taken.
    s = kadamw.AdamWScalars(0.1, 0.5, 1e-8, 0.0, 0.9, 0.999, lr=0.1, weight_decay=0.0,
                            count=torch.tensor(2**24 + 1))
    leaves = [[torch.randn(3)] for _ in range(4)]
    assert not kadamw._fused_ok(*leaves, [None], s, amsgrad=False)
    assert kadamw._fused_ok(*leaves, [None], s._replace(count=torch.tensor(2**24)),
                            amsgrad=False)
    # Scalars without the raw lr / weight decay / count (built by hand): not taken.
    assert not kadamw._fused_ok(*leaves, [None], s._replace(lr=None), amsgrad=False)


def test_grads_and_inputs_untouched_outside_donation():
    # The kernels write p, m, v (and b) in place; outside inplace_updates they get clones.
    for opt in (fo.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
                fo.sgd(lr=0.1, momentum=0.9, maximize=True)):
        params, grads = _tree(0, torch.float32), _tree(1, torch.float32)
        state = opt.apply(grads, opt.init(params), params)[1]  # a state with nonzero moments
        copies = [x.clone() for x in tree_leaves((params, grads, state)) if torch.is_tensor(x)]
        opt.apply(grads, state, params)
        now = [x for x in tree_leaves((params, grads, state)) if torch.is_tensor(x)]
        for a, b in zip(now, copies, strict=True):
            assert torch.equal(a, b)
