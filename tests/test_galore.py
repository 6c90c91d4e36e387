"""GaLore step by step against galore-torch 1.0 (GaLoreAdamW, GaLoreAdafactor, GaLoreAdamW8bit),
its 8-bit states against its fp32 ones, the projector, the leaf selection and the checks."""

import warnings

import numpy as np
import pytest
import torch
from conftest import max_rel_err
from torch import nn

import funcpar.optim as fo
from funcpar.optim.galore import (
    GaLoreConfig,
    galore_adafactor,
    galore_adamw,
    galore_param_groups,
)
from funcpar.optim.projector import Projector, fit_projector
from funcpar.optim.quant8 import Quantized, dequantize, dynamic_map, roundtrip_bound
from funcpar.state.tree import tree_leaves

galore_torch = pytest.importorskip("galore_torch")

# Square, wide (left projection under "std"), tall (right), 1-D, 3-D (unprojected), a single
# element and a scalar.
SHAPES = {"sq": (12, 12), "wide": (8, 20), "tall": (24, 10), "b": (7,), "t": (2, 3, 4),
          "one": (1,), "s": ()}
PROJECTED = ("sq", "wide", "tall")
RANK, GAP, SCALE = 4, 5, 0.3
# "tall" has its own config: a different rank and gap (per-leaf configs, as param groups).
TALL = dict(rank=3, update_proj_gap=4, scale=0.5)
# 12 steps: projector refreshes at steps 0, 5, 10 (gap 5) and 0, 4, 8 ("tall", gap 4).
STEPS = 12
# float64: galore-torch computes the SVD in float32 (casting float64 there and back) and so do
# we by default (svd_dtype=float32): identical projectors, then identical float64 arithmetic
# up to reassociation. float32: the references' Python-double scalars vs our float64 0-d
# tensors cast to float32 at each multiply.
TOL = {torch.float64: 1e-10, torch.float32: 1e-6}


def _mask(shapes=SHAPES, projected=PROJECTED, tall=TALL):
    out = {k: k in projected for k in shapes}
    if "tall" in projected and tall is not None:
        out["tall"] = dict(tall)
    return out


def _ref_groups(tp, proj_type, shapes=SHAPES, projected=PROJECTED, tall=TALL):
    main = [tp[k] for k in projected if k != "tall" or tall is None]
    groups = [{"params": main, "rank": RANK, "update_proj_gap": GAP, "scale": SCALE,
               "proj_type": proj_type}]
    if "tall" in projected and tall is not None:
        groups.append({"params": [tp["tall"]], "proj_type": proj_type, **tall})
    groups.append({"params": [tp[k] for k in shapes if k not in projected]})
    return groups


