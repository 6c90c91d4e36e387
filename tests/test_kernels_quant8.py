"""Blockwise 8-bit quantize/dequantize kernels and the fused 8-bit Adam step against their
references (Triton's CPU interpreter), and GaLore's 8-bit AdamW under ``kernel_mode("triton")``.

Quantize and dequantize are the same float32 operations in both (an IEEE division, a max, a
binary search and one distance comparison; a product): codes and absmax must be identical. The
fused step's direction: <= 1e-6 relative (a square root and two divisions; torch's CPU square
root is not always correctly rounded). Its codes: the updated states are the same float32
operations too, but torch may contract its ``add(alpha=)`` into an fma only on vector lanes,
so a state can differ by one ulp and, at a tie distance, round to the neighbouring code: allow
that on at most 0.1 % of the elements, and one code index apart.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import needs_triton

import funcpar.optim as fo
from funcpar.kernels import _launch, kernel_mode
from funcpar.kernels.quant8 import (
    Adam8bitScalars,
    adam8bit_reference,
    adam8bit_triton,
    dequantize_reference,
    dequantize_triton,
    quantize_reference,
    quantize_triton,
)
from funcpar.optim.quant8 import dynamic_map
from funcpar.state.tree import tree_leaves

# Odd sizes, 3-D, 0-d, empty; block sizes that are and are not powers of two; 1 or 2 blocks
# per program.
CASES = [((3, 5, 7), 16), ((1000,), 256), ((), 64), ((2, 33), 100), ((0,), 8), ((4, 1, 9), 7)]


def _x(shape, seed, *, zero_block=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    x.view(-1)[:zero_block] = 0  # an all-zero block maps to the code of 0
    return x


@needs_triton
@pytest.mark.parametrize("shape,block_size", CASES)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_dequantize_bit_identical(interpret, shape, block_size, rows, signed):
    code = dynamic_map(signed=signed)
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(shape, 1, zero_block=block_size).to(dtype)
        if not signed:
            x = x.abs()
        with _launch.poisoned_outputs():
            codes, absmax = quantize_triton(x, code, block_size, rows=rows)
        ref_codes, ref_absmax = quantize_reference(x, code, block_size)
        assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)
        for out in (torch.float32, torch.bfloat16):
            with _launch.poisoned_outputs():
                y = dequantize_triton(ref_codes, ref_absmax, code, block_size, out, rows=rows)
            ref = dequantize_reference(ref_codes, ref_absmax, code, block_size, out)
            assert y.dtype == ref.dtype and not y.isnan().any()
            if out == torch.float32:
                assert torch.equal(y, ref)
            else:
                # Triton's interpreter casts float32 to bfloat16 by truncation (a GPU rounds to
                # nearest even, as torch): one bfloat16 ulp (2**-7 relative) apart at most.
                assert bool(((y.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all())


@needs_triton
@pytest.mark.parametrize("shape,block_size", [c for c in CASES if c[0] != ()])  # 0-d: reference
@pytest.mark.parametrize("variant", ["hf", "bnb"])
def test_fused_adam8bit_matches_reference(interpret, shape, block_size, variant):
    cm, cv = dynamic_map(signed=True), dynamic_map(signed=False)
    g = _x(shape, 2)
    m = quantize_reference(_x(shape, 3, zero_block=block_size), cm, block_size)
    v = quantize_reference(_x(shape, 4).abs(), cv, block_size)
    s = Adam8bitScalars(0.9, 0.999, torch.tensor(1e-8, dtype=torch.float64),
                        torch.tensor(0.05, dtype=torch.float64), variant)
    with _launch.poisoned_outputs():
        d, (mc, ma), (vc, va) = adam8bit_triton(g, m, v, cm, cv, block_size, s, rows=2)
    rd, (rmc, rma), (rvc, rva) = adam8bit_reference(g, m, v, cm, cv, block_size, s)
    assert d.shape == rd.shape and d.dtype == rd.dtype and not d.isnan().any()
    if rd.numel():
        assert float((d - rd).abs().max() / rd.abs().max()) <= 1e-6
    for k, r in ((ma, rma), (va, rva)):
        assert k.shape == r.shape and not k.isnan().any()
        assert torch.allclose(k, r, rtol=1e-6, atol=0)
    for k, r in ((mc, rmc), (vc, rvc)):
        assert k.shape == r.shape and k.dtype == torch.uint8
        diff = (k.int() - r.int()).abs()
        assert int(diff.max()) <= 1 if diff.numel() else True
        assert int((diff > 0).sum()) <= max(1, r.numel() // 1000)


def _galore_run(steps=3):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(24, 40, generator=gen), "e": torch.randn(48, 20, generator=gen),
              "b": torch.randn(40, generator=gen)}
    opt = fo.galore_adamw(lr=1e-2, weight_decay=0.1, eight_bit=True, min_8bit_size=64,
                          block_size=64, galore_mask={"w": {"rank": 8}, "e": False, "b": False})
    state = opt.init(params)
    for i in range(steps):
        g2 = torch.Generator().manual_seed(10 + i)
        grads = {k: torch.randn(v.shape, generator=g2) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        params = fo.apply_updates(params, updates)
    return params, state


@needs_triton
def test_galore_eight_bit_under_triton(interpret, monkeypatch):
    calls = []
    import funcpar.kernels.quant8 as kq

    real = kq.adam8bit_triton
    monkeypatch.setattr(kq, "adam8bit_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    with kernel_mode("triton"):
        params, state = _galore_run()
    assert len(calls) == 3 * 2  # w (projected, 8x40 state) and e (unprojected), every step
    with kernel_mode("reference"):
        ref_params, ref_state = _galore_run()
    for k in params:
        err = float((params[k] - ref_params[k]).abs().max() / ref_params[k].abs().max())
        # A flipped code (module docstring) moves a parameter by at most lr x 0.0070 of its
        # Adam step; none flipped in this run, so the float32 tolerance holds.
        assert err <= 1e-6, (k, err)
    for x, y in zip(tree_leaves(state), tree_leaves(ref_state), strict=True):
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape
            if x.dtype == torch.uint8:
                assert int((x.int() - y.int()).abs().max()) <= 1
