"""shard_params and data_parallel give the single-process training, step for step.

The example Llama with a vocabulary (50) and an MLP width (42) that 4 does not divide (uneven
shards 13/13/13/11 and 11/11/11/9), trained 10 steps on fixed random tokens under tp, dp and
tp x dp, against the same 10 steps in one process. float64: the collectives only reorder sums,
so the error is rounding (~1e-15 relative); 1e-10 leaves room for 10 steps of it. float32: 1e-5.
"""

import pytest
import torch

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.comm import comm_log
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import Rule, llama_rules, plan_sharding
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, batches, max_rel, train
from funcpar.train import make_train_step
from funcpar.transforms import shard_params


def _cases(world):
    return [(tp, world // tp) for tp in (1, 2, 4)
            if world % tp == 0 and not (tp == 1 and world == 1)]


def _all_cases(world, dtype):
    """Every (tp, dp, optim) of one world size, in one spawn (a spawn costs seconds on 2 cores)."""
    out = {}
    for tp, dp in _cases(world):
        for optim in ("sgd", "adamw"):
            out[(tp, dp, optim)] = train(tp, dp, optim, dtype)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tp_dp_match_single_process_float64(world):
    ref = {o: train(1, 1, o, torch.float64) for o in ("sgd", "adamw")}
    results = run_ranks(_all_cases, world, world, torch.float64, backend=None, timeout=240)
    for rank, res in enumerate(results):
        assert set(res) == {(tp, dp, o) for tp, dp in _cases(world) for o in ("sgd", "adamw")}
        for (tp, dp, optim), (losses, params) in res.items():
            ref_losses, ref_params = ref[optim]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-10, (
                rank, tp, dp, optim)
            assert max_rel(params, ref_params) <= 1e-10, (rank, tp, dp, optim)
    # The loss fell: the comparison is of training, not of a constant.
    assert ref["adamw"][0][-1] < ref["adamw"][0][0]


def _float32_tp2():
    return {o: train(2, 1, o, torch.float32) for o in ("sgd", "adamw_small_lr")}


def test_tp2_float32():
    results = run_ranks(_float32_tp2, 2, backend=None, timeout=120)
    for optim in ("sgd", "adamw_small_lr"):
        ref_losses, ref_params = train(1, 1, optim, torch.float32)
        for res in results:
            losses, params = res[optim]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
            assert max_rel(params, ref_params) <= 1e-5, optim


def _tp2_gathered_logits_and_report():
    losses, params = train(2, 1, "adamw", torch.float64, vocab_parallel_loss=False)
    mesh = DeviceMesh.from_env(dp=1, tp=2)
    torch.manual_seed(0)
    model = Llama(CFG).double()
    apply_fn, p, b = functionalize(model)
    opt = fo.adamw(lr=1e-2)
    step, state = shard_params(llama_rules(CFG.head_dim), mesh)(
        make_train_step(apply_fn, lm_loss, opt), init_state(p, b, opt))
    with comm_log.capture() as records:
        step(state, batches()[0])
    return losses, params, [(r.op, r.axis, r.nbytes, r.purpose) for r in records]


def test_tp2_gathered_logits_and_comm_report():
    ref_losses, ref_params = train(1, 1, "adamw", torch.float64)
    for losses, params, records in run_ranks(_tp2_gathered_logits_and_report, 2, backend=None,
                                             timeout=120):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-10
        assert max_rel(params, ref_params) <= 1e-10
        ops = {op for op, *_ in records}
        assert ops == {"all_reduce"}, ops  # no gathers at all with the vocab-parallel loss
        purposes = " ".join(p for *_, p in records)
        for what in ("o_proj: output", "down_proj: output", "q_proj: input grad",
                     "gate_proj: input grad", "embed_tokens", "cross_entropy"):
            assert what in purposes, what
        # k/v share q's input all-reduce; up shares gate's.
        assert "k_proj: input grad" not in purposes and "up_proj: input grad" not in purposes
        # Exactly the expected collectives: per layer 2 forward (o_proj, down_proj outputs) and
        # 2 backward (q/k/v and gate/up input grads); the embedding; the head's input grad; 3
        # for the cross-entropy; 1 for the grad-norm metric (all tp-split leaves together).
        assert len(records) == 4 * CFG.n_layers + 1 + 1 + 3 + 1, purposes
        assert sum(p.endswith("global_norm") for *_, p in records) == 1
        # No message is the size of a parameter matrix: activations and scalars only.
        biggest = max(n for _, _, n, _ in records)
        assert biggest <= 8 * 12 * CFG.dim * 8  # one activation [batch, seq, dim] in float64


def test_rule_errors():
    mesh = DeviceMesh.virtual(rank=0, tp=4)
    model = Llama(CFG)
    with pytest.raises(ValueError, match="matches no module"):
        plan_sharding(model, [Rule("layers.*.attn.q", "colwise")], mesh)
    with pytest.raises(ValueError, match="does not divide the number of heads 2"):
        gqa = Llama(LlamaConfig(vocab_size=16, dim=16, n_layers=1, n_heads=4, n_kv_heads=2))
        plan_sharding(gqa, llama_rules(4), mesh)  # 2 kv heads over tp=4
    with pytest.raises(ValueError, match="more than one rule"):
        plan_sharding(model, [Rule("lm_head", "colwise"), Rule("lm_*", "rowwise")], mesh)
    with pytest.raises(ValueError, match="cannot split a dim of 4"):
        plan_sharding(Llama(LlamaConfig(vocab_size=4, dim=8, n_layers=1, n_heads=1)),
                      [Rule("embed_tokens", "embedding_rowwise")], DeviceMesh.virtual(tp=8))
    with pytest.raises(ValueError, match="unknown style"):
        Rule("lm_head", "diagonal")
    with pytest.raises(ValueError, match="does not apply"):
        plan_sharding(model, [Rule("embed_tokens", "colwise")], mesh)


def test_plan_report_names_every_leaf():
    mesh = DeviceMesh.virtual(rank=1, tp=2)
    plan = plan_sharding(Llama(CFG), llama_rules(CFG.head_dim), mesh)
    report = plan.report()
    for name, _ in Llama(CFG).named_parameters():
        assert name in report
    assert "(no rule)" in report  # the norms
    assert plan.layouts["layers.0.mlp.down_proj.weight"].local_shape() == (32, 21)


def test_vocab_parallel_head_needs_cross_entropy():
    mesh = DeviceMesh.virtual(rank=0, tp=2)
    apply_fn, params, buffers = functionalize(Llama(CFG))
    opt = fo.sgd(lr=0.1)
    step = make_train_step(apply_fn, lambda out, y: out.float().mean(), opt)
    with pytest.raises(ValueError, match="cross-entropy"):
        shard_params(llama_rules(CFG.head_dim), mesh)(step, init_state(params, buffers, opt))
