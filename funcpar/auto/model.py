"""What the layout search needs to know about a model: parameter counts by how tensor and
expert parallelism split them, FLOPs per token, and activation bytes per token - computed from
the config alone (no tensor is built), so a 405B config costs what a 2-layer one does.

Only funcpar's :class:`~funcpar.models.Llama` (dense or MoE) is described; a config of
another family is refused by :func:`model_spec`.

**Parameters** (elements), per block: the attention's ``q, k, v, o`` (``2 D^2 + 2 H_kv d_h D``)
and the dense MLP's ``3 F D`` are split over ``tp`` (``llama_rules``); the two norms
(``2 D``) and an MoE router (``E D``) are whole on every tp rank; an MoE block's stacked
experts (``3 E F D``) are split over ``ep`` on their expert dim. Outside the blocks: the
embedding and the LM head (``V D`` each, vocab-split over ``tp``; one tensor when tied) and
the final norm (``D``).

**FLOPs** (forward, per token): ``2 x`` the matmul parameters a token meets (an MoE block:
attention, router and ``top_k`` experts) + the head's ``2 V D`` + causal attention
``2 t D`` (``QK^T`` and ``AV`` over the ``t/2`` earlier positions on average). The backward
is twice the forward (two matmuls per forward one); remat adds one forward of the blocks it
recomputes. :attr:`ModelSpec.model_flops_per_token` is the MFU convention of the benchmarks
(``6 N + 12 L D t``, Narayanan et al. 2021 eq. 3 without the vocabulary term, which ``6 N``
already holds).

**Activations** saved for the backward, per token of a micro-batch, bytes, with ``s`` the
compute dtype's size (measured with saved-tensor hooks on funcpar's Llama, tests/test_auto.py):
per dense block ``8 D + 8 + 4 s D`` whole on every tp rank (the two RMSNorms keep their input
in float32 at least, their statistic and their normalized output, and the linears' inputs) and
``(4 s D + 4 H + 4 s F) / tp`` split (q, k, v as attention saves them, its float32
log-sum-exp per head, its output, and the MLP's four ``F``-wide tensors); plus the rotary
tables ``2 t d_h s`` per block and micro-batch. Under sequence parallelism the norms' part is
also divided by ``tp`` (not measured: an estimate). An MoE block's feed-forward keeps about
``top_k (4 s F + 2 s D) + 8 E`` per token (an estimate). Remat keeps the block input (``s D``)
per block and one block's activations while it recomputes. The head: the final norm and
``(s + 4) V / tp`` (logits and the float32 log-softmax; ``+ 4 V / tp`` for the logits'
float32 copy in half precision).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["OPS_FWD", "BlockCounts", "ModelSpec", "model_spec"]

#: Ops a block's forward dispatches (norms, projections, rotary, attention, MLP, residuals):
#: the cost model charges ``op_latency`` for each, three times over forward and backward.
OPS_FWD = 40


@dataclasses.dataclass(frozen=True)
class BlockCounts:
    """Elements of one block's parameters by how they are split, and its leaf count."""

    tp_split: int  # split over tp (attention; the dense MLP)
    replicated: int  # whole on every tp rank (norms; the MoE router)
    experts: int  # stacked experts, split over ep (0 for a dense block)
    leaves: int
    moe: bool


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Llama config as the cost model reads it (module docstring)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tie_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float | None = 1.25
    name: str = "llama"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def block(self, layer: int) -> BlockCounts:
        d, f = self.dim, self.ffn
        attn = 2 * d * d + 2 * self.kv_heads * self.head_dim * d
        if self.is_moe(layer):
            return BlockCounts(attn, 2 * d + self.n_experts * d, 3 * self.n_experts * f * d,
                               10, True)
        return BlockCounts(attn + 3 * f * d, 2 * d, 0, 9, False)

    @property
    def n_moe_blocks(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def embed(self) -> int:
        return self.vocab * self.dim

    @property
    def head(self) -> int:
        """The LM head's elements (0 when tied to the embedding)."""
        return 0 if self.tie_embeddings else self.vocab * self.dim

    @property
    def n_params(self) -> int:
        blocks = sum(b.tp_split + b.replicated + b.experts for b in map(self.block,
                                                                         range(self.layers)))
        return blocks + self.embed + self.head + self.dim

    @property
    def n_active_params(self) -> int:
        """Parameters one token's forward multiplies by (an MoE block: ``top_k`` experts)."""
        n = self.embed + self.head + self.dim
        for i in range(self.layers):
            b = self.block(i)
            n += b.tp_split + b.replicated + (b.experts * self.top_k // self.n_experts
                                              if b.moe else 0)
        return n

    # ------------------------------------------------------------------------------ flops
    def block_flops(self, layer: int, seq: int) -> tuple[float, float]:
        """(matmul, attention) FLOPs of one token's forward through block ``layer``."""
        b = self.block(layer)
        mm = b.tp_split + (self.n_experts * self.dim
                           + b.experts * self.top_k // self.n_experts if b.moe else 0)
        return 2.0 * mm, 2.0 * seq * self.dim

    def head_flops(self) -> float:
        """One token's forward through the LM head (the embedding is a lookup)."""
        return 2.0 * self.vocab * self.dim

    def model_flops_per_token(self, seq: int) -> float:
        """``6 N + 12 L D t`` with ``N`` the active parameters less the embedding lookup."""
        return 6.0 * (self.n_active_params - self.embed) + 12.0 * self.layers * self.dim * seq

    # -------------------------------------------------------------------------- activations
    def block_activation_bytes(self, layer: int, s: int, tp: int = 1,
                               sequence_parallel: bool = False) -> float:
        """Bytes one block saves for the backward per token (module docstring)."""
        d, f, h = self.dim, self.ffn, self.heads
        norms = 8 * d + 8 + 2 * s * d  # both norms: float32 input, statistic, output
        inputs = 2 * s * d  # the linears' (gathered) inputs
        split = 4 * s * d + 4 * h
        if self.is_moe(layer):
            split /= tp
            # The experts' F-wide tensors split over tp with their ffn (docs/MOE.md).
            ffn = self.top_k * (4 * s * f / tp + 2 * s * d) + 8 * self.n_experts
            return norms / (tp if sequence_parallel else 1) + inputs + split + ffn
        split = (split + 4 * s * f) / tp
        return norms / (tp if sequence_parallel else 1) + inputs + split

    def rope_bytes(self, seq: int, s: int) -> int:
        return 2 * seq * self.head_dim * s

    def head_activation_bytes(self, s: int, tp: int = 1) -> float:
        """Per token: final norm, logits, their float32 copy (half precision only) and the
        float32 log-softmax."""
        return 4 * self.dim + 4 + 2 * s * self.dim + (s + 4 + (4 if s < 4 else 0)) * \
            self.vocab / tp


def model_spec(model: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a :class:`~funcpar.models.LlamaConfig`, a
    :class:`~funcpar.models.Llama`, or a ModelSpec (returned as is)."""
    from funcpar.models.llama import Llama, LlamaConfig

    if isinstance(model, ModelSpec):
        return model
    cfg = model.cfg if isinstance(model, Llama) else model
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"auto_parallel describes funcpar's Llama (a LlamaConfig, a Llama or a "
                        f"ModelSpec); got {type(model).__name__}")
    return ModelSpec(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads,
                     cfg.hidden, cfg.tie_embeddings, cfg.n_experts, cfg.top_k, cfg.moe_every,
                     cfg.capacity_factor)
