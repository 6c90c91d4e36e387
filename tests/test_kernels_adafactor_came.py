"""Adafactor / CAME passes (funcpar.kernels.factored): references, dispatch, Triton kernels.

In this process: the plain-torch references are bit-identical to the pre-kernel implementation
(rebuilt here from the building blocks it used, ``ema_rsqrt`` and ``clip_by_rms``), the fused
``apply`` equals ``update`` + ``apply_updates``, bad arguments raise, and off CUDA the ``auto``
mode never touches Triton.

The ``test_interp_*`` cases run the Triton kernels through Triton's CPU interpreter. The
interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton is first imported, and it
must not leak into the rest of the suite (one process), so :func:`test_triton_interpreter_cases`
runs them in a subprocess with that variable set; in this process they are skipped. Tolerance
(float32): max relative error <= 1e-6 against the reference. The kernels round every step as the
reference does (IEEE division and square root) but sum rows, columns and norms in another order
(tile sums, then a sum of the tile partials) and the moment updates may differ by a last-bit
rounding (measured: <= 2.2e-7); 1e-6 is ~16 float32 ulps, an order above that and far below any
real error (a wrong index or a missing element shows as O(1)).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch
from conftest import max_rel_err

import funcpar.optim as fo
from funcpar.kernels import factored as K
from funcpar.kernels import kernel_mode, triton_available
from funcpar.optim.adafactor import _adafactor, adafactor, adafactor_leaf_init
from funcpar.optim.base import apply_updates, update_params
from funcpar.optim.came import _came, came
from funcpar.optim.factored import (
    RESIDUAL,
    SECOND_MOMENT,
    clip_by_rms,
    compute_dtype,
    decoupled_decay,
    ema,
    ema_rsqrt,
)

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interp = pytest.mark.skipif(
    not INTERP, reason="Triton interpreter case: run in a subprocess with TRITON_INTERPRET=1 by "
                       "test_triton_interpreter_cases")

TOL32 = 1e-6
# Square, non-square, odd, 1-D, 3-D, single-element and 0-d leaves.
SHAPES = {"square": (6, 6), "rect": (5, 8), "odd": (7, 3), "vec": (7,), "cube": (3, 4, 5),
          "one": (1,), "scalar": ()}

ADAFACTOR_CONFIGS = [
    dict(),  # relative step, parameter-RMS scaling
    dict(relative_step=False, lr=1e-2, scale_parameter=False, weight_decay=0.1),
    dict(beta1=0.9, weight_decay=0.05, clip_threshold=0.5),
]
CAME_CONFIGS = [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, clip_threshold=0.3)]


def _tree_rel(a, b) -> float:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    return max((max_rel_err(x.double(), y.double()) for x, y in zip(la, lb)
                if torch.is_tensor(x) and x.is_floating_point()), default=0.0)


def _data(shapes, dtype, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
             for _ in range(steps)]
    return params, grads


# --------------------------------------------------------------------------------------------
# The pre-kernel implementation, rebuilt from the building blocks it used
# --------------------------------------------------------------------------------------------


def _injected(kw, names):
    # inject_hyperparams hands these to the optimizer as 0-d float64 tensors (which decides
    # the dtype some scalars are rounded in).
    return {k: torch.tensor(float(kw[k]), dtype=torch.float64) for k in names
            if kw.get(k) is not None}


def _old_adafactor_leaf(g, p, st, t, *, lr, eps, clip_threshold, decay_rate, beta1,
                        scale_parameter, relative_step, warmup_init, weight_decay):
    from funcpar.optim.adafactor import adafactor_step_size

    cd = compute_dtype(g.dtype)
    g, p32 = g.to(cd), p.to(cd)
    alpha = adafactor_step_size(t, p32, lr=lr, eps2=eps[1], scale_parameter=scale_parameter,
                                relative_step=relative_step, warmup_init=warmup_init)
    beta2t = 1.0 - t.to(torch.float64) ** decay_rate
    moments = {k: v for k, v in st.items() if k != "exp_avg"}
    inv, new = ema_rsqrt(g * g + eps[0], moments, SECOND_MOMENT, beta2t)
    u = clip_by_rms(inv * g, clip_threshold) * alpha.to(cd)
    if beta1 is not None:
        u = new["exp_avg"] = ema(st["exp_avg"], u, beta1)
    new_p = decoupled_decay(p32, weight_decay * alpha)
    return (new_p - u) - p32, new


def _old_came_leaf(g, p, st, *, lr, betas, eps, clip_threshold, weight_decay):
    g = g.to(compute_dtype(g.dtype))
    sq = {k: v for k, v in st.items() if k in SECOND_MOMENT}
    inv, new = ema_rsqrt(g * g + eps[0], sq, SECOND_MOMENT, betas[1])
    u = clip_by_rms(inv * g, clip_threshold)
    m = new["exp_avg"] = ema(st["exp_avg"], u, betas[0])
    direction = m
    if RESIDUAL.row in st:
        res = {RESIDUAL.row: st[RESIDUAL.row], RESIDUAL.col: st[RESIDUAL.col]}
        inv_s, res_new = ema_rsqrt((u - m) ** 2 + eps[1], res, RESIDUAL, betas[2])
        new.update(res_new)
        direction = inv_s * m
    p = p.to(direction.dtype)
    return (decoupled_decay(p, weight_decay * lr) - direction * lr.to(direction.dtype)) - p, new


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reference_is_bit_identical_to_pre_kernel_adafactor(dtype):
    params, grads = _data(SHAPES, dtype, steps=5)
    for cfg in ADAFACTOR_CONFIGS:
        full = dict(lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                    scale_parameter=True, relative_step=True, warmup_init=False,
                    weight_decay=0.0) | cfg
        full |= _injected(full, ("weight_decay", "clip_threshold", "lr"))
        opt = adafactor(**cfg)
        state, p_new = opt.init(params), dict(params)
        old_st = {k: adafactor_leaf_init(v.shape, dtype=dtype, beta1=full["beta1"])
                  for k, v in params.items()}
        p_old = dict(params)
        with kernel_mode("reference"):
            for t, g in enumerate(grads, start=1):
                upd, state = opt.update(g, state, p_new)
                p_new = apply_updates(p_new, upd)
                for k in p_old:
                    u, old_st[k] = _old_adafactor_leaf(g[k], p_old[k], old_st[k],
                                                       torch.tensor(t), **full)
                    p_old[k] = p_old[k] + u.to(dtype)
        for k in params:
            assert torch.equal(p_new[k], p_old[k]), (cfg, k)
            for key, v in old_st[k].items():
                assert torch.equal(state.inner.stats[k][key], v), (cfg, k, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_is_bit_identical_to_pre_kernel_came(dtype):
    params, grads = _data(SHAPES, dtype, steps=5)
    for cfg in CAME_CONFIGS:
        full = dict(betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16), clip_threshold=1.0,
                    weight_decay=0.0) | cfg
        full |= _injected(full, ("weight_decay", "clip_threshold", "lr"))
        opt = came(**cfg)
        state = opt.init(params)
        old_st = {k: dict(v) for k, v in state.inner.stats.items()}
        p_new, p_old = dict(params), dict(params)
        with kernel_mode("reference"):
            for g in grads:
                upd, state = opt.update(g, state, p_new)
                p_new = apply_updates(p_new, upd)
                for k in p_old:
                    u, old_st[k] = _old_came_leaf(g[k], p_old[k], old_st[k], **full)
                    p_old[k] = p_old[k] + u
        for k in params:
            assert torch.equal(p_new[k], p_old[k]), (cfg, k)
            for key, v in old_st[k].items():
                assert torch.equal(state.inner.stats[k][key], v), (cfg, k, key)


# --------------------------------------------------------------------------------------------
# The fused apply, dispatch and argument checks
# --------------------------------------------------------------------------------------------


def _hp(**kw):
    return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in kw.items()}


INNER = {
    # The un-injected transformations (inject_hyperparams passes 0-d float64 hyperparameters):
    # their apply is the fused step whatever inject_hyperparams does with it.
    "adafactor": lambda: _adafactor(**_hp(lr=1e-2, weight_decay=0.1, clip_threshold=1.0),
                                    eps=(1e-30, 1e-3), decay_rate=-0.8, beta1=0.9,
                                    scale_parameter=True, relative_step=False,
                                    warmup_init=False, min_dim_size_to_factor=0,
                                    weight_decay_mask=None),
    "came": lambda: _came(**_hp(lr=1e-2, weight_decay=0.1, clip_threshold=1.0),
                          betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16),
                          weight_decay_mask=None),
}


def _apply_vs_update(name, dtype, steps=3, shapes=SHAPES):
    opt = INNER[name]()
    assert opt.apply is not None
    params, grads = _data(shapes, dtype, steps)
    sa = su = opt.init(params)
    pa = pu = params
    for g in grads:
        pa, sa = opt.apply(g, sa, pa)
        upd, su = opt.update(g, su, pu)
        pu = apply_updates(pu, upd)
    return pa, sa, pu, su


@pytest.mark.parametrize("name", sorted(INNER))
def test_apply_equals_update_then_apply_updates(name):
    with kernel_mode("reference"):
        pa, sa, pu, su = _apply_vs_update(name, torch.float32)
    # (new - p) is exact for steps under half the parameter (Sterbenz), and then p + (new - p)
    # is the same float as new; where a step is larger (entries near 0) the update path rounds
    # twice: one float32 ulp of that entry, ~1e-9 of the leaf's scale (measured 2.8e-9). Through
    # RMS(W) (scale_parameter) that reaches the next steps' statistics at the same level.
    assert _tree_rel(pa, pu) <= 1e-7 and _tree_rel(sa, su) <= 1e-6
    if name == "adafactor" and fo.adafactor().apply is not None:  # propagated by the wrappers
        opt = fo.adafactor(lr=1e-2, relative_step=False, beta1=0.9)
        params, (g,) = _data(SHAPES, torch.float32, 1)
        a, _ = update_params(opt, g, opt.init(params), params)
        u, _ = opt.update(g, opt.init(params), params)
        assert _tree_rel(a, apply_updates(params, u)) <= 1e-7


def test_auto_mode_on_cpu_never_imports_triton(monkeypatch):
    def boom():
        raise AssertionError("a Triton kernel was chosen for CPU tensors in auto mode")

    monkeypatch.setattr(K, "_tk", boom)
    params, grads = _data(SHAPES, torch.float32, 2)
    for opt in (adafactor(beta1=0.9), came()):
        state = opt.init(params)
        with kernel_mode("auto"):
            for g in grads:
                params, state = update_params(opt, g, state, params)
    # float64 leaves take the reference even when kernels are forced (checked before Triton
    # would be needed).
    g = torch.randn(4, 5, dtype=torch.float64)
    with kernel_mode("triton"):
        if not INTERP:
            pytest.skip("the forced mode on CPU needs TRITON_INTERPRET; checked in the "
                        "interpreter subprocess")
        K.sq_row_col_sums(g, 1e-30)


def test_bad_arguments_are_named():
    g = torch.randn(4, 5)
    f = K.Factors(torch.ones(4, 1), torch.ones(1, 5), torch.ones(1, 1))
    with pytest.raises(ValueError, match="out must be one of"):
        K.precond_apply(g, g, f, out="params")
    with pytest.raises(ValueError, match="momentum and beta1"):
        K.precond_apply(g, g, f, momentum=g)
    with pytest.raises(ValueError, match="needs the parameter"):
        K.precond_apply(g, None, f, out="update")
    # Shapes the annotations already refuse: the jaxtyping hook (tests) raises a TypeError
    # first, the explicit check (without the hook) a ValueError.
    with pytest.raises((ValueError, TypeError), match=r"(>= 2 dims, got shape \(5,\))|g"):
        K.sq_row_col_sums(torch.randn(5), 1e-30)
    with pytest.raises(ValueError, match=r"factors.col has shape \(1, 4\), expected \(1, 5\)"):
        K.scaled_norm(g, K.Factors(f.row, torch.ones(1, 4), f.row_mean))
    with pytest.raises((ValueError, TypeError), match=r"(m has shape \(4, 4\) but the leaf has "
                                                      r"\(4, 5\))|m"):
        K.came_residual(g, f, torch.tensor(1.0), torch.zeros(4, 4), 0.9, 1e-16)


# --------------------------------------------------------------------------------------------
# Triton kernels through the interpreter (run in a subprocess by the test below)
# --------------------------------------------------------------------------------------------


def _interpreter_subprocess(marks: str, least: int) -> None:
    """Run this file's ``test_interp_*`` cases selected by ``marks`` with TRITON_INTERPRET=1."""
    if not triton_available():
        pytest.skip("Triton is not installed (pip install triton): the kernels' interpreter "
                    "tests need it")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("FUNCPAR_KERNELS", None)
    # -n 0: the cases run in this one interpreter process, not in workers of their own.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
           "-m", marks, "-k", "test_interp_", str(Path(__file__).resolve())]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                       cwd=Path(__file__).resolve().parent.parent)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= least and "skipped" not in out, out[-3000:]


