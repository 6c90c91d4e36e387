"""lamb step by step against torch_optimizer.Lamb, pytorch_optimizer.Lamb and torch.optim.AdamW,
and against the paper's equations written out here."""

import itertools
import math

import pytest
import pytorch_optimizer
import torch
import torch_optimizer
from conftest import max_rel_err

import funcpar.optim as fo
from funcpar.optim.lamb import _trust_ratio, _trust_ratio_host, lamb

# "zero" starts at 0 (||w|| = 0: trust ratio 1 at step 1); "nograd" only ever gets zero
# gradients (||a|| = 0 without decay); "big" has ||w|| > 10, so the references' clamp acts.
SHAPES = {"w": (5, 7), "sq": (4, 4), "b": (7,), "s": (), "t": (2, 3, 4), "one": (1,),
          "zero": (6,), "nograd": (3,), "big": (8, 8)}
STEPS = 12
# float64, same operations up to reassociation: a few ulp; 1e-10 leaves room for the norms'
# different summation order over 12 steps.
TOL64 = 1e-10


def _params(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    p = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}
    p["zero"] = torch.zeros(SHAPES["zero"], dtype=dtype)
    p["big"] = 3 * p["big"]
    return p


def _grads(gen, dtype):
    g = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
    g["nograd"] = torch.zeros(SHAPES["nograd"], dtype=dtype)
    return g


def _run(ours, theirs_factory, dtype=torch.float64):
    """Run both for STEPS random full-rank gradients; return the max param error and states."""
    params = _params(dtype)
    state = ours.init(params)
    theirs_p = {k: v.clone().requires_grad_() for k, v in params.items()}
    theirs = theirs_factory(list(theirs_p.values()))
    gen = torch.Generator().manual_seed(2)
    err = 0.0
    for _ in range(STEPS):
        grads = _grads(gen, dtype)
        updates, state = ours.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        for k, p in theirs_p.items():
            p.grad = grads[k].clone()
        theirs.step()
        for k in SHAPES:
            err = max(err, max_rel_err(params[k], theirs_p[k].detach()))
    return err, state.inner, theirs, theirs_p


def _check_states(inner, theirs, theirs_p, *, trust_ratio=True):
    errs = {}
    for k, p in theirs_p.items():
        ref = theirs.state[p]
        errs[f"{k}.exp_avg"] = max_rel_err(inner.exp_avg[k], ref["exp_avg"])
        errs[f"{k}.exp_avg_sq"] = max_rel_err(inner.exp_avg_sq[k], ref["exp_avg_sq"])
        if trust_ratio:
            r = torch.as_tensor(ref["trust_ratio"], dtype=inner.trust_ratio[k].dtype).reshape(())
            errs[f"{k}.trust_ratio"] = max_rel_err(inner.trust_ratio[k], r)
    bad = {k: e for k, e in errs.items() if not e <= TOL64}
    assert not bad, bad
    return max(errs.values())


@pytest.mark.parametrize(
    "ours_kw, theirs_kw",
    [
        (dict(), dict()),
        (dict(weight_decay=0.1), dict(weight_decay=0.1)),
        (dict(bias_correction="step_size", max_weight_norm=1.5, weight_decay=0.05),
         dict(debias=True, clamp_value=1.5, weight_decay=0.05)),
        (dict(adam=True, weight_decay=0.1), dict(adam=True, weight_decay=0.1)),
        (dict(betas=(0.8, 0.99), eps=1e-4, bias_correction="step_size"),
         dict(betas=(0.8, 0.99), eps=1e-4, debias=True)),
    ],
)
def test_matches_torch_optimizer(ours_kw, theirs_kw):
    ours = lamb(lr=0.02, variant="torch_optimizer", **ours_kw)
    err, inner, theirs, tp = _run(
        ours, lambda ps: torch_optimizer.Lamb(ps, lr=0.02, **theirs_kw)
    )
    assert err <= TOL64
    _check_states(inner, theirs, tp)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(
    "ours_kw, theirs_kw",
    [
        (dict(), dict()),
        (dict(weight_decay=0.1), dict(weight_decay=0.1)),
        (dict(weight_decay=0.1, weight_decay_mode="in_update", grad_averaging=False),
         dict(weight_decay=0.1, weight_decouple=False, grad_averaging=False)),
        (dict(adam=True, weight_decay=0.05, eps=1e-3),
         dict(adam=True, weight_decay=0.05, eps=1e-3)),
    ],
)
def test_matches_pytorch_optimizer(ours_kw, theirs_kw, foreach):
    ours = lamb(lr=0.02, variant="pytorch_optimizer", **ours_kw)
    err, inner, theirs, tp = _run(
        ours, lambda ps: pytorch_optimizer.Lamb(ps, lr=0.02, foreach=foreach, **theirs_kw)
    )
    assert err <= TOL64
    _check_states(inner, theirs, tp)


