"""vmap over a whole TrainStep (funcpar.train.vmap): N members in one call equal N runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcpar.optim as fo
from funcpar.optim.hyperparams import set_hyperparams
from funcpar.state import functionalize, init_state, tree_leaves
from funcpar.train import make_train_step
from funcpar.train.vmap import stack_states, unstack_states, vmap_step
from funcpar.transforms import amp_cast, remat

N, STEPS = 4, 10
LRS = (0.01, 0.02, 0.005, 0.03)


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _members(opt, dtype=torch.float64, dropout=0.0):
    """N states of one MLP with different seeds and lr, and the step."""
    states = []
    for i, lr in enumerate(LRS):
        torch.manual_seed(i)
        model = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Dropout(dropout),
                              nn.Linear(12, 3)).to(dtype)
        apply_fn, params, buffers = functionalize(model)
        st = init_state(params, buffers, opt, seed=7)
        states.append(st._replace(opt_state=set_hyperparams(st.opt_state, lr=lr)))
    return make_train_step(apply_fn, _mse, opt), states


def _batches(dtype=torch.float64, stacked=False):
    g = torch.Generator().manual_seed(123)
    lead = (N,) if stacked else ()
    return [(torch.randn(*lead, 16, 5, generator=g, dtype=dtype),
             torch.randn(*lead, 16, 3, generator=g, dtype=dtype)) for _ in range(STEPS)]


def _separate(step, states, batches, stacked=False):
    out = []
    for i, st in enumerate(states):
        losses = []
        for x, y in batches:
            st, m = step(st, (x[i], y[i]) if stacked else (x, y))
            losses.append(m["loss"])
        out.append((st, torch.stack(losses)))
    return out


def _vmapped(step, states, batches, stacked=False, **kw):
    run = vmap_step(step, batch_axis=0 if stacked else None, **kw)
    st = stack_states(states)
    losses = []
    for b in batches:
        st, m = run(st, b)
        losses.append(m["loss"])
    return st, torch.stack(losses, 1)


def _assert_members_equal(step, states, batches, tol, stacked=False, vmapped=None, **kw):
    stacked_state, losses = vmapped or _vmapped(step, states, batches, stacked, **kw)
    for i, (ref, ref_losses) in enumerate(_separate(step, states, batches, stacked)):
        member = unstack_states(stacked_state)[i]
        torch.testing.assert_close(losses[i], ref_losses, rtol=tol, atol=tol)
        for a, b in zip(tree_leaves(member), tree_leaves(ref)):
            if torch.is_tensor(a):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


OPTS = {
    "adamw": lambda: fo.adamw(lr=1e-2, weight_decay=0.1),
    "sgd": lambda: fo.sgd(lr=0.05, momentum=0.9),
    "adafactor": lambda: fo.adafactor(lr=1e-2, relative_step=False),
    "came": lambda: fo.came(lr=1e-2),
    "lamb": lambda: fo.lamb(lr=1e-2, weight_decay=0.01),
}


@pytest.mark.parametrize("name", [
    "adamw", "sgd",
    pytest.param("adafactor", marks=pytest.mark.slow),
    pytest.param("came", marks=pytest.mark.slow),
    pytest.param("lamb", marks=pytest.mark.slow),
])
def test_vmapped_members_equal_separate_runs(name):
    # float64, 4 members with their own seed and lr, 10 steps: the batched ops may sum in
    # another order than the separate ones (round-off ~1e-16), so 1e-12, not bit-identical.
    step, states = _members(fo.chain(fo.clip_by_global_norm(1.0), OPTS[name]()))
    _assert_members_equal(step, states, _batches(), 1e-12)


def test_stacked_batches_and_lr_metric():
    step, states = _members(fo.adamw(lr=1e-2))
    _assert_members_equal(step, states, _batches(stacked=True)[:3], 1e-12, stacked=True)
    _, m = vmap_step(step)(stack_states(states), _batches()[0])
    assert m["lr"].tolist() == list(LRS)
    # States initialised by optimizers built with each lr stack to the same hyperparameters.
    built = stack_states([st._replace(opt_state=fo.adamw(lr=lr).init(st.params))
                          for st, lr in zip(states, LRS)])
    for a, b in zip(tree_leaves(built.opt_state), tree_leaves(stack_states(states).opt_state)):
        assert torch.equal(a, b) if torch.is_tensor(a) else a is b is None


def test_amp_cast_bf16_composes():
    step, states = _members(fo.adamw(lr=1e-2), dtype=torch.float32)
    bf16 = amp_cast("bf16")(step, states[0])[0]
    # The bf16 matmuls of the batched forward (bmm) accumulate in another order than the
    # separate ones (mm), and each bf16 output rounds to 2^-8 relative: measured 3.5e-4 on the
    # losses, so one bf16 ulp (2^-8) is the bound, not float32's.
    _assert_members_equal(bf16, states, _batches(torch.float32)[:3], 2.0**-8)


class _Blocks(nn.Module):
    """Two residual blocks (Linear, Tanh, Dropout) in a ModuleList: remat's default choice."""

    def __init__(self, dropout):
        super().__init__()
        self.inp = nn.Linear(5, 12)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh(),
                                                  nn.Dropout(dropout)) for _ in range(2))
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def _block_members(opt, dropout=0.0):
    states = []
    for i, lr in enumerate(LRS):
        torch.manual_seed(i)
        apply_fn, params, buffers = functionalize(_Blocks(dropout).double())
        st = init_state(params, buffers, opt, seed=7)
        states.append(st._replace(opt_state=set_hyperparams(st.opt_state, lr=lr)))
    step = make_train_step(apply_fn, _mse, opt)
    return step, remat()(step, states[0])[0], states


