"""Tiny random Hugging Face models, one per decoder family, built locally (no Hub access).

``build(family)`` returns a seeded ``*ForCausalLM`` whose widths split over up to 4 ranks
(4 heads of 8, 2 key/value heads, ffn 48, MoE: 4 experts of ffn 16, top 2). The tests of
:mod:`funcpar.shard.hf_plan` and ``benchmarks/hf_coverage.py`` share these configs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "MOE_FAMILIES", "build", "config"]

VOCAB = 64

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=32, use_cache=False, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DROP = object()  # an override that removes a common key (a config that refuses it)
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)

#: model_type -> overrides of the common tiny config (None: as is).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "olmo": {}, "cohere": {}, "cohere2": {},
    "granite": {}, "smollm3": {}, "starcoder2": {}, "qwen3": {}, "olmo2": {}, "olmo3": {},
    "glm": {}, "glm4": {}, "phi3": {}, "gemma": {}, "gemma2": {}, "vaultgemma": {},
    "gemma3_text": {},
    "phi": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_pct=0.5),
    "gptj": dict(n_embd=32, n_head=4, n_layer=2, n_inner=48, rotary_dim=4, n_positions=32),
    "mixtral": _MOE, "olmoe": _MOE, "qwen3_moe": dict(_MOE, decoder_sparse_step=1),
    "qwen2_moe": dict(_MOE, decoder_sparse_step=1),
    "deepseek_v3": dict(_MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                        num_key_value_heads=4, head_dim=4),
    "opt": dict(ffn_dim=48, word_embed_proj_dim=32, enable_bias=True, dropout=0.0,
                attention_dropout=0.0),
    "falcon": dict(new_decoder_architecture=False, multi_query=True, alibi=False, head_dim=_DROP),
    "bloom": dict(n_embd=32, n_head=4, n_layer=2),
}

#: The families of the coverage table, dense then MoE then those without a tp_plan.
FAMILIES = tuple(_OVERRIDES)
MOE_FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def config(family: str, **overrides: Any) -> Any:
    """The tiny config of ``family`` (a transformers ``model_type``)."""
    from transformers import AutoConfig

    kw = {k: v for k, v in {**_COMMON, **_OVERRIDES[family], **overrides}.items()
          if v is not _DROP}
    for k in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        kw.setdefault(k, 0.0)
    return AutoConfig.for_model(family, **kw)


def build(family: str, seed: int = 0, dtype: torch.dtype | None = torch.float64,
          **overrides: Any) -> nn.Module:
    """A seeded tiny ``AutoModelForCausalLM`` of ``family`` (eager attention and experts: the
    grouped-mm kernels take no float64), in ``dtype``."""
    from transformers import AutoModelForCausalLM

    cfg = config(family, **overrides)
    torch.manual_seed(seed)  # transformers initialises from the global generator
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             experts_implementation="eager")
    return model if dtype is None else model.to(dtype)