@pytest.mark.skipif(INTERP, reason="already inside the interpreter subprocess")
def test_triton_interpreter_cases():
    _interpreter_subprocess("not slow", least=80)


@pytest.mark.slow
@pytest.mark.skipif(INTERP, reason="already inside the interpreter subprocess")
def test_triton_interpreter_tp2():
    """Kernels inside tp2 ranks (1-3 minutes in the interpreter on a shared 2-core VM)."""
    _interpreter_subprocess("slow", least=2)


def _poison():
    K._POISON = True  # every kernel output starts as NaN: an unwritten element stays NaN


def _check(a, b, what, tol=TOL32):
    assert not torch.isnan(a).any(), f"{what}: NaN (an element the kernel did not write?)"
    err = max_rel_err(a.double(), b.double())
    assert err <= tol, f"{what}: max relative error {err:.3g} > {tol}"


KERNEL_SHAPES = [(5, 7), (7, 3), (1, 9), (33, 300), (3, 4, 5), (2, 17, 9)]


def _factors(g):
    rows, cols = K.sq_row_col_sums_reference(g, 1e-30)
    row, col = rows / g.shape[-1] + 0.1, cols / g.shape[-2] + 0.2
    return K.Factors(row, col, row.mean(-2, keepdim=True))


@interp
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_interp_statistics_and_norm_passes(shape):
    from funcpar.kernels import _factored_triton as T

    _poison()
    g = torch.randn(shape)
    for a, b, what in zip(T.sq_row_col_sums(g, 1e-30), K.sq_row_col_sums_reference(g, 1e-30),
                          ("row sums", "column sums")):
        assert a.shape == b.shape
        _check(a, b, f"{what} {shape}")
    f = _factors(g)
    _check(T.scaled_norm(g, f), K.scaled_norm_reference(g, f), f"norm {shape}")
    # bfloat16 gradients are read as such and squared in float32.
    gb = g.bfloat16()
    _check(T.sq_row_col_sums(gb, 1e-3)[0], K.sq_row_col_sums_reference(gb, 1e-3)[0],
           f"bf16 row sums {shape}")


