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

import os

import pytest
import torch
from _kernel_helpers import needs_triton

import funcpar.optim as fo
from funcpar.kernels import _launch, kernel_mode
from funcpar.kernels.quant8 import (
    Adam8bitScalars,
    adam8bit_absmax_reference,
    adam8bit_absmax_triton,
    adam8bit_reference,
    adam8bit_requantize_reference,
    adam8bit_requantize_triton,
    adam8bit_triton,
    block_segments,
    dequantize_reference,
    dequantize_triton,
    quantize_reference,
    quantize_triton,
)
from funcpar.optim.quant8 import (
    Quantized,
    _global_blocks,
    adam8bit_phases,
    dynamic_map,
    global_segments,
)
from funcpar.shard.layout import Layout, Shard, shard_tensor
from funcpar.shard.mesh import DeviceMesh
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


# --------------------------------------------------------------------------------------------
# Sharded 8-bit states: the two passes around the absmax all-reduce
# --------------------------------------------------------------------------------------------

# (global shape, placements, mesh axes, blocks): column split (every block cut, one segment per
# row piece), uneven row split, nested axes on one dim, a dim of each axis, a blocked split,
# 1-D and 3-D.
SHARDED = [
    ((7, 10), {"tp": Shard(1)}, {"tp": 2}, {}),
    ((9, 5), {"tp": Shard(0)}, {"tp": 2}, {}),
    ((13, 6), {"tp": Shard(0), "dp": Shard(0)}, {"dp": 2, "tp": 2}, {}),
    ((6, 11), {"tp": Shard(0), "dp": Shard(1)}, {"dp": 2, "tp": 2}, {}),
    ((8, 6), {"tp": Shard(0)}, {"tp": 2}, {0: 2}),
    ((41,), {"tp": Shard(0)}, {"tp": 2}, {}),
    ((3, 4, 9), {"tp": Shard(2)}, {"tp": 2}, {}),
]


def _shards(shape, placements, axes, blocks, block_size):
    """Every rank's (layout, g, m, v) of whole 8-bit states quantized in the whole blocks."""
    cm, cv = dynamic_map(signed=True), dynamic_map(signed=False)
    g, m, v = _x(shape, 5), _x(shape, 6), _x(shape, 7).abs()
    mq, vq = quantize_reference(m, cm, block_size), quantize_reference(v, cv, block_size)
    world = 1
    for n in axes.values():
        world *= n
    out = []
    for rank in range(world):
        lay = Layout(DeviceMesh.virtual(rank=rank, **axes), shape, placements, blocks=blocks,
                     name="w")
        out.append((lay, shard_tensor(g, lay), (shard_tensor(mq[0], lay), mq[1]),
                    (shard_tensor(vq[0], lay), vq[1])))
    return out


