"""adafactor against transformers' Adafactor, adafactor_torch against torch.optim.Adafactor, and
the per-leaf function against galore-torch's GaLoreAdafactor; step by step, params and every
state tensor by name.

The harness here (run_lockstep) is also used by test_came.py.
"""

import math

import pytest
import torch
from conftest import max_rel_err
from transformers.optimization import Adafactor as HFAdafactor

import funcpar.optim as fo
from funcpar.optim.adafactor import (
    adafactor,
    adafactor_leaf_init,
    adafactor_leaf_update,
)
from funcpar.optim.adafactor_torch import adafactor_torch
from funcpar.optim.masks import matrices_only

# Square, non-square, 1-D, 3-D, single-element and 0-d leaves: every reference handles 0-d.
SHAPES = {"square": (6, 6), "rect": (5, 8), "vec": (7,), "cube": (3, 4, 5), "one": (1,),
          "scalar": ()}
STEPS = 12
# The brief's bounds. The operation order (including which adds are fused and which scalars
# are rounded to the leaf's dtype) follows the references, so the measured errors are far
# below: 0 to a few 1e-16 in float64, 0 to 1e-9 in float32.
TOL = {torch.float64: 1e-10, torch.float32: 1e-6}
# Reference bookkeeping that is not a statistic: our count is global and RMS(param) is
# recomputed each step.
BOOKKEEPING = {"step", "RMS"}


def compare(params, stats, theirs_p, theirs_state):
    """Max relative error over params and every reference state tensor, matched by name."""
    worst = 0.0
    for name, p in theirs_p.items():
        assert params[name].dtype == p.dtype, name
        worst = max(worst, max_rel_err(params[name], p.detach()))
        ref = {k: v for k, v in theirs_state[p].items() if k not in BOOKKEEPING}
        assert sorted(stats[name]) == sorted(ref), (name, sorted(stats[name]), sorted(ref))
        for key, v in ref.items():
            assert stats[name][key].dtype == v.dtype, (name, key)
            worst = max(worst, max_rel_err(stats[name][key], v))  # asserts equal shapes
    return worst