def test_colossalai_variant_is_torch_optimizer_debiased_unclamped():
    # Colossal-AI's DistributedLamb (not installed here) is, operation for operation,
    # torch_optimizer.Lamb(debias=True) without the weight-norm clamp.
    ours = lamb(lr=0.02, weight_decay=0.1, variant="colossalai")
    err, inner, theirs, tp = _run(
        ours,
        lambda ps: torch_optimizer.Lamb(ps, lr=0.02, weight_decay=0.1, debias=True,
                                        clamp_value=1e30),
    )
    assert err <= TOL64
    _check_states(inner, theirs, tp)


def test_default_adam_mode_is_adamw():
    # With trust ratio 1, a = m_hat/(sqrt(v_hat)+eps) + wd w and w <- w - lr a is AdamW.
    ours = lamb(lr=0.02, weight_decay=0.1, adam=True, eps=1e-8)
    err, inner, theirs, tp = _run(
        ours, lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1, eps=1e-8)
    )
    assert err <= TOL64
    _check_states(inner, theirs, tp, trust_ratio=False)


@pytest.mark.parametrize("max_trust_ratio", [None, 0.5])
def test_default_variant_matches_paper_equations(max_trust_ratio):
    """Algorithm 2 of the paper with bias-corrected moments, written out independently."""
    lr, (b1, b2), eps, wd = 0.02, (0.9, 0.999), 1e-6, 0.1
    ours = lamb(lr=lr, weight_decay=wd, max_trust_ratio=max_trust_ratio)
    params = _params()
    state = ours.init(params)
    ref = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in ref.items()}
    v = {k: torch.zeros_like(x) for k, x in ref.items()}
    gen = torch.Generator().manual_seed(2)
    for t in range(1, STEPS + 1):
        grads = _grads(gen, torch.float64)
        updates, state = ours.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        for k, x in ref.items():
            g = grads[k]
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            r = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps) + wd * x
            wn, rn = float(x.norm()), float(r.norm())
            tau = wn / rn if wn > 0 and rn > 0 else 1.0
            if max_trust_ratio is not None:
                tau = min(tau, max_trust_ratio)
            ref[k] = x - lr * tau * r
            want = torch.tensor(tau, dtype=x.dtype)
            assert max_rel_err(state.inner.trust_ratio[k], want) <= TOL64
        for k in SHAPES:
            assert max_rel_err(params[k], ref[k]) <= TOL64, k
    # Only decay moves "nograd": a = wd * w, so tau = ||w|| / ||wd w|| = 1 / wd (or the clamp).
    want = 1 / wd if max_trust_ratio is None else max_trust_ratio
    assert abs(float(state.inner.trust_ratio["nograd"]) - want) <= 1e-12


def test_trust_ratio_edge_cases():
    # ||w|| = 0 ("zero" at step 1) and ||a|| = 0 ("nograd" without decay): trust ratio 1.
    params = _params()
    opt = lamb(lr=0.02)
    state = opt.init(params)
    grads = _grads(torch.Generator().manual_seed(3), torch.float64)
    updates, state = opt.update(grads, state, params)
    assert float(state.inner.trust_ratio["zero"]) == 1.0
    assert float(state.inner.trust_ratio["nograd"]) == 1.0
    assert torch.equal(updates["nograd"], torch.zeros(SHAPES["nograd"], dtype=torch.float64))
    # The first step of a zero leaf is plain Adam's: -lr * m_hat / (sqrt(v_hat) + eps).
    g = grads["zero"]
    assert max_rel_err(updates["zero"], -0.02 * g / (g.abs() + 1e-6)) <= 1e-14


