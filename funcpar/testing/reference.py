"""The reference training run: one model, optimizer set and layout list for every comparison.

The example Llama with a vocabulary (50) and an MLP width (42) that 4 does not divide (uneven
shards 13/13/13/11 and 11/11/11/9), trained on two alternating batches of fixed random tokens,
under any composition of tensor parallelism, data parallelism and ZeRO. The distributed tests
compare every layout's run with one process's; ``benchmarks/comm_table.py`` counts the
collectives of the same runs.
"""

from __future__ import annotations

import dataclasses

import torch

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.train import make_train_step
from funcpar.transforms import (
    compose,
    data_parallel,
    pipeline_split,
    shard_params,
    zero_partition,
)

CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=42,
                  max_seq_len=16)
STEPS = 10


def _clip(opt):
    return fo.chain(fo.clip_by_global_norm(0.5), opt)


def _galore(params):
    # Rank 4, a refresh every 3 steps (steps 0, 3, 6, 9), from the whole model as a user builds
    # it before sharding. The SVD runs in float64: in float32, the last-bit differences of a
    # gradient summed in another order change the projector by ~1e-6 (measured: tp vs one
    # process 1.8e-6 on the params), which is float32's exactness, not the layout's.
    return fo.galore_param_groups(params, rank=4, update_proj_gap=3)


# float32 runs of AdamW use lr 1e-3 and eps 1e-5. Adam divides by sqrt(v) + eps, so entries
# whose gradients are near eps amplify the round-off of the summation order. Measured over 10
# steps (max relative error per leaf, against the float64 run of the same model):
#   eps 1e-8: one process float32 1.1e-5, tp2 float32 4.0e-6 (tp2 vs one process 1.0e-5)
#   eps 1e-6: one process float32 7.0e-6, tp2 float32 6.0e-6 (tp2 vs one process 1.3e-5)
#   eps 1e-5: one process float32 1.2e-6, tp2 float32 1.4e-6 (tp2 vs one process 2.0e-6)
# so at small eps float32 itself is not exact to 1e-5; tp adds no error of its own (float64
# agrees to 1e-15). The float32 case uses the better-conditioned eps.
OPTIMIZERS = {
    "sgd": lambda p: _clip(fo.sgd(lr=0.05, momentum=0.9)),
    "adamw": lambda p: _clip(fo.adamw(lr=1e-2, weight_decay=0.1)),
    "adamw_small_lr": lambda p: _clip(fo.adamw(lr=1e-3, eps=1e-5, weight_decay=0.1)),
    "adafactor": lambda p: _clip(fo.adafactor(lr=1e-2, relative_step=False,
                                              scale_parameter=False, weight_decay=0.1)),
    "adafactor_momentum": lambda p: _clip(fo.adafactor(lr=1e-2, beta1=0.9, relative_step=False,
                                                       scale_parameter=False, weight_decay=0.1)),
    "adafactor_relative": lambda p: fo.adafactor(),  # relative step, parameter-RMS scaling
    "adafactor_torch": lambda p: _clip(fo.adafactor_torch(lr=1e-2, weight_decay=0.1)),
    "came": lambda p: _clip(fo.came(lr=1e-3, weight_decay=0.1)),
    "lamb": lambda p: _clip(fo.lamb(lr=1e-2, weight_decay=0.1)),
    "galore_adamw": lambda p: _clip(fo.galore_adamw(lr=1e-2, weight_decay=0.1,
                                                    galore_mask=_galore(p),
                                                    svd_dtype=torch.float64)),
    # Blocks of 24 and a threshold of 100 so that the low-rank states are quantized in blocks
    # that straddle the shard boundaries.
    "galore_adamw8bit": lambda p: _clip(fo.galore_adamw(
        lr=1e-2, galore_mask=_galore(p), eight_bit=True, block_size=24, min_8bit_size=100,
        adam_variant="bnb", eps=1e-8, svd_dtype=torch.float64)),
    "galore_adafactor": lambda p: _clip(fo.galore_adafactor(
        lr=0.5, relative_step=False, beta1=0.9, weight_decay=0.1, galore_mask=_galore(p),
        svd_dtype=torch.float64)),
}