@interp
@pytest.mark.parametrize("make", [
    lambda lr: adafactor(lr=lr, relative_step=False, beta1=0.9),
    lambda lr: came(lr=lr, weight_decay=0.1)], ids=["adafactor", "came"])
def test_interp_lr_requiring_grad_is_refused_by_the_kernel_choice(make):
    """Issue 17: only ``lr`` requires grad. In mode triton the passes that do not see it run
    their kernels (here in the interpreter) and the first that does is refused by name; in
    mode auto (CPU: no kernels) the step keeps lr's graph."""
    p = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    g = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    lr = torch.tensor(0.01, dtype=torch.float64, requires_grad=True)
    opt = make(lr)
    with kernel_mode("triton"), pytest.raises(RuntimeError, match="not differentiable"):
        update_params(opt, g, opt.init(p), p)
    with kernel_mode("auto"):
        new, _ = update_params(opt, g, opt.init(p), p)
    assert new["w"].requires_grad and new["b"].requires_grad


@interp
@pytest.mark.parametrize("shape", [(5,), (1,), (), (300,), (3, 4, 5)])
def test_interp_full_moment_pass(shape):
    from funcpar.kernels import _factored_triton as T

    _poison()
    g, v = torch.randn(shape), torch.rand(shape)
    for decay in (torch.tensor(0.3, dtype=torch.float64), 0.999):  # by pointer, by value
        a, b = T.full_moment(g, v, decay, 1e-30), K.full_moment_reference(g, v, decay, 1e-30)
        _check(a[0], b[0], f"V {shape}")
        _check(a[1], b[1], f"norm {shape}")