def _exactly(a, b):
    (sa, la), (sb, lb) = a, b
    assert torch.equal(la, lb)
    for x, y in zip(tree_leaves(sa), tree_leaves(sb)):
        assert torch.equal(x, y) if torch.is_tensor(x) else x is y is None


@pytest.mark.parametrize("randomness, dropout", [
    ("error", 0.0), pytest.param("same", 0.5, marks=pytest.mark.slow), ("different", 0.5),
])
def test_remat_composes(randomness, dropout):
    """vmap_step of a remat step (funcpar.transforms.remat's torch.func checkpoint)."""
    step, rstep, states = _block_members(fo.adamw(lr=1e-2, weight_decay=0.1), dropout)
    batches = _batches() if randomness == "error" else _batches()[:3]
    # The recompute runs the same ops on the same values (dropout: from the forward's
    # generator state), so the vmapped step with remat is the one without it, bit for bit.
    got = _vmapped(rstep, states, batches, randomness=randomness)
    _exactly(got, _vmapped(step, states, batches, randomness=randomness))
    if randomness != "different":  # "different" draws are not a separate run's
        # 4 members x 10 steps with remat equal 4 separate runs with remat: 1e-12, the batched
        # kernels' summation order (as test_vmapped_members_equal_separate_runs).
        _assert_members_equal(rstep, states, batches, 1e-12, vmapped=got)


def test_remat_under_vmap_frees_activations():
    """Peak live bytes of vmapped forward + backward (4 members, 8 blocks): the torch.func
    checkpoint keeps one block's activations at a time, as remat does eagerly."""
    from test_lazy_init import LiveBytes

    from funcpar.train.step import loss_and_grads

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Tanh(),
                                                      nn.Linear(128, 32), nn.Tanh())
                                        for _ in range(8))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    states = []
    for i in range(N):
        torch.manual_seed(i)
        apply_fn, params, buffers = functionalize(Deep().double())
        states.append(init_state(params, buffers, fo.sgd(lr=0.1)))
    step = make_train_step(apply_fn, _mse, fo.sgd(lr=0.1))
    stacked = stack_states(states)
    x, y = torch.randn(256, 32, dtype=torch.float64), torch.randn(256, 32, dtype=torch.float64)
    peaks, grads = [], []
    for s in (step, remat()(step, states[0])[0]):
        f = torch.func.vmap(lambda p, b, s=s: loss_and_grads(s.apply_fn, _mse, p, b, (x, y))[1])
        with LiveBytes() as mem:
            grads.append(f(stacked.params, stacked.buffers))
        peaks.append(mem.peak)
    print(f"\nvmapped forward + backward peak: {peaks[0] / 2**20:.1f} MiB without remat, "
          f"{peaks[1] / 2**20:.1f} MiB with")
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert peaks[1] < 0.5 * peaks[0]
    # vmap_step's own route (the backward by autograd outside the level, member_grads) keeps
    # fewer activations to begin with; remat still frees most of them. Its blocks are
    # differentiated by torch.func.vjp, the rest by autograd: the same values to rounding.
    steps, peaks = [], []
    for s in (step, remat()(step, states[0])[0]):
        with LiveBytes() as mem:
            steps.append(vmap_step(s)(stacked, (x, y))[0])
        peaks.append(mem.peak)
    print(f"vmap_step peak: {peaks[0] / 2**20:.1f} MiB without remat, "
          f"{peaks[1] / 2**20:.1f} MiB with")
    for a, b in zip(tree_leaves(steps[0]), tree_leaves(steps[1]), strict=True):
        if torch.is_tensor(a):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert peaks[1] < 0.75 * peaks[0]


