"""The example Llama: shapes, causality, init, and agreement with Hugging Face's Llama and with
its own functionalized form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.state import functionalize

SMALL = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 48,
         "max_seq_len": 32}


def _tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "extra",
    [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "tie_embeddings": True}, {"ffn_hidden": None}],
)
def test_forward_shapes(extra):
    cfg = LlamaConfig(**{**SMALL, **extra})
    model = Llama(cfg)
    logits = model(_tokens(3, 7, cfg.vocab_size))
    assert logits.shape == (3, 7, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    names = dict(model.named_parameters())
    assert names["layers.0.self_attn.k_proj.weight"].shape == (cfg.kv_heads * cfg.head_dim, 32)
    assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)


def test_default_ffn_width_is_llamas():
    assert LlamaConfig(dim=128).hidden == 352  # 8/3 * 128 = 341.3, up to a multiple of 32


def test_causal():
    """Changing token t changes no logit before t and does change the logits from t on."""
    model = Llama(LlamaConfig(**SMALL, n_kv_heads=2), dtype=torch.float64)
    x = _tokens(2, 12, 64)
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 64
    a, b = model(x), model(y)
    # float64 and the same kernels on the same prefix: earlier positions agree to rounding.
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=1e-12, atol=1e-12)
    assert (a[:, 7:] - b[:, 7:]).abs().amax() > 1e-3


def test_init_is_a_function_of_the_seed():
    cfg = LlamaConfig(**SMALL)
    before = torch.get_rng_state()
    a, b, c = Llama(cfg, seed=3), Llama(cfg, seed=3), Llama(cfg, seed=4)
    assert torch.equal(before, torch.get_rng_state()), "init must not consume the global RNG"
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    # Same draws whatever the target dtype.
    d = Llama(cfg, seed=3, dtype=torch.float64)
    for (name, pa), pd in zip(a.named_parameters(), d.parameters()):
        assert pd.dtype == torch.float64
        assert torch.equal(pa.double(), pd), name
    w = a.layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - cfg.init_std) < 0.2 * cfg.init_std
    assert torch.equal(a.norm.weight, torch.ones(cfg.dim))


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"dim": 30}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 12, "n_heads": 4}, "even head_dim"),
        ({"n_layers": 0}, "n_layers"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"ffn_hidden": -1}, "ffn_hidden"),
    ],
)
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**SMALL, **bad})


def test_sequence_longer_than_max_is_an_error():
    model = Llama(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        model(_tokens(1, 33, 64))


def test_lm_loss():
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    targets = _tokens(2, 5, 11)
    expected = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    # Same math, different kernels (fused cross_entropy vs log_softmax + gather): 1e-12.
    torch.testing.assert_close(lm_loss(logits, targets), expected, rtol=1e-12, atol=0)
    targets[0, :3] = -100
    keep = targets != -100
    expected = -torch.log_softmax(logits, -1)[keep].gather(-1, targets[keep][:, None]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected, rtol=1e-12, atol=0)
    low = lm_loss(logits.bfloat16(), targets.clamp(min=0))
    assert low.dtype == torch.float32


def test_annotations_are_checked_and_name_the_argument():
    """Under the test suite's jaxtyping import hook (pyproject addopts) a wrong shape or dtype
    fails at the call with a message naming the parameter, instead of deep inside a kernel or
    not at all (a float tensor of token ids would silently index after a cast)."""
    from jaxtyping import TypeCheckError

    logits = torch.randn(2, 5, 16)
    with pytest.raises(TypeCheckError, match="parameter 'targets'"):
        lm_loss(logits, _tokens(2, 6, 16))  # seq 6 against the logits' seq 5
    with pytest.raises(TypeCheckError, match="parameter 'logits'"):
        lm_loss(logits.long(), _tokens(2, 5, 16))  # integer logits
    model = Llama(LlamaConfig(**SMALL))
    with pytest.raises(TypeCheckError, match="parameter 'tokens'"):
        model(torch.zeros(2, 5))  # float token ids


@pytest.mark.parametrize("tie", [False, True])
def test_matches_huggingface_llama(tie):
    """Copying our weights into transformers' LlamaForCausalLM (names prefixed with
    ``model.``) gives the same logits: the rotary layout, norms and GQA are Llama's."""
    transformers = pytest.importorskip("transformers")
    cfg = LlamaConfig(**SMALL, n_kv_heads=2, rope_theta=500.0, tie_embeddings=tie)
    ours = Llama(cfg, seed=1)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in
             ours.state_dict().items()}
    if tie:
        state["lm_head.weight"] = ours.embed_tokens.weight
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k]
    x = _tokens(2, 20, cfg.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=x).logits
        got = ours(x)
    # float32, eager softmax attention vs SDPA and a different order of rotary ops: agreement
    # to float32 rounding of logits of size ~1 (HF's RMSNorm works in float32 even for float64
    # inputs, so float64 would not tighten this).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_functionalized_model_matches_module():
    """The same outputs and gradients from ``functionalize(model)`` as from the module."""
    model = Llama(LlamaConfig(**SMALL, n_kv_heads=2), seed=2, dtype=torch.float64)
    apply_fn, params, buffers = functionalize(model)
    assert buffers == {}
    x, t = _tokens(2, 10, 64, seed=1), _tokens(2, 10, 64, seed=2)

    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    out, new_buffers = apply_fn(live, buffers, x)
    f_grads = torch.autograd.grad(lm_loss(out, t), list(live.values()))

    model.zero_grad(set_to_none=True)
    ref = model(x)
    lm_loss(ref, t).backward()

    # float64, the same kernels in the same order: identical up to rounding (1e-12 relative).
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    ref_grads = dict(model.named_parameters())
    for (name, g) in zip(live, f_grads):
        torch.testing.assert_close(g, ref_grads[name].grad, rtol=1e-12, atol=1e-15, msg=name)
    assert new_buffers == {}


def test_gradients_match_finite_differences():
    """A float64 gradcheck of the whole model on a tiny config (checks the hand-written
    rotary and norm code, which the module-vs-functional test cannot)."""
    cfg = LlamaConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=8,
                      max_seq_len=4)
    model = Llama(cfg, seed=5, dtype=torch.float64)
    apply_fn, params, buffers = functionalize(model)
    x, t = _tokens(1, 4, 8, seed=3), _tokens(1, 4, 8, seed=4)
    names = list(params)

    def loss(*leaves):
        out, _ = apply_fn(dict(zip(names, leaves)), buffers, x)
        return lm_loss(out, t)

    inputs = tuple(p.clone().requires_grad_(True) for p in params.values())
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_sdpa_matches_explicit_causal_softmax():
    """Our attention (through SDPA) against softmax(QK^T/sqrt(d) + causal mask) V written out."""
    cfg = LlamaConfig(**SMALL, n_kv_heads=2)
    model = Llama(cfg, seed=0, dtype=torch.float64)
    attn = model.layers[0].self_attn
    x = torch.randn(2, 9, cfg.dim, dtype=torch.float64)
    from funcpar.models.llama import _rotate, rotary_cos_sin

    cos, sin = rotary_cos_sin(9, cfg.head_dim, cfg.rope_theta, dtype=x.dtype, device=x.device)
    q = attn.q_proj(x).view(2, 9, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 9, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v_proj(x).view(2, 9, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.o_proj((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 9, -1))
    # float64, different kernels: 1e-12.
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-12, atol=1e-12)
