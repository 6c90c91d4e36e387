"""generate: KV-cache decoding equals recomputation, sampling is reproducible from the rng,
and a tensor-parallel state generates what one process does."""

import dataclasses

import pytest
import torch

from funcpar.models import Llama, LlamaConfig
from funcpar.models.generate import decode, generate, logits_gatherer, sample_next
from funcpar.state import functionalize, generator_state
from funcpar.testing import run_ranks

CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=42,
                  max_seq_len=32)


def _model(cfg=CFG, dtype=torch.float64):
    return functionalize(Llama(cfg, seed=3, dtype=dtype))


def _prompt():
    return torch.randint(0, CFG.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))


def _recompute_greedy(apply_fn, params, buffers, prompt, n):
    tokens = prompt
    for _ in range(n):
        out, _ = apply_fn(params, buffers, tokens)
        logits = getattr(out, "logits", out)  # an MoE model's MoEOutput
        tokens = torch.cat((tokens, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return tokens


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, n_experts=4, top_k=2,
                                                          capacity_factor=None)],
                         ids=["dense", "moe-dropless"])
def test_kv_cache_greedy_equals_recompute_greedy(cfg):
    apply_fn, params, buffers = _model(cfg)
    prompt = _prompt()
    got, rng = generate(apply_fn, params, buffers, prompt, 12, temperature=0)
    assert rng is None
    want = _recompute_greedy(apply_fn, params, buffers, prompt, 12)
    assert torch.equal(got, want)


def test_cached_logits_equal_the_full_forward():
    apply_fn, params, buffers = _model()
    tokens = _prompt()
    full, _ = apply_fn(params, buffers, tokens)
    first, cache = decode(apply_fn, params, buffers, tokens[:, :3])
    rest, cache = decode(apply_fn, params, buffers, tokens[:, 3:], cache)
    assert cache[0][0].shape[2] == 5
    assert float((torch.cat((first, rest), 1) - full).abs().max()) <= 1e-13


def test_sampling_is_reproducible_from_the_rng():
    apply_fn, params, buffers = _model()
    prompt = _prompt()
    rng = generator_state("cpu", 7)
    kw = {"temperature": 0.8, "top_k": 10, "top_p": 0.9}
    a, rng_a = generate(apply_fn, params, buffers, prompt, 10, rng=rng, **kw)
    b, rng_b = generate(apply_fn, params, buffers, prompt, 10, rng=rng, **kw)
    assert torch.equal(a, b) and torch.equal(rng_a, rng_b)
    assert not torch.equal(rng_a, rng)  # the rng moved on
    c, _ = generate(apply_fn, params, buffers, prompt, 10, rng=rng_a, **kw)
    assert not torch.equal(a, c)  # the returned rng continues the stream
    with pytest.raises(ValueError, match="needs rng"):
        generate(apply_fn, params, buffers, prompt, 2, temperature=1.0)


def test_top_k_and_top_p_filter():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, gen, top_k=2)) for _ in range(200)}
    assert seen == {0, 1}
    # p = softmax: 0.636, 0.234, ...: top_p 0.7 keeps the first two, 0.5 the first alone.
    seen = {int(sample_next(logits, gen, top_p=0.7)) for _ in range(200)}
    assert seen == {0, 1}
    assert {int(sample_next(logits, gen, top_p=0.5)) for _ in range(50)} == {0}


def test_moe_with_capacity_is_refused():
    apply_fn, params, buffers = _model(dataclasses.replace(CFG, n_experts=4))
    with pytest.raises(ValueError, match="dropless"):
        generate(apply_fn, params, buffers, _prompt(), 2, temperature=0)


def _tp_generate():
    from funcpar.models import lm_loss
    from funcpar.optim import sgd
    from funcpar.shard.mesh import DeviceMesh
    from funcpar.shard.rules import llama_rules
    from funcpar.state import init_state
    from funcpar.train import make_train_step
    from funcpar.transforms import shard_params

    mesh = DeviceMesh.from_env(tp=2)
    apply_fn, params, buffers = _model()
    opt = sgd(lr=0.1)
    step, state = shard_params(llama_rules(CFG.head_dim), mesh)(
        make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt))
    gather = logits_gatherer(step)
    assert gather is not None
    greedy, _ = generate(step.apply_fn, state.params, state.buffers, _prompt(), 8,
                         temperature=0, gather_logits=gather)
    sampled, _ = generate(step.apply_fn, state.params, state.buffers, _prompt(), 8,
                          temperature=1.0, top_k=20, rng=generator_state("cpu", 5),
                          gather_logits=gather)
    return greedy, sampled


def test_tensor_parallel_generates_as_one_process():
    apply_fn, params, buffers = _model()
    want_greedy = _recompute_greedy(apply_fn, params, buffers, _prompt(), 8)
    want_sampled, _ = generate(apply_fn, params, buffers, _prompt(), 8, temperature=1.0,
                               top_k=20, rng=generator_state("cpu", 5))
    for greedy, sampled in run_ranks(_tp_generate, 2, backend=None, timeout=120):
        assert torch.equal(greedy, want_greedy)
        assert torch.equal(sampled, want_sampled)


def test_hf_model_decodes_through_its_own_cache():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    apply_fn, params, buffers = functionalize(model)
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(2))
    got, _ = generate(apply_fn, params, buffers, prompt, 6, temperature=0)
    tokens = prompt
    for _ in range(6):  # recomputation, no cache
        with torch.no_grad():
            logits = model(tokens, use_cache=False).logits
        tokens = torch.cat((tokens, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(got, tokens)
