"""Tensor parallelism inside the experts (rule style ``"experts"``), alone and under
``expert_parallel``: every optimizer equals one process.

The reference MoE run (funcpar.testing.moe, shared with tests/test_moe_parallel.py): the
reference Llama with 4 top-1 experts per block (ffn 42, split 21/21 over tp2), capacity factor
2.0, skewed routers (uneven all_to_all splits, an expert with no token in some step: asserted
on the one-process run). ``shard_params(llama_rules_for(cfg), mesh)`` splits every expert's ffn
over ``tp`` (gate/up Shard(1), down Shard(2)), the router stays replicated; ``expert_parallel``
after it cuts the experts over ``ep`` too: ``{ep: Shard(0), tp: Shard(1)}``. 10 steps in
float64, max relative error <= 1e-10 on every loss and whole parameter (8-bit GaLore 1e-8:
its quantized states amplify a reordered sum's last bit, as in test_moe_parallel).

Default: one spawn of 4 ranks, tp2 x dp2 + ZeRO-2 (no ep) with AdamW, ep2 x tp2 with CAME and
``moe_hybrid(ep_size=2, tp_size=2)`` with AdamW, plus the layout and error checks on virtual
meshes (no spawn). ``-m slow``: every optimizer under tp2 and under ep2 x tp2, ep2 x tp2 +
remat, ep2 x tp2 x dp2 + ZeRO-2 (8 ranks), and a checkpoint saved under ep2 x tp2 resumed under
one process and tp2 x dp2 + ZeRO-2.
"""

import dataclasses

import pytest
import torch

import funcpar.optim as fo
from funcpar.models import Llama, moe_lm_loss
from funcpar.presets import pick_rules
from funcpar.shard.layout import Shard
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import Rule, llama_rules, llama_rules_for, plan_sharding
from funcpar.state import functionalize, init_state
from funcpar.testing.moe import MATRIX_OPTIMIZERS, MOE_CFG, check, check_resharding
from funcpar.train import make_train_step
from funcpar.transforms import compose, expert_parallel, shard_params

EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def test_tp_and_ep_x_tp_match_one_process():
    check(4, [("tp2xdp2+zero2", "adamw"), ("ep2xtp2", "came"),
              ("moe_hybrid(ep2, tp2)", "adamw")])  # the preset: the same composition


@pytest.mark.slow
@pytest.mark.parametrize("world,pairs", [
    (2, [("tp2", o) for o in MATRIX_OPTIMIZERS]),
    (4, [("ep2xtp2", o) for o in MATRIX_OPTIMIZERS]),
    (4, [("ep2xtp2+remat", "adamw")]),  # the recompute repeats the a2a and the all-reduce
    (8, [("ep2xtp2xdp2+zero2", o) for o in ("adamw", "came", "galore_adamw")]),
], ids=["tp2", "ep2xtp2", "ep2xtp2+remat", "ep2xtp2xdp2+zero2"])
def test_moe_tp_matrix(world, pairs):
    check(world, pairs)


@pytest.mark.slow
def test_checkpoint_ep2xtp2_loads_under_one_process_and_tp2xdp2(tmp_path):
    """Saved after 5 steps under ep2 x tp2 (experts over both axes); resumed for 5 more under
    one process and under tp2 x dp2 + ZeRO-2: both equal 10 uninterrupted steps."""
    check_resharding(str(tmp_path / "ckpt"), "ep2xtp2", ["tp2xdp2+zero2"], "came")


# ----------------------------------------------------------------- layouts, no collectives
def _inputs(cfg=MOE_CFG):
    apply_fn, params, buffers = functionalize(Llama(cfg))
    opt = fo.sgd(lr=0.1)
    return make_train_step(apply_fn, moe_lm_loss, opt), init_state(params, buffers, opt)


def test_experts_style_splits_the_ffn_and_expert_parallel_the_experts():
    step, state = _inputs()
    whole = dict(state.params)
    mesh = DeviceMesh.virtual(rank=3, ep=2, tp=2)  # ep coordinate 1, tp coordinate 1
    step, state = compose(shard_params(llama_rules_for(MOE_CFG), mesh),
                          expert_parallel(mesh))(step, state)
    for i in range(MOE_CFG.n_layers):
        p = f"layers.{i}.mlp.experts."
        for leaf, dim in zip(EXPERT_LEAVES, (1, 1, 2), strict=True):
            lay = step.layouts[p + leaf]
            assert lay.dim_axes[0] == ("ep",) and lay.dim_axes[dim] == ("tp",)
            assert lay.placements == (Shard(0), Shard(dim))  # mesh order (ep, tp)
            want = whole[p + leaf][2:].narrow(dim, 21, 21)  # experts 2-3, ffn 21-41
            assert torch.equal(state.params[p + leaf], want)
        assert not step.layouts[f"layers.{i}.mlp.router.weight"].is_sharded
    assert step.layouts["layers.0.self_attn.q_proj.weight"].dim_axes[0] == ("tp",)


