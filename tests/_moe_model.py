"""The MoE model of tests/test_moe_pipeline.py and tests/test_moe_compose.py.

The reference Llama (funcpar.testing.reference.CFG) with 4 blocks, every second one MoE (4
experts, top-1, capacity factor 2.0, so tokens are dropped), the routers skewed by
:func:`funcpar.testing.moe.skew` (experts 0 and 3 take most tokens: uneven all_to_all splits
between ep ranks and an expert with no token in some step, which
:func:`funcpar.testing.moe.routing_is_skewed` checks). A balanced pp2 cut gives each stage one
dense and one MoE block.
"""

from __future__ import annotations

import dataclasses

import torch

from funcpar.models import Llama
from funcpar.testing import moe
from funcpar.testing.reference import CFG

MOE4_CFG = dataclasses.replace(CFG, n_layers=4, n_experts=4, top_k=1, moe_every=2,
                               capacity_factor=2.0, aux_loss_weight=0.01, z_loss_weight=0.001)


def skewed_model(dtype: torch.dtype = torch.float64) -> Llama:
    """:data:`MOE4_CFG`'s Llama in ``dtype``, its routers skewed."""
    return moe.skewed_model(dtype, MOE4_CFG)


def routing_is_skewed() -> tuple[bool, bool]:
    """(an expert with no token in some step, uneven ep2 splits in some step), one process."""
    return moe.routing_is_skewed(skewed_model())