@interp
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_interp_came_residual_pass(shape):
    from funcpar.kernels import _factored_triton as T

    _poison()
    g, m = torch.randn(shape), torch.randn(shape)
    f, clip = _factors(g), torch.tensor(1.7)
    for a, b, what in zip(T.came_residual(g, f, clip, m, 0.9, 1e-16),
                          K.came_residual_reference(g, f, clip, m, 0.9, 1e-16),
                          ("M", "residual row sums", "residual column sums")):
        _check(a, b, f"{what} {shape}")


APPLY_CASES = {
    "adafactor": dict(clip=torch.tensor(1.7), pre=torch.tensor(1e-2, dtype=torch.float64),
                      decay=torch.tensor(1e-3, dtype=torch.float64)),
    "adafactor momentum": dict(clip=torch.tensor(1.3), pre=0.02, beta1=0.9),
    "came": dict(post=torch.tensor(1e-3, dtype=torch.float64), decay=1e-4),
    "came unfactored": dict(clip=torch.tensor(2.0), beta1=0.9, post=0.5, decay=1e-4),
}


@interp
@pytest.mark.parametrize("shape", [(5, 7), (33, 300), (2, 17, 9), (13,), ()])
@pytest.mark.parametrize("case", sorted(APPLY_CASES))
@pytest.mark.parametrize("out", ["direction", "update", "param"])
def test_interp_update_pass(shape, case, out):
    from funcpar.kernels import _factored_triton as T

    _poison()
    kw = dict(APPLY_CASES[case])
    x, p = torch.randn(shape), torch.randn(shape)
    factored = len(shape) >= 2 and "unfactored" not in case
    precond = _factors(x) if factored else torch.rand(shape) + 0.5
    if "beta1" in kw:
        kw["momentum"] = torch.randn(shape)
    a, ma = T.precond_apply(x, p, precond, out=out, **kw)
    b, mb = K.precond_apply_reference(x, p, precond, out=out, **kw)
    if out == "update":
        # W' - W carries the rounding of W' at W's scale: compare the parameters it makes.
        a, b = p + a, p + b
    _check(a, b, f"{case} {out} {shape}")
    if mb is not None:
        _check(ma, mb, f"{case} momentum {shape}")
    # bfloat16 parameters: computed in float32, written once in bfloat16. Triton's CPU
    # interpreter converts float32 to bfloat16 by truncation (a GPU rounds to nearest even, as
    # torch does), so elements may differ by one bf16 ulp: <= 2^-7 of the largest element.
    if out == "param":
        a, _ = T.precond_apply(x, p.bfloat16(), precond, out=out, **kw)
        b, _ = K.precond_apply_reference(x, p.bfloat16(), precond, out=out, **kw)
        assert a.dtype == torch.bfloat16
        _check(a, b, f"{case} bf16 {shape}", tol=2.0**-7)


