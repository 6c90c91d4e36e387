"""funcpar.meta.custom_root: non-symmetric roots (refused by CG's residual check, exact with
GMRES and normal-equation CG), argnums / keyword / pytree meta-parameters with integer labels,
has_aux, and torch.func.grad / vmap against plain autograd. All float64; every reference is a
dense closed form of the implicit function theorem."""

from __future__ import annotations

import pytest
import torch

from funcpar.meta import SolveError, custom_root, solve_cg, solve_gmres, solve_normal_cg

D = torch.float64
N = 6


def _tanh_problem():
    """x = tanh(W x + theta), W non-symmetric with ||W|| < 1 (a contraction: the fixed point
    iteration converges), and an outer loss c.x."""
    g = torch.Generator().manual_seed(0)
    w = 0.4 * torch.randn(N, N, generator=g, dtype=D) / N**0.5
    theta = torch.randn(N, generator=g, dtype=D)
    return w, theta, torch.randn(N, generator=g, dtype=D)


def _tanh_root(w, solve):
    def optimality(x, theta):
        return x - torch.tanh(w @ x + theta)

    @custom_root(optimality, solve=solve)
    def fixed_point(x0, theta):
        x = x0
        for _ in range(200):
            x = torch.tanh(w @ x + theta)
        return x

    return fixed_point


def _tanh_closed_form(w, theta, c):
    # dx/dtheta = (I - S W)^{-1} S with S = diag(1 - x^2): grad = S (I - S W)^{-T} c.
    x = torch.zeros(N, dtype=D)
    for _ in range(200):
        x = torch.tanh(w @ x + theta)
    s = torch.diag(1 - x**2)
    return s @ torch.linalg.solve((torch.eye(N, dtype=D) - s @ w).T, c)


@pytest.mark.parametrize("solve", [solve_gmres, solve_normal_cg])
def test_nonsymmetric_root_is_exact_with_a_general_solver(solve):
    w, theta, c = _tanh_problem()
    theta = theta.requires_grad_(True)
    root = _tanh_root(w, solve)
    (got,) = torch.autograd.grad(c @ root(torch.zeros(N, dtype=D), theta), theta)
    want = _tanh_closed_form(w, theta.detach(), c)
    # The brief's bound: 1e-8 in float64 (measured: ~1e-15, rounding of a 6x6 solve).
    assert (got - want).abs().max() <= 1e-8 * want.abs().max()


def test_nonsymmetric_root_is_refused_by_cg():
    w, theta, c = _tanh_problem()
    theta = theta.requires_grad_(True)
    x = _tanh_root(w, None)(torch.zeros(N, dtype=D), theta)
    # (dF/dx)^T = I - W^T S is not symmetric: CG's answer was 12 % off, silently.
    with pytest.raises(SolveError, match="solve_cg.*symmetric positive definite"):
        torch.autograd.grad(c @ x, theta)

    def warn_only(matvec, b, rmatvec):
        return solve_cg(matvec, b, rmatvec=rmatvec, on_fail="warn")

    x = _tanh_root(w, warn_only)(torch.zeros(N, dtype=D), theta)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        torch.autograd.grad(c @ x, theta)


def _softmax_problem():
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(12, 3, generator=g, dtype=D)
    labels = torch.randint(0, 3, (12,), generator=g)
    hp = {"lam": torch.tensor(0.5, dtype=D), "prior": 0.1 * torch.randn(3, 3, generator=g,
                                                                        dtype=D)}
    return feats, labels, hp


def _softmax_optimality(w, feats, labels, hp):
    """The gradient of mean cross-entropy(feats w, labels) + lam/2 ||w - prior||^2."""
    e = (feats @ w).exp()  # small logits: no max shift needed (torch.softmax: ~8 ms a call)
    p = e / e.sum(dim=1, keepdim=True)
    onehot = torch.nn.functional.one_hot(labels, 3).to(D)
    return feats.T @ (p - onehot) / len(labels) + hp["lam"] * (w - hp["prior"])


def _descend(w, feats, labels, hp):
    for _ in range(200):  # lam = 0.5: a contraction of ~0.75 a step, 1e-16 stationary
        w = w - 0.5 * _softmax_optimality(w, feats, labels, hp)
    return w


