"""make_eval_step: a pure evaluation step, token-weighted, equal under tp2, dp2 + ZeRO-3 and
pp2 to one process (float64)."""

import math

import pytest
import torch

from funcpar.models import lm_loss
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, batches, build
from funcpar.train import evaluate, make_eval_step
from funcpar.transforms import accumulate_grads


def _eval_batches():
    """Two held-out batches whose targets ignore a different number of tokens per row, so a
    mean of per-slice means would differ from the token mean."""
    g = torch.Generator().manual_seed(7)
    out = []
    for b in range(2):
        ids = torch.randint(0, CFG.vocab_size, (8, 13), generator=g)
        targets = ids[:, 1:].clone()
        for row in range(8):
            targets[row, : (row * 3 + b) % 11] = -100
        out.append((ids[:, :-1], targets))
    return out


def _trained(layout: dict):
    """A state after two training steps under ``layout`` (reference.build's keywords), and
    the eval step made from the transformed train step."""
    step, state = build(**layout)
    for batch in batches()[:2]:
        state, _ = step(state, batch)
    return make_eval_step(step), state


def _metrics(layout: dict):
    eval_step, state = _trained(layout)
    return [{k: float(v) for k, v in eval_step(state, b).items()} for b in _eval_batches()]


ONE = {"tp": 1, "dp": 1, "optim": "adamw"}


def test_eval_is_the_token_mean_and_pure():
    eval_step, state = _trained(ONE)
    before = {n: p.clone() for n, p in state.params.items()}
    rng = state.rng.clone()
    for inputs, targets in _eval_batches():
        m = eval_step(state, (inputs, targets))
        out, _ = eval_step.apply_fn(state.params, state.buffers, inputs)
        want = lm_loss(out, targets)
        assert abs(float(m["loss"]) - float(want)) <= 1e-13
        assert int(m["tokens"]) == int((targets != -100).sum())
        assert float(m["ppl"]) == pytest.approx(math.exp(float(want)), rel=1e-13)
        again = eval_step(state, (inputs, targets))
        assert torch.equal(again["loss"], m["loss"])
    assert all(torch.equal(before[n], state.params[n]) for n in before)
    assert torch.equal(rng, state.rng)
    # evaluate: combined over batches by tokens.
    both = evaluate(eval_step, state, _eval_batches())
    each = [eval_step(state, b) for b in _eval_batches()]
    n = sum(int(m["tokens"]) for m in each)
    assert both["tokens"] == n
    assert both["loss"] == pytest.approx(sum(float(m["loss"]) * int(m["tokens"])
                                             for m in each) / n, rel=1e-14)


def test_eval_under_accumulation_is_the_same():
    want = _metrics(ONE)
    step, state = build(**ONE)
    step, state = accumulate_grads(2)(step, state)
    for batch in batches()[:2]:
        state, _ = step(state, batch)
    got = [{k: float(v) for k, v in make_eval_step(step)(state, b).items()}
           for b in _eval_batches()]
    for a, b in zip(got, want):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-12 * b["loss"]


LAYOUTS = {
    "tp2": (2, {"tp": 2, "dp": 1, "optim": "adamw"}),
    "dp2+zero3": (2, {"tp": 1, "dp": 2, "optim": "adamw", "zero": 3}),
    "pp2": (2, {"tp": 1, "dp": 1, "optim": "adamw", "pp": 2, "microbatches": 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_under_a_layout_equals_one_process(name):
    world, layout = LAYOUTS[name]
    want = _metrics(ONE)
    for got in run_ranks(_metrics, world, layout, backend=None, timeout=180):
        for a, b in zip(got, want):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) <= 1e-12 * b["loss"], (name, a, b)
            assert abs(a["ppl"] - b["ppl"]) <= 1e-11 * b["ppl"]


def _moe_metrics(layout_name: str):
    from funcpar.testing import moe

    lay = moe.LAYOUTS[layout_name] if layout_name != "one" else moe.MoeLayout()
    step, state = moe.build(lay, "adamw")
    for batch in batches()[:2]:
        state, _ = step(state, batch)
    eval_step = make_eval_step(step)
    return [{k: float(v) for k, v in eval_step(state, b).items()} for b in _eval_batches()]


def test_moe_eval_is_the_cross_entropy_alone():
    from funcpar.testing import moe

    step, state = moe.build(moe.MoeLayout(), "adamw")
    eval_step = make_eval_step(step)
    inputs, targets = _eval_batches()[0]
    out, _ = step.apply_fn(state.params, state.buffers, inputs)
    assert float(out.router_loss) > 0
    got = float(eval_step(state, (inputs, targets))["loss"])
    assert abs(got - float(lm_loss(out.logits, targets))) <= 1e-13


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "tp2"])
def test_moe_eval_under_ep_and_tp_equals_one_process(name):
    want = _moe_metrics("one")
    for got in run_ranks(_moe_metrics, 2, name, backend=None, timeout=300):
        for a, b in zip(got, want):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) <= 1e-12 * b["loss"], (name, a, b)