def _run(ours, make_ref, dtype, shapes=SHAPES, steps=STEPS, seed=0):
    """Both optimizers on the same random full-rank gradients; max param error over the run."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    p0 = {k: v.clone() for k, v in params.items()}
    state = ours.init(params)
    tp = {k: v.clone().requires_grad_() for k, v in params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # galore-torch's AdamW deprecation note
        ref = make_ref(tp) if make_ref is not None else None
    err = 0.0
    for _ in range(steps):
        grads = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
        updates, state = ours.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        if ref is not None:
            for k, p in tp.items():
                p.grad = grads[k].clone()
            ref.step()
            err = max(err, max(max_rel_err(params[k], tp[k].detach()) for k in shapes))
    return err, params, state.inner, ref, tp, p0


def _ortho(proj: Projector, proj_type):
    if proj_type == "full":
        return [proj.left, proj.right]
    return proj.left if proj.left is not None else proj.right


def _check_projectors(inner, ref, tp, proj_type, tol, projected=PROJECTED):
    for k, p in tp.items():
        if k not in projected:
            assert inner.projector[k] is None, k
            continue
        theirs = ref.state[p]["projector"].ortho_matrix
        mine = _ortho(inner.projector[k], proj_type)
        if proj_type == "full":
            for a, b in zip(mine, theirs):
                assert max_rel_err(a, b) <= tol, k
        else:
            assert max_rel_err(mine, theirs) <= tol, k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
def test_galore_adamw_matches_galore_torch(proj_type, dtype):
    tol = TOL[dtype]
    ours = galore_adamw(lr=0.01, weight_decay=0.1, rank=RANK, update_proj_gap=GAP, scale=SCALE,
                        proj_type=proj_type, galore_mask=_mask())
    err, _params, inner, ref, tp, _ = _run(
        ours, lambda tp: galore_torch.GaLoreAdamW(_ref_groups(tp, proj_type), lr=0.01,
                                                  weight_decay=0.1), dtype)
    assert err <= tol
    for k, p in tp.items():
        st = ref.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            mine = getattr(inner, name)[k]
            assert mine.shape == st[name].shape, (k, name)
            assert max_rel_err(mine, st[name]) <= tol, (k, name)
    _check_projectors(inner, ref, tp, proj_type, tol)
    assert int(inner.count) == STEPS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(beta1=0.9, weight_decay=0.1),
        dict(lr=0.01, relative_step=False, scale_parameter=False, beta1=0.8, weight_decay=0.05,
             clip_threshold=0.5),
        dict(warmup_init=True, eps=(1e-20, 1e-2), decay_rate=-0.6),
    ],
)
def test_galore_adafactor_matches_galore_torch(kwargs, dtype):
    tol = TOL[dtype]
    ours = galore_adafactor(**kwargs, rank=RANK, update_proj_gap=GAP, scale=SCALE,
                            galore_mask=_mask())
    err, _params, inner, ref, tp, _ = _run(
        ours, lambda tp: galore_torch.GaLoreAdafactor(_ref_groups(tp, "std"), **kwargs), dtype)
    assert err <= tol
    for k, p in tp.items():
        st = ref.state[p]
        theirs = {n for n in ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")
                  if n in st}
        assert set(inner.stats[k]) == theirs, k
        for name in theirs:
            assert inner.stats[k][name].shape == st[name].shape, (k, name)
            assert max_rel_err(inner.stats[k][name], st[name]) <= tol, (k, name)
    _check_projectors(inner, ref, tp, "std", tol)


# Larger leaves for the 8-bit tests: each projected leaf's low-rank state has >= 256 elements
# (8-bit with min_8bit_size=256, in several blocks of 256, one with a short tail), as do "b"
# and "t" (unprojected 8-bit); "s" and "one" stay fp32.
SHAPES8 = {"sq": (64, 64), "wide": (32, 80), "tall": (96, 40), "b": (300,), "t": (4, 8, 10),
           "s": (5,), "one": (1,)}
KW8 = dict(lr=0.01, weight_decay=0.1, rank=8, update_proj_gap=GAP, scale=SCALE, eps=1e-8)


def _movement(params, p0, k):
    return float((params[k] - p0[k]).abs().max())


@pytest.mark.parametrize("adam_variant", ["hf", "bnb"])
def test_eight_bit_tracks_fp32(adam_variant):
    mask = {k: k in PROJECTED for k in SHAPES8}
    common = dict(KW8, galore_mask=mask, adam_variant=adam_variant, min_8bit_size=256)
    opt8, opt32 = galore_adamw(**common, eight_bit=True), galore_adamw(**common)
    gen = torch.Generator().manual_seed(0)
    p0 = {k: torch.randn(s, generator=gen) for k, s in SHAPES8.items()}
    p8, p32 = dict(p0), dict(p0)
    s8, s32 = opt8.init(p8), opt32.init(p32)
    peak = {k: [0.0, 0.0] for k in SHAPES8}  # max over steps of the fp32 moments' absmax
    for _ in range(STEPS):
        grads = {k: torch.randn(s, generator=gen) for k, s in SHAPES8.items()}
        u8, s8 = opt8.update(grads, s8, p8)
        u32, s32 = opt32.update(grads, s32, p32)
        p8, p32 = fo.apply_updates(p8, u8), fo.apply_updates(p32, u32)
        for k in SHAPES8:
            peak[k][0] = max(peak[k][0], float(s32.inner.exp_avg[k].abs().max()))
            peak[k][1] = max(peak[k][1], float(s32.inner.exp_avg_sq[k].abs().max()))
    s8, s32 = s8.inner, s32.inner
    code_m, code_v = dynamic_map(True), dynamic_map(False)
    b1, b2 = 0.9, 0.999
    for k in SHAPES8:
        quantized = k not in ("s", "one")
        assert isinstance(s8.exp_avg[k], Quantized) == quantized, k
        assert isinstance(s8.exp_avg_sq[k], Quantized) == quantized, k
        if not quantized:
            assert torch.equal(p8[k], p32[k])
            continue
        # Measured over 12 steps: the 8-bit parameters stay within 1.9% of the fp32 run's
        # largest movement (0.4-0.6% on projected leaves, 1.5-1.9% on unprojected ones).
        assert float((p8[k] - p32[k]).abs().max()) <= 0.03 * _movement(p32, p0, k), k
        # The moments depend on the gradients only. Each requantization adds at most one
        # round-trip error B * absmax, which the EMA then decays by beta per step: after t steps
        # |m8 - m32| <= B * max_t absmax * (1 - b^t) / (1 - b) (+1% for the error's own effect
        # on absmax). Measured: m at 34-46%, v at 4-6% of this bound.
        m8 = dequantize(s8.exp_avg[k], code_m, 256)
        v8 = dequantize(s8.exp_avg_sq[k], code_v, 256)
        for mine, ref, code, beta, top in ((m8, s32.exp_avg[k], code_m, b1, peak[k][0]),
                                          (v8, s32.exp_avg_sq[k], code_v, b2, peak[k][1])):
            bound = roundtrip_bound(code) * top * (1 - beta**STEPS) / (1 - beta) * 1.01
            assert float((mine - ref).abs().max()) <= bound, k
    # Same projectors (the SVD sees the same gradients).
    for k in PROJECTED:
        assert torch.equal(_ortho(s8.projector[k], "std"), _ortho(s32.projector[k], "std"))


def test_eight_bit_matches_galore_adamw8bit(monkeypatch):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    # GaLoreAdamW8bit calls torch.cuda.synchronize() after every parameter, which raises on a
    # CPU-only torch; there is nothing to synchronize on CPU.
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    # galore-torch 1.0 passes its percentile_clipping (100) and block_wise (True) positionally
    # into bitsandbytes 0.50's max_unorm and skip_zeros: with fp32 states (low-rank size under
    # min_8bit_size) a projected leaf's update is then scaled by 0 (its zeroed stand-in has
    # norm 0), so the comparison keeps every projected state 8-bit.
    mask = {k: k in PROJECTED for k in SHAPES8}
    ours = galore_adamw(**KW8, galore_mask=mask, eight_bit=True, adam_variant="bnb",
                        min_8bit_size=256)

    def ref(tp):
        groups = [{"params": [tp[k] for k in PROJECTED], "rank": 8, "update_proj_gap": GAP,
                   "scale": SCALE, "proj_type": "std"},
                  {"params": [tp[k] for k in SHAPES8 if k not in PROJECTED]}]
        return galore_torch.GaLoreAdamW8bit(groups, lr=0.01, weight_decay=0.1, eps=1e-8,
                                            min_8bit_size=256)

    _, params, inner, ref, tp, p0 = _run(ours, ref, torch.float32, SHAPES8)
    code_m, code_v = dynamic_map(True), dynamic_map(False)
    for k, p in tp.items():
        st = ref.state[p]
        mine_m, mine_v = inner.exp_avg[k], inner.exp_avg_sq[k]
        if st["state1"].dtype == torch.float32:
            # bitsandbytes' fp32 states: same arithmetic, float32 rounding.
            assert not isinstance(mine_m, Quantized)
            assert max_rel_err(mine_m, st["state1"]) <= 1e-6
            assert max_rel_err(mine_v, st["state2"]) <= 1e-6
            assert max_rel_err(params[k], p.detach()) <= 1e-6
            continue
        assert isinstance(mine_m, Quantized) and mine_m.codes.shape == st["state1"].shape
        assert torch.equal(st["qmap1"], code_m) and torch.equal(st["qmap2"], code_v)
        # Identical inputs give identical absmax (measured: bit-equal after 12 steps).
        assert max_rel_err(mine_m.absmax, st["absmax1"]) <= 1e-6
        assert max_rel_err(mine_v.absmax, st["absmax2"]) <= 1e-6
        # bitsandbytes' CPU code search sometimes misses the nearest code (test_quant8); a
        # missed code feeds the next step's EMA, so a few codes end up one step apart
        # (measured: <= 1.7% of the codes; at most one code step, <= 0.0141 absmax, apart).
        for mine, theirs, code, key in ((mine_m, st["state1"], code_m, "1"),
                                        (mine_v, st["state2"], code_v, "2")):
            assert float((mine.codes != theirs).float().mean()) <= 0.05
            a = dequantize(mine, code, 256)
            b = bnb_functional.dequantize_blockwise(theirs, absmax=st["absmax" + key],
                                                    code=code.clone(), blocksize=256)
            step = float((code[1:] - code[:-1]).max()) + 2.0**-22
            absmax = mine.absmax.repeat_interleave(256)[:a.numel()].reshape(a.shape)
            assert torch.all((a - b).abs() <= step * absmax), (k, key)
        # Parameters: measured within 0.33% of the largest movement.
        assert float((params[k] - p.detach()).abs().max()) <= 0.01 * _movement(params, p0, k)
    _check_projectors(inner, ref, tp, "std", 0.0, projected=PROJECTED)


def test_projector_refreshes_every_gap_steps():
    shapes = {"w": (10, 6)}
    opt = galore_adamw(lr=0.01, rank=2, update_proj_gap=3)
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(10, 6, generator=gen, dtype=torch.float64)}
    state = opt.init(params)
    before = state.inner.projector["w"].right
    assert before.shape == (2, 6) and state.inner.projector["w"].left is None
    refreshed = []
    for step in range(10):
        g = {"w": torch.randn(shapes["w"], generator=gen, dtype=torch.float64)}
        _, state = opt.update(g, state, params)
        now = state.inner.projector["w"].right
        refreshed.append(not torch.equal(now, before))
        if step % 3 == 0:
            want = fit_projector(g["w"], 2, "std").right
            assert torch.equal(now, want)
        before = now
    assert refreshed == [s % 3 == 0 for s in range(10)]


def test_float64_svd_projects_on_the_top_singular_subspace():
    gen = torch.Generator().manual_seed(6)
    for shape, side in (((30, 12), "right"), ((9, 25), "left")):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        proj = fit_projector(g, 5, "std", svd_dtype=None)
        mat = getattr(proj, side)
        assert mat.dtype == torch.float64
        # Independent float64 SVD (numpy); P P^T is sign-invariant.
        u, _, vh = np.linalg.svd(g.numpy(), full_matrices=False)
        if side == "right":
            want, got = vh[:5].T @ vh[:5], (mat.T @ mat).numpy()
        else:
            want, got = u[:, :5] @ u[:, :5].T, (mat @ mat.T).numpy()
        assert np.abs(got - want).max() <= 1e-10
        # The float32 SVD (galore-torch's) agrees to float32 accuracy only.
        f32 = getattr(fit_projector(g, 5, "std"), side)
        p32 = (f32.T @ f32 if side == "right" else f32 @ f32.T).numpy()
        assert 1e-10 < np.abs(p32 - want).max() <= 1e-4


def test_float64_svd_option_runs_close_to_float32_svd():
    # Until the second refresh the run does not depend on the singular vectors' signs, so the
    # float64 and float32 SVDs agree to float32 accuracy there. (After it they need not: the
    # moments carried over from the old basis meet gradients in a new basis whose signs are
    # LAPACK's choice; galore-torch keeps the moments across refreshes too.)
    mask = _mask()
    a = galore_adamw(lr=0.01, rank=RANK, update_proj_gap=GAP, galore_mask=mask, svd_dtype=None)
    b = galore_adamw(lr=0.01, rank=RANK, update_proj_gap=GAP, galore_mask=mask)
    steps = TALL["update_proj_gap"]
    _, pa, *_ = _run(a, None, torch.float64, steps=steps)
    _, pb, *_ = _run(b, None, torch.float64, steps=steps)
    for k in SHAPES:
        assert max_rel_err(pa[k], pb[k]) <= 1e-5


def test_reverse_std_wide_full_rank_projects_back_on_the_same_side():
    # galore-torch picks the side of its projection back from the low-rank shape and fails
    # here (8 x 20, rank 8, right projection); ours uses the side it projected on.
    opt = galore_adamw(lr=0.01, rank=8, update_proj_gap=2, proj_type="reverse_std")
    params = {"w": torch.randn(8, 20, dtype=torch.float64)}
    state = opt.init(params)
    u, state = opt.update({"w": torch.randn(8, 20, dtype=torch.float64)}, state, params)
    assert u["w"].shape == (8, 20) and state.inner.exp_avg["w"].shape == (8, 8)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(16, 16), "o_proj": nn.Linear(16, 16)})
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(16, 40), "down_proj": nn.Linear(40, 16)})
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 50, bias=False)


def test_galore_param_groups_by_name():
    cfgs = galore_param_groups(_Block(), rank=4, update_proj_gap=7,
                               overrides={r"mlp\.up": {"rank": 8}, r"o_proj": None})
    chosen = {k: v for k, v in cfgs.items() if v is not None}
    assert set(chosen) == {"self_attn.q_proj.weight", "mlp.up_proj.weight",
                           "mlp.down_proj.weight"}
    assert chosen["mlp.up_proj.weight"] == GaLoreConfig(8, 7, 0.25, "std")
    assert chosen["self_attn.q_proj.weight"] == GaLoreConfig(4, 7, 0.25, "std")
    # The tree drives the optimizer: per-leaf ranks give per-leaf low-rank state shapes.
    params = {k: v.detach() for k, v in _Block().named_parameters()}
    state = galore_adamw(galore_mask=cfgs).init(params).inner
    assert state.exp_avg["mlp.up_proj.weight"].shape == (40, 8)  # (40, 16): tall -> right
    assert state.exp_avg["mlp.down_proj.weight"].shape == (4, 40)  # (16, 40): wide -> left
    assert state.exp_avg["self_attn.q_proj.weight"].shape == (16, 4)
    assert state.exp_avg["embed.weight"].shape == (50, 16)
    assert state.projector["self_attn.o_proj.weight"] is None
    # Targets are regular expressions on the names; a too-large rank is caught by name.
    only_mlp = galore_param_groups(params, rank=4, targets=[r"^mlp\."])
    assert {k for k, v in only_mlp.items() if v is not None} == {"mlp.up_proj.weight",
                                                                "mlp.down_proj.weight"}
    with pytest.raises(ValueError, match="lm_head.weight"):
        galore_param_groups(params, rank=17, targets=["lm_head"])


def test_default_mask_is_every_matrix():
    params = {"w": torch.randn(6, 4), "b": torch.randn(4), "t": torch.randn(2, 3, 4)}
    inner = galore_adamw(rank=2).init(params).inner
    assert inner.projector["w"] is not None and inner.exp_avg["w"].shape == (6, 2)
    assert inner.projector["b"] is None and inner.projector["t"] is None


def test_state_is_a_pure_checkpointable_tree():
    opt = galore_adamw(lr=0.01, rank=RANK, update_proj_gap=GAP, galore_mask=_mask(),
                       eight_bit=True, min_8bit_size=16)
    gen = torch.Generator().manual_seed(7)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    state = opt.init(params)
    grads = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    u1, s1 = opt.update(grads, state, params)
    u2, s2 = opt.update(grads, state, params)  # same state twice: same result
    for a, b in zip(tree_leaves((u1, s1)), tree_leaves((u2, s2))):
        assert (a is None and b is None) or torch.equal(a, b)
    assert all(x is None or torch.is_tensor(x) for x in tree_leaves(s1))
    assert isinstance(s1.inner.exp_avg["sq"], Quantized)


class _Layout:
    def __init__(self, global_shape):
        self.global_shape = tuple(global_shape)

    def all_reduce(self, t, dims, op, purpose):
        return t


def test_sharded_projected_leaf_needs_a_funcpar_layout():
    # Tensor-parallel exactness is tests/test_galore_sharded.py's; a projected shard must come
    # with a funcpar Layout (to gather its gradient and shard the projector), and a bare
    # Reducible is refused clearly, before any compute.
    opt = galore_adamw(rank=2)
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    state = opt.init(params)
    grads = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    whole = {"w": _Layout((6, 4)), "b": _Layout((8,))}  # "b" sharded but unprojected: fine
    opt.update(grads, state, params, layouts=whole)
    with pytest.raises(TypeError, match="needs a funcpar Layout"):
        opt.update(grads, state, params, layouts={"w": _Layout((12, 4)), "b": None})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank"),
        (dict(rank=-2), "rank"),
        (dict(update_proj_gap=0), "update_proj_gap"),
        (dict(lr=-1e-3), "lr"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(-0.1, 0.999)), "betas"),
        (dict(proj_type="diagonal"), "proj_type"),
        (dict(scale=-1.0), "scale"),
        (dict(adam_variant="apex"), "adam_variant"),
        (dict(block_size=0), "block_size"),
        (dict(min_8bit_size=-1), "min_8bit_size"),
        (dict(svd_dtype=torch.float16), "svd_dtype"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        galore_adamw(**kwargs)


def test_validation_against_shapes():
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    with pytest.raises(ValueError, match=r"rank 5 exceeds min\(6, 4\) = 4 for leaf 'w'"):
        galore_adamw(rank=5).init(params)
    with pytest.raises(ValueError, match="'b'.*2-D"):
        galore_adamw(rank=2, galore_mask={"w": True, "b": True}).init(params)
    with pytest.raises(ValueError, match="rank"):
        galore_adamw(rank=2, galore_mask={"w": {"rank": 0}, "b": False}).init(params)
    with pytest.raises(ValueError, match="unknown keys"):
        galore_adamw(galore_mask={"w": {"rnak": 2}, "b": False}).init(params)
    with pytest.raises(TypeError, match="galore_mask"):
        galore_adamw(galore_mask={"w": 3, "b": False}).init(params)
    with pytest.raises(ValueError, match="rank"):
        galore_adafactor(rank=0)
    with pytest.raises(ValueError, match="relative_step"):
        galore_adafactor(lr=1e-2, rank=2)
    with pytest.raises(ValueError, match="rank 5 exceeds"):
        galore_adafactor(rank=5).init(params)


def test_trained_state_for_other_layouts_is_refused():
    # A (4, 8) leaf split on its columns over tp=2: the shard (4, 4) is "tall", the whole leaf
    # "wide", so "std" projects the shard's state on another side than the leaf's. A fresh
    # state (count 0) is rebuilt by the first update (tests/test_galore_sharded.py); a trained
    # one is refused before any compute or collective (the virtual mesh cannot communicate).
    from funcpar.shard.layout import Layout, Shard
    from funcpar.shard.mesh import DeviceMesh

    lay = Layout(DeviceMesh.virtual(rank=0, tp=2), (4, 8), {"tp": Shard(1)}, name="w")
    opt = galore_adamw(rank=2)
    params = {"w": torch.randn(4, 4)}
    _, state = opt.update({"w": torch.randn(4, 4)}, opt.init(params), params)
    with pytest.raises(ValueError, match="shaped for other layouts"):
        opt.update({"w": torch.randn(4, 4)}, state, params, layouts={"w": lay})
