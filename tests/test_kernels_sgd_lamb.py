"""The SGD and Lamb kernels against their plain-torch references, the optimizers under
``kernel_mode("triton")`` against ``"reference"``, and Lamb's kernels on tensor-parallel shards.

Kernels run in Triton's CPU interpreter (the ``interpret`` fixture sets ``TRITON_INTERPRET=1``
for one test). float32 tolerance 1e-6, as in tests/test_kernels_adamw.py: a few float32
operations per output, correctly rounded in the kernel, not always in torch's CPU square root.
Lamb's per-leaf sums are float32 per 64-element tile, then float64 across tiles, against a
float64 sum in the reference: well inside 1e-6.
"""

from __future__ import annotations

import os

import pytest
import torch
from _kernel_helpers import (
    check_apply_equals_update,
    check_outputs,
    counting_launches,
    leaves_of,
    max_rel_err,
    needs_triton,
    train,
)

import funcpar.optim as fo
from funcpar.kernels import _launch, kernel_mode
from funcpar.kernels.lamb import (
    LambScalars,
    lamb_moments_reference,
    lamb_moments_triton,
    lamb_update_reference,
    lamb_update_triton,
)
from funcpar.kernels.sgd import SGDScalars, sgd_reference, sgd_triton
from funcpar.optim.lamb import LAMB_VARIANTS
from funcpar.testing import run_ranks

TOL32 = 1e-6
SHAPES = [(3, 5, 7), (1,), (), (130,), (2, 97), (0,)] + [(k,) for k in range(1, 20)]
DECAY = [i % 3 != 1 for i in range(len(SHAPES))]


