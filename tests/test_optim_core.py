"""sgd and adamw step by step against torch.optim, plus the optimizer plumbing."""

import math

import optree
import pytest
import torch
from conftest import max_rel_err

import funcpar.optim as fo

# Leaves of several ranks, a scalar and a 3-D one: a state bug tied to a shape shows here.
SHAPES = {"w": (5, 7), "sq": (4, 4), "b": (7,), "s": (), "t": (2, 3, 4), "one": (1,)}
STEPS = 12
# float64 with identical operation order up to reassociation: errors are a few ulp (~1e-15).
TOL64 = 1e-12


def _params(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


def _run_pair(ours, make_theirs, *, clip=None, dtype=torch.float64, names_to_state=None):
    params = _params(dtype)
    state = ours.init(params)
    theirs_p = {k: v.clone().requires_grad_() for k, v in params.items()}
    theirs = make_theirs(list(theirs_p.values()))
    g = torch.Generator().manual_seed(2)
    err = 0.0
    for _ in range(STEPS):
        grads = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}
        updates, state = ours.update(grads, state, params)
        params = fo.apply_updates(params, updates)
        for k, p in theirs_p.items():
            p.grad = grads[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(theirs_p.values()), clip)
        theirs.step()
        for k in SHAPES:
            err = max(err, max_rel_err(params[k], theirs_p[k].detach()))
    return params, state, theirs, theirs_p, err


def _inner(state):
    """The optimizer's own state under its HyperState."""
    return state.inner


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.05),
        dict(lr=0.05, momentum=0.9),
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
        dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
        dict(lr=0.05, momentum=0.9, maximize=True),
    ],
)
def test_sgd_matches_torch(kwargs):
    _p, state, theirs, theirs_p, err = _run_pair(
        fo.sgd(**kwargs), lambda ps: torch.optim.SGD(ps, **kwargs)
    )
    assert err <= TOL64
    if kwargs.get("momentum"):
        for k, p in theirs_p.items():
            ref = theirs.state[p]["momentum_buffer"]
            assert max_rel_err(_inner(state).momentum_buffer[k], ref) <= TOL64, k
    else:
        assert all(b is None for b in _inner(state).momentum_buffer.values())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.01),
        dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6),
        dict(lr=0.01, weight_decay=0.05, amsgrad=True),
        dict(lr=0.01, maximize=True),
    ],
)
def test_adamw_matches_torch(kwargs):
    _p, state, theirs, theirs_p, err = _run_pair(
        fo.adamw(**kwargs), lambda ps: torch.optim.AdamW(ps, **kwargs)
    )
    assert err <= TOL64
    inner = _inner(state)
    assert int(inner.count) == STEPS
    for k, p in theirs_p.items():
        ref = theirs.state[p]
        assert max_rel_err(inner.exp_avg[k], ref["exp_avg"]) <= TOL64, k
        assert max_rel_err(inner.exp_avg_sq[k], ref["exp_avg_sq"]) <= TOL64, k
        if kwargs.get("amsgrad"):
            assert max_rel_err(inner.max_exp_avg_sq[k], ref["max_exp_avg_sq"]) <= TOL64, k


def test_adamw_float32_matches_torch():
    # float32: the same operations rounded to 24 bits; 1e-6 leaves room for ~10 ulp drift.
    *_, err = _run_pair(
        fo.adamw(lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        dtype=torch.float32,
    )
    assert err <= 1e-6


def test_clip_then_adamw_matches_torch():
    # Gradients of norm ~5 clipped to 0.5: the clip is active on every step.
    *_, err = _run_pair(
        fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=0.01, weight_decay=0.1)),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        clip=0.5,
    )
    assert err <= TOL64


def test_global_norm():
    tree = {"a": torch.tensor([3.0, 0.0]), "b": {"c": torch.tensor(4.0)}}
    assert float(fo.global_norm(tree)) == pytest.approx(5.0)


def test_weight_decay_mask_predicate_and_tree():
    params = _params()
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    for mask in (fo.matrices_only, {k: v.dim() >= 2 for k, v in params.items()}):
        opt = fo.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask=mask)
        updates, _ = opt.update(grads, opt.init(params), params)
        for k, p in params.items():
            expected = -0.1 * 0.5 * p if p.dim() >= 2 else torch.zeros_like(p)
            torch.testing.assert_close(updates[k], expected, rtol=1e-12, atol=1e-15)


