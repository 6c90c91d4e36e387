"""Each optimizer of issue 4 trains the example model on CPU: 50 steps, the loss falls.

The model is funcpar's Llama, made small (2 layers, dim 32, vocab 64) so that 50 steps of every
optimizer take a few seconds in all; the data is a fixed, learnable token stream: each sequence
follows ``x_{i+1} = (a x_i + b) mod V`` from a random start, so the next token is a function of
the current one and a model that learns drives the loss far below ln(V) = 4.16. The steps are
funcpar's own pure train step (``make_train_step``) on the ``functionalize``d model, the
optimizers those of ``examples/train_lm.py`` (a global-norm clip, then the optimizer).

What is asserted, per optimizer: every loss is finite, and the mean of the last five losses is
below 25 % of the first loss (measured: 0.1-6.5 %, see MAX_LAST5_OVER_FIRST below), and below
the mean of the first five. The bound is ~4x the worst measured value so the test is not flaky,
and far below 100 % so an optimizer that does not learn (or diverges) fails it.
"""

from __future__ import annotations

import math

import pytest
import torch

from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import chain, clip_by_global_norm, matrices_only
from funcpar.optim.adafactor import adafactor
from funcpar.optim.adafactor_torch import adafactor_torch
from funcpar.optim.came import came
from funcpar.optim.galore import galore_adafactor, galore_adamw, galore_param_groups
from funcpar.optim.lamb import lamb
from funcpar.optim.quant8 import Quantized
from funcpar.state import functionalize, init_state
from funcpar.state.tree import tree_leaves
from funcpar.train import make_train_step

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 50
CFG = LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=SEQ)
# Measured (torch 2.13, CPU) mean(last 5 losses) / first loss, for the record:
# adafactor 0.007, adafactor_torch 0.065, came 0.009, lamb 0.058, galore 0.002, galore8bit 0.002,
# galore_adafactor 0.001. (Lamb at lr 1e-2 reaches only 0.79 in 50 steps: its trust ratio
# scales the step by ||w||, small at this init, so it gets a larger lr.)
MAX_LAST5_OVER_FIRST = 0.25


def _galore_mask(params):
    # Rank 8 of the 32-wide attention and MLP matrices; refresh every 10 steps, so the 50
    # steps cross 5 projector refreshes.
    return galore_param_groups(params, rank=8, update_proj_gap=10, scale=0.25)


# name -> (factory of params -> GradientTransformation). Learning rates: the usual order of
# magnitude for each (Adafactor/CAME/Lamb large, as train_lm.py's entries).
OPTIMIZERS = {
    "adafactor": lambda p: adafactor(lr=1e-2, relative_step=False, scale_parameter=False,
                                     weight_decay=0.01, weight_decay_mask=matrices_only),
    # The preset that is torch.optim.Adafactor (relative step, its lr is the cap).
    "adafactor_torch": lambda p: adafactor_torch(lr=3e-2),
    "came": lambda p: came(lr=3e-3, weight_decay=0.01, weight_decay_mask=matrices_only),
    "lamb": lambda p: lamb(lr=3e-2, weight_decay=0.01, weight_decay_mask=matrices_only),
    "galore": lambda p: galore_adamw(lr=1e-2, galore_mask=_galore_mask(p)),
    # min_8bit_size=0: every moment of this small model is 8-bit (the default 4096 would keep
    # the low-rank ones in fp32), so the quantized path is what is trained.
    "galore8bit": lambda p: galore_adamw(lr=1e-2, galore_mask=_galore_mask(p), eight_bit=True,
                                         min_8bit_size=0, block_size=64),
    "galore_adafactor": lambda p: galore_adafactor(lr=3e-2, relative_step=False,
                                                   scale_parameter=False,
                                                   galore_mask=_galore_mask(p)),
}


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    seq = [start]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def _train(name: str) -> tuple[list[float], object]:
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG))
    opt = chain(clip_by_global_norm(1.0), OPTIMIZERS[name](params))
    state = init_state(params, buffers, opt)
    step = make_train_step(apply_fn, lm_loss, opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, _batch(gen))
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_loss_falls_over_50_steps(name):
    losses, state = _train(name)
    assert len(losses) == STEPS and int(state.step) == STEPS
    assert all(math.isfinite(x) for x in losses), losses
    first, late = losses[0], sum(losses[-5:]) / 5
    # A fresh model predicts ~uniformly: the first loss is ln(VOCAB) give or take.
    assert abs(first - math.log(VOCAB)) < 0.5, first
    assert late < MAX_LAST5_OVER_FIRST * first, (name, first, late, losses)
    assert late < sum(losses[:5]) / 5
    if name == "galore8bit":
        # The 8-bit path really ran: moments are kept as Quantized (uint8 codes + absmax).
        quantized = [x for x in tree_leaves(state.opt_state)
                     if torch.is_tensor(x) and x.dtype == torch.uint8]
        assert quantized
    if name.startswith("galore"):
        inner = state.opt_state[1].inner  # chain: (clip state, galore state)
        q = inner.projector["layers.0.self_attn.q_proj.weight"]
        assert q is not None and inner.projector["norm.weight"] is None
        if name == "galore8bit":
            assert isinstance(inner.exp_avg["layers.0.mlp.up_proj.weight"], Quantized)


def test_galore8bit_tracks_the_fp32_galore_run():
    """The same 50 steps with 8-bit moments (every moment quantized, blocks of 64) and with fp32
    ones: the two loss curves stay together.

    Measured (torch 2.13, CPU): max |loss8 - loss32| = 6.7e-4 over the 50 steps (at step 22,
    loss ~0.7), max relative difference 1.5 % (late, where the loss is ~0.01); the bound below
    is ~7x the absolute one. (tests/test_galore.py::test_eight_bit_tracks_fp32 bounds the
    moments and parameters themselves on random gradients.)
    """
    l8, _ = _train("galore8bit")
    l32, _ = _train("galore")
    diff = max(abs(a - b) for a, b in zip(l8, l32))
    assert diff <= 5e-3, (diff, l8, l32)
    # Not vacuous: the run learns, and the 8-bit run is not bit-identical to the fp32 one.
    assert l32[-1] < 0.25 * l32[0] and l8 != l32
