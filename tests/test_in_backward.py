"""The optimizer in the backward equals the normal step (float64) and refuses a global clip."""

import pytest
import torch

from funcpar import optim as fo
from funcpar.models import Llama, lm_loss
from funcpar.state import functionalize, init_state, tree_flatten
from funcpar.testing.reference import CFG, batches
from funcpar.train import make_train_step

OPTS = {
    "adamw": lambda: fo.adamw(lr=1e-2, weight_decay=0.1),
    "sgd": lambda: fo.sgd(lr=0.05, momentum=0.9),
    "adafactor": lambda: fo.adafactor(lr=1e-2, relative_step=False, scale_parameter=False,
                                      weight_decay=0.1),
    "came": lambda: fo.came(lr=1e-3, weight_decay=0.1),
}


def _run(optim, **kw):
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG).to(torch.float64))
    opt = OPTS[optim]()
    step = make_train_step(apply_fn, lm_loss, opt, **kw)
    state = init_state(params, buffers, opt)
    out = []
    for batch in batches()[:3]:
        state, m = step(state, batch)
        out.append((float(m["loss"]), float(m["grad_norm"])))
    return out, state


@pytest.mark.parametrize("optim", sorted(OPTS))
def test_in_backward_equals_normal_step(optim):
    ref, s0 = _run(optim)
    got, s1 = _run(optim, donate=True, update_in_backward=True)
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert abs(l0 - l1) <= 1e-12 * abs(l0) and abs(g0 - g1) <= 1e-12 * g0
    a, sa = tree_flatten((s0.params, s0.opt_state))
    b, sb = tree_flatten((s1.params, s1.opt_state))
    assert sa == sb
    for x, y in zip(a, b):
        if torch.is_tensor(x) and x.is_floating_point():
            assert (x - y).abs().max() <= 1e-12 * max(1.0, float(x.abs().max()))
        elif torch.is_tensor(x):
            assert torch.equal(x, y)


def test_in_backward_refuses_global_clip_and_undonated():
    apply_fn, _, _ = functionalize(Llama(CFG))
    clipped = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=1e-3))
    with pytest.raises(ValueError, match="clip_by_global_norm"):
        make_train_step(apply_fn, lm_loss, clipped, donate=True, update_in_backward=True)
    with pytest.raises(ValueError, match="donate=True"):
        make_train_step(apply_fn, lm_loss, fo.adamw(lr=1e-3), update_in_backward=True)
