"""Transforms of a (step, state) pair: each returns a new pair computing the same training."""

from funcpar.init.lazy import materialize
from funcpar.transforms.accumulate_grads import accumulate_grads
from funcpar.transforms.amp_cast import amp_cast
from funcpar.transforms.check_rules import check_rules
from funcpar.transforms.compose import compose
from funcpar.transforms.context_parallel import context_parallel
from funcpar.transforms.data_parallel import data_parallel
from funcpar.transforms.expert_parallel import expert_parallel
from funcpar.transforms.offload import offload
from funcpar.transforms.pipeline_split import pipeline_split
from funcpar.transforms.remat import remat
from funcpar.transforms.shard_params import logits_of, shard_params
from funcpar.transforms.skip_nonfinite import skip_nonfinite
from funcpar.transforms.zero_partition import zero_partition

__all__ = [
    "accumulate_grads",
    "amp_cast",
    "check_rules",
    "compose",
    "context_parallel",
    "data_parallel",
    "expert_parallel",
    "logits_of",
    "materialize",
    "offload",
    "pipeline_split",
    "remat",
    "shard_params",
    "skip_nonfinite",
    "zero_partition",
]