def _run(opt, params, grads, mode, fused):
    state = opt.init(params)
    with kernel_mode(mode):
        for g in grads:
            if fused:
                params, state = opt.apply(g, state, params)
            else:
                upd, state = opt.update(g, state, params)
                params = apply_updates(params, upd)
    return params, state


# Measured over 3-4 steps (float32, triton vs reference): params <= 3e-7, states <= 2.2e-6 (a
# CAME residual factor: (u - M)^2 is a difference of nearly equal numbers, so the summation
# order's 1e-7 there grows; its effect on the params is at the 1e-7 level). Bounds: 1e-6 for
# params (the kernels' bound), 1e-5 for states.
E2E_TOL = {"params": 1e-6, "state": 1e-5}


# ~2 s each in the interpreter. By default the configurations with every option on (momentum,
# weight decay, a clip) and the fused applies; -m slow adds the plainer ones.
_E2E_CASES = [
    *[pytest.param(f"adafactor {i}", lambda c=c: adafactor(**c), False, id=f"adafactor {i}",
                   marks=() if c.get("beta1") else pytest.mark.slow)
      for i, c in enumerate(ADAFACTOR_CONFIGS)],
    *[pytest.param(f"came {i}", lambda c=c: came(**c), False, id=f"came {i}",
                   marks=() if c.get("clip_threshold") else pytest.mark.slow)
      for i, c in enumerate(CAME_CONFIGS)],
    *[pytest.param(f"{name} fused apply", INNER[name], True, id=f"{name} fused apply")
      for name in sorted(INNER)],
]


@interp
@pytest.mark.parametrize(("name", "make", "fused"), _E2E_CASES)
def test_interp_optimizers_triton_vs_reference(name, make, fused):
    _poison()
    shapes = dict(SHAPES, wide=(9, 70))
    params, grads = _data(shapes, torch.float32, steps=3)
    p_ref, s_ref = _run(make(), params, grads, "reference", fused)
    p_tri, s_tri = _run(make(), params, grads, "triton", fused)
    assert _tree_rel(p_tri, p_ref) <= E2E_TOL["params"], (name, _tree_rel(p_tri, p_ref))
    assert _tree_rel(s_tri, s_ref) <= E2E_TOL["state"], (name, _tree_rel(s_tri, s_ref))


@interp
@pytest.mark.slow  # 3.5 s in the interpreter; the batched passes' other cases stay by default
def test_interp_many_tiny_leaves():
    _poison()
    shapes = {f"l{i}": s for i, s in enumerate([(1, 1), (2, 3), (1,), (), (3, 1), (1, 5),
                                                (2, 2, 2), (4,)] * 2)}
    params, grads = _data(shapes, torch.float32, steps=2)
    for opt in (adafactor(beta1=0.9, weight_decay=0.1), came(lr=1e-2)):
        p_ref, _ = _run(opt, params, grads, "reference", False)
        p_tri, _ = _run(opt, params, grads, "triton", False)
        assert _tree_rel(p_tri, p_ref) <= E2E_TOL["params"]


@interp
def test_interp_float64_takes_the_reference_when_forced(monkeypatch):
    def boom():
        raise AssertionError("float64 went to a kernel")

    monkeypatch.setattr(K, "_tk", boom)
    g = torch.randn(4, 5, dtype=torch.float64)
    with kernel_mode("triton"):
        rows, _ = K.sq_row_col_sums(g, 1e-30)
    assert rows.dtype == torch.float64