def _softmax_closed_form(feats, labels, hp, outer):
    """-(dF/dtheta)^T (dF/dx)^{-T} dL/dx by dense Jacobians, for the leaves of hp."""
    w = _descend(torch.zeros(3, 3, dtype=D), feats, labels, hp).detach()
    wl = w.detach().requires_grad_(True)
    (v,) = torch.autograd.grad(outer(wl), wl)
    jx = torch.autograd.functional.jacobian(
        lambda x: _softmax_optimality(x, feats, labels, hp), w).reshape(9, 9)
    u = torch.linalg.solve(jx.T, v.reshape(9))
    out = {}
    for k in hp:
        jt = torch.autograd.functional.jacobian(
            lambda t, k=k: _softmax_optimality(w, feats, labels, {**hp, k: t}), hp[k])
        out[k] = -(jt.reshape(9, -1).T @ u).reshape(hp[k].shape)
    return out


def _outer(w):
    return (w**2).sum() + w[0, 1]


@pytest.mark.parametrize("by_keyword", [False, True])
def test_argnums_keywords_dicts_and_integer_labels(by_keyword):
    feats, labels, hp = _softmax_problem()
    want = _softmax_closed_form(feats, labels, hp, _outer)
    feats = feats.requires_grad_(True)  # data that requires grad: argnums leaves it alone
    hp = {k: v.requires_grad_(True) for k, v in hp.items()}

    def optimality(w, feats, labels, hp):
        return _softmax_optimality(w, feats, labels, hp)

    # argnums=2: only hp (positional index 2 after x0); keyword arguments are always
    # meta-parameters. labels (int64) would crash a backward asked for its gradient.
    solve = custom_root(optimality, argnums=() if by_keyword else 2)(_descend)
    w0 = torch.zeros(3, 3, dtype=D)
    w = solve(w0, feats, labels, hp=hp) if by_keyword else solve(w0, feats, labels, hp)
    got = torch.autograd.grad(_outer(w), [hp["lam"], hp["prior"], feats], allow_unused=True)
    assert got[2] is None  # no gradient computed for the data
    for k, g in zip(hp, got):
        # Same formula, iterative (CG, tol 1e-10) against dense: measured ~1e-13 relative.
        assert (g - want[k]).abs().max() <= 1e-9 * want[k].abs().max(), k


def test_has_aux_passes_through_undifferentiated():
    w, theta, c = _tanh_problem()
    theta = theta.requires_grad_(True)

    def optimality(x, theta):
        return x - torch.tanh(w @ x + theta)

    @custom_root(optimality, solve=solve_gmres, has_aux=True)
    def fixed_point(x0, theta):
        x = torch.tanh(w @ x0 + theta)
        for _ in range(199):
            x = torch.tanh(w @ x + theta)
        return x, {"iters": 200, "residual": optimality(x, theta).norm()}

    x, info = fixed_point(torch.zeros(N, dtype=D), theta)
    assert info["iters"] == 200 and info["residual"] < 1e-12
    assert not info["residual"].requires_grad
    (got,) = torch.autograd.grad(c @ x, theta)
    want = _tanh_closed_form(w, theta.detach(), c)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_composes_with_torch_func_grad_and_vmap():
    w, theta, c = _tanh_problem()
    root = _tanh_root(w, solve_gmres)
    x0 = torch.zeros(N, dtype=D)
    thetas = theta + 0.3 * torch.randn(3, N, generator=torch.Generator().manual_seed(2),
                                       dtype=D)

    def loss(t):
        return c @ root(x0, t)

    def autograd_grad(t):
        t = t.clone().requires_grad_(True)
        return torch.autograd.grad(loss(t), t)[0]

    # Same solves on the same values: equal to rounding (1e-12; measured <= 1e-15).
    torch.testing.assert_close(torch.func.grad(loss)(theta), autograd_grad(theta),
                               rtol=1e-12, atol=1e-12)
    xs = torch.func.vmap(lambda t: root(x0, t))(thetas)
    torch.testing.assert_close(xs, torch.stack([root(x0, t) for t in thetas]),
                               rtol=1e-12, atol=1e-12)
    per_task = torch.func.vmap(torch.func.grad(loss))(thetas)
    torch.testing.assert_close(per_task, torch.stack([autograd_grad(t) for t in thetas]),
                               rtol=1e-12, atol=1e-12)