@pytest.mark.parametrize("shape,placements,axes,blocks", SHARDED)
@pytest.mark.parametrize("block_size", [8, 24])
def test_block_segments_cover_the_global_blocks(shape, placements, axes, blocks, block_size):
    """The segments of a shard are its elements' global blocks (the reference's per-element
    index) as runs of one block each, no longer than a block; the whole tensor's are its
    blocks."""
    for lay, g, _, _ in _shards(shape, placements, axes, blocks, block_size):
        index, nb = _global_blocks(g, lay, block_size)
        segs = global_segments(lay, block_size, g.device)
        assert segs.n_blocks == nb
        assert torch.equal(torch.repeat_interleave(segs.block, segs.length.long()), index)
        assert bool((segs.block[1:] != segs.block[:-1]).all())  # maximal runs
        assert 0 < segs.max_length <= block_size
    whole = block_segments(torch.arange(50) // 8, 7)
    assert torch.equal(whole.length, torch.tensor([8] * 6 + [2], dtype=torch.int32))


@needs_triton
@pytest.mark.parametrize("shape,placements,axes,blocks", SHARDED)
@pytest.mark.parametrize("variant", ["hf", "bnb"])
def test_sharded_adam8bit_passes_match_reference(interpret, shape, placements, axes, blocks,
                                                 variant):
    """Both passes on every rank's shard against their references (module docstring's
    tolerances), outputs poisoned; the references against the optimizer's own reference path
    (funcpar.optim.quant8.adam8bit_phases in kernel_mode("reference")), bit for bit."""
    cm, cv = dynamic_map(signed=True), dynamic_map(signed=False)
    s = Adam8bitScalars(0.9, 0.999, torch.tensor(1e-8, dtype=torch.float64),
                        torch.tensor(0.05, dtype=torch.float64), variant)
    block_size = 8
    ranks = _shards(shape, placements, axes, blocks, block_size)
    locals_m, locals_v = [], []
    for lay, g, m, v in ranks:
        segs = global_segments(lay, block_size, g.device)
        with _launch.poisoned_outputs():
            d, am, av = adam8bit_absmax_triton(g, m, v, cm, cv, segs, s, rows=2)
        rd, ram, rav = adam8bit_absmax_reference(g, m, v, cm, cv, segs, s)
        assert d.shape == rd.shape and not d.isnan().any()
        assert float((d - rd).abs().max() / rd.abs().max()) <= 1e-6
        for k, r in ((am, ram), (av, rav)):
            assert k.shape == r.shape == (segs.n_blocks,) and not k.isnan().any()
            assert torch.allclose(k, r, rtol=1e-6, atol=0)
        locals_m.append(ram)
        locals_v.append(rav)
        # The optimizer's reference path: its phase asks for exactly these local maxima.
        with kernel_mode("reference"):
            phases = adam8bit_phases(g, Quantized(*m), Quantized(*v), cm, cv, block_size, s,
                                     layout=lay)
            asked = next(phases)
        assert [type(r).__name__ for r in asked] == ["MaxPartial", "MaxPartial"]
        assert torch.equal(asked[0].x, ram) and torch.equal(asked[1].x, rav)
    # The all-reduce (max) over the ranks, then pass 2 on each rank.
    gm, gv = torch.stack(locals_m).amax(0), torch.stack(locals_v).amax(0)
    for lay, g, m, v in ranks:
        segs = global_segments(lay, block_size, g.device)
        with _launch.poisoned_outputs():
            mc, vc = adam8bit_requantize_triton(g, m, v, cm, cv, segs, s, gm, gv, rows=2)
        rmc, rvc = adam8bit_requantize_reference(g, m, v, cm, cv, segs, s, gm, gv)
        for k, r in ((mc, rmc), (vc, rvc)):
            assert k.shape == r.shape == g.shape and k.dtype == torch.uint8
            diff = (k.int() - r.int()).abs()
            assert int(diff.max()) <= 1 if diff.numel() else True
            assert int((diff > 0).sum()) <= max(1, r.numel() // 1000)
        with kernel_mode("reference"):
            phases = adam8bit_phases(g, Quantized(*m), Quantized(*v), cm, cv, block_size, s,
                                     layout=lay)
            next(phases)
            try:
                phases.send([gm, gv])
            except StopIteration as stop:
                direction, mq, vq = stop.value
        assert torch.equal(mq.codes, rmc) and torch.equal(vq.codes, rvc)
        assert torch.equal(mq.absmax, gm) and torch.equal(vq.absmax, gv)
        assert torch.equal(direction, adam8bit_absmax_reference(g, m, v, cm, cv, segs, s)[0])


@needs_triton
def test_sharded_passes_of_a_whole_tensor_are_the_fused_step(interpret):
    """On a whole tensor the segments are its blocks, and the two passes (with the local
    maxima as the absmax: no other rank) give the one-pass kernel's outputs bit for bit: the
    same jit code for the moments, the direction and the codes."""
    cm, cv = dynamic_map(signed=True), dynamic_map(signed=False)
    s = Adam8bitScalars(0.9, 0.99, 1e-6, 0.3, "hf")
    block_size = 16
    g, m, v = _x((5, 13), 8), _x((5, 13), 9), _x((5, 13), 10).abs()
    m, v = quantize_reference(m, cm, block_size), quantize_reference(v, cv, block_size)
    segs = block_segments(torch.arange(g.numel()) // block_size, -(-g.numel() // block_size))
    d1, (mc1, ma1), (vc1, va1) = adam8bit_triton(g, m, v, cm, cv, block_size, s, rows=1)
    d2, am, av = adam8bit_absmax_triton(g, m, v, cm, cv, segs, s, rows=1)
    mc2, vc2 = adam8bit_requantize_triton(g, m, v, cm, cv, segs, s, am, av, rows=1)
    for a, b in ((d1, d2), (ma1, am), (va1, av), (mc1, mc2), (vc1, vc2)):
        assert torch.equal(a, b)


# Leaves for the tp2 run: "w_rows" (rows split, "std" projects its whole columns: a (40, 8)
# low-rank state split by rows, blocks of 64 cut at the shard boundary), "w_cols" (columns split,
# "left": an (8, 20) state split by columns, every block cut), "e" (unprojected, 47 rows split
# unevenly), "w_whole" (rows split, "std" projects the split rows: a whole (8, 40) state, the
# one-pass kernel), "b" (too small for 8-bit: float32 states).
TP_LEAVES = {"w_rows": ((40, 24), 0, {"rank": 8}), "w_cols": ((30, 20), 1, {"rank": 8,
                                                                          "proj_type": "left"}),
             "e": ((47, 20), 0, False), "w_whole": ((24, 40), 0, {"rank": 8}),
             "b": ((40,), 0, False)}
SHARDED_8BIT = 3  # w_rows, w_cols and e


def _tp_run(layouts_of, steps=3):
    """galore_adamw 8-bit for ``steps`` steps on this process's shards (``layouts_of``: name ->
    Layout or None); (whole params, per step the optimizer's records, the sharded kernels'
    launches)."""
    from funcpar.shard.comm import comm_log
    from funcpar.shard.layout import unshard

    gen = torch.Generator().manual_seed(0)
    whole = {k: torch.randn(s, generator=gen) for k, (s, _, _) in TP_LEAVES.items()}
    lays = {k: layouts_of(k) for k in TP_LEAVES}
    local = {k: x if lays[k] is None else shard_tensor(x, lays[k]) for k, x in whole.items()}
    opt = fo.galore_adamw(lr=1e-2, weight_decay=0.1, eight_bit=True, min_8bit_size=64,
                          block_size=64, update_proj_gap=2,
                          galore_mask={k: m for k, (_, _, m) in TP_LEAVES.items()})
    state = opt.init(local)
    records, launches = [], []
    for i in range(steps):
        g2 = torch.Generator().manual_seed(10 + i)
        grads = {k: torch.randn(s, generator=g2) for k, (s, _, _) in TP_LEAVES.items()}
        grads = {k: x if lays[k] is None else shard_tensor(x, lays[k]) for k, x in grads.items()}
        with comm_log.capture() as recs, _launch.launch_counter() as names:
            updates, state = opt.update(grads, state, local,
                                        layouts=None if all(v is None for v in lays.values())
                                        else lays)
        local = fo.apply_updates(local, updates)
        records.append([(r.op, r.axis, r.purpose) for r in recs])
        launches.extend(names)
    params = {k: x if lays[k] is None else unshard(x, lays[k]) for k, x in local.items()}
    return params, records, launches


def _tp_ranks() -> dict:
    """On each tp2 rank: the run in kernel_mode("triton") and in "reference"."""
    from funcpar.shard.mesh import DeviceMesh as Mesh

    # Ranks start from a fork server that may predate the test's environment: set it here,
    # before the kernels (and Triton) are first built in this process.
    os.environ["TRITON_INTERPRET"] = "1"
    mesh = Mesh.from_env(tp=2)

    def layouts_of(name):
        shape, dim, _ = TP_LEAVES[name]
        return Layout(mesh, shape, {"tp": Shard(dim)}, name=name)

    out = {}
    for mode in ("triton", "reference"):
        with kernel_mode(mode):
            out[mode] = _tp_run(layouts_of)
    return out


@needs_triton
def test_sharded_kernels_in_galore_on_tp2(interpret):
    """galore_adamw 8-bit on tp2 ranks (run_ranks; the interpreter in every rank): the sharded
    states take the two-pass kernels (3 states x 3 steps x 2 passes), the absmax of all of them
    travel in one all-reduce per step in both modes, and the parameters match the reference path
    and the one-process run within 1e-6 (float32, as the whole-state kernel; measured <= 3.4e-8
    both: the kernel's fused multiply-add, and the projections' partial sums added in another
    order). The reference path of the unprojected "e" (no projection) and the float32 states
    of "b" are the one-process run bit for bit."""
    from funcpar.testing import run_ranks

    with kernel_mode("reference"):
        one, _, _ = _tp_run(lambda name: None)
    for rank, res in enumerate(run_ranks(_tp_ranks, 2, timeout=600)):
        kernel, ref = res["triton"], res["reference"]
        assert kernel[2].count("adam8bit_absmax_kernel") == 3 * SHARDED_8BIT, kernel[2]
        assert kernel[2].count("adam8bit_requantize_kernel") == 3 * SHARDED_8BIT, kernel[2]
        assert "adam8bit_absmax_kernel" not in ref[2]
        for recs in kernel[1] + ref[1]:
            assert [r for r in recs if r[2] == "8-bit absmax"] == [
                ("all_reduce", "tp", "8-bit absmax")], recs
        for k in TP_LEAVES:
            err = float((kernel[0][k] - ref[0][k]).abs().max() / ref[0][k].abs().max())
            assert err <= 1e-6, (rank, k, err)
            err = float((kernel[0][k] - one[k]).abs().max() / one[k].abs().max())
            assert err <= 1e-6, (rank, k, err)
        assert torch.equal(ref[0]["e"], one["e"]) and torch.equal(ref[0]["b"], one["b"])
        assert torch.equal(kernel[0]["b"], one["b"])


@needs_triton
@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_sharded_state_of_another_layout_is_refused(interpret, mode):
    """A sharded 8-bit state whose absmax or codes do not fit the layout is a ValueError on
    both paths (the kernels would index out of bounds), before any request is made."""
    cm, cv = dynamic_map(signed=True), dynamic_map(signed=False)
    s = Adam8bitScalars(0.9, 0.999, 1e-8, 0.05, "hf")
    lay, g, m, v = _shards((7, 10), {"tp": Shard(1)}, {"tp": 2}, {}, 8)[0]
    short = Quantized(m[0], m[1][:-1])
    with kernel_mode(mode), pytest.raises(ValueError, match="absmax has 8 blocks"):
        next(adam8bit_phases(g, short, Quantized(*v), cm, cv, 8, s, layout=lay))
    wrong = Quantized(v[0][:, :-1], v[1])
    with kernel_mode(mode), pytest.raises(ValueError, match=r"codes of shape \(7, 4\)"):
        next(adam8bit_phases(g, Quantized(*m), wrong, cm, cv, 8, s, layout=lay))
