"""The fused AdamW kernel against its plain-torch reference, and the optimizer's dispatch.

The Triton kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set per test by the
``interpret`` fixture and restored after it; kernels built interpreted are cached apart from
compiled ones, funcpar.kernels._launch.lazy_kernels). Tolerance for float32: max relative error
(max |kernel - reference| / max |reference|, per tensor) <= 1e-6. Each output is a handful of
float32 operations (<= ~8 roundings of 2**-24 = 6e-8); the kernel's square root and division
are correctly rounded, torch's vectorised CPU square root is not always (measured: one ulp off
on some inputs), and an fma may stand where torch rounds twice, so the two may differ in the
last bits of a few intermediate values: 1e-6 leaves room for that and nothing more.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import (
    check_apply_equals_update,
    check_outputs,
    counting_launches,
    grads_like,
    leaves_of,
    max_rel_err,
    needs_triton,
    train,
)

import funcpar.optim as fo
from funcpar.kernels import _launch, kernel_mode, triton_available
from funcpar.kernels import adamw as kadamw
from funcpar.kernels.adamw import AdamWScalars, adamw_reference, adamw_triton

TOL32 = 1e-6
# bf16 outputs: the reference rounds to bf16 after every operation (and its scalars to bf16),
# the kernel computes in float32 and rounds once; a few bf16 ulps (2**-8 = 3.9e-3 each) apart.
TOL16 = 3e-2
# Odd sizes, 0-d, 1-D, 3-D, empty, a leaf over many tiles (block 64 below), many tiny leaves.
SHAPES = [(3, 5, 7), (1,), (), (130,), (2, 97), (0,), (4, 1, 3)] + [(k,) for k in range(1, 30)]


def _leaves(dtype, *, positive=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g, dtype=torch.float32) for s in SHAPES]
    return [(x.abs() if positive else x).to(dtype) for x in out]


def _scalars(t=3, lr=1e-2, wd=0.1):
    t64 = torch.tensor(float(t), dtype=torch.float64)
    return AdamWScalars(torch.tensor(lr, dtype=torch.float64) / (1 - 0.9**t64),
                        (1 - 0.999**t64).sqrt(), torch.tensor(1e-8, dtype=torch.float64),
                        torch.tensor(lr * wd, dtype=torch.float64), 0.9, 0.999)


@needs_triton
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("write_params", [False, True])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16p", "bf16"])
def test_kernel_matches_reference(interpret, amsgrad, maximize, write_params, dtypes):
    pd, sd = dtypes
    g, p = _leaves(pd, seed=1), _leaves(pd, seed=2)
    m, v, vmax = _leaves(sd, seed=3), _leaves(sd, positive=True, seed=4), _leaves(
        sd, positive=True, seed=5)
    decay = [i % 3 != 1 for i in range(len(SHAPES))]  # a mask: some leaves without decay
    kw = dict(amsgrad=amsgrad, maximize=maximize, write_params=write_params)
    with _launch.poisoned_outputs():
        out = adamw_triton(g, p, m, v, vmax, decay, _scalars(), block=64, **kw)
    ref = adamw_reference(g, p, m, v, vmax, decay, _scalars(), **kw)
    for k, r in zip(out, ref, strict=True):
        check_outputs(k, r, TOL32 if pd == sd == torch.float32 else TOL16)


@needs_triton
def test_one_launch_for_many_leaves(interpret, monkeypatch):
    launches = []
    real = kadamw._kernel

    def counting():
        kernel = real()

        class Spy:
            def __getitem__(self, grid):
                launches.append(grid)
                return kernel[grid]

        return Spy()

    monkeypatch.setattr(kadamw, "_kernel", counting)
    g, p, m, v = (_leaves(torch.float32, positive=i == 3, seed=i) for i in range(4))
    adamw_triton(g, p, m, v, [None] * len(g), [True] * len(g), _scalars(), block=64)
    # One dtype group: one launch, one program per 64-element tile of every non-empty leaf.
    assert launches == [(sum(-(-torch.Size(s).numel() // 64) for s in SHAPES),)]


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(9, 13, generator=gen, dtype=dtype),
            "b": torch.randn(13, generator=gen, dtype=dtype),
            "s": torch.randn((), generator=gen, dtype=dtype),
            "t": torch.randn(2, 3, 5, generator=gen, dtype=dtype)}


def _train(opt, steps, *, fused=True, dtype=torch.float32):
    return train(opt, _params(dtype), steps, fused=fused)


OPTIMIZERS = {
    "adamw": lambda: fo.adamw(lr=1e-2, weight_decay=0.1),
    "amsgrad_maximize_mask": lambda: fo.adamw(lr=1e-2, amsgrad=True, maximize=True,
                                              weight_decay_mask=fo.matrices_only),
    "chain_schedule": lambda: fo.chain(fo.clip_by_global_norm(0.5),
                                       fo.adamw(lr=fo.cosine(1e-2, 10), weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_apply_equals_update_in_reference_mode(name):
    """The fused path (``apply``, through chain and inject_hyperparams) and update +
    apply_updates: the same bits on the per-leaf reference; on CPU's fast path ``apply`` runs
    torch's fused kernel (tests/test_fused_cpu.py): 3 steps of TOL32 apart at most."""
    opt = OPTIMIZERS[name]()
    assert opt.apply is not None
    with kernel_mode("reference"):
        check_apply_equals_update(opt, _params(), 3, 3 * TOL32)