def test_mask_errors():
    params = _params()
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    opt = fo.sgd(lr=0.1, weight_decay=0.1, weight_decay_mask=lambda n, p: 1)
    with pytest.raises(TypeError, match="expected bool"):
        opt.update(grads, opt.init(params), params)
    opt = fo.sgd(lr=0.1, weight_decay=0.1, weight_decay_mask={"w": True})
    with pytest.raises(ValueError, match="weight_decay_mask"):
        opt.update(grads, opt.init(params), params)


def test_schedules():
    s = fo.warmup_cosine(1.0, warmup_steps=4, decay_steps=14, init=0.0, end=0.1)
    vals = [float(s(t)) for t in range(20)]
    assert vals[0] == 0.0 and vals[2] == pytest.approx(0.5) and vals[4] == pytest.approx(1.0)
    assert vals[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert vals[14] == pytest.approx(0.1) and vals[19] == pytest.approx(0.1)
    assert float(fo.cosine(2.0, 10)(torch.tensor(5))) == pytest.approx(1.0)
    assert float(fo.linear_warmup(1.0, 0)(3)) == 1.0
    assert float(fo.constant(0.3)(100)) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="decay_steps"):
        fo.warmup_cosine(1.0, 10, 5)
    with pytest.raises(ValueError, match="peak"):
        fo.cosine(-1.0, 10)


def test_scheduled_lr_matches_torch_lambda_lr():
    sched = fo.warmup_cosine(0.02, warmup_steps=3, decay_steps=10)

    def make(ps):
        opt = torch.optim.AdamW(ps, lr=1.0)
        lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: float(sched(t)))
        class Stepper:
            def step(self):
                opt.step()
                lam.step()
        return Stepper()

    *_, err = _run_pair(fo.adamw(lr=sched), make)
    assert err <= TOL64


def test_set_hyperparams_changes_lr_between_steps():
    params = _params()
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=0.01))
    state = opt.init(params)
    assert float(fo.get_hyperparams(state)["lr"]) == pytest.approx(0.01)
    state = fo.set_hyperparams(state, lr=0.0)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    updates, state = opt.update(grads, state, params)
    # lr 0 and weight decay scaled by lr: nothing moves, but the moments did update.
    assert all(float(u.abs().max()) == 0.0 for u in updates.values())
    assert float(fo.get_hyperparams(state)["lr"]) == 0.0
    with pytest.raises(KeyError, match="momentum"):
        fo.set_hyperparams(state, momentum=0.9)
    with pytest.raises(ValueError, match="lr"):
        fo.set_hyperparams(state, lr=-1.0)


