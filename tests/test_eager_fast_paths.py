"""The eager (no Triton) fast paths of Adafactor, CAME and Lamb: the in-place plain-torch passes
(funcpar.kernels.foreach_factored, funcpar.kernels.lamb.lamb_fast) give the per-leaf
references' bits exactly, donated (in place) or not, and step aside for autograd; the kernel
choice counts the step's tensor hyperparameters (issue 17)."""

from __future__ import annotations

import importlib

import pytest
import torch

import funcpar.optim as fo
from funcpar.kernels import factored, foreach_factored
from funcpar.kernels import lamb as lamb_kernels
from funcpar.kernels.dispatch import kernel_mode
from funcpar.kernels.inplace import inplace_updates
from funcpar.optim import galore

# The module (funcpar.optim re-exports the function under the same name).
ADAFACTOR_TORCH = importlib.import_module("funcpar.optim.adafactor_torch")
SHAPES = {"emb": (9, 6), "w3": (2, 5, 4), "vec": (7,), "s": (), "col": (5, 2)}
STEPS = 3

OPTS = {
    "adafactor": lambda: fo.adafactor(),  # relative step, RMS(param) scaling, decay 0 skipped
    "adafactor_b1_wd": lambda: fo.adafactor(lr=1e-2, relative_step=False, beta1=0.9,
                                            weight_decay=0.1, clip_threshold=0.5),
    "adafactor_torch": lambda: fo.adafactor_torch(lr=1e-2, weight_decay=0.1),
    "adafactor_torch_max": lambda: fo.adafactor_torch(lr=1e-2, maximize=True),
    "came": lambda: fo.came(lr=1e-2),
    "came_wd": lambda: fo.came(lr=1e-2, weight_decay=0.1, clip_threshold=0.5),
    "lamb": lambda: fo.lamb(lr=1e-2, weight_decay=0.1),
    "lamb_pytorch_optimizer": lambda: fo.lamb(lr=1e-2, weight_decay=0.1,
                                              variant="pytorch_optimizer"),
    "lamb_adam": lambda: fo.lamb(lr=1e-2, adam=True, maximize=True),
    "galore_adamw": lambda: fo.galore_adamw(lr=1e-2, rank=2, weight_decay=0.1,
                                            svd_dtype=torch.float64),
    "galore_adafactor": lambda: fo.galore_adafactor(
        lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1, rank=2,
        svd_dtype=torch.float64),
    "galore_adamw8bit_bnb": lambda: fo.galore_adamw(
        lr=1e-2, rank=2, weight_decay=0.1, eight_bit=True, min_8bit_size=4, block_size=8,
        adam_variant="bnb", eps=1e-8, svd_dtype=torch.float64),
}


def _problem(dtype):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
             for _ in range(STEPS)]
    # A transposed (non-contiguous) gradient: that leaf takes the reference, the rest not.
    grads[1]["emb"] = torch.randn(6, 9, generator=gen, dtype=dtype).T
    return params, grads


def _run(name, dtype, *, eager, donate, monkeypatch, via_update=False):
    """``STEPS`` of ``update`` (undonated runs) and ``update_params`` (``via_update``:
    ``update`` + ``apply_updates``): the new params, state and updates."""
    with monkeypatch.context() as mp:
        if not eager:
            mp.setattr(foreach_factored, "eager_allowed", lambda *a, **k: False)
            mp.setattr(lamb_kernels, "lamb_fast_ok", lambda *a, **k: False)
            mp.setattr(galore, "_eager_ok", lambda *a, **k: False)
            mp.setattr(ADAFACTOR_TORCH, "fast_path_ok", lambda *a, **k: False)
        params, grads = _problem(dtype)
        opt = OPTS[name]()
        state = opt.init(params)
        updates = []
        for g in grads:
            if not donate:  # under donation update() would consume the state
                updates.append(opt.update(g, state, params)[0])
            with inplace_updates(donate):
                if via_update:
                    u, state = opt.update(g, state, params)
                    params = fo.apply_updates(params, u)
                else:
                    params, state = fo.update_params(opt, g, state, params)
    return params, state, updates


def _leaves(tree):
    from funcpar.state import tree_flatten

    return tree_flatten(tree)[0]