def test_llama_rules_for_picks_the_mlp_rules():
    dense_and_moe = dataclasses.replace(MOE_CFG, moe_every=2)
    patterns = {r.pattern: r.style for r in llama_rules_for(dense_and_moe)}
    assert patterns["layers.*.mlp.experts"] == "experts"
    assert patterns["layers.*.mlp.gate_proj"] == "colwise"
    mesh = DeviceMesh.virtual(rank=0, tp=2)
    plan = plan_sharding(Llama(dense_and_moe), llama_rules_for(dense_and_moe), mesh)
    assert plan.layouts["layers.0.mlp.gate_proj.weight"].dim_axes[0] == ("tp",)
    assert plan.layouts["layers.1.mlp.experts.down_proj"].dim_axes[2] == ("tp",)
    assert "layers.*.mlp.gate_proj" not in {r.pattern for r in llama_rules_for(MOE_CFG)}
    assert llama_rules_for(dataclasses.replace(MOE_CFG, n_experts=0)) == llama_rules(
        MOE_CFG.head_dim)
    # The presets pick them for an MoE Llama (hybrid_parallel with tp_size).
    assert pick_rules(Llama(MOE_CFG)) == llama_rules_for(MOE_CFG)


def test_moe_tp_errors():
    mesh = DeviceMesh.virtual(rank=0, tp=2)
    dense = dataclasses.replace(MOE_CFG, n_experts=0)
    # MoE rules matching no leaf: the model has no experts.
    with pytest.raises(ValueError, match="matches no module: the model has no MoE experts"):
        shard_params(llama_rules(dense.head_dim, experts=True), mesh)(*_inputs(dense))
    with pytest.raises(ValueError, match="style 'experts' applies to stacked MoE experts"):
        plan_sharding(Llama(MOE_CFG), [Rule("layers.*.mlp.router", "experts")], mesh)
    with pytest.raises(ValueError, match="its style must be 'experts'"):
        plan_sharding(Llama(MOE_CFG), [Rule("layers.*.mlp.experts", "colwise")], mesh)
    with pytest.raises(ValueError, match="unit does not apply to the 'experts' style"):
        Rule("layers.*.mlp.experts", "experts", unit=4)
    # ffn 42 over tp=4: not divisible.
    with pytest.raises(ValueError, match=r"experts' ffn dim \(1\) of 42 is not divisible by tp=4"):
        shard_params(llama_rules_for(MOE_CFG), DeviceMesh.virtual(rank=0, tp=4))(*_inputs())
    with pytest.raises(ValueError, match="sequence_parallel with MoE experts"):
        shard_params(llama_rules_for(MOE_CFG), mesh, sequence_parallel=True)(*_inputs())
    # One order only: shard_params, then expert_parallel.
    ep_tp = DeviceMesh.virtual(rank=0, ep=2, tp=2)
    step, state = expert_parallel(ep_tp)(*_inputs())
    with pytest.raises(ValueError, match="before expert_parallel"):
        shard_params(llama_rules_for(MOE_CFG), ep_tp)(step, state)
    with pytest.raises(ValueError, match="already split over 'ep': apply expert_parallel once"):
        expert_parallel(ep_tp)(step, state)
    step, state = shard_params(llama_rules_for(MOE_CFG), ep_tp)(*_inputs())
    with pytest.raises(ValueError, match="on another mesh"):
        expert_parallel(DeviceMesh.virtual(rank=0, ep=2, tp=2))(step, state)


def test_train_lm_composes_tp_with_experts(capsys):
    """examples/train_lm.py: --tp with --experts and --ep gives shard_params(llama_rules_for)
    then expert_parallel; --sequence-parallel with --experts is a usage error."""
    from _examples import load_example

    train_lm = load_example("train_lm.py", "train_lm_moe_tp")
    argv = ["--experts", "4", "--ep", "2", "--tp", "2", "--top-k", "1", "--dtype", "float64"]
    args = train_lm.parse_args(argv)
    mesh = DeviceMesh.virtual(rank=0, ep=2, dp=1, tp=2)
    cfg = dataclasses.replace(MOE_CFG, n_layers=2)
    step, state = compose(*train_lm.manual_transforms(args, mesh, cfg))(*_inputs(cfg))
    name = "layers.1.mlp.experts.down_proj"
    assert step.layouts[name].dim_axes == (("ep",), (), ("tp",))
    assert tuple(state.params[name].shape) == (2, 32, 21)  # 2 of 4 experts, 21 of 42 ffn
    with pytest.raises(SystemExit):
        train_lm.parse_args([*argv, "--sequence-parallel"])
    assert "--sequence-parallel does not work with --experts" in capsys.readouterr().err



def test_plan_refuses_tensor_parallel_experts():
    """The experts' tp region all-reduces a routing-dependent [kept rows, dim] per MoE block,
    which the plan does not model: refused with or without expert parallelism, never
    under-predicted."""
    from funcpar.presets.plan import describe

    for axes in ({"tp": 2}, {"ep": 2, "tp": 2}):
        mesh = DeviceMesh.virtual(rank=0, **axes)
        transforms = [shard_params(llama_rules_for(MOE_CFG), mesh)]
        if "ep" in axes:
            transforms.append(expert_parallel(mesh))
        step, state = compose(*transforms)(*_inputs())
        with pytest.raises(ValueError, match="MoE experts under tensor parallelism"):
            describe(step, state, mesh, batch_shape=(8, 12)).expected_comm()
