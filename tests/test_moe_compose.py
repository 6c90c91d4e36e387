"""expert_parallel composed with amp_cast (bf16) and with lazy initialization.

The model is tests/_moe_model.py's (4 blocks, every second one MoE with 4 skewed top-1
experts, capacity factor 2.0).

* Lazy init: a meta-built MoE model cut by ``expert_parallel`` (ep2; ep2 x dp2 + ZeRO-2 under
  ``-m slow``) and then materialized holds, on every rank, bit for bit the shards of the same
  init materialized whole and then cut (virtual meshes, one process); trained 3 steps under ep2
  from the lazy state it matches one process trained from the whole init within 1e-10 (float64:
  the collectives only reorder sums).
* amp_cast("bf16") after expert_parallel (ep2) against one-process bf16, 5 AdamW steps. A bf16
  run is not exact against another bf16 run whose sums are associated differently (each
  rank's gradient is rounded to bf16 over its half of the batch, one process rounds the
  whole), so the check is relative to the precision itself: the first loss agrees to float32
  rounding, 1e-6 (the forward is per token and routing is per sequence, so the same bf16
  products are taken; only the loss's mean is reassociated; measured: equal), and over the
  run ep2's largest loss gap to one-process bf16 and its parameters' distance are no larger
  than one-process bf16's to float32 training (measured: 7.1e-4 vs 1.7e-3 in loss); the loss
  falls. AdamW at lr 1e-3, eps 1e-5: reference.py's float32 setting.
"""

import pytest
import torch
from _lazy_check import assert_same_state
from _moe_model import MOE4_CFG, skewed_model

from funcpar.init import llama_inits, materialize, meta_device
from funcpar.models import Llama, moe_lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.testing.moe import one_thread
from funcpar.testing.reference import OPTIMIZERS, batches, loss_rel, max_rel, run
from funcpar.train import make_train_step
from funcpar.transforms import (
    amp_cast,
    compose,
    data_parallel,
    expert_parallel,
    zero_partition,
)

LAZY_STEPS = 3
AMP_STEPS = 5


# --------------------------------------------------------------------------------- lazy init
def _meta_step(optim="adamw"):
    with meta_device():
        model = Llama(MOE4_CFG, dtype=torch.float64)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params)
    return make_train_step(apply_fn, moe_lm_loss, opt), init_state(params, buffers, opt)


def _parallel(mesh, dp, zero):
    out = [expert_parallel(mesh)]
    if dp > 1:
        out.append(data_parallel(mesh))
    if zero:
        out.append(zero_partition(zero, mesh))
    return out


def _lazy(mesh, dp=1, zero=0):
    """Meta model -> expert_parallel (...) -> materialize: only this rank's experts exist."""
    return compose(*_parallel(mesh, dp, zero),
                   materialize(seed=1, inits=llama_inits(MOE4_CFG)))(*_meta_step())


def _full(mesh=None, dp=1, zero=0):
    """The same init materialized whole, then cut by the same transforms (none: one process)."""
    step, state = materialize(seed=1, inits=llama_inits(MOE4_CFG))(*_meta_step())
    return (step, state) if mesh is None else compose(*_parallel(mesh, dp, zero))(step, state)


@pytest.mark.parametrize("ep,dp,zero", [(2, 1, 0), pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_lazy_moe_equals_whole_init_shard_for_shard(ep, dp, zero):
    experts = "layers.1.mlp.experts.gate_proj"
    for rank in range(ep * dp):
        mesh = DeviceMesh.virtual(rank=rank, ep=ep, dp=dp)
        with one_thread():
            lazy_step, lazy_state = _lazy(mesh, dp, zero)
            full_step, full_state = _full(mesh, dp, zero)
        assert lazy_step.layouts == full_step.layouts
        assert_same_state(lazy_state, full_state, ep, dp, zero, rank)
        if zero == 0:  # this rank's 2 of the 4 experts, not a copy of the others'
            local = lazy_state.params[experts]
            assert local.shape[0] == 2 and not torch.equal(local[0], local[1])
            whole = _full()[1].params[experts]
            assert torch.equal(local, whole[2 * rank:2 * rank + 2])


# ------------------------------------------------------------------------ ranks: lazy and amp
def _amp(precision, mesh=None):
    model = skewed_model(torch.float32)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS["adamw_small_lr"](params)  # the float32 runs' AdamW (reference.py)
    step = make_train_step(apply_fn, moe_lm_loss, opt)
    state = init_state(params, buffers, opt)
    transforms = [] if mesh is None else [expert_parallel(mesh)]
    if precision is not None:
        transforms.append(amp_cast(precision, mesh=mesh))
    return compose(*transforms)(step, state) if transforms else (step, state)


def _on_ep2():
    mesh = DeviceMesh.from_env(ep=2)
    lazy = run(*_lazy(mesh), batches()[:LAZY_STEPS])
    amp = run(*_amp("bf16", mesh), batches()[:AMP_STEPS])
    return lazy, amp


def test_lazy_init_and_bf16_under_ep2():
    with one_thread():
        lazy_ref = run(*_full(), batches()[:LAZY_STEPS])
        bf16 = run(*_amp("bf16"), batches()[:AMP_STEPS])
        fp32 = run(*_amp(None), batches()[:AMP_STEPS])
        results = run_ranks(_on_ep2, 2, timeout=600)
    for rank, ((losses, params), (amp_losses, amp_params)) in enumerate(results):
        err = max(loss_rel(losses, lazy_ref[0]), max_rel(params, lazy_ref[1]))
        print(f"rank {rank} lazy ep2 vs whole init, one process: {err:.2e}")
        assert err <= 1e-10, (rank, err)
        # bf16: the first loss up to float32 rounding of the reassociated mean...
        first = abs(amp_losses[0] - bf16[0][0]) / abs(bf16[0][0])
        # ... then no further from one-process bf16 than bf16 is from float32 over the run.
        gaps = [abs(a - b) for a, b in zip(amp_losses, bf16[0])]
        precision = [abs(a - b) for a, b in zip(bf16[0], fp32[0])]
        print(f"rank {rank} bf16 ep2 vs one process: first loss {first:.1e}, |loss| gaps "
              f"{[f'{g:.1e}' for g in gaps]} vs bf16-fp32 {[f'{p:.1e}' for p in precision]}")
        assert first <= 1e-6, (rank, first)
        assert max(gaps) <= max(precision), (rank, gaps, precision)
        assert max_rel(amp_params, bf16[1]) <= max_rel(bf16[1], fp32[1]), rank
        assert amp_losses[-1] < amp_losses[0], rank
