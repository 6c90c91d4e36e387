"""Lazy initialization: models built on the meta device, each rank materializing its shards."""

from funcpar.init.lazy import (
    CHUNK,
    Init,
    Slab,
    check_materialized,
    constant,
    fan_in_uniform,
    init_rules,
    llama_inits,
    materialize,
    materialize_tree,
    meta_device,
    normal,
    uniform,
    values,
)

__all__ = [
    "CHUNK",
    "Init",
    "Slab",
    "check_materialized",
    "constant",
    "fan_in_uniform",
    "init_rules",
    "llama_inits",
    "materialize",
    "materialize_tree",
    "meta_device",
    "normal",
    "uniform",
    "values",
]
