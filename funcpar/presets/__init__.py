"""Presets: the common compositions of funcpar's transforms, named after Colossal-AI's plugins.

``step, state = hybrid_parallel(model, lm_loss, adamw(1e-3), tp_size=2, zero_stage=2)`` is
``compose(shard_params(...), data_parallel(...), zero_partition(2, ...))`` applied to
``make_train_step`` and ``init_state``, with the mesh built from the torchrun world and the
sharding rules picked for the model. The manual composition stays the primary API; a preset
only chooses its arguments (docs/PRESETS.md has the Colossal-AI -> funcpar table).
"""

from funcpar.presets.plan import CommRow, MemoryReport, Plan, describe
from funcpar.presets.presets import (
    Composed,
    Preset,
    ddp,
    gemini,
    hybrid_parallel,
    low_level_zero,
    moe_hybrid,
    pick_rules,
    titan_parallelize,
)

__all__ = [
    "CommRow",
    "Composed",
    "MemoryReport",
    "Plan",
    "Preset",
    "ddp",
    "describe",
    "gemini",
    "hybrid_parallel",
    "low_level_zero",
    "moe_hybrid",
    "pick_rules",
    "titan_parallelize",
]
