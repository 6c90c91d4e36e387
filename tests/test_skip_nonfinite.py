"""skip_nonfinite (issue 20, item 6a): a step with an inf/nan gradient is skipped and counted
in float32, bf16 and (wrapping its loss scaler) fp16; ``policy="raise"`` stops at the k-th in a
row; under dp2 + ZeRO-2 a nan in one rank's part of the gradients skips the step on both.

A one-Linear model and an MSE loss: a nan in the inputs makes every weight gradient nan.
"""

from __future__ import annotations

import pytest
import torch

from funcpar.optim import adamw
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.state.tree import tree_leaves
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.transforms import amp_cast, compose, data_parallel, skip_nonfinite, zero_partition
from funcpar.transforms.skip_nonfinite import NonFiniteError


def _mse(out, target):
    return ((out.float() - target) ** 2).mean()


def _build(*transforms):
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(torch.nn.Linear(8, 4))
    opt = adamw(lr=1e-2)
    return compose(*transforms)(make_train_step(apply_fn, _mse, opt),
                                init_state(params, buffers, opt))


def _batch(i, bad=False):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    if bad:
        x[0, 0] = float("nan")
    return x, y


def _same(a, b):
    return all(torch.equal(x, y) if torch.is_tensor(x) else x == y
               for x, y in zip(tree_leaves(a), tree_leaves(b)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_step_is_skipped_and_counted(precision):
    amp = [amp_cast("bf16")] if precision == "bf16" else []
    # Unguarded, the nan reaches every parameter (the failure this guards against).
    step, state = _build(*amp)
    bad, _ = step(state, _batch(1, bad=True))
    assert all(torch.isnan(p).all() for p in tree_leaves(bad.params))

    ref_step, ref = _build(*amp)
    step, state = _build(*amp, skip_nonfinite())
    ref, _ = ref_step(ref, _batch(0))
    state, m = step(state, _batch(0))
    assert not bool(m["skipped"]) and int(m["skipped_steps"]) == 0
    assert _same(state.params, ref.params)  # the guard's clean step is the plain step's bits
    before = state
    state, m = step(state, _batch(1, bad=True))
    assert bool(m["skipped"]) and int(m["skipped_steps"]) == 1
    assert state.params is before.params and state.opt_state is before.opt_state
    assert int(state.step) == 2 and int(state.extras["skipped_steps"]) == 1
    assert int(state.extras["nonfinite_run"]) == 1
    ref, _ = ref_step(ref, _batch(2))
    state, m = step(state, _batch(2))
    assert _same(state.params, ref.params) and _same(state.opt_state, ref.opt_state)
    assert int(state.extras["nonfinite_run"]) == 0 and int(state.extras["skipped_steps"]) == 1


def test_raise_after_k_consecutive():
    step, state = _build(skip_nonfinite("raise", max_consecutive=2))
    state, _ = step(state, _batch(0, bad=True))
    state, _ = step(state, _batch(1))  # a clean step resets the run
    state, _ = step(state, _batch(2, bad=True))
    with pytest.raises(NonFiniteError, match=r"2 consecutive steps had non-finite .* \(3 "
                                             r"skipped in all\).*max_consecutive=2"):
        step(state, _batch(3, bad=True))
    assert int(state.extras["skipped_steps"]) == 2  # the state held is the one before


def test_wraps_fp16_loss_scaling():
    step, state = _build(amp_cast("fp16"), skip_nonfinite("raise", max_consecutive=2))
    scale = float(state.extras["loss_scale"])
    state, m = step(state, _batch(0, bad=True))
    # fp16's own skip and backoff, the guard's count, both metrics.
    assert bool(m["skipped"]) and int(m["skipped_steps"]) == 1 and "loss_scale" in m
    assert float(state.extras["loss_scale"]) == scale / 2
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        step(state, _batch(1, bad=True))


def test_errors():
    with pytest.raises(ValueError, match="policy must be one of"):
        skip_nonfinite("ignore")
    with pytest.raises(ValueError, match="max_consecutive must be an int >= 1"):
        skip_nonfinite("raise", max_consecutive=0)
    step, state = _build(skip_nonfinite())
    with pytest.raises(ValueError, match="already applied"):
        skip_nonfinite()(step, state)
    with pytest.raises(ValueError, match="apply amp_cast first, then skip_nonfinite"):
        amp_cast("fp16")(step, state)  # it would replace the guard


class _Scale(torch.nn.Module):
    """out = x * a: a nan in column 0 of x makes only a[0]'s gradient nan."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x * self.a


def _zero2():
    mesh = DeviceMesh.from_env(dp=2, tp=1)
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(_Scale())
    opt = adamw(lr=1e-2)
    step0, state0 = make_train_step(apply_fn, _mse, opt), init_state(params, buffers, opt)
    try:
        compose(data_parallel(mesh), zero_partition(2, mesh), skip_nonfinite())(step0, state0)
        refused = None
    except ValueError as err:
        refused = str(err)
    step, state = compose(data_parallel(mesh), zero_partition(2, mesh),
                          skip_nonfinite(mesh=mesh))(step0, state0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    state, _ = step(state, (x, y))
    # After ZeRO-2's reduce-scatter only the rank holding a[0]'s part sees the nan: the other
    # skips because the verdict is agreed (alone, it would run the optimizer and its gather).
    bad = x.clone()
    bad[0, 0] = float("nan")
    after, m = step(state, (bad, y))
    skipped = bool(m["skipped"]) and _same(after.params, state.params)
    after, m = step(after, (x, y))
    return refused, skipped, int(after.extras["skipped_steps"]), tree_leaves(after.params)


def test_zero2_ranks_agree_on_a_skip():
    res = run_ranks(_zero2, 2, backend=None, timeout=120)
    for refused, skipped, count, _ in res:
        assert refused is not None and "needs mesh=" in refused
        assert skipped and count == 1
    assert _same(res[0][3], res[1][3])