def test_host_trust_ratio_is_the_tensor_one():
    """The eager path's host arithmetic (_trust_ratio_host) against _trust_ratio's 0-d tensor
    operations: the same value and dtype, bit for bit, on zeros, signed zeros, subnormals, the
    clamps' edges, overflowing quotients, inf and NaN, with eps a number or a 0-d tensor of
    either dtype (a float64 one promotes a float32 ratio)."""
    values = [0.0, -0.0, 1e-45, 1e-40, 2.5e-8, 0.1, 1.0, 2.0 / 3.0, 9.999999, 10.0, 10.000001,
              1e20, 3.3e38, float("inf"), float("nan")]
    for dtype, eps, mwn, mtr, in_ratio in itertools.product(
            (torch.float32, torch.float64),
            (1e-6, 0.1, torch.tensor(1e-6, dtype=torch.float64),
             torch.tensor(0.3, dtype=torch.float32)),
            (None, 0.3), (None, 0.7), (False, True)):
        opts = dict(max_weight_norm=mwn, max_trust_ratio=mtr, eps_in_trust_ratio=in_ratio)
        for w, a in itertools.product(values, values):
            w, a = torch.tensor(w, dtype=dtype), torch.tensor(a, dtype=dtype)
            want = _trust_ratio(w, a, eps, **opts)
            got, number = _trust_ratio_host(w, a, eps, **opts)
            case = (dtype, eps, opts, w, a, want, got)
            assert got.dtype == want.dtype, case
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), case
            assert number == float(want) or (math.isnan(number) and want.isnan()), case


@pytest.mark.parametrize(
    "variant, theirs",
    [
        ("torch_optimizer", lambda ps: torch_optimizer.Lamb(ps, lr=0.02, weight_decay=0.1)),
        ("pytorch_optimizer",
         lambda ps: pytorch_optimizer.Lamb(ps, lr=0.02, weight_decay=0.1, foreach=False)),
    ],
)
def test_float32_matches_references(variant, theirs):
    # float32: the references' scalar arithmetic is in double, ours in 0-d float64 tensors
    # cast to float32 at the multiply: agreement to float32 rounding.
    ours = lamb(lr=0.02, weight_decay=0.1, variant=variant)
    err, *_ = _run(ours, theirs, dtype=torch.float32)
    assert err <= 1e-6


def test_weight_decay_mask_and_schedule():
    # Decay only on matrices, lr from a schedule: the same as two references, one per group.
    mask = fo.matrices_only
    ours = lamb(lr=lambda step: 0.02, weight_decay=0.1, variant="torch_optimizer",
                weight_decay_mask=mask)
    params = _params()
    names = list(SHAPES)

    def factory(ps):
        decayed = [p for k, p in zip(names, ps) if params[k].dim() >= 2]
        rest = [p for k, p in zip(names, ps) if params[k].dim() < 2]
        return torch_optimizer.Lamb([{"params": decayed, "weight_decay": 0.1},
                                     {"params": rest, "weight_decay": 0.0}], lr=0.02)

    err, inner, theirs, tp = _run(ours, factory)
    assert err <= TOL64
    _check_states(inner, theirs, tp)


class _RecordingLayout:
    """A layout of a whole tensor that records which reductions asked for a collective."""

    def __init__(self, shape, log):
        self.global_shape = tuple(shape)
        self.log = log

    def all_reduce(self, t, dims, op, purpose):
        self.log.append(purpose)
        return t


def test_norms_go_through_the_layout():
    params = _params()
    log = []
    layouts = {k: _RecordingLayout(v.shape, log) for k, v in params.items()}
    opt = lamb(lr=0.02, weight_decay=0.1)
    s1 = s2 = opt.init(params)
    grads = _grads(torch.Generator().manual_seed(3), torch.float64)
    u1, s1 = opt.update(grads, s1, params, layouts=layouts)
    u2, s2 = opt.update(grads, s2, params)
    n_nonscalar = sum(1 for v in params.values() if v.dim() > 0)
    assert sorted(set(log)) == ["lamb update norm", "lamb weight norm"]
    assert len(log) == 2 * n_nonscalar
    for k in SHAPES:
        assert max_rel_err(u1[k], u2[k]) <= 1e-14


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(betas=(1.0, 0.999)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(variant="apex"), "variant"),
        (dict(bias_correction="sometimes"), "bias_correction"),
        (dict(weight_decay_mode="l2"), "weight_decay_mode"),
        (dict(max_weight_norm=0.0), "max_weight_norm"),
        (dict(max_trust_ratio=-1.0), "max_trust_ratio"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lamb(**kwargs)


def test_state_is_a_tree_of_tensors():
    params = _params()
    state = lamb().init(params)
    inner = state.inner
    assert set(inner._fields) == {"count", "exp_avg", "exp_avg_sq", "trust_ratio"}
    for k, p in params.items():
        assert inner.exp_avg[k].shape == p.shape and inner.exp_avg_sq[k].shape == p.shape
        assert inner.trust_ratio[k].shape == ()
    with pytest.raises(TypeError, match="dtype"):
        lamb().init({"i": torch.zeros(3, dtype=torch.int64)})
