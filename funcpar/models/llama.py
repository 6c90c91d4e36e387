"""A small Llama-style decoder-only transformer (Touvron et al. 2023, arXiv 2302.13971).

Pre-norm blocks ``h = x + Attn(RMSNorm(x)); y = h + MLP(RMSNorm(h))`` with

* RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w``;
* rotary position embeddings (Su et al. 2021, arXiv 2104.09864) in the "rotate half" layout
  that Hugging Face's Llama uses (the two halves of each head are the real and imaginary
  parts), so weights move between the two models by renaming only;
* causal attention through ``scaled_dot_product_attention``, with grouped-query attention when
  ``n_kv_heads < n_heads`` (Ainslie et al. 2023);
* the SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, arXiv 2002.05202).

The module layout is the one sharding rules expect: every projection is its own ``nn.Linear``
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, no
fused QKV), blocks live in the ``nn.ModuleList`` ``layers``, and the ends are ``embed_tokens``,
``norm`` and ``lm_head``. Block sub-modules carry Hugging Face's names (``self_attn``, ``mlp``,
``input_layernorm``, ``post_attention_layernorm``): a parameter ``n`` here is
``model.n`` in ``transformers.LlamaForCausalLM`` (``lm_head.weight`` keeps its name).

The model holds no buffers: rotary angles are computed from the positions in ``forward`` (a few
thousand sin/cos, negligible next to the matmuls), so the functional state is parameters only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from funcpar.models.moe import MoE, MoEStats

__all__ = ["Llama", "LlamaConfig", "MoEOutput", "RMSNorm", "causal_attention", "lm_loss",
           "moe_lm_loss", "moe_output", "rotary_cos_sin", "router_loss"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a :class:`Llama`.

    ``n_kv_heads=None`` means ``n_heads`` (plain multi-head attention). ``ffn_hidden=None``
    gives Llama's SwiGLU width: ``8/3 * dim`` rounded up to a multiple of 32.

    Mixture of Experts (:mod:`funcpar.models.moe`): with ``n_experts > 0`` every
    ``moe_every``-th block (blocks ``moe_every - 1, 2 moe_every - 1, ...``) has an MoE
    feed-forward of ``n_experts`` SwiGLU experts of width ``hidden``, ``top_k`` of them per token,
    ``capacity_factor`` (None: dropless) and router noise ``router_noise`` (std of the logits'
    noise, in training mode). The model then returns a :class:`MoEOutput` whose
    ``router_loss = aux_loss_weight * sum(load-balancing losses) + z_loss_weight * sum(z-losses)``
    over the MoE blocks; :func:`moe_lm_loss` adds it to the language-model loss.
    """

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float | None = 1.25
    router_noise: float = 0.0
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head_dim, got dim/n_heads = {self.head_dim}"
            )
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(
                f"LlamaConfig.n_kv_heads ({self.n_kv_heads}) must be positive and divide "
                f"n_heads ({self.n_heads})"
            )
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"LlamaConfig.ffn_hidden must be positive, got {self.ffn_hidden}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LlamaConfig.{name} must be finite and > 0, got {value!r}")
        self._check_moe()

    def _check_moe(self) -> None:
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"LlamaConfig.n_experts must be an int >= 0, got {self.n_experts!r}")
        if not self.n_experts:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"LlamaConfig.top_k ({self.top_k}) must be in "
                             f"[1, n_experts={self.n_experts}]")
        if not 1 <= self.moe_every <= self.n_layers:
            raise ValueError(f"LlamaConfig.moe_every ({self.moe_every}) must be in "
                             f"[1, n_layers={self.n_layers}]: no block would be MoE")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError("LlamaConfig.capacity_factor must be > 0 or None (dropless), got "
                             f"{self.capacity_factor!r}")
        for name in ("router_noise", "aux_loss_weight", "z_loss_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LlamaConfig.{name} must be finite and >= 0, got {value!r}")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has an MoE feed-forward."""
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 32 * math.ceil(8 * self.dim / 3 / 32)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Norm statistics and rotary angles in at least float32 (bf16 angles lose whole positions);
    # float64 models stay float64 so that gradient checks are exact.
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, the statistic in at least float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Float[Tensor, "*batch dim"]) -> Float[Tensor, "*batch dim"]:
        h = x.to(_compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, *, dtype: torch.dtype, device: torch.device,
    positions: Int[Tensor, " seq"] | None = None,
) -> tuple[Float[Tensor, "seq head_dim"], Float[Tensor, "seq head_dim"]]:
    """cos and sin of the angles ``pos * theta^(-2i/head_dim)``, each half of a head repeated.

    ``pos`` runs over ``0 .. seq_len - 1``, or over ``positions`` when given (the global
    positions of a sequence chunk under context parallelism)."""
    work = _compute_dtype(dtype)
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=work) / head_dim
    )
    pos = (torch.arange(seq_len, device=device, dtype=work) if positions is None
           else positions.to(device=device, dtype=work))
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(
    x: Float[Tensor, "batch heads seq head_dim"],
    cos: Float[Tensor, "seq head_dim"],
    sin: Float[Tensor, "seq head_dim"],
) -> Float[Tensor, "batch heads seq head_dim"]:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_attention(
    q: Float[Tensor, "batch heads seq head_dim"],
    k: Float[Tensor, "batch kv_heads seq head_dim"],
    v: Float[Tensor, "batch kv_heads seq head_dim"],
) -> Float[Tensor, "batch heads seq head_dim"]:
    """Causal ``softmax(q k^T / sqrt(head_dim)) v``, each kv head shared by ``heads / kv_heads``
    consecutive query heads (grouped-query attention)."""
    b, _, t, hd = k.shape
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # expand + reshape rather than sdpa(enable_gqa=...): the latter needs torch >= 2.5
        k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, -1, t, hd)
        v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, -1, t, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Rotary multi-head (or grouped-query) self-attention.

    The attention proper is ``self.attend(q, k, v)`` (:func:`causal_attention` by default),
    given the rotated queries and the kv heads before any GQA repeat: an attribute so that a
    transform can install another exact attention for a call (context parallelism's ring or
    Ulysses attention, :mod:`funcpar.transforms.context_parallel`)."""

    attend = staticmethod(causal_attention)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self,
        x: Float[Tensor, "batch seq dim"],
        cos: Float[Tensor, "seq head_dim"],
        sin: Float[Tensor, "seq head_dim"],
    ) -> Float[Tensor, "batch seq dim"]:
        b, t, _ = x.shape
        # Head counts are read from the projections' outputs, not from the config, so that a
        # tensor-parallel shard (fewer local heads) runs the same code.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = self.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: Float[Tensor, "batch seq dim"]) -> Float[Tensor, "batch seq dim"]:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: Float[Tensor, "batch seq dim"],
        # "positions", not "seq": under sequence parallelism a block holds a chunk of the
        # sequence but the rotary tables of all of it (the attention gathers the sequence).
        cos: Float[Tensor, "positions head_dim"],
        sin: Float[Tensor, "positions head_dim"],
    ) -> Float[Tensor, "batch seq dim"]:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoEBlock(Block):
    """A block whose feed-forward is :class:`~funcpar.models.moe.MoE`; returns ``(y, stats)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.mlp = MoE(cfg.dim, cfg.hidden, cfg.n_experts, top_k=cfg.top_k,
                       capacity_factor=cfg.capacity_factor, noise_std=cfg.router_noise)

    def forward(
        self,
        x: Float[Tensor, "batch seq dim"],
        cos: Float[Tensor, "positions head_dim"],
        sin: Float[Tensor, "positions head_dim"],
    ) -> tuple[Float[Tensor, "batch seq dim"], MoEStats]:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, stats = self.mlp(self.post_attention_layernorm(h))
        return h + y, stats


class MoEOutput(NamedTuple):
    """What an MoE :class:`Llama` returns: the logits, the weighted router loss to add to the
    training loss, and per MoE block (in model order) its kept assignments per expert and its
    dropped assignments."""

    logits: Float[Tensor, "batch seq vocab"]
    router_loss: Float[Tensor, ""]
    tokens_per_expert: Int[Tensor, "moe_blocks experts"]
    dropped: Int[Tensor, " moe_blocks"]


class Llama(nn.Module):
    """Token ids ``[batch, seq]`` to next-token logits ``[batch, seq, vocab]``.

    Initialisation is a function of ``seed`` alone (a private generator, the global RNG is
    untouched): every weight matrix and the embedding ~ N(0, init_std^2), the residual-branch
    outputs (``o_proj``, ``down_proj``) scaled by ``1/sqrt(2 n_layers)`` as in GPT-2, norms 1.
    The weights are drawn on the CPU in float32 and then moved, so the same seed gives the same
    model on every device and dtype.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device: torch's own per-layer init would draw from the global RNG
        # and be thrown away by reset_parameters anyway.
        with torch.device("meta"):
            # An explicit (meta) weight skips nn.Embedding's own normal_ init, whose meta
            # implementation imports torch._dynamo: seconds at start-up in every process.
            self.embed_tokens = nn.Embedding(
                cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim)
            )
            self.layers = nn.ModuleList(
                MoEBlock(cfg) if cfg.is_moe(i) else Block(cfg) for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.to_empty(device="cpu")
        if cfg.tie_embeddings:  # after to_empty, which gives each module its own tensor
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters(seed)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std, residual_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        # named_parameters visits each tensor once (a tied lm_head is skipped), in registration
        # order: the draw order, and so the weights, are fixed by the architecture and the seed.
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
                continue
            s = residual_std if name.endswith(("o_proj.weight", "down_proj.weight",
                                               "experts.down_proj")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)

    def forward(
        self, tokens: Int[Tensor, "batch seq"], positions: Int[Tensor, " seq"] | None = None
    ) -> Float[Tensor, "batch seq vocab"] | MoEOutput:
        """``positions``: each token's position in its sequence (default ``0 .. seq - 1``);
        a chunk of a longer sequence passes its global ones (context parallelism), whose
        transform checks the whole length against ``max_seq_len``."""
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.embed_tokens(tokens)
        cos, sin = rotary_cos_sin(
            t, self.cfg.head_dim, self.cfg.rope_theta, dtype=x.dtype, device=x.device,
            positions=positions,
        )
        stats = []
        for block in self.layers:
            if isinstance(block, MoEBlock):
                x, s = block(x, cos, sin)
                stats.append(s)
            else:
                x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if not stats:
            return logits
        return moe_output(self.cfg, logits, stats)


def router_loss(cfg: LlamaConfig, stats: Sequence[MoEStats]) -> Tensor:
    """``aux_loss_weight * sum(aux losses) + z_loss_weight * sum(z-losses)`` over the MoE blocks
    of ``stats`` (at least one)."""
    return (cfg.aux_loss_weight * sum(s.aux_loss for s in stats)
            + cfg.z_loss_weight * sum(s.z_loss for s in stats))


def moe_output(cfg: LlamaConfig, logits: Float[Tensor, "batch seq vocab"],
               stats: Sequence[MoEStats]) -> MoEOutput:
    """The :class:`MoEOutput` of ``logits`` and the MoE blocks' ``stats`` (in model order).
    No block (a pipeline's last stage may hold none): a zero router loss, no rows."""
    if not stats:
        zero = torch.zeros((), dtype=_compute_dtype(logits.dtype), device=logits.device)
        none = torch.zeros((0, cfg.n_experts), dtype=torch.int64, device=logits.device)
        return MoEOutput(logits, zero, none, none[:, 0])
    return MoEOutput(logits, router_loss(cfg, stats),
                     torch.stack([s.tokens_per_expert for s in stats]),
                     torch.stack([s.dropped for s in stats]))


def lm_loss(
    logits: Float[Tensor, "batch seq vocab"],
    targets: Int[Tensor, "batch seq"],
    ignore_index: int = -100,
) -> Float[Tensor, ""]:
    """Mean next-token cross-entropy over the targets that are not ``ignore_index``.

    Low-precision logits are upcast to float32 first: the log-sum-exp over a large vocabulary
    loses too much in bf16.
    """
    logits = logits.to(_compute_dtype(logits.dtype))
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index
    )


def moe_lm_loss(out: MoEOutput, targets: Int[Tensor, "batch seq"]) -> Float[Tensor, ""]:
    """``lm_loss(out.logits, targets) + out.router_loss``: the training loss of an MoE
    :class:`Llama` (the router losses' weights are the config's)."""
    return lm_loss(out.logits, targets) + out.router_loss.to(_compute_dtype(out.logits.dtype))


# Declares what lm_loss computes, so that tensor parallelism may swap in the vocab-parallel
# cross-entropy (funcpar.transforms.shard_params) when the LM head's logits stay split.
lm_loss.token_cross_entropy = True
# moe_lm_loss is that cross-entropy plus a term of the output: the router losses, whole on
# every tensor-parallel rank, added to the vocab-parallel cross-entropy.
moe_lm_loss.token_cross_entropy = True
moe_lm_loss.extra_loss = lambda out: out.router_loss
