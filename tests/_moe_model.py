"""The MoE model of tests/test_moe_pipeline.py and tests/test_moe_compose.py.

The reference Llama (funcpar.testing.reference.CFG) with 4 blocks, every second one MoE (4
experts, top-1, capacity factor 2.0, so tokens are dropped), the routers skewed as in
funcpar.testing.moe - larger router rows plus a common direction weighted 3, 1, -1, -3 - so
that experts 0 and 3 take most tokens: uneven all_to_all splits between ep ranks and an expert
with no token in some step (:func:`routing_is_skewed`). A balanced pp2 cut gives each stage one
dense and one MoE block.
"""

from __future__ import annotations

import dataclasses

import torch

from funcpar.models import Llama
from funcpar.testing.reference import CFG, batches

MOE4_CFG = dataclasses.replace(CFG, n_layers=4, n_experts=4, top_k=1, moe_every=2,
                               capacity_factor=2.0, aux_loss_weight=0.01, z_loss_weight=0.001)


def skew(model: Llama) -> Llama:
    """``model`` with its MoE blocks' routers skewed in place (module docstring)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            if model.cfg.is_moe(i):
                w = block.mlp.router.weight
                v = torch.randn(w.shape[1], generator=gen, dtype=w.dtype)
                w.mul_(20.0).add_(torch.outer(torch.tensor([3.0, 1.0, -1.0, -3.0],
                                                           dtype=w.dtype), v))
    return model


def skewed_model(dtype: torch.dtype = torch.float64) -> Llama:
    torch.manual_seed(0)
    return skew(Llama(MOE4_CFG).to(dtype))


def routing_is_skewed(model: Llama) -> tuple[bool, bool]:
    """Over the reference batches on one process: (an expert with no token in some step,
    the two halves of a batch sending different numbers of rows to ep rank 0 in some step)."""
    empty = uneven = False
    for tokens, _ in batches():
        out = model(tokens)
        empty |= bool((out.tokens_per_expert == 0).any())
        halves = [model(t).tokens_per_expert[:, :2].sum() for t in tokens.chunk(2)]
        uneven |= bool(halves[0] != halves[1])
    return empty, uneven