# Leaves of every view the kernels make, several of each tile width (16, 64, 256 columns), for
# the batched (multi-leaf) launches.
MIXED_SHAPES = [(5, 7), (3, 40), (7, 300), (2, 3, 5), (1, 1), (4, 4), (2, 17, 9), (6, 70)]


@interp
def test_interp_batched_passes_equal_the_reference_per_leaf():
    """Each pass over many leaves at once (one launch per launch group) gives every leaf its
    reference result: per-leaf geometry, pointers, partial offsets and scalars in one launch;
    float32 and bfloat16 gradients in one call (two groups)."""
    from funcpar.kernels import _launch

    _poison()
    gen = torch.Generator().manual_seed(3)
    gs = [torch.randn(s, generator=gen) for s in MIXED_SHAPES]
    gs[1], gs[5] = gs[1].bfloat16(), gs[5].bfloat16()
    fs = [_factors(g.float()) for g in gs]
    with kernel_mode("triton"), _launch.launch_counter() as launches:
        sums = K.sq_row_col_sums_batch([((g, 1e-3), {}) for g in gs])
        norms = K.scaled_norm_batch([((g, f), {}) for g, f in zip(gs, fs)])
        clips = [torch.tensor(1.0 + i / 4) for i in range(len(gs))]
        ms = [torch.randn(g.shape, generator=gen) for g in gs]
        res = K.came_residual_batch([((g, f, c, m, 0.9, 1e-16), {})
                                     for g, f, c, m in zip(gs, fs, clips, ms)])
    # Two gradient dtypes x three tile widths: at most six groups per pass, each one launch
    # (+ one segment-sum launch), whatever the number of leaves.
    assert len(launches) <= 3 * 6 * 2, launches
    for i, g in enumerate(gs):
        for a, b in zip(sums[i], K.sq_row_col_sums_reference(g, 1e-3)):
            assert a.shape == b.shape
            _check(a, b, f"row/col sums {tuple(g.shape)} {g.dtype}")
        _check(norms[i], K.scaled_norm_reference(g, fs[i]), f"norm {tuple(g.shape)}")
        for a, b in zip(res[i], K.came_residual_reference(g, fs[i], clips[i], ms[i], 0.9, 1e-16)):
            _check(a, b, f"came residual {tuple(g.shape)}")
    flat = [torch.randn(s, generator=gen) for s in [(5,), (), (300,), (3, 4, 5), (1,)]]
    vs = [torch.rand(x.shape, generator=gen) + 0.1 for x in flat]
    decays = [0.999, torch.tensor(0.3, dtype=torch.float64), 0.5, 0.9, 0.0]
    with kernel_mode("triton"):
        full = K.full_moment_batch([((g, v, d, 1e-30), {}) for g, v, d in zip(flat, vs, decays)])
    for (a_v, a_n), g, v, d in zip(full, flat, vs, decays):
        b_v, b_n = K.full_moment_reference(g, v, d, 1e-30)
        _check(a_v, b_v, f"V {tuple(g.shape)}")
        _check(a_n, b_n, f"full norm {tuple(g.shape)}")


@interp
def test_interp_batched_update_pass_mixed_leaves():
    """The update pass over leaves that differ in everything a leaf decides at run time (the
    preconditioner: factored, full or none; clip, pre, momentum, post, decay on or off, the
    scalars' values) in one call, in the three output modes and with bfloat16 parameters: each
    leaf's result is its reference's."""
    _poison()
    gen = torch.Generator().manual_seed(5)
    calls = []
    for i, shape in enumerate(MIXED_SHAPES + [(13,), (), (3, 4, 5)]):
        x = torch.randn(shape, generator=gen)
        p = torch.randn(shape, generator=gen)
        if i % 3 == 2:
            p = p.bfloat16()
        kind = i % 3 if len(shape) >= 2 else 1 + i % 2  # 0 factored, 1 full, 2 none
        precond = (_factors(x) if kind == 0 else
                   torch.rand(shape, generator=gen) + 0.5 if kind == 1 else None)
        kw = dict(clip=torch.tensor(1.0 + i / 7) if i % 2 else None,
                  pre=torch.tensor(0.01 * (i + 1), dtype=torch.float64) if i % 4 != 1 else None,
                  post=0.5 + i / 10 if i % 3 else None,
                  decay=torch.tensor(1e-3 * i, dtype=torch.float64) if i % 5 else None)
        if i % 2 == 0:
            kw |= dict(momentum=torch.randn(shape, generator=gen), beta1=0.8 + i / 100)
        for out in ("direction", "update", "param"):
            calls.append(((x, p, precond), dict(kw, out=out)))
    with kernel_mode("triton"):
        got = K.precond_apply_batch(calls)
    for ((x, p, precond), kw), (a, ma) in zip(calls, got):
        b, mb = K.precond_apply_reference(x, p, precond, **kw)
        what = f"{tuple(x.shape)} {kw['out']} {p.dtype}"
        if kw["out"] == "update":
            a, b = p.float() + a, p.float() + b  # W' - W: compare the parameters it makes
        # bfloat16 parameters: the interpreter truncates to bf16 (see test_interp_update_pass).
        tol = 2.0**-7 if kw["out"] == "param" and p.dtype == torch.bfloat16 else TOL32
        assert a.dtype == b.dtype, what
        _check(a, b, what, tol=tol)
        assert (ma is None) == (mb is None), what
        if mb is not None:
            _check(ma, mb, f"momentum {what}")