def _assert_bits(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and torch.equal(x, y), f"leaf {i} differs"


# float32 for every configuration, float64 for one of each optimizer by default (the rest slow).
CASES = [pytest.param(n, torch.float32, id=f"{n}-f32") for n in sorted(OPTS)] + [
    pytest.param(n, torch.float64, id=f"{n}-f64",
                 marks=() if n in ("adafactor", "came_wd", "lamb", "galore_adamw")
                 else pytest.mark.slow) for n in sorted(OPTS)]


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_eager_path_gives_the_references_bits(name, dtype, monkeypatch):
    ref = _run(name, dtype, eager=False, donate=False, monkeypatch=monkeypatch)
    fast = _run(name, dtype, eager=True, donate=False, monkeypatch=monkeypatch)
    _assert_bits(ref, fast)
    donated = _run(name, dtype, eager=True, donate=True, monkeypatch=monkeypatch)
    _assert_bits(ref[:2], donated[:2])
    if name.startswith(("galore", "adafactor_torch")):
        # GaLore's and adafactor_torch's apply (the new weight, in place) against update +
        # apply_updates, which rounds p + (w' - p) once more: equal where the step is under
        # half the weight, else within eps (|w' - p| + |w'|) / 2 <= 4 eps here (|p| < 4,
        # steps ~1e-2).
        via = _run(name, dtype, eager=True, donate=False, via_update=True,
                   monkeypatch=monkeypatch)
        eps = torch.finfo(dtype).eps
        for a, b in zip(_leaves(ref[0]), _leaves(via[0])):
            torch.testing.assert_close(a, b, rtol=0, atol=4 * eps)


@pytest.mark.parametrize("name", ["adafactor_b1_wd", "came_wd"])
def test_factored_passes_take_the_eager_path(name, monkeypatch):
    """With the per-leaf references made to fail, a float32 step on contiguous leaves still
    runs: every pass took the eager path."""

    def boom(*a, **k):
        raise AssertionError("the reference ran")

    for ref in ("sq_row_col_sums_reference", "scaled_norm_reference", "full_moment_reference",
                "came_residual_reference", "_apply_reference", "factor_ema_reference",
                "clip_divisor_reference"):
        monkeypatch.setattr(factored, ref, boom)
    params, grads = _problem(torch.float32)
    opt = OPTS[name]()
    state = opt.init(params)
    params, state = fo.update_params(opt, grads[0], state, params)
    with pytest.raises(AssertionError, match="the reference ran"):  # a transposed gradient
        fo.update_params(opt, grads[1], state, params)


@pytest.mark.parametrize("name", ["adafactor_b1_wd", "adafactor_torch", "came_wd", "lamb",
                                  "galore_adamw", "galore_adafactor"])
def test_donated_step_writes_params_and_state_in_place(name):
    params, grads = _problem(torch.float32)
    opt = OPTS[name]()
    state = opt.init(params)
    # (GaLore writes a 0-d leaf, a float64 product there, out of place.)
    ptrs = {k: v.data_ptr() for k, v in params.items()
            if v.dim() or not name.startswith("galore")}
    with inplace_updates(True):
        new, _ = fo.update_params(opt, grads[0], state, params)
    assert {k: new[k].data_ptr() for k in ptrs} == ptrs


@pytest.mark.parametrize("name", ["adafactor_b1_wd", "came_wd", "lamb"])
def test_a_hyperparameter_requiring_grad_keeps_fast_paths_out(name):
    """Only ``lr`` requires grad: in mode auto the step keeps its graph (the eager in-place
    paths and the kernels step aside) and its hypergradient is finite; Lamb's kernel choice
    (one for the whole step) refuses it by name in mode triton."""
    make = {"adafactor_b1_wd": lambda lr: fo.adafactor(lr=lr, relative_step=False, beta1=0.9),
            "came_wd": lambda lr: fo.came(lr=lr, weight_decay=0.1),
            "lamb": lambda lr: fo.lamb(lr=lr, weight_decay=0.1)}[name]
    params, grads = _problem(torch.float32)
    lr = torch.tensor(0.01, dtype=torch.float64, requires_grad=True)
    opt = make(lr)
    if name == "lamb":
        with kernel_mode("triton"), pytest.raises(RuntimeError, match="not differentiable"):
            opt.update(grads[0], opt.init(params), params)
    with kernel_mode("auto"), inplace_updates(True):
        new, _ = fo.update_params(opt, grads[0], opt.init(params), params)
    assert all(v.requires_grad for v in new.values())
    (sum(v.sum() for v in new.values())).backward()
    assert lr.grad is not None and torch.isfinite(lr.grad)


@pytest.mark.parametrize("arg", ["pre", "post", "decay"])
def test_factored_kernel_choice_counts_tensor_hyperparameters(arg):
    """A factored pass whose only tensor requiring grad is a hyperparameter (Adafactor's
    ``alpha_t`` is ``pre``, CAME's ``lr`` is ``post``, a decay ``lr * wd``): mode triton
    refuses the kernel by name (before any Triton import), mode auto keeps the graph."""
    x, p = torch.randn(4, 3), torch.randn(4, 3)
    v = torch.rand(4, 3) + 0.5
    h = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    p0 = p.clone()
    with kernel_mode("triton"), pytest.raises(RuntimeError, match="not differentiable"):
        factored.precond_apply(x, p, v, **{arg: h})
    with kernel_mode("auto"), inplace_updates(True):
        out, _ = factored.precond_apply(x, p, v, **{arg: h})
    assert out.requires_grad and torch.equal(p, p0)  # the reference: p not written


def test_grad_mode_is_off_for_a_step_only_when_nothing_requires_grad():
    """no_grad_unless_needed (Adafactor's and CAME's steps): grad mode off when no input
    (nested lists, tuples, dicts; numbers ignored) requires grad, as it is otherwise, and
    untouched under a torch.func transform."""
    from funcpar.optim.factored import no_grad_unless_needed

    x = torch.ones(2)
    with no_grad_unless_needed([x, None], {"a": (x,)}, 1.0, None):
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    lr = torch.tensor(0.1, requires_grad=True)
    with no_grad_unless_needed([x], {"a": [x, lr]}):
        assert torch.is_grad_enabled()
    with torch.no_grad(), no_grad_unless_needed([x]):
        assert not torch.is_grad_enabled()

    def f(y):
        with no_grad_unless_needed([x]):
            assert torch.is_grad_enabled()
        return (y * y).sum()

    assert torch.equal(torch.func.grad(f)(torch.ones(2)), torch.full((2,), 2.0))
