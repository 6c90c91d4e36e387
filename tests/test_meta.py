"""funcpar.meta: unrolled MAML against torchopt, truncation, implicit differentiation of ridge
regression against its closed form."""

from __future__ import annotations

import pytest
import torch

from funcpar.meta import custom_root, maml_adapt, solve_normal_cg, unroll, unroll_train_step
from funcpar.optim import adamw, sgd

D = torch.float64


def _sine_task(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(10, 1, generator=g, dtype=D) * 10 - 5
    amp = 0.1 + 4.9 * torch.rand((), generator=g, dtype=D)
    phase = 3.0 * torch.rand((), generator=g, dtype=D)
    return x[:5], amp * torch.sin(x[:5] + phase), x[5:], amp * torch.sin(x[5:] + phase)


def _mlp(p, x):
    return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _mse(p, x, y):
    return ((_mlp(p, x) - y) ** 2).mean()


def _theta():
    g = torch.Generator().manual_seed(1)
    return {"w1": torch.randn(1, 16, generator=g, dtype=D), "b1": torch.zeros(16, dtype=D),
            "w2": 0.3 * torch.randn(16, 1, generator=g, dtype=D), "b2": torch.zeros(1, dtype=D)}


def test_maml_meta_gradient_matches_torchopt(float64_default):
    torchopt = pytest.importorskip("torchopt")
    theta = {k: v.requires_grad_(True) for k, v in _theta().items()}
    names = list(theta)
    mine, ref = 0.0, 0.0
    for seed in range(2):
        xs, ys, xq, yq = _sine_task(seed)
        adapted, _ = maml_adapt(_mse, adamw(0.01, weight_decay=0.0), theta, (xs, ys), steps=3)
        mine = mine + _mse(adapted, xq, yq)
        # torchopt's functional Adam, unrolled by hand the same way (differentiable updates).
        opt = torchopt.adam(0.01, moment_requires_grad=True)
        p = tuple(theta[k] for k in names)
        state = opt.init(p)
        for _ in range(3):
            grads = torch.autograd.grad(_mse(dict(zip(names, p)), xs, ys), p, create_graph=True)
            updates, state = opt.update(grads, state, inplace=False)
            p = torchopt.apply_updates(p, updates, inplace=False)
        ref = ref + _mse(dict(zip(names, p)), xq, yq)
    g_mine = torch.autograd.grad(mine, [theta[k] for k in names])
    g_ref = torch.autograd.grad(ref, [theta[k] for k in names])
    for k, a, b in zip(names, g_mine, g_ref):
        # Same maths, different float64 rounding order: agreement to ~1e-14 relative.
        assert (a - b).abs().max() <= 1e-10, (k, (a - b).abs().max().item())


def test_maml_adapt_under_no_grad_adapts_without_a_graph():
    """An evaluation loop under no_grad: the inner gradients are still taken, nothing keeps a
    graph, and the adapted params equal first-order adaptation to rounding (failed before: raw
    autograd error)."""
    theta = {k: v.requires_grad_(True) for k, v in _theta().items()}
    xs, ys, _, _ = _sine_task(0)
    with torch.no_grad():
        adapted, losses = maml_adapt(_mse, adamw(0.01), theta, (xs, ys), steps=3)
    ref, _ = maml_adapt(_mse, adamw(0.01), theta, (xs, ys), steps=3, first_order=True)
    assert all(v.grad_fn is None for v in adapted.values())
    assert all(loss.grad_fn is None for loss in losses)
    for k in theta:
        # Under no_grad the optimizer may take its fused path, the differentiable one outside
        # it: the same equations, one rounding apart.
        torch.testing.assert_close(adapted[k], ref[k].detach(), rtol=1e-14, atol=1e-15)


def test_maml_adapt_under_vmap_per_task_equals_a_loop():
    """Per-task ``torch.func.vmap`` over maml_adapt: the query losses and the meta-gradient
    equal a Python loop over the tasks (float64; batched kernels may sum in another order,
    so 1e-12 relative rather than bit-equal). Failed before: autograd.grad cannot see the
    batched loss."""
    theta = {k: v.requires_grad_(True) for k, v in _theta().items()}
    tasks = [_sine_task(s) for s in range(3)]
    xs, ys, xq, yq = (torch.stack(t) for t in zip(*tasks))

    def query_loss(xs, ys, xq, yq):
        adapted, _ = maml_adapt(_mse, adamw(0.01, weight_decay=0.0), theta, (xs, ys), steps=2)
        return _mse(adapted, xq, yq)

    batched = torch.func.vmap(query_loss)(xs, ys, xq, yq)
    looped = torch.stack([query_loss(*t) for t in tasks])
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=0)
    g_b = torch.autograd.grad(batched.sum(), list(theta.values()))
    g_l = torch.autograd.grad(looped.sum(), list(theta.values()))
    for a, b in zip(g_b, g_l):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_keep_last_truncates_like_a_detached_start():
    theta = {k: v.requires_grad_(True) for k, v in _theta().items()}
    xs, ys, xq, yq = _sine_task(0)
    opt = sgd(0.05, momentum=0.9)
    batches = [(xs, ys)] * 3
    full, _, _ = unroll(_mse, opt, theta, opt.init(theta), batches)
    cut, _, _ = unroll(_mse, opt, theta, opt.init(theta), batches, keep_last=1)
    # Same forward values; with keep_last=1 no gradient reaches theta (cut before the last step).
    assert torch.equal(full["w1"], cut["w1"])
    assert torch.autograd.grad(_mse(full, xq, yq), theta["w1"])[0].abs().sum() > 0
    assert not cut["w1"].grad_fn or theta["w1"] not in _leaves_of(cut["w1"])
    lr = torch.tensor(0.05, dtype=D, requires_grad=True)
    opt = sgd(lr, momentum=0.9)
    cut, _, _ = unroll(_mse, opt, _theta(), opt.init(_theta()), batches, truncate_every=1)
    # The learning rate stays attached through truncation (only params and state are cut).
    assert torch.autograd.grad(_mse(cut, xq, yq), lr)[0] != 0