def test_randomness():
    step, states = _members(fo.sgd(lr=0.1), dropout=0.5)
    batch = _batches()[0]
    with pytest.raises(RuntimeError, match="randomness"):
        vmap_step(step)(stack_states(states), batch)
    # 'same' with one generator state: the draws of a separate run of each member.
    _assert_members_equal(step, states, _batches()[:2], 1e-12, randomness="same")
    other = [st._replace(rng=init_state(st.params, st.buffers, step.optimizer, seed=i).rng)
             for i, st in enumerate(states)]
    with pytest.raises(ValueError, match="different generator states"):
        vmap_step(step, randomness="same")(stack_states(other), batch)
    # 'different': repeatable, and the members' masks differ (same params, same batch).
    same_params = stack_states([states[0]] * N)
    run = vmap_step(step, randomness="different")
    a, m1 = run(same_params, batch)
    b, m2 = run(same_params, batch)
    assert torch.equal(m1["loss"], m2["loss"]) and torch.equal(a.rng, b.rng)
    assert len(set(m1["loss"].tolist())) == N


def test_refused_transforms_and_bad_stacks():
    step, states = _members(fo.sgd(lr=0.1), dtype=torch.float32)
    fp16 = amp_cast("fp16")(step, states[0])[0]
    with pytest.raises(ValueError, match=r"amp_cast\('fp16'\)"):
        vmap_step(fp16)
    import dataclasses

    for field, value, name in [("pipeline", object(), "pipeline_split"),
                               ("partition", object(), "zero_partition"),
                               ("sync_grads", lambda g: g, "data_parallel"),
                               ("layouts", {}, "shard_params"),
                               ("donate", True, "donate")]:
        with pytest.raises(ValueError, match=name):
            vmap_step(dataclasses.replace(step, **{field: value}))
    with pytest.raises(ValueError, match="vmap_step: randomness"):
        vmap_step(step, randomness="sometimes")
    wide = states[1]._replace(step=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="leaf step of state 1"):
        stack_states([states[0], wide])
    with pytest.raises(ValueError, match="not a stacked state"):
        vmap_step(step)(states[0], _batches()[0])


@pytest.mark.parametrize("amsgrad", [False, True])
def test_vmapped_adamw_is_each_members_fused_step(amsgrad, monkeypatch):
    """Under vmap (vmap_step's update) AdamW runs torch's fused CPU kernel on each member's
    slices (funcpar.kernels.members): every member's new params and state are bit for bit
    those of its own step, with a per-member lr and weight decay and a decay mask."""
    calls = []
    fused = torch._fused_adamw_

    def counting(*args, **kw):
        calls.append(kw["lr"])
        return fused(*args, **kw)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    opt = fo.adamw(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad,
                   weight_decay_mask=fo.matrices_only)
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (12, 5), "b1": (12,), "w2": (3, 12)}
    params = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in LRS]
    states = []
    for i, (p, lr) in enumerate(zip(params, LRS)):
        st = set_hyperparams(opt.init(p), lr=lr, weight_decay=0.1 * (i + 1))
        for _ in range(i + 1):  # the members at different counts
            _, st = opt.apply({k: torch.randn(s, generator=g) for k, s in shapes.items()},
                              st, p)
        states.append(st)
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in LRS]

    from funcpar.state.tree import tree_flatten, tree_unflatten

    # vmap takes and returns tensors only: the None moments (amsgrad off) stay outside it
    leaves, spec = tree_flatten((_stack(grads), _stack(states), _stack(params)))
    held = [i for i, x in enumerate(leaves) if x is not None]

    def apply(*tensors):
        flat = list(leaves)
        for i, t in zip(held, tensors, strict=True):
            flat[i] = t
        return tuple(x for x in tree_leaves(opt.apply(*tree_unflatten(spec, flat)))
                     if x is not None)

    calls.clear()
    got = torch.func.vmap(apply)(*(leaves[i] for i in held))
    assert calls == [lr for lr in LRS for _ in range(2)]  # per member: decayed, then not
    for i in range(len(LRS)):
        want = [x for x in tree_leaves(opt.apply(grads[i], states[i], params[i]))
                if x is not None]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a[i], b), i