@interp
def test_interp_between_pass_work_batched():
    """The small work between the passes, batched on the fast path (foreach ops, one segment
    sum), equals each leaf's reference: the factors' EMAs with mean(R) or (sharded) the local
    sum of R, the clip divisor from a norm or a completed squared norm with a Python or a 0-d
    float64 threshold (the result's dtype follows the reference's promotion), Adafactor's step
    size from the parameter or its completed sum of squares, with and without weight decay."""
    import importlib

    A = importlib.import_module("funcpar.optim.adafactor")  # the module, not the function
    gen = torch.Generator().manual_seed(9)
    calls = []
    for i, s in enumerate(MIXED_SHAPES):
        g = torch.randn(s, generator=gen)
        rs, cs = K.sq_row_col_sums_reference(g, 1e-30)
        row, col = torch.rand(rs.shape, generator=gen), torch.rand(cs.shape, generator=gen)
        decay = torch.tensor(0.3 + i / 20, dtype=torch.float64) if i % 2 else 0.999
        calls.append(((rs, cs, row, col, decay, s[-2], s[-1], bool(i % 3 == 1)), {}))
    with kernel_mode("triton"):
        got = K.factor_ema_batch(calls)
    for (args, _), res in zip(calls, got):
        for a, b, what in zip(res, K.factor_ema_reference(*args), ("R'", "C'", "mean/sum")):
            assert a.shape == b.shape and a.dtype == b.dtype, what
            _check(a, b, f"{what} {tuple(args[0].shape)} local_sum={args[7]}")
    calls = [((torch.rand((), generator=gen) * 40, thr, n, sq), {})
             for thr in (1.0, torch.tensor(0.5, dtype=torch.float64))
             for n, sq in ((7, False), (300, True), (1, False), (60, True))]
    with kernel_mode("triton"):
        got = K.clip_divisor_batch(calls)
    for (args, _), a in zip(calls, got):
        b = K.clip_divisor_reference(*args)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
        _check(a, b, f"clip divisor {args[1:]}")
    rho = torch.tensor(1e-2, dtype=torch.float64)
    params = [torch.randn(s, generator=gen) * (0.01 if i % 3 == 0 else 1.0)
              for i, s in enumerate(MIXED_SHAPES)]  # RMS(W) below eps2 too: the other branch
    params[2] = params[2].bfloat16()
    calls = []
    for i, p in enumerate(params):
        sq = None if i % 2 else p.float().square().sum()
        wd = None if i % 4 == 3 else torch.tensor(0.1 * i, dtype=torch.float64)
        calls.append(((p, sq, rho, 0.02, p.numel(), wd), {}))
    with kernel_mode("triton"):
        got = A._step_size_batch(calls)
        sqs = A._param_sq_batch([((p,), {}) for p in params])
    for (args, _), res, p, sq in zip(calls, got, params, sqs):
        for a, b in zip(res, A._step_size_reference(*args)):
            assert (a is None) == (b is None)
            if b is not None:
                assert a.dtype == b.dtype == torch.float64
                _check(a, b, f"step size {tuple(p.shape)}")
        _check(sq, A._param_sq_reference(p), f"param sum of squares {tuple(p.shape)}")


def _tree(k: int) -> dict[str, tuple[int, ...]]:
    # k leaves of each kind: factored (two tile widths), 3-D, 1-D (unfactored), 0-d.
    kinds = [(12, 20), (6, 70), (2, 5, 7), (20,), ()]
    return {f"l{i}_{j}": s for i in range(k) for j, s in enumerate(kinds)}


@interp
@pytest.mark.parametrize("name", ["adafactor", *(pytest.param(n, marks=pytest.mark.slow)
                                                 for n in ("adafactor beta1", "came"))])