def _leaves(seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    return [(lambda x: x.abs() if positive else x)(torch.randn(s, generator=g)) for s in SHAPES]


def _check(kernel_out, ref_out):
    # Every output here is float32 (check_outputs' float() changes nothing).
    check_outputs(kernel_out, ref_out, TOL32)


@needs_triton
@pytest.mark.parametrize("momentum,dampening,nesterov", [(0.0, 0.0, False), (0.9, 0.3, False),
                                                         (0.8, 0.0, True)])
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("write_params", [False, True])
def test_sgd_kernel_matches_reference(interpret, momentum, dampening, nesterov, first,
                                      write_params):
    g, p, b = _leaves(1), _leaves(2), _leaves(3)
    bufs = b if momentum else [None] * len(b)
    s = SGDScalars(torch.tensor(0.05, dtype=torch.float64), torch.tensor(0.01, dtype=torch.float64),
                   torch.tensor(first), momentum, dampening)
    kw = dict(nesterov=nesterov, maximize=True, write_params=write_params)
    with _launch.poisoned_outputs():
        out = sgd_triton(g, p, bufs, DECAY, s, block=64, **kw)
    ref = sgd_reference(g, p, bufs, DECAY, s, **kw)
    for k, r in zip(out, ref, strict=True):
        _check(k, r)


def _lamb_scalars(moments, in_update):
    f = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return LambScalars(0.9, 0.999, 0.1, f(0.271), f(0.003), f(1e-6), f(0.1), f(1 - 1e-3),
                       moments, in_update, True)


@needs_triton
@pytest.mark.parametrize("moments,in_update", [(True, True), (False, True), (False, False)])
def test_lamb_kernels_match_reference(interpret, moments, in_update):
    g, p, m, v = _leaves(1), _leaves(2), _leaves(3), _leaves(4, positive=True)
    s = _lamb_scalars(moments, in_update)
    with _launch.poisoned_outputs():
        km, kv, ksums = lamb_moments_triton(g, p, m, v, DECAY, s, block=64)
    rm, rv, rsums = lamb_moments_reference(g, p, m, v, DECAY, s)
    _check(km, rm)
    _check(kv, rv)
    assert ksums.shape == rsums.shape == (len(SHAPES), 2) and ksums.dtype == torch.float64
    assert float(((ksums - rsums).abs() / rsums.abs().clamp_min(1e-30)).max()) <= TOL32
    coef = torch.rand(len(SHAPES), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for write_params in (False, True):
        with _launch.poisoned_outputs():
            out = lamb_update_triton(p, rm, rv, DECAY, coef, s, write_params=write_params,
                                     block=64)
        ref = lamb_update_reference(p, rm, rv, DECAY, coef, s, write_params=write_params)
        scalar = [i for i, x in enumerate(SHAPES) if x == ()]
        _check([o for i, o in enumerate(out) if i not in scalar],
               [r for i, r in enumerate(ref) if i not in scalar])
        for i in scalar:
            # A 0-d leaf: torch promotes it against the 0-d float64 scalars, so the reference
            # runs in float64 there (w - p = -lr wd p exactly), the kernel in float32: equal
            # to float32 resolution of the parameter.
            assert out[i].dtype == ref[i].dtype and not out[i].isnan()
            assert abs(float(out[i] - ref[i])) <= TOL32 * max(abs(float(p[i])), abs(float(ref[i])))


def _params():
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(9, 13, generator=gen), "b": torch.randn(13, generator=gen),
            "s": torch.randn((), generator=gen), "t": torch.randn(2, 3, 5, generator=gen),
            "z": torch.zeros(4)}  # a zero weight: trust ratio 1


def _train(opt, steps, *, fused=True):
    return train(opt, _params(), steps, fused=fused)


OPTIMIZERS = {
    "sgd": lambda: fo.sgd(lr=0.05),
    "sgd_momentum": lambda: fo.sgd(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01),
    "sgd_nesterov_chain": lambda: fo.chain(fo.clip_by_global_norm(1.0),
                                           fo.sgd(lr=fo.cosine(0.05, 10), momentum=0.9,
                                                  nesterov=True, maximize=True)),
    **{f"lamb_{v}": (lambda v=v: fo.lamb(lr=1e-2, weight_decay=0.1, variant=v,
                                         weight_decay_mask=fo.matrices_only))
       for v in LAMB_VARIANTS},
    "lamb_adam_clamped": lambda: fo.lamb(lr=1e-2, adam=True, max_trust_ratio=2.0),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_apply_equals_update_in_reference_mode(name):
    # Lamb's apply is p + u: bit for bit. SGD's runs torch's fused CPU kernel
    # (tests/test_fused_cpu.py), whose p - lr d is one fused multiply-add: 3 steps of TOL32.
    opt = OPTIMIZERS[name]()
    assert opt.apply is not None
    with kernel_mode("reference"):
        check_apply_equals_update(opt, _params(), 3, 3 * TOL32 if name.startswith("sgd") else 0)


# Each Lamb case takes ~3 s in the interpreter. By default: the paper's variant, the clamped
# Adam one and pytorch_optimizer's (decoupled decay, eps in the trust ratio); -m slow: the two
# that differ from those only in the bias correction and the weight-norm clamp.
# Lamb's default and SGD under the interpreter by default; the other Lamb variants' kernels
# differ only in their scalars (tested without the interpreter above).
_SLOW_UNDER_TRITON = {"lamb_torch_optimizer", "lamb_colossalai", "lamb_pytorch_optimizer",
                      "lamb_adam_clamped"}


@needs_triton
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in _SLOW_UNDER_TRITON else n for n in sorted(OPTIMIZERS)])
def test_optimizer_under_triton_matches_reference(interpret, name):
    opt = OPTIMIZERS[name]()
    with counting_launches() as tables, kernel_mode("triton"):
        fused, unfused = _train(opt, 3), _train(opt, 3, fused=False)
    assert tables, "the kernels did not run"
    with kernel_mode("reference"):
        ref = _train(opt, 3)
    for x, y in zip(leaves_of(fused), leaves_of(unfused), strict=True):
        assert torch.equal(x, y)  # the same kernel operations either way
    for x, y in zip(leaves_of(fused), leaves_of(ref), strict=True):
        # Every state leaf with the reference's dtype (Lamb's trust ratios included).
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype)
        if x.is_floating_point():
            assert max_rel_err(x, y) <= 3 * TOL32, max_rel_err(x, y)  # 3 steps compound
        else:
            assert torch.equal(x, y)


TP_STEPS = 4  # each step is ~1.5 s in the interpreter on two ranks


def _lamb_run(tp):
    """The reference run's first TP_STEPS steps of Lamb on tp ranks: (losses, whole params)."""
    from funcpar.testing.reference import batches, build, run

    return run(*build(tp, 1, "lamb", torch.float32), batches()[:TP_STEPS])


def lamb_tp2_under_triton():
    """Rank body: the example's tp2 run with Lamb's kernels on the local shards."""
    os.environ["TRITON_INTERPRET"] = "1"
    with counting_launches() as tables, kernel_mode("triton"):
        result = _lamb_run(2)
    return result, len(tables)


@needs_triton
@pytest.mark.slow  # 20-35 s: two ranks in the interpreter (Adafactor's and CAME's tp2 case too)
def test_lamb_kernels_on_tensor_parallel_shards():
    """Kernels on each rank's shard, norms completed over tp between the passes: the
    single-process reference run (float32: <= 1e-5 as the float32 distributed tests)."""
    from funcpar.testing.reference import loss_rel, max_rel

    with kernel_mode("reference"):
        ref_losses, ref_params = _lamb_run(1)
    for (losses, params), launches in run_ranks(lamb_tp2_under_triton, 2, timeout=600):
        assert launches >= 2 * len(ref_losses), "the kernels did not run on the shards"
        assert loss_rel(losses, ref_losses) <= 1e-5
        assert max_rel(params, ref_params) <= 1e-5
    assert ref_losses[2] < ref_losses[0]  # the same batch (the reference alternates two)
