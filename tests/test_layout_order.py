"""The layout transforms' shared refusals (funcpar.transforms.compose): a trained state, and a
re-cutting transform after zero_partition, are errors naming the transform."""

import pytest

import funcpar.optim as fo
from funcpar.models import Llama, moe_lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules_for
from funcpar.state import functionalize, init_state
from funcpar.testing.moe import MOE_CFG
from funcpar.train import make_train_step
from funcpar.transforms import (
    expert_parallel,
    pipeline_split,
    shard_params,
    zero_partition,
)


def _inputs():
    apply_fn, params, buffers = functionalize(Llama(MOE_CFG))
    opt = fo.sgd(lr=0.1)
    return make_train_step(apply_fn, moe_lm_loss, opt), init_state(params, buffers, opt)


@pytest.mark.parametrize("name", ["shard_params", "expert_parallel", "zero_partition",
                                  "pipeline_split"])
def test_a_trained_state_is_refused(name):
    mesh = DeviceMesh.virtual(rank=0, pp=2, ep=2, dp=1, tp=2)
    transform = {
        "shard_params": lambda: shard_params(llama_rules_for(MOE_CFG), mesh),
        "expert_parallel": lambda: expert_parallel(mesh),
        "zero_partition": lambda: zero_partition(1, mesh),
        "pipeline_split": lambda: pipeline_split(mesh, microbatches=2),
    }[name]()
    step, state = _inputs()
    with pytest.raises(ValueError, match=f"{name} takes a fresh state \\(step 0\\), got step 3"):
        transform(step, state._replace(step=state.step + 3))


@pytest.mark.parametrize("name", ["shard_params", "expert_parallel"])
def test_recutting_after_zero_partition_is_refused(name):
    mesh = DeviceMesh.virtual(rank=0, ep=2, dp=2, tp=2)
    transform = (shard_params(llama_rules_for(MOE_CFG), mesh) if name == "shard_params"
                 else expert_parallel(mesh))
    step, state = zero_partition(1, mesh)(*_inputs())
    with pytest.raises(ValueError, match=f"apply {name} before zero_partition"):
        transform(step, state)