def _leaves_of(t):
    seen, todo, out = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            out.add(fn.variable)
        todo.extend(f for f, _ in fn.next_functions)
    return out


def test_unroll_train_step_refuses_parallel_hooks():
    from funcpar.train.step import TrainStep

    step = TrainStep(apply_fn=lambda p, b, x: (_mlp(p, x), b),  # (output, new buffers)
                     loss_fn=lambda o, y: ((o - y) ** 2).mean(), optimizer=sgd(0.1))
    xs, ys, _, _ = _sine_task(0)
    theta = _theta()
    _, _, losses = unroll_train_step(step, theta, {}, step.optimizer.init(theta),
                                     [(xs, ys)] * 2)
    assert losses[1] < losses[0]
    bad = TrainStep(apply_fn=step.apply_fn, loss_fn=step.loss_fn, optimizer=step.optimizer,
                    sync_grads=lambda g: g)
    with pytest.raises(ValueError, match="sync_grads"):
        unroll_train_step(bad, theta, {}, step.optimizer.init(theta), [(xs, ys)])


def _ridge():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 5, generator=g, dtype=D), torch.randn(20, generator=g, dtype=D)
    av, bv = torch.randn(10, 5, generator=g, dtype=D), torch.randn(10, generator=g, dtype=D)
    return a, b, av, bv