def run_lockstep(ours, make_theirs, *, dtype, shapes=SHAPES, steps=STEPS, zeros=False,
                 before_step=None, seed=0):
    """Run ``ours`` and a torch.optim reference on the same fresh random gradients each step."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: (torch.zeros(s, dtype=dtype) if zeros else
                  torch.randn(s, generator=gen, dtype=dtype)) for k, s in shapes.items()}
    theirs_p = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    theirs = make_theirs(theirs_p)
    state = ours.init(params)
    worst = 0.0
    for i in range(steps):
        grads = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
        updates, state = ours.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        for k, p in theirs_p.items():
            p.grad = grads[k].clone()
        if before_step is not None:
            before_step(theirs, i)
        theirs.step()
        worst = max(worst, compare(params, state.inner.stats, theirs_p, theirs.state))
    # Guard against a vacuous comparison: the parameters must actually have moved.
    assert any(not torch.equal(p.detach(), q) for p, q in
               zip(theirs_p.values(), (torch.zeros(s, dtype=dtype) for s in shapes.values())))
    return worst


HF_CONFIGS = [
    dict(),
    dict(warmup_init=True),
    dict(relative_step=False, lr=1e-2, scale_parameter=False),
    dict(relative_step=False, lr=3e-2, beta1=0.9, weight_decay=0.1),
    dict(beta1=0.8, weight_decay=0.05, clip_threshold=0.5),
    dict(scale_parameter=False, clip_threshold=100.0, decay_rate=-0.5, eps=(1e-20, 1e-2)),
    dict(relative_step=False, lr=1e-2, scale_parameter=False, beta1=0.0, weight_decay=0.2),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kwargs", HF_CONFIGS)
def test_adafactor_matches_transformers(kwargs, dtype):
    err = run_lockstep(adafactor(**kwargs), lambda ps: HFAdafactor(list(ps.values()), **kwargs),
                       dtype=dtype)
    assert err <= TOL[dtype]


@pytest.mark.parametrize("kwargs", [dict(), dict(relative_step=False, lr=1e-2, beta1=0.9)])
def test_adafactor_zero_init_uses_eps2(kwargs):
    # RMS(W) = 0 at first: the step size is eps2 * rho_t (the other branch of the max).
    err = run_lockstep(adafactor(**kwargs), lambda ps: HFAdafactor(list(ps.values()), **kwargs),
                       dtype=torch.float64, zeros=True)
    assert err <= TOL[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adafactor_weight_decay_mask_matches_param_groups(dtype):
    kw = dict(relative_step=False, lr=2e-2, beta1=0.9)

    def theirs(ps):
        groups = [
            {"params": [p for p in ps.values() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps.values() if p.dim() < 2], "weight_decay": 0.0},
        ]
        return HFAdafactor(groups, **kw)

    ours = adafactor(**kw, weight_decay=0.1, weight_decay_mask=matrices_only)
    assert run_lockstep(ours, theirs, dtype=dtype) <= TOL[dtype]


def test_adafactor_lr_schedule_matches_changing_group_lr():
    # The count arrives as an int64 tensor (an int when validated): in float64, 0.8**count is
    # what Python computes to an ulp.
    def sched(count):
        return 2e-2 * 0.8 ** torch.as_tensor(count, dtype=torch.float64)

    def set_lr(theirs, i):
        theirs.param_groups[0]["lr"] = 2e-2 * 0.8**i

    kw = dict(relative_step=False, weight_decay=0.1)
    err = run_lockstep(adafactor(lr=sched, **kw),
                       lambda ps: HFAdafactor(list(ps.values()), lr=1.0, **kw),
                       dtype=torch.float64, before_step=set_lr)
    assert err <= TOL[torch.float64]


TORCH_CONFIGS = [
    dict(),
    dict(lr=5e-3, weight_decay=0.1),
    dict(eps=(1e-6, 1e-2), d=2.0, beta2_decay=-0.5),
    dict(lr=0.5, maximize=True, weight_decay=0.01),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kwargs", TORCH_CONFIGS)
def test_adafactor_torch_matches_torch(kwargs, dtype):
    err = run_lockstep(adafactor_torch(**kwargs),
                       lambda ps: torch.optim.Adafactor(list(ps.values()), **kwargs),
                       dtype=dtype)
    assert err <= TOL[dtype]


def test_adafactor_torch_zero_init():
    err = run_lockstep(adafactor_torch(weight_decay=0.1),
                       lambda ps: torch.optim.Adafactor(list(ps.values()), weight_decay=0.1),
                       dtype=torch.float64, zeros=True)
    assert err <= TOL[torch.float64]


# ---- the per-leaf function, as GaLore uses it ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(relative_step=False, lr=1e-2, beta1=0.9, weight_decay=0.1),
     dict(beta1=0.5, weight_decay=0.05, warmup_init=True)],
)
def test_leaf_update_reproduces_galore_adafactor(kwargs, dtype):
    """Project the gradient, run adafactor_leaf_update on the projection, project back, decay:
    exactly galore_torch.GaLoreAdafactor (the low-rank gradient has another shape than W)."""
    from galore_torch import GaLoreAdafactor
    from galore_torch.galore_projector import GaLoreProjector

    rank, gap, scale = 3, 4, 0.5
    gen = torch.Generator().manual_seed(3)
    shapes = {"tall": (8, 6), "wide": (5, 9)}  # right and left projections
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    theirs_p = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    theirs = GaLoreAdafactor([{"params": list(theirs_p.values()), "rank": rank,
                               "update_proj_gap": gap, "scale": scale, "proj_type": "std"}],
                             **kwargs)
    wd = kwargs.get("weight_decay", 0.0)
    hp = {k: v for k, v in kwargs.items() if k != "weight_decay"}
    projectors = {k: GaLoreProjector(rank, update_proj_gap=gap, scale=scale, proj_type="std")
                  for k in shapes}
    states = {}
    worst = 0.0
    for i in range(STEPS):
        grads = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
        for k in shapes:
            low = projectors[k].project(grads[k], i)
            assert low.shape != params[k].shape
            if k not in states:
                states[k] = adafactor_leaf_init(low.shape, dtype=low.dtype,
                                                beta1=hp.get("beta1"))
            out = adafactor_leaf_update(low, params[k], states[k], torch.tensor(i + 1), **hp)
            states[k] = out.state
            decayed = params[k] - (wd * out.step_size).to(dtype) * params[k]
            params[k] = decayed - projectors[k].project_back(out.update)
            theirs_p[k].grad = grads[k].clone()
        theirs.step()
        ref_state = {p: {n: v for n, v in theirs.state[p].items() if n != "projector"}
                     for p in theirs_p.values()}
        worst = max(worst, compare(params, states, theirs_p, ref_state))
    assert worst <= TOL[dtype]


def test_leaf_update_is_pure_and_state_keys():
    g = torch.randn(4, 5, dtype=torch.float64)
    p = torch.randn(4, 5, dtype=torch.float64)
    st = adafactor_leaf_init(g.shape, dtype=g.dtype, beta1=0.9)
    assert sorted(st) == ["exp_avg", "exp_avg_sq_col", "exp_avg_sq_row"]
    before = {k: v.clone() for k, v in st.items()}
    a = adafactor_leaf_update(g, p, st, torch.tensor(1), beta1=0.9)
    b = adafactor_leaf_update(g, p, st, torch.tensor(1), beta1=0.9)
    assert all(torch.equal(st[k], before[k]) for k in st)
    assert torch.equal(a.update, b.update) and a.update.shape == g.shape
    assert a.step_size.dtype == torch.float64 and a.step_size.dim() == 0
    # Step 1 with relative_step: alpha = max(eps2, RMS(p)) * min(1e-2, 1).
    rms_p = p.norm() / math.sqrt(p.numel())
    assert torch.allclose(a.step_size, rms_p * 1e-2, rtol=1e-15)
    assert sorted(adafactor_leaf_init((7,), dtype=torch.float32)) == ["exp_avg_sq"]
    with pytest.raises(KeyError, match="exp_avg"):
        adafactor_leaf_update(g, p, adafactor_leaf_init(g.shape, dtype=g.dtype), torch.tensor(1),
                              beta1=0.9)


# ---- memory, validation, layouts ---------------------------------------------------------------


def _bytes(d):
    return sum(v.numel() * v.element_size() for v in d.values())


def test_factored_state_is_rows_plus_cols():
    params = {"w": torch.zeros(300, 500), "t": torch.zeros(4, 30, 50), "b": torch.zeros(500)}
    for opt in (adafactor(), adafactor_torch()):
        stats = opt.init(params).inner.stats
        assert _bytes(stats["w"]) == (300 + 500) * 4
        assert _bytes(stats["t"]) == (4 * 30 + 4 * 50) * 4
        assert _bytes(stats["b"]) == 500 * 4
    stats = adafactor().init(params).inner.stats
    assert stats["t"]["exp_avg_sq_row"].shape == (4, 30)
    assert stats["t"]["exp_avg_sq_col"].shape == (4, 50)
    stats = adafactor(beta1=0.9).init(params).inner.stats
    assert _bytes(stats["w"]) == (300 + 500 + 300 * 500) * 4
    # Below the threshold a leaf keeps a full second moment.
    stats = adafactor(min_dim_size_to_factor=400).init(params).inner.stats
    assert sorted(stats["w"]) == ["exp_avg_sq"] and _bytes(stats["w"]) == 300 * 500 * 4
    assert sorted(adafactor(min_dim_size_to_factor=30).init(params).inner.stats["t"]) == [
        "exp_avg_sq_col", "exp_avg_sq_row"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: adafactor(lr=1e-3), "relative_step"),
        (lambda: adafactor(relative_step=False), "lr is required"),
        (lambda: adafactor(relative_step=False, lr=1e-3, warmup_init=True), "warmup_init"),
        (lambda: adafactor(relative_step=False, lr=-1.0), "lr"),
        (lambda: adafactor(eps=(0.0, 1e-3)), "eps"),
        (lambda: adafactor(eps=(1e-30,)), "pair"),
        (lambda: adafactor(eps=(1e-30, -1.0)), "eps"),
        (lambda: adafactor(eps=(1e-30, 0.0)), r"eps\[1\] must be finite and > 0, got 0.0"),
        (lambda: adafactor(eps=(-1e-30, 1e-3)), r"eps\[0\] must be finite and > 0, got -1e-30"),
        (lambda: adafactor(clip_threshold=0.0), "clip_threshold"),
        (lambda: adafactor(decay_rate=0.5), "decay_rate"),
        (lambda: adafactor(beta1=1.0), "beta1"),
        (lambda: adafactor(beta1=-0.1), "beta1"),
        (lambda: adafactor(weight_decay=-0.1), "weight_decay"),
        (lambda: adafactor(min_dim_size_to_factor=-1), "min_dim_size_to_factor"),
        (lambda: adafactor_torch(lr=-1.0), "lr"),
        (lambda: adafactor_torch(beta2_decay=0.1), "beta2_decay"),
        (lambda: adafactor_torch(eps=(0.0, 1e-3)), "eps"),
        (lambda: adafactor_torch(eps=(None, -1.0)), "eps"),
        (lambda: adafactor_torch(eps=(None, 0.0)), r"eps\[1\] must be finite and > 0"),
        (lambda: adafactor_torch(lr=-0.5), "adafactor_torch: lr must be finite and >= 0, got -0.5"),
        (lambda: adafactor_torch(d=0.5), "clipping threshold"),
        (lambda: adafactor_torch(weight_decay=-1.0), "weight_decay"),
    ],
)
def test_hyperparameter_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_beta1_schedule_rejected():
    with pytest.raises(TypeError, match="beta1"):
        adafactor(beta1=lambda c: 0.9)


class RecordingLayout:
    """A whole leaf seen through the layout protocol: records each reduction it is asked for."""

    def __init__(self, shape):
        self.global_shape = tuple(shape)
        self.calls = []

    def all_reduce(self, t, dims, op, purpose):
        self.calls.append((purpose, tuple(dims), op))
        return t


@pytest.mark.parametrize("name", ["adafactor", "adafactor_torch", "came"])
def test_every_reduction_goes_through_the_layout(name):
    from funcpar.optim.came import came

    make = {"adafactor": lambda: adafactor(beta1=0.9, weight_decay=0.1),
            "adafactor_torch": lambda: adafactor_torch(weight_decay=0.1),
            "came": lambda: came(lr=1e-2, weight_decay=0.1)}[name]
    gen = torch.Generator().manual_seed(5)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    layouts = {k: RecordingLayout(s) for k, s in SHAPES.items()}
    opt = make()
    state = opt.init(params)
    u_plain, _ = opt.update(grads, state, params)
    u_laid, _ = opt.update(grads, state, params, layouts=layouts)
    for k in SHAPES:
        assert max_rel_err(u_laid[k], u_plain[k]) <= 1e-12
    purposes = {p for p, _, _ in layouts["rect"].calls}
    expected = {"factored row mean", "factored column mean", "update rms"}
    expected |= {"factored mean of row stats"} if name != "adafactor_torch" else set()
    expected |= {"param rms"} if name != "came" else set()
    assert expected <= purposes, purposes
    # A row mean reduces the leaf's last dim, a column mean its second-last.
    cube = {p: d for p, d, _ in layouts["cube"].calls}
    assert cube["factored row mean"] == (2,) and cube["factored column mean"] == (1,)


def _adafactor_torch_messages() -> int:
    """On a rank of tp2: the optimizer's own all-reduces in one training step of
    adafactor_torch (not clipping's global norm, not the gradients')."""
    from funcpar.shard.comm import comm_log
    from funcpar.testing import reference

    step, state = reference.build(2, 1, "adafactor_torch")
    with comm_log.capture() as recs:
        step(state, reference.batches()[0])
    return sum(1 for r in recs if "rms" in r.purpose or "factored" in r.purpose)


def test_adafactor_torch_batches_its_reductions_per_phase():
    """adafactor_torch's per-leaf step runs as phases in lockstep over all leaves
    (funcpar.shard.reduce.run_phased): on tp2 one all-reduce per phase - the parameter's RMS
    with the row and column means, the row factor's mean, the update's RMS - where reducing
    leaf by leaf sent 60 (docs/DISTRIBUTED_OPTIM.md). Its results under every layout are the
    distributed matrix's (tests/test_distributed_optim.py)."""
    from funcpar.testing import run_ranks

    assert run_ranks(_adafactor_torch_messages, 2, timeout=300) == [3, 3]