def test_accumulate_equals_big_batch():
    # k micro-steps of mean gradients == one step on their mean.
    params = _params()
    g = torch.Generator().manual_seed(3)
    micro = [{k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
             for _ in range(3)]
    acc = fo.accumulate(fo.adamw(lr=0.01, weight_decay=0.1), every=3)
    st = acc.init(params)
    p = params
    for i, gr in enumerate(micro):
        u, st = acc.update(gr, st, p)
        if i < 2:
            assert all(float(x.abs().max()) == 0 for x in u.values())
        p = fo.apply_updates(p, u)
    ref = fo.adamw(lr=0.01, weight_decay=0.1)
    mean = {k: sum(m[k] for m in micro) / 3 for k in SHAPES}
    u, _ = ref.update(mean, ref.init(params), params)
    expected = fo.apply_updates(params, u)
    for k in SHAPES:
        assert max_rel_err(p[k], expected[k]) <= TOL64
    assert int(st.micro_step) == 0
    with pytest.raises(ValueError, match="every"):
        fo.accumulate(fo.sgd(), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inner", ["adamw", "clip+adamw"])
def test_accumulate_apply_equals_update(dtype, inner):
    # The fused path through accumulate: params unchanged (the same tensors) between inner
    # steps, inner.apply on the mean at every 3rd call - update + apply_updates to round-off
    # (base.py's contract: on CPU apply runs torch's fused AdamW, which rounds the new
    # parameter as one expression; a few ulps per step, 3 steps: 10 ulps of the dtype, relative
    # to the leaf's largest entry). The inner state is the same either way up to an fma.
    def make():
        opt = fo.adamw(lr=0.01, weight_decay=0.1)
        return fo.accumulate(fo.chain(fo.clip_by_global_norm(0.5), opt) if inner != "adamw"
                             else opt, every=3)

    acc = make()
    assert acc.apply is not None
    assert fo.accumulate(fo.identity(), 2).apply is None  # no fused inner step, no apply
    params = _params(dtype)
    g = torch.Generator().manual_seed(4)
    micro = [{k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}
             for _ in range(7)]  # two whole rounds and one call into the third
    p_a = p_u = params
    st_a = st_u = acc.init(params)
    for i, gr in enumerate(micro):
        new_a, st_a = fo.update_params(acc, gr, st_a, p_a)  # takes acc.apply
        u, st_u = acc.update(gr, st_u, p_u)
        p_u = fo.apply_updates(p_u, u)
        if i % 3 != 2:
            assert all(new_a[k] is p_a[k] for k in SHAPES)
        else:
            assert not torch.equal(new_a["w"], p_a["w"])
        p_a = new_a
        tol = 10 * torch.finfo(dtype).eps
        for k in SHAPES:
            assert p_a[k].dtype == dtype and max_rel_err(p_a[k], p_u[k]) <= tol, (i, k)
        for x, y in zip(optree.tree_leaves(st_a), optree.tree_leaves(st_u), strict=True):
            assert (max_rel_err(x, y) <= tol if x.is_floating_point()
                    else torch.equal(x, y)), i
    assert int(st_a.micro_step) == 1


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: fo.adamw(lr=-1.0), "lr"),
        (lambda: fo.adamw(betas=(0.9, 1.0)), "betas"),
        (lambda: fo.adamw(eps=0.0), "eps"),
        (lambda: fo.sgd(lr=-0.1), "lr"),
        (lambda: fo.sgd(momentum=1.5), "momentum"),
        (lambda: fo.sgd(nesterov=True), "nesterov"),
        (lambda: fo.clip_by_global_norm(0.0), "max_norm"),
        (lambda: fo.adamw(lr=fo.linear(-1.0, 0.0, 10)), "init"),
    ],
)
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_trees_and_leaves():
    params = _params()
    opt = fo.adamw()
    state = opt.init(params)
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    with pytest.raises(ValueError, match="missing \\['w'\\]"):
        opt.update({k: v for k, v in grads.items() if k != "w"}, state, params)
    with pytest.raises(ValueError, match="'w' has shape"):
        opt.update({**grads, "w": torch.zeros(7, 5, dtype=torch.float64)}, state, params)
    with pytest.raises(ValueError, match="params are required"):
        opt.update(grads, state, None)
    with pytest.raises(TypeError, match="'ids'.*int64"):
        opt.init({**params, "ids": torch.arange(3)})
    # Under the test-time type checker the annotation catches it first; both name the type.
    with pytest.raises(TypeError, match="GradientTransformation"):
        fo.chain(fo.sgd(), "adam")


@pytest.mark.parametrize(
    "opt", [fo.adamw(weight_decay=0.1), fo.sgd(momentum=0.9, weight_decay=0.1)]
)
def test_updates_keep_the_leaf_dtype(opt):
    params = _params(torch.float32)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    updates, _ = opt.update(grads, opt.init(params), params)
    assert all(updates[k].dtype == torch.float32 for k in params)


def test_state_is_a_tree_of_tensors():
    from funcpar.state import tree_leaves

    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=fo.cosine(1e-3, 10), amsgrad=True))
    leaves = tree_leaves(opt.init(_params()))
    assert leaves and all(torch.is_tensor(x) for x in leaves)


def test_dict_mask_for_a_larger_model_applies_to_the_subset():
    """A pipeline stage holds some of the model's leaves; a flat dict mask built for the whole
    model applies to them (restrict_to), and a mask missing one of them is still an error."""
    params = {"w": torch.ones(2, 2, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float64)}
    whole = {"w": True, "b": False, "other.w": True}
    opt = fo.adamw(lr=0.1, weight_decay=0.5, weight_decay_mask=whole)
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    u, _ = opt.update(grads, opt.init(params), params)
    assert torch.equal(u["w"], torch.full((2, 2), -0.05, dtype=torch.float64))  # decayed
    assert torch.equal(u["b"], torch.zeros(2, dtype=torch.float64))  # masked out
    bad = fo.adamw(lr=0.1, weight_decay_mask={"w": True, "other": False})
    with pytest.raises(ValueError):
        bad.update(grads, bad.init(params), params)