def test_reference_is_torch_adamw():
    """The per-leaf reference (the optimizer's only code on CPU) is torch.optim.AdamW."""
    params = _params(torch.float64)
    ours = fo.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True)
    state = ours.init(params)
    theirs_p = [x.clone().requires_grad_() for x in params.values()]
    theirs = torch.optim.AdamW(theirs_p, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)
    for i in range(5):
        grads = grads_like(params, i)
        params, state = fo.update_params(ours, grads, state, params)
        for p, g in zip(theirs_p, grads.values()):
            p.grad = g.clone()
        theirs.step()
    for x, y in zip(params.values(), theirs_p):
        assert max_rel_err(x, y.detach()) <= 1e-12  # float64, same operations: a few ulp


@needs_triton
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_under_triton_matches_reference(interpret, monkeypatch, name):
    opt = OPTIMIZERS[name]()
    with counting_launches() as tables, kernel_mode("triton"):
        fused = _train(opt, 4, fused=True)
        unfused = _train(opt, 4, fused=False)
    assert tables, "the kernels did not run"
    with kernel_mode("reference"):
        ref = _train(opt, 4)
    # Both kernel paths compute u with the same operations, and p + u as apply_updates does.
    for x, y in zip(leaves_of(fused), leaves_of(unfused), strict=True):
        assert torch.equal(x, y)
    # Four steps: the per-step differences (<= 1e-6, module docstring) compound a little.
    for x, y in zip(leaves_of(fused), leaves_of(ref), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.is_floating_point():
            assert max_rel_err(x, y) <= 4 * TOL32, max_rel_err(x, y)
        else:
            assert torch.equal(x, y)


def test_dispatch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(kadamw, "adamw_triton", boom)
    opt = fo.adamw(lr=1e-2)
    # auto on CPU and reference anywhere: the reference.
    for mode in ("auto", "reference"):
        with kernel_mode(mode):
            _train(opt, 1)
    # float64 leaves take the reference even when the kernel is forced.
    with kernel_mode("triton"):
        if triton_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            _train(opt, 1, dtype=torch.float64)
        else:
            with pytest.raises(RuntimeError, match="Triton is not installed"):
                _train(opt, 1)


@needs_triton
def test_donated_kernels_write_into_their_inputs(interpret):
    # Inside inplace_updates (a donated step) the AdamW and SGD kernels write the new
    # parameters and moments into the inputs' own storage (no second copy of the state on a
    # GPU), with the bits of the fresh-output launch.
    from funcpar.kernels.inplace import inplace_updates
    from funcpar.kernels.sgd import SGDScalars, sgd_triton

    decay = [True] * len(SHAPES)
    g, p, m, v = (_leaves(torch.float32, positive=i == 3, seed=i) for i in range(4))
    fresh = adamw_triton(g, p, m, v, [None] * len(g), decay, _scalars(), block=64,
                         write_params=True)
    mine = [[t.clone() for t in ts] for ts in (p, m, v)]
    ptrs = [[t.data_ptr() for t in ts] for ts in mine]
    with inplace_updates():
        out = adamw_triton(g, *mine, [None] * len(g), decay, _scalars(), block=64,
                           write_params=True)
    for got, want, own in zip(out[:3], fresh[:3], ptrs, strict=True):
        assert [t.data_ptr() for t in got] == own
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    s = SGDScalars(torch.tensor(0.1, dtype=torch.float64), 0.01, False, momentum=0.9,
                   dampening=0.0)
    fresh = sgd_triton(g, p, m, decay, s, write_params=True, block=64)
    mine = [[t.clone() for t in ts] for ts in (p, m)]
    ptrs = [[t.data_ptr() for t in ts] for ts in mine]
    with inplace_updates():
        out = sgd_triton(g, *mine, decay, s, write_params=True, block=64)
    for got, want, own in zip(out, fresh, ptrs, strict=True):
        assert [t.data_ptr() for t in got] == own
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_kernels_step_aside_under_compile_tracing(monkeypatch):
    # Traced by torch.compile (or the whole-step region) every mode takes the reference: the
    # launchers read numbers out of 0-d tensors, which a trace cannot.
    from funcpar.kernels import use_kernels

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with kernel_mode("triton"):
        assert not use_kernels(torch.zeros(3))
