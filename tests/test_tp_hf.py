"""shard_params on Hugging Face models built from small configs: the same training as one process.

Llama (separate q/k/v, GQA, its own ``tp_plan``), GPT-2 (fused ``c_attn`` Conv1D split per
q/k/v block, tied LM head) and BERT (masked-LM head tied to the word embeddings, with a bias).
Vocabularies of 50 and MLP widths of 42 do not divide by 4 (uneven shards). float64, 10 steps of
AdamW with global-norm clipping: the collectives only reorder sums, so 1e-10 is ample.
"""

import pytest
import torch

pytest.importorskip("transformers")

import funcpar.optim as fo
from funcpar.models import lm_loss
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import bert_rules, gpt2_rules, hf_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.transforms import compose, data_parallel, shard_params

STEPS = 10
VOCAB = 50


def build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=42,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=16, use_cache=False)
        model = tf.LlamaForCausalLM(cfg)
        return model, hf_rules(model)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=42,
                            n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0, use_cache=False)
        model = tf.GPT2LMHeadModel(cfg)
        return model, gpt2_rules(cfg.n_embd // cfg.n_head)
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=42, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = tf.BertForMaskedLM(cfg)
    return model, bert_rules(cfg.hidden_size // cfg.num_attention_heads)


def hf_loss(output, targets):
    return lm_loss(output.logits, targets)


hf_loss.token_cross_entropy = True  # lets shard_params compute it vocab-parallel


def _batches(kind):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8, 13), generator=g)
    if kind == "bert":  # masked LM: predict a random half of the tokens, ignore the rest
        keep = torch.rand(ids.shape, generator=g) < 0.5
        labels = torch.where(keep, ids, torch.full_like(ids, -100))
        return [(ids[i % 2, :, :-1], labels[i % 2, :, :-1]) for i in range(STEPS)]
    return [(ids[i % 2, :, :-1], ids[i % 2, :, 1:]) for i in range(STEPS)]


def train(kind, tp, dp):
    mesh = DeviceMesh.from_env(dp=dp, tp=tp)
    model, rules = build(kind)
    model = model.double()
    apply_fn, params, buffers = functionalize(model)
    opt = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2, weight_decay=0.1))
    step = make_train_step(apply_fn, hf_loss, opt)
    state = init_state(params, buffers, opt)
    transforms = ([shard_params(rules, mesh)] if tp > 1 else []) + (
        [data_parallel(mesh)] if dp > 1 else [])
    step, state = compose(*transforms)(step, state)
    losses = []
    for batch in _batches(kind):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    params = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    return losses, params


CASES = {2: [("llama", 2, 1), ("gpt2", 2, 1), ("bert", 2, 1)],
         4: [("llama", 4, 1), ("gpt2", 4, 1), ("gpt2", 2, 2)]}


def _run(world):
    return {case: train(*case) for case in CASES[world]}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hf_models_match_single_process(world):
    refs = {kind: train(kind, 1, 1) for kind, _, _ in CASES[world]}
    for rank, res in enumerate(run_ranks(_run, world, world, backend=None, timeout=240)):
        for (kind, tp, dp), (losses, params) in res.items():
            ref_losses, ref_params = refs[kind]
            assert set(params) == set(ref_params)
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            assert err <= 1e-10, (rank, kind, tp, dp, err)
            for k in ref_params:
                a, b = params[k], ref_params[k]
                if b.abs().max() < 1e-12:
                    # BERT's key biases: softmax cancels them (they add q.b to every score of a
                    # query), so their gradient is 0 in exact arithmetic and they hold round-off
                    # alone (~6e-15 after 10 steps); a relative error of round-off means nothing.
                    assert a.abs().max() < 1e-12, (rank, kind, k)
                    continue
                e = float((a - b).abs().max() / b.abs().max())
                assert e <= 1e-10, (rank, kind, tp, dp, k, e)
    for kind in refs:  # the comparison is of training, not of a constant
        assert refs[kind][0][-1] < refs[kind][0][0], kind


def test_gpt2_fused_qkv_layout():
    model, rules = build("gpt2")
    from funcpar.shard.rules import plan_sharding

    plan = plan_sharding(model, rules, DeviceMesh.virtual(rank=1, tp=2))
    lay = plan.layouts["transformer.h.0.attn.c_attn.weight"]
    assert lay.local_shape() == (32, 48) and lay.dim_blocks == (1, 3)
    w = model.transformer.h[0].attn.c_attn.weight.detach()
    from funcpar.shard.layout import shard_tensor

    local = shard_tensor(w, lay)  # rank 1: the second half of q, of k and of v
    assert torch.equal(local, torch.cat([w[:, 16:32], w[:, 48:64], w[:, 80:96]], dim=1))
    assert plan.local_attrs[0][1:] == ("split_size", 16)
    assert plan.matched_by["transformer.wte.weight"] in ("transformer.wte", "lm_head")
