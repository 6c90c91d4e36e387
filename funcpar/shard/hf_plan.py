"""Hugging Face models -> funcpar sharding rules: the model's own ``tp_plan``, or rules funcpar
ships for families without one, or a refusal that names the style, the module and the reason.

transformers (5.x) declares tensor parallelism per family as ``base_model_tp_plan`` (module or
parameter pattern -> style name); ``model.tp_plan`` prefixes it for the task model
(``model.layers.*.self_attn.q_proj``) and adds the head (``lm_head``). Each style, what
transformers' DTensor implementation computes, and what funcpar runs for it:

=================================  =========================================================
transformers style                 funcpar
=================================  =========================================================
``colwise``                        ``colwise`` (whole heads for ``q/k/v_proj``)
``rowwise``                        ``rowwise``
``embedding_rowwise``              ``embedding_rowwise`` (vocab-parallel lookup; Gemma's
                                   scaled embedding keeps its scale)
``colwise_gather_output``,         ``colwise_gather_output``; the LM head becomes
``colwise_rep``                    ``vocab_parallel`` with ``vocab_parallel_loss``
``rowwise_split_input``,           ``rowwise_split_input``: the input is whole on every rank
``rowwise_rep``                    (after a gathered output), each rank takes its slice
``replicated_with_grad_allreduce`` ``grad_sum``: the module (Qwen3's, Gemma3's per-head q/k
                                   norms) runs whole on this rank's heads; its parameters'
                                   gradients are summed over ``tp``
``packed_colwise``                 on an ``nn.Linear``: ``colwise`` with ``blocks=2`` (each
                                   half split on its own); on the experts' 3-D
                                   ``gate_up_proj``: part of ``packed_experts``
``moe_tp_experts`` (with           ``packed_experts``: every expert's ffn split over ``tp``,
``gate_up_proj: packed_colwise``,  the input and routing weights entered once, the scaled
``down_proj: rowwise``)            outputs summed once
``replicate``                      ``replicate``
=================================  =========================================================

Refused, naming the style and the module: ``sequence_parallel`` (funcpar's own
``shard_params(sequence_parallel=True)`` is the way), ``packed_rowwise`` (transposed experts,
Llama 4, Aria), ``mla_kv_a_proj`` (DeepSeek-V2's MLA: its rope half bypasses the column split),
``moe_identity_expert``, ``local_params`` (attention sinks), ``all_reduce``,
``embedding_colwise``, and parameter-level entries other than the experts' two.

A plan entry that matches nothing in this model is dropped: the plans are written for every
config of a family (Qwen2-MoE's dense-MLP entries when every block is sparse). Whatever is
accepted can be checked against one process with :func:`funcpar.shard.check.check_rules`.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from funcpar.shard.rules import LocalAttr, Rule, is_packed_experts

__all__ = ["HF_STYLES", "REFUSED_STYLES", "hf_rules", "opt_rules"]

#: transformers style -> funcpar style, for module-level entries.
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "embedding_rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "replicated_with_grad_allreduce": "grad_sum",
    "packed_colwise": "colwise",  # with blocks=2 (the experts' 3-D one: packed_experts)
    "moe_tp_experts": "packed_experts",
    "replicate": "replicate",
}

#: transformers styles funcpar refuses, and why.
REFUSED_STYLES = {
    "sequence_parallel": "transformers' sequence-parallel norms; use funcpar's "
                         "shard_params(sequence_parallel=True) with colwise/rowwise rules",
    "packed_rowwise": "experts stored transposed ([E, dim, 2 ffn], Llama 4, Aria) are not "
                      "recognised by funcpar's packed_experts",
    "mla_kv_a_proj": "DeepSeek-V2-style multi-head latent attention (the rope half of "
                     "kv_a_proj_with_mqa bypasses the column-split kv_b_proj); not implemented",
    "moe_identity_expert": "identity experts (LongCat-Flash) summed by the experts' all-reduce; "
                           "not implemented",
    "local_params": "bare parameters sharded by their own entries (attention sinks); "
                    "not implemented",
    "all_reduce": "a module whose forward returns partial sums by construction; not implemented",
    "embedding_colwise": "an embedding split on its hidden dim; not implemented",
}

#: The experts' parameter-level entries that ``moe_tp_experts`` consumes.
_EXPERT_PARAMS = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", pattern)))


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def hf_rules(model: nn.Module, *, vocab_parallel_loss: bool = True) -> list[Rule | LocalAttr]:
    """funcpar's rules for a Hugging Face model: from its own ``tp_plan`` (module docstring:
    each style's mapping), or funcpar's rules for a family without one (OPT), or a ValueError
    naming what is missing (Falcon, Bloom, T5, ...). Heads are kept whole via the config.

    With ``vocab_parallel_loss`` the LM head's ``colwise_gather_output`` becomes
    ``vocab_parallel`` (no logits gather; the loss must be funcpar's token cross-entropy).
    """
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        return _no_plan_rules(model, vocab_parallel_loss)
    cfg = model.config
    head_dim = _head_dim(getattr(cfg, "get_text_config", lambda: cfg)())
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    module_entries: list[tuple[str, str, list[str]]] = []
    param_entries: dict[str, tuple[str, list[str]]] = {}
    for pattern, style in plan.items():
        rx = _regex(pattern)
        hits = [n for n in modules if n and rx.fullmatch(n)]
        phits = [n for n in params if rx.fullmatch(n)]
        if phits and not hits:
            param_entries[pattern] = (style, phits)
        elif hits:
            module_entries.append((pattern, style, hits))
        # else: written for another config of the family (no such module here): dropped
    rules: list[Rule | LocalAttr] = []
    used: set[str] = set()
    for pattern, style, hits in module_entries:
        if style in REFUSED_STYLES or style not in HF_STYLES:
            why = REFUSED_STYLES.get(style, "unknown to funcpar")
            raise ValueError(f"{type(model).__name__}: tp_plan style {style!r} of {pattern!r} "
                             f"(module {hits[0]!r}) is not supported: {why}")
        ours = HF_STYLES[style]
        blocks = 1
        if style == "moe_tp_experts":
            used |= _experts_entries(model, pattern, hits, modules, param_entries)
        elif style == "packed_colwise":
            if not isinstance(modules[hits[0]], nn.Linear):
                raise ValueError(f"{type(model).__name__}: tp_plan style 'packed_colwise' of "
                                 f"{pattern!r} applies to nn.Linear or the experts' "
                                 f"gate_up_proj, not {type(modules[hits[0]]).__name__} "
                                 f"({hits[0]!r})")
            blocks = 2
        if ours == "colwise_gather_output" and vocab_parallel_loss and pattern == "lm_head":
            ours = "vocab_parallel"
        unit = head_dim if re.search(r"(q|k|v|o)_proj$", pattern) and ours in (
            "colwise", "rowwise") else None
        rules.append(Rule(pattern, ours, unit, blocks))
    for pattern, (style, phits) in param_entries.items():
        if pattern not in used:
            why = REFUSED_STYLES.get(style, "parameter-level entries are supported only for "
                                     "the experts of a moe_tp_experts module")
            raise ValueError(f"{type(model).__name__}: tp_plan style {style!r} of parameter "
                             f"{pattern!r} ({phits[0]!r}) is not supported: {why}")
    return rules


def _experts_entries(model: nn.Module, pattern: str, hits: list[str],
                     modules: dict[str, nn.Module],
                     param_entries: dict[str, tuple[str, list[str]]]) -> set[str]:
    """The parameter entries a ``moe_tp_experts`` entry consumes, checked to be the packed
    layout funcpar splits (``gate_up_proj: packed_colwise``, ``down_proj: rowwise``)."""
    who = type(model).__name__
    for n in hits:
        if not is_packed_experts(modules[n]):
            raise ValueError(
                f"{who}: tp_plan style 'moe_tp_experts' of {pattern!r}: {n!r} "
                f"({type(modules[n]).__name__}) is not stacked experts funcpar splits "
                "(gate_up_proj [E, 2 ffn, dim] = [gate; up], down_proj [E, dim, ffn], no "
                "biases, not transposed)")
    used = set()
    for pname, want in _EXPERT_PARAMS.items():
        key = f"{pattern}.{pname}"
        style = param_entries.get(key, (None, []))[0]
        if style != want:
            raise ValueError(f"{who}: tp_plan style 'moe_tp_experts' of {pattern!r} needs "
                             f"{key!r}: {want!r}, got {style!r}")
        used.add(key)
    return used


# ----------------------------------------------------------------- families without a tp_plan
def opt_rules(model: nn.Module, *, vocab_parallel_loss: bool = True) -> list[Rule | LocalAttr]:
    """Rules for Hugging Face's ``OPTForCausalLM`` (no ``tp_plan`` in transformers): q/k/v and
    ``fc1`` column-split, ``out_proj`` and ``fc2`` row-split, the token embedding and the LM
    head tied to it vocab-split, positions and norms replicated. OPT's attention reshapes by
    ``self.num_heads`` (``view(bsz, -1, num_heads, head_dim)``, which would silently fold the
    local heads into the sequence), so that attribute is made local (:class:`LocalAttr`)."""
    cfg = model.config
    p = "model.decoder." if hasattr(model, "model") else "decoder."
    hd = cfg.hidden_size // cfg.num_attention_heads
    rules: list[Rule | LocalAttr] = [
        Rule(f"{p}layers.*.self_attn.q_proj", "colwise", hd),
        Rule(f"{p}layers.*.self_attn.k_proj", "colwise", hd),
        Rule(f"{p}layers.*.self_attn.v_proj", "colwise", hd),
        Rule(f"{p}layers.*.self_attn.out_proj", "rowwise", hd),
        LocalAttr(f"{p}layers.*.self_attn", "num_heads"),
        Rule(f"{p}layers.*.fc1", "colwise"),
        Rule(f"{p}layers.*.fc2", "rowwise"),
        Rule(f"{p}embed_tokens", "embedding_rowwise"),
    ]
    if hasattr(model, "lm_head"):
        rules.append(Rule("lm_head", "vocab_parallel" if vocab_parallel_loss
                          else "colwise_gather_output"))
    return rules


#: model_type -> why funcpar ships no rules for it (a family without a tp_plan).
NO_RULES = {
    "bloom": "BloomModel builds the ALiBi bias for all heads (build_alibi_tensor, shape "
             "[batch * n_head, 1, seq]) outside the attention, so a rank holding a slice of "
             "the heads would need its slice of the bias; funcpar does not cut it",
    "falcon": "Falcon's fused query_key_value packs the heads per family variant (multi-query: "
              "all q heads then one k and one v head, which cannot be split; grouped: per kv "
              "group) and may use ALiBi built outside the attention; funcpar ships no rules",
    "t5": "an encoder-decoder whose relative attention bias is built for all heads in the "
          "first layer and shared by the others (a rank would need its heads' slice of it); "
          "funcpar ships no rules",
}


def _no_plan_rules(model: nn.Module, vocab_parallel_loss: bool) -> list[Rule | LocalAttr]:
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt == "opt":
        return opt_rules(model, vocab_parallel_loss=vocab_parallel_loss)
    why = NO_RULES.get(mt, "write Rule(pattern, style) for it by hand (docs/HF_MODELS.md)")
    raise ValueError(f"{type(model).__name__} (model_type {mt!r}) has no tp_plan and funcpar "
                     f"ships no rules for it: {why}")