def _stack(trees):
    from funcpar.state.tree import tree_map

    return tree_map(lambda *xs: None if xs[0] is None else torch.stack(xs), *trees)


def _count_route(monkeypatch):
    """Record, per call of the step's gradient route, whether member_grads took it."""
    import funcpar.train.member_grads as mg
    import funcpar.train.step as step_mod

    taken: list[bool] = []
    route = mg.grads_at_vmap_level

    def counting(fn, xs):
        out = route(fn, xs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(step_mod, "grads_at_vmap_level", counting)
    return taken


@pytest.mark.parametrize("randomness, dropout", [("error", 0.0), ("different", 0.5)])
def test_member_gradients_by_autograd_on_the_stack(randomness, dropout, monkeypatch):
    """vmap_step's gradients come from ordinary autograd of the summed member losses on the
    stacked leaves (funcpar.train.member_grads), not torch.func.grad nested in the vmap, at
    every step, and the backward and the members' fused update run outside the vmap level; 10
    steps (clipped) give separate runs' states and the torch.func.grad route's to rounding
    (float64, 1e-12:
    with a grad level around them some batching rules sum in another order; dropout's
    per-member draws included)."""
    import funcpar.kernels.members as members
    import funcpar.train.member_grads as mg
    import funcpar.train.step as step_mod

    opt = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2, weight_decay=0.1))
    step, states = _members(opt, dropout=dropout)
    taken = _count_route(monkeypatch)
    outside = []
    leave = members.stepped_out

    def counting_exit(own):
        outside.append(own.level)
        return leave(own)

    monkeypatch.setattr(members, "stepped_out", counting_exit)
    monkeypatch.setattr(mg, "stepped_out", counting_exit)
    got = _vmapped(step, states, _batches(), randomness=randomness)
    assert taken == [True] * STEPS
    # Out of vmap_step's level twice a step: the backward, then AdamW's fused member update.
    assert outside == [1, 1] * STEPS
    if randomness == "error":  # each member's draws are its own with "different"
        _assert_members_equal(step, states, _batches(), 1e-12, vmapped=got)
    monkeypatch.setattr(step_mod, "grads_at_vmap_level", lambda fn, xs: None)
    want = _vmapped(step, states, _batches(), randomness=randomness)
    for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
        if torch.is_tensor(a):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_member_gradients_route_only_under_vmap_step(monkeypatch):
    """The autograd route is vmap_step's own: torch.func.vmap of loss_and_grads (a level
    vmap_step does not own) and a step on stacked params that require grad (a graph through
    the run is being built) keep torch.func.grad, with the same values to rounding."""
    from funcpar.train.step import loss_and_grads

    step, states = _members(fo.sgd(lr=0.05, momentum=0.9))
    stacked = stack_states(states)
    x, y = _batches()[0]
    taken = _count_route(monkeypatch)
    torch.func.vmap(lambda p, b: loss_and_grads(step.apply_fn, _mse, p, b, (x, y))[1])(
        stacked.params, stacked.buffers)
    assert taken == [False]

    run = vmap_step(step)
    plain, _ = run(stacked, (x, y))
    assert taken == [False, True]
    live = {k: v.detach().requires_grad_() for k, v in stacked.params.items()}
    traced, _ = run(stacked._replace(params=live), (x, y))
    assert taken == [False, True, False]
    assert all(v.requires_grad for v in traced.params.values())
    for a, b in zip(tree_leaves(plain), tree_leaves(traced), strict=True):
        if torch.is_tensor(a):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)


def test_torch_func_vmap_of_a_step_points_at_vmap_step():
    """What a JAX user writes first, ``torch.func.vmap(step, in_dims=(0, None))`` over a stacked
    state: torch stops at the state's None leaves and its one-line message names vmap_step
    (was: an 800-character repr of the step); a stacked generator state that reaches the step
    is refused by the step itself, also naming vmap_step (was: "Cannot access data pointer")."""
    step, states = _members(fo.adamw(0.01))
    stacked = stack_states(states)
    batch = _batches()[0]
    with pytest.raises(ValueError, match=r"vmap_step") as err:
        torch.func.vmap(step, in_dims=(0, None))(stacked, batch)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400
    with pytest.raises(ValueError, match=r"stacked rng.*vmap_step"):
        torch.func.vmap(lambda rng: step(states[0]._replace(rng=rng), batch)[1]["loss"])(
            stacked.rng)