def test_interp_launches_per_step_do_not_grow_with_leaves(name, monkeypatch):
    """One optimizer step launches each pass once per launch group, not once per leaf: the
    launches of a step over 1 leaf of each kind and over 4 of each (5 vs 20 leaves) are the
    same, counted by funcpar's launch_counter and, independently, by Triton's interpreter
    (every kernel run); results equal the reference's."""
    from triton.runtime.interpreter import InterpretedFunction

    from funcpar.kernels import _launch

    seen: list[str] = []
    run = InterpretedFunction.run

    def counting(self, *a, **kw):
        seen.append(self.fn.__name__)
        return run(self, *a, **kw)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    make = {"adafactor": lambda: adafactor(weight_decay=0.1),
            "adafactor beta1": lambda: adafactor(beta1=0.9, weight_decay=0.1),
            "came": lambda: came(lr=1e-2, weight_decay=0.1)}[name]
    counts = {}
    for k in (1, 4):
        params, grads = _data(_tree(k), torch.float32, steps=2, seed=k)
        opt = make()
        p_ref, _ = _run(opt, params, grads, "reference", False)
        state = opt.init(params)
        with kernel_mode("triton"):
            upd, state = opt.update(grads[0], state, params)
            p = apply_updates(params, upd)
            seen.clear()
            with _launch.launch_counter() as launches:
                upd, state = opt.update(grads[1], state, p)
        assert launches == seen, (launches, seen)
        assert _tree_rel(apply_updates(p, upd), p_ref) <= E2E_TOL["params"]
        counts[k] = launches
    # Launch for launch the same kernels (one per pass and launch group; per leaf before).
    assert counts[1] == counts[4], counts
    print(f"{name}: {len(counts[4])} launches per step: {counts[4]}")


@interp
def test_interp_mixed_tree_bf16_params_batched():
    """A tree mixing float32 and bfloat16 parameters (two launch groups per pass) and every
    kind of leaf: adafactor with momentum and came, fused apply, kernels vs reference."""
    _poison()
    # One step: with bfloat16 parameters each step may differ by a bf16 ulp (the interpreter
    # truncates where torch rounds), so over s steps by s ulps; one is the pass's own bound.
    params, grads = _data(_tree(2), torch.float32, steps=1, seed=11)
    for k in list(params)[::2]:
        params[k] = params[k].bfloat16()
        for g in grads:
            g[k] = g[k].bfloat16()
    for name in sorted(INNER):
        p_ref, s_ref = _run(INNER[name](), params, grads, "reference", True)
        p_tri, s_tri = _run(INNER[name](), params, grads, "triton", True)
        # bfloat16 parameters: one bf16 ulp (the interpreter truncates, torch rounds); through
        # RMS(W) in Adafactor's step size that reaches the momentum at the same level.
        assert _tree_rel(p_tri, p_ref) <= 2.0**-7, name
        assert _tree_rel(s_tri, s_ref) <= 2.0**-7, name
        for k in params:
            if params[k].dtype == torch.float32:
                assert max_rel_err(p_tri[k].double(), p_ref[k].double()) <= E2E_TOL["params"]


def _tp2_rank(optim):
    from funcpar.testing import reference

    with kernel_mode("triton"):
        return reference.train(2, 1, optim, torch.float32)


@interp
@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adafactor_momentum", "came"])
def test_interp_tp2_triton_matches_one_process(optim):
    """Kernels on TP shards (uneven ones included) with the layout-aware reductions between
    passes give the one-process reference run."""
    from funcpar.testing import reference, run_ranks

    with kernel_mode("reference"):
        losses, params = reference.train(1, 1, optim, torch.float32)
    for rank_losses, rank_params in run_ranks(_tp2_rank, 2, optim, backend=None, timeout=300):
        # float32 over 10 training steps: the sharded matmuls and the kernels' summation order
        # each move the last bits; measured 2e-6 (the reference-mode tp2 run differs as much).
        assert reference.loss_rel(rank_losses, losses) < 1e-5
        assert reference.max_rel(rank_params, params) < 1e-4
        assert not any(math.isnan(x) for x in rank_losses)


def test_bench_optim_smoke(capsys, monkeypatch):
    """benchmarks/bench_optim.py runs on CPU (tiny preset, one step): funcpar's row, its
    reference row and the peer's, with numbers and the ratio."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_optim.py"
    spec = importlib.util.spec_from_file_location("bench_optim", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_optim", bench)  # its dataclass looks itself up
    spec.loader.exec_module(bench)
    bench.main(["--preset", "tiny", "--only", "came", "--steps", "1", "--reps", "1",
                "--warmup", "1", "--reference", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| came |")]
    assert [r.split("|")[2].strip() for r in rows] == [
        "funcpar", "funcpar [reference]", "came-pytorch CAME"], out
    assert all(re.search(r"\| \d+\.\d+ \|", r) for r in rows), out
    assert "reference / kernels" in rows[1] and "funcpar" in rows[2].split("|")[-2], out