@pytest.mark.parametrize("normal", [False, True])
def test_implicit_ridge_hypergradient_matches_closed_form(normal):
    a, b, av, bv = _ridge()

    def optimality(x, lam):  # gradient of 0.5 ||a x - b||^2 + 0.5 lam ||x||^2
        return a.T @ (a @ x - b) + lam * x

    solve = solve_normal_cg if normal else None

    @custom_root(optimality, solve=solve)
    def ridge(x0, lam):  # an iterative inner solver, never unrolled: plain gradient descent
        x = x0
        step = 1.0 / (torch.linalg.matrix_norm(a, 2) ** 2 + lam)
        for _ in range(3000):
            x = x - step * optimality(x, lam)
        return x

    lam = torch.tensor(0.7, dtype=D, requires_grad=True)
    x = ridge(torch.zeros(5, dtype=D), lam)
    r = av @ x - bv
    (hyper,) = torch.autograd.grad(0.5 * (r**2).sum(), lam)
    with torch.no_grad():
        h = a.T @ a + lam * torch.eye(5, dtype=D)
        xs = torch.linalg.solve(h, a.T @ b)
        closed = -(av.T @ (av @ xs - bv)) @ torch.linalg.solve(h, xs)
    assert torch.allclose(x.detach(), xs, atol=1e-12, rtol=0)
    assert abs(hyper - closed) <= 1e-6 * abs(closed), (hyper.item(), closed.item())


def test_unroll_train_step_second_order_through_remat():
    """unroll_train_step on a functionalize'd model (apply_fn returns (output, buffers)), with
    and without remat: the second-order meta-gradient w.r.t. the initial params and a tensor lr
    through 3 AdamW steps is the same, bit for bit (the recompute runs the same ops on the same
    values; the second-order backward recomputes each checkpoint a second time)."""
    from torch import nn

    from funcpar.state import functionalize
    from funcpar.train import make_train_step
    from funcpar.transforms import remat

    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(D))
    lr = torch.tensor(0.01, dtype=D, requires_grad=True)
    opt = adamw(lr=lr, weight_decay=0.0)
    step = make_train_step(apply_fn, lambda o, y: ((o - y) ** 2).mean(), opt)
    rstep = remat(lambda n, m: isinstance(m, nn.Linear))(step, None)[0]
    x, y = torch.randn(5, 4, dtype=D), torch.randn(5, 2, dtype=D)

    def meta_grads(s):
        theta = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        w, _, _ = unroll_train_step(s, theta, buffers, opt.init(theta), [(x, y)] * 3)
        out, _ = s.apply_fn(w, buffers, x)
        return torch.autograd.grad(((out - y) ** 2).mean(), [*theta.values(), lr])

    ref, got = meta_grads(step), meta_grads(rstep)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert ref[-1].abs() > 0


def test_torchopt_metasgd_loop_ported_to_functionalize(float64_default):
    """docs/FUNCTIONAL.md's port of torchopt's ``MetaSGD(module)`` MAML loop to
    ``functionalize`` + ``maml_adapt``: the meta-gradients of the module's parameters, summed
    over two tasks, equal torchopt's (same maths, float64 rounding apart)."""
    torchopt = pytest.importorskip("torchopt")
    import torch.nn.functional as F
    from torch import nn

    from funcpar.state import functionalize

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    tasks = [_sine_task(s) for s in range(2)]
    # torchopt: the module's own parameters are updated in place by the differentiable SGD.
    inner_opt = torchopt.MetaSGD(net, lr=0.1)
    for xs, ys, xq, yq in tasks:
        saved = torchopt.extract_state_dict(net)
        for _ in range(3):
            inner_opt.step(F.mse_loss(net(xs), ys))
        F.mse_loss(net(xq), yq).backward()
        torchopt.recover_state_dict(net, saved)
    ref = {k: p.grad.clone() for k, p in net.named_parameters()}
    # funcpar: the same loop as a function of the parameters.
    apply_fn, theta, buffers = functionalize(net)
    theta = {k: v.detach().requires_grad_(True) for k, v in theta.items()}

    def loss(p, x, y):
        out, _ = apply_fn(p, buffers, x)
        return F.mse_loss(out, y)

    outer = 0.0
    for xs, ys, xq, yq in tasks:
        adapted, _ = maml_adapt(loss, sgd(0.1), theta, (xs, ys), steps=3)
        outer = outer + loss(adapted, xq, yq)
    grads = dict(zip(theta, torch.autograd.grad(outer, list(theta.values()))))
    for k in ref:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-10, atol=1e-12)
