"""compile=True with remat: the checkpointed blocks inside the whole-step region
(funcpar/train/whole_step.py; funcpar/transforms/remat.py ``_contexts``).

``make_fx`` runs each checkpoint as eager does, so the forward is traced once and the
recompute again in the backward's place: the graph holds the blocks' forward ops twice and no
longer keeps their activations from the forward to the backward (checked on the traced graph:
its matmul count and its peak of live intermediate bytes in graph order,
``whole_step.peak_live_bytes``). A step whose trace draws random numbers under remat is refused
by the region (the recompute would not replay the forward's draws) and compiles the forward
and backward only.

Reference: the same step eager (remat on), same state and batches: float64 with the ``eager``
backend (dynamo captures the traced graph without generating code; the traced optimizer takes
the reference maths where eager takes its in-place fast path, so 10 steps agree to float64
round-off, 1e-12 relative), and float32 under inductor (torch.testing's float32 tolerances,
as tests/test_compile_step.py). Those are slow; the default suite keeps the refusal of random
draws here and tests/test_remat.py's compiled remat comparison (one region, the peak falls).
"""

from __future__ import annotations

import collections

import pytest
import torch
from test_compile_step import _fresh, _region_ran_once  # the tests' dir is on sys.path
from torch import nn

import funcpar.optim as fo
import funcpar.train.whole_step as whole_step
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.state import functionalize, init_state
from funcpar.train import make_train_step
from funcpar.transforms import remat

STEPS = 10
# Activations (batch 4 x 32 tokens) outweigh the parameters and optimizer state, so the
# graph's peak of live intermediates is the activations' and remat shows in it.
CFG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=32)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(x, x) for x in (torch.randint(0, 32, (4, 32), generator=g) for _ in range(STEPS))]


def _build(dtype, compile, rematted):
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG).to(dtype))
    opt = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2))
    step = make_train_step(apply_fn, lm_loss, opt, compile=compile)
    state = init_state(params, buffers, opt)
    return remat()(step, state) if rematted else (step, state)


def _train(dtype, compile, rematted):
    step, state = _build(dtype, compile, rematted)
    losses = []
    for b in _batches():
        state, m = step(state, b)
        losses.append(m["loss"])
    return step, state, torch.stack(losses)


def _one_region(step):
    _region_ran_once(step)
    (graph,) = step._whole.traced_graphs()
    return graph


def _matmuls(graph):
    return collections.Counter(str(n.target) for n in graph.graph.nodes)["aten.mm.default"]


@pytest.mark.slow  # the default suite has tests/test_remat.py's compiled remat comparison
def test_remat_in_the_whole_step_region(monkeypatch):
    """float64, 10 steps: equal to the eager remat step, 0 graph breaks, one graph, and the
    graph recomputes the blocks (more matmuls than the same step's graph without remat) with
    a lower peak of live intermediates (measured 1.22 -> 0.79 MB: 57 matmuls against 45)."""
    _fresh("eager", monkeypatch)
    _, ref, ref_losses = _train(torch.float64, False, True)
    step, got, losses = _train(torch.float64, True, True)
    graph = _one_region(step)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=0)
    for k in ref.params:
        torch.testing.assert_close(got.params[k], ref.params[k], rtol=1e-12, atol=1e-14, msg=k)
    plain, state = _build(torch.float64, True, False)  # its graph traced only, not compiled
    plain = plain._whole.graph(state.params, state.buffers, state.opt_state, _batches()[0],
                               state.extras)
    assert _matmuls(graph) > _matmuls(plain)
    peaks = whole_step.peak_live_bytes(graph), whole_step.peak_live_bytes(plain)
    assert peaks[0] < 0.8 * peaks[1], peaks


class _DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.25), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_random_draws_under_remat_are_refused_by_the_region():
    """A traced step with dropout under remat raises NotTraceable, naming the op; without
    remat the same trace is accepted (its draws are the compiled graph's, as under
    torch.compile of a module)."""
    def dropped(x, *rest):
        return (torch.nn.functional.dropout(x, 0.5, training=True),)

    def attended(q, *rest):  # dropout_p = 0: an op tagged random that draws nothing
        return (torch.nn.functional.scaled_dot_product_attention(q, q, q),)

    with pytest.raises(whole_step.NotTraceable,
                       match=r"remat with random ops in the step \(aten\.bernoulli"):
        whole_step.WholeStep(dropped, remat=True)(torch.ones(4), None, None, None, None)
    whole_step.WholeStep(dropped)(torch.ones(4), None, None, None, None)
    whole_step.WholeStep(attended, remat=True)(torch.ones(1, 2, 4, 8), None, None, None, None)


@pytest.mark.slow
def test_random_draws_under_remat_fall_back_to_forward_backward():
    """The TrainStep falls back at its first call: the forward and backward compiled, the
    rest eager; the step stays pure (the same state twice gives the same result)."""
    torch._dynamo.reset()
    apply_fn, params, buffers = functionalize(_DropNet())
    opt = fo.adamw(lr=0.01)
    step = make_train_step(apply_fn, nn.functional.cross_entropy, opt, compile=True)
    step, state = remat()(step, init_state(params, buffers, opt))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    a, ma = step(state, batch)
    assert step._whole is None
    b, mb = step(state, batch)
    assert torch.equal(ma["loss"], mb["loss"])
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_remat_whole_step_inductor_float32(monkeypatch):
    """float32 under inductor, 10 steps against the eager remat step: float32 round-off."""
    _fresh("inductor", monkeypatch)
    _, ref, ref_losses = _train(torch.float32, False, True)
    step, got, losses = _train(torch.float32, True, True)
    _one_region(step)
    torch.testing.assert_close(losses, ref_losses)
    for k in ref.params:
        torch.testing.assert_close(got.params[k], ref.params[k], msg=k)
