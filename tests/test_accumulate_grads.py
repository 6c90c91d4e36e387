"""accumulate_grads: K micro-batches in one step equal the K-times-larger batch (float64), and
under data parallelism / ZeRO the gradients cross the wire once per step."""

import pytest
import torch

from funcpar.shard.comm import comm_log
from funcpar.testing import run_ranks
from funcpar.testing.reference import batches, build, loss_rel, max_rel, run
from funcpar.train.step import MicroBatches
from funcpar.transforms import accumulate_grads, compose, pipeline_split


def _accumulated(tp, dp, optim, k, zero=0):
    step, state = build(tp, dp, optim, zero=zero)
    return accumulate_grads(k)(step, state)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_accumulation_equals_the_larger_batch(optim):
    # Each reference batch has 8 rows: 4 micro-batches of 2 against the batch of 8.
    want = run(*build(1, 1, optim), batches())
    got = run(*_accumulated(1, 1, optim, 4), batches())
    assert loss_rel(got[0], want[0]) <= 1e-12
    assert max_rel(got[1], want[1]) <= 1e-12


def test_micro_batches_refused_when_the_batch_does_not_divide():
    step, state = _accumulated(1, 1, "sgd", 3)
    with pytest.raises(ValueError, match="accumulate_grads.*k=3"):
        step(state, batches()[0])


def test_refused_after_pipeline_split_and_twice():
    from funcpar.shard.mesh import DeviceMesh

    step, state = build(1, 1, "sgd")
    with pytest.raises(ValueError, match="raise its microbatches"):
        compose(pipeline_split(DeviceMesh.from_env(pp=1, dp=1), microbatches=2),
                accumulate_grads(2))(step, state)
    step, state = compose(accumulate_grads(2), accumulate_grads(2))(*build(1, 1, "sgd"))
    with pytest.raises(ValueError, match="applied twice"):
        step(state, batches()[0])


def test_loss_and_grads_of_one_micro_batch_is_the_batch():
    from funcpar.models import lm_loss
    from funcpar.train.step import loss_and_grads

    step, state = build(1, 1, "sgd")
    batch = batches()[0]
    a = loss_and_grads(step.apply_fn, lm_loss, state.params, state.buffers, batch)
    b = loss_and_grads(step.apply_fn, lm_loss, state.params, state.buffers,
                       MicroBatches((batch,)))
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def _grad_collectives(k, zero):
    """dp2 (+ ZeRO) with k micro-batches: (losses, params, gradient collectives of step 1)."""
    step, state = _accumulated(1, 2, "adamw", k, zero)
    data = batches()
    with comm_log.capture() as records:
        state, _ = step(state, data[0])
    grads = [(r.op, r.purpose) for r in records if "grad" in r.purpose]
    losses, params = run(step, state, data[1:])
    return losses, params, grads


@pytest.mark.parametrize("zero", [0, 2])
def test_dp2_zero_reduces_once_per_step(zero):
    want = run(*build(1, 1, "adamw"), batches())
    for k in (1, 2):
        results = run_ranks(_grad_collectives, 2, k, zero, backend=None, timeout=180)
        if k == 1:
            once = results[0][2]
            assert once, "no gradient collective recorded"
            continue
        for losses, params, grads in results:
            assert grads == once  # the same collectives as without accumulation: once a step
            assert loss_rel(losses, want[0][1:]) <= 1e-12
            assert max_rel(params, want[1]) <= 1e-12


def test_preset_grad_accum():
    import funcpar.optim as fo
    from funcpar.models import Llama, lm_loss
    from funcpar.presets import ddp
    from funcpar.testing.reference import CFG

    def boosted(k):
        torch.manual_seed(0)
        model = Llama(CFG).double()
        return ddp(model, lm_loss, fo.sgd(lr=0.05, momentum=0.9), grad_accum=k, donate=False)

    want, got = boosted(1), boosted(4)
    assert "accumulate_grads(4)" in got.plan.transforms
    a = run(want.step, want.state, batches()[:3])
    b = run(got.step, got.state, batches()[:3])
    assert loss_rel(b[0], a[0]) <= 1e-12 and max_rel(b[1], a[1]) <= 1e-12


@pytest.mark.slow
def test_dp2_zero3_accumulates_like_the_larger_batch():
    """ZeRO-3 (its per-block gathers and reduce-scatters run once per micro-batch) with 2
    micro-batches: one process's training (float64, 1e-12)."""
    want = run(*build(1, 1, "adamw"), batches())
    for losses, params, _ in run_ranks(_grad_collectives, 2, 2, 3, backend=None, timeout=180):
        assert loss_rel(losses, want[0][1:]) <= 1e-12
        assert max_rel(params, want[1]) <= 1e-12
