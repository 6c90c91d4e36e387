"""Sharding: the device mesh, per-leaf layouts, accounted collectives, layout-aware reductions.

See docs/SHARDING.md. Imports flow ``mesh <- comm <- layout``; :mod:`funcpar.shard.reduce`
depends on none of them (it asks only for the :class:`~funcpar.shard.reduce.Reducible`
protocol that :class:`Layout` satisfies).
"""

from funcpar.shard.comm import CommRecord, comm_log, comm_report
from funcpar.shard.layout import (
    Layout,
    Replicate,
    Shard,
    check_layouts,
    shard_tensor,
    shard_tree,
    unshard,
    unshard_tree,
    with_leaf_names,
)
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.reduce import (
    Reducible,
    norm,
    reduce_max,
    reduce_mean,
    reduce_sum,
    rms,
    sum_of_squares,
)
from funcpar.shard.rules import (
    LocalAttr,
    Rule,
    ShardingPlan,
    bert_rules,
    gpt2_rules,
    hf_rules,
    llama_rules,
    plan_sharding,
)

__all__ = [
    "CommRecord",
    "DeviceMesh",
    "Layout",
    "LocalAttr",
    "Reducible",
    "Replicate",
    "Rule",
    "Shard",
    "ShardingPlan",
    "bert_rules",
    "check_layouts",
    "comm_log",
    "comm_report",
    "gpt2_rules",
    "hf_rules",
    "llama_rules",
    "norm",
    "plan_sharding",
    "reduce_max",
    "reduce_mean",
    "reduce_sum",
    "rms",
    "shard_tensor",
    "shard_tree",
    "sum_of_squares",
    "unshard",
    "unshard_tree",
    "with_leaf_names",
]