#: name -> (world size, tp, dp, zero stage).
LAYOUTS = {
    "tp2": (2, 2, 1, 0),
    "dp2": (2, 1, 2, 0),
    "dp2+zero1": (2, 1, 2, 1),
    "dp2+zero2": (2, 1, 2, 2),
    "dp2+zero3": (2, 1, 2, 3),
    "tp4": (4, 4, 1, 0),
    "dp4+zero2": (4, 1, 4, 2),
    "tp2xdp2+zero2": (4, 2, 2, 2),
    "tp2xdp2+zero3": (4, 2, 2, 3),
}


#: The example model with 8 blocks, for pipelines (up to pp4 x 2 virtual stages; uneven
#: stages by explicit cuts). Adafactor amplifies any last-bit difference along its trajectory
#: (a one-ulp change of the first clip coefficient grows to 1.4e-9 over 10 steps with 9
#: blocks), so summing the gradient in parts (micro-batches or dp4 alike) ends 3.6e-9 from one
#: process there; with 8 blocks, 3.1e-11 (docs/PIPELINE.md, "Adafactor and the last bit").
PP_CFG = dataclasses.replace(CFG, n_layers=8)


def build(tp, dp, optim, dtype=torch.float64, *, zero=0, vocab_parallel_loss=True,
          sequence_parallel=False, cfg=None, pp=1, microbatches=None, schedule="1f1b",
          virtual_stages=1, cuts=None):
    """The composed ``(step, state)`` of ``optim`` under tp x dp (+ ZeRO) on this rank.

    ``cfg``: the model's config (default :data:`CFG`). With ``pp > 1`` or ``microbatches``
    the model is first cut by ``pipeline_split`` over a mesh ``(pp, dp, tp)``.
    """
    cfg = CFG if cfg is None else cfg
    piped = pp > 1 or microbatches is not None
    mesh = DeviceMesh.from_env(pp=pp, dp=dp, tp=tp) if piped else DeviceMesh.from_env(dp=dp,
                                                                                     tp=tp)
    torch.manual_seed(0)
    model = Llama(cfg).to(dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params)
    step = make_train_step(apply_fn, lm_loss, opt)
    state = init_state(params, buffers, opt)
    transforms = []
    if piped:
        transforms.append(pipeline_split(mesh, microbatches=microbatches or 1,
                                         schedule=schedule, virtual_stages=virtual_stages,
                                         cuts=cuts))
    if tp > 1:
        rules = llama_rules(cfg.head_dim, vocab_parallel_loss=vocab_parallel_loss)
        kw = {"sequence_parallel": True} if sequence_parallel else {}
        transforms.append(shard_params(rules, mesh, **kw))
    if dp > 1:
        transforms.append(data_parallel(mesh))
    if zero:
        transforms.append(zero_partition(zero, mesh))
    return compose(*transforms)(step, state)


def train(tp, dp, optim, dtype=torch.float64, *, zero=0, vocab_parallel_loss=True,
          sequence_parallel=False, **pipeline):
    """10 steps; returns (losses, whole params) on every rank. ``pipeline``: :func:`build`'s
    ``cfg``, ``pp``, ``microbatches``, ``schedule``, ``virtual_stages``, ``cuts``; under a
    pipeline the params are this rank's stages' leaves (whole over tp and dp)."""
    step, state = build(tp, dp, optim, dtype, zero=zero, vocab_parallel_loss=vocab_parallel_loss,
                        sequence_parallel=sequence_parallel, **pipeline)
    return run(step, state, batches())


def run(step, state, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``step`` over the batches of ``data`` from ``state``: (losses, whole params), the params
    gathered over the layout's shards (a pipeline rank's own stages' leaves)."""
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    params = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    return losses, params


def batches(seed=0):
    """``STEPS`` batches: two batches of random tokens in turn, seen repeatedly, so the loss
    can fall."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (2, 8, 13), generator=g)
    return [(ids[i % 2, :, :-1], ids[i % 2, :, 1:]) for i in range(STEPS)]


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Max over leaves of max|a - b| / max|b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def loss_rel(a: list[float], b: list[float]) -> float:
    """Max over steps of |a - b| / |b|."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
