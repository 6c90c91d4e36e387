"""Sampling from a language model with a key/value cache, as pure functions.

``tokens, rng = generate(apply_fn, params, buffers, prompt, max_new_tokens, temperature=...,
top_k=..., top_p=..., rng=...)`` runs the prompt once (prefill), then one token at a time,
each step attending to the keys and values of every earlier position kept in a cache instead
of recomputing them (the cost of a new token is one position's, not the whole prefix's).

For funcpar's :class:`~funcpar.models.Llama` the cache is a tuple of ``(k, v)`` per block,
``[batch, kv_heads, positions, head_dim]`` (after rotary embedding), passed in and returned
by :func:`decode`: pure, nothing kept in the module. The cached forward is installed for the
call only, on the module's own instances (the model code, ``funcpar/models/llama.py``, is not
changed): the top-level forward offsets the rotary positions by the cache's length, and each
attention appends its new keys and values and attends over all of them with the causal mask
of the new positions. Because it swaps forwards at the attention and model level only, it
composes with the transforms that swap others for the call: ``shard_params`` (the linears:
each rank caches its own heads; the vocab-split logits are gathered, :func:`logits_gatherer`)
and ZeRO-3's per-block gathers. Not supported: a pipeline's stage ``apply_fn`` (the stages
live on other ranks: load the checkpoint into one process or a tensor-parallel layout) and
sequence parallelism (it swaps the attention regions itself). Refused: an MoE model with an
expert capacity (routing is per sequence, so the capacity of a one-token step differs from the
prefix's: dropless, ``capacity_factor=None``, decodes exactly).

A Hugging Face causal LM (``transformers.PreTrainedModel``) decodes through its own cache
(``cache``, ``past_key_values`` before transformers 5.x, with ``use_cache=True``); the
sampling is the same.

Sampling (the logits of the last position, in float32 at least): ``temperature == 0`` is
greedy (argmax; ties to the lowest id); otherwise ``softmax(logits / temperature)`` restricted
to the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``
(nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751), renormalised, one draw per row
from a ``torch.Generator`` set to ``rng`` (a generator state: ``funcpar.state.generator_state``
or a train state's ``rng``). The new state is returned, so the same ``rng`` gives the same
tokens and a caller threads the returned one on, as with a training step.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from funcpar.models.llama import Attention, Llama, MoEBlock, _rotate, rotary_cos_sin
from funcpar.state.functional import ApplyFn
from funcpar.state.tree import Tree

__all__ = ["KVCache", "decode", "generate", "logits_gatherer", "sample_next"]

#: One ``(keys, values)`` per block, ``[batch, kv_heads, positions, head_dim]``.
KVCache = tuple[tuple[Tensor, Tensor], ...]


def _cached_attention(attn: Attention, layer: int, cache: KVCache | None,
                      out: list[tuple[Tensor, Tensor]]) -> Callable:
    """``attn.forward`` over the cached positions of block ``layer`` plus the new ones."""

    def forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        d = attn.head_dim
        q = attn.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k = torch.cat((cache[layer][0], k), dim=2)
            v = torch.cat((cache[layer][1], v), dim=2)
        out.append((k, v))
        total = k.shape[2]
        group = q.shape[1] // k.shape[1]
        if group > 1:  # as Attention.forward: expand + reshape
            k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, -1, total, d)
            v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, -1, total, d)
        # New position i (absolute total - t + i) sees every position up to itself.
        mask = (torch.arange(total, device=x.device)[None, :]
                <= torch.arange(total - t, total, device=x.device)[:, None])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    return forward


def _cached_model(model: Llama, start: int) -> Callable:
    """``model.forward`` for tokens at positions ``start, start + 1, ...``."""

    def forward(tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if start + t > model.cfg.max_seq_len:
            raise ValueError(f"generate: position {start + t} exceeds max_seq_len "
                             f"{model.cfg.max_seq_len}")
        x = model.embed_tokens(tokens)
        cos, sin = rotary_cos_sin(start + t, model.cfg.head_dim, model.cfg.rope_theta,
                                  dtype=x.dtype, device=x.device)
        cos, sin = cos[start:], sin[start:]
        for block in model.layers:
            x = block(x, cos, sin)
            if isinstance(block, MoEBlock):
                x = x[0]  # the router statistics are training terms
        return model.lm_head(model.norm(x))

    return forward


@contextlib.contextmanager
def _installed(model: Llama, cache: KVCache | None,
               out: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    start = 0 if cache is None else cache[0][0].shape[2]
    swapped: list[nn.Module] = [model]
    model.forward = _cached_model(model, start)
    for i, block in enumerate(model.layers):
        block.self_attn.forward = _cached_attention(block.self_attn, i, cache, out)
        swapped.append(block.self_attn)
    try:
        yield
    finally:
        for m in swapped:
            m.__dict__.pop("forward", None)


def _module(apply_fn: ApplyFn) -> nn.Module:
    module = getattr(apply_fn, "module", None)
    if module is None:
        raise TypeError("generate needs an apply_fn from functionalize(module) (or a transform "
                        "of it), which names its module")
    return module


def _check_llama(model: Llama) -> None:
    cfg = model.cfg
    if cfg.n_experts and cfg.capacity_factor is not None:
        raise ValueError(
            f"generate: this MoE Llama routes with capacity_factor={cfg.capacity_factor}, per "
            "sequence, so a one-token decoding step would route under another capacity than "
            "the whole sequence does; decode a dropless model (capacity_factor=None)")


def decode(
    apply_fn: ApplyFn, params: Tree, buffers: Tree, tokens: Int[Tensor, "batch seq"],
    cache: Any = None,
) -> tuple[Float[Tensor, "batch seq vocab"], Any]:
    """``(logits, new_cache)`` of ``tokens`` following the positions in ``cache`` (None: the
    sequence starts here). funcpar's Llama: ``cache`` a :data:`KVCache`; a Hugging Face model:
    its own ``past_key_values``."""
    module = _module(apply_fn)
    if isinstance(module, Llama):
        _check_llama(module)
        new: list[tuple[Tensor, Tensor]] = []
        with torch.no_grad(), _installed(module, cache, new):
            logits, _ = apply_fn(params, buffers, tokens)
        return logits, tuple(new)
    if _is_hf(module):
        # transformers 5.x names the cache argument and output ``cache`` (``past_key_values``
        # before, deprecated since).
        key = ("cache" if "cache" in inspect.signature(module.forward).parameters
               else "past_key_values")
        with torch.no_grad():
            out, _ = apply_fn(params, buffers, tokens, use_cache=True, **{key: cache})
        return out.logits, out[key]
    raise TypeError(f"generate: no cached decoding for {type(module).__name__}; funcpar's "
                    "Llama and Hugging Face causal LMs have one")


def _is_hf(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is an extra
        return False
    return isinstance(module, PreTrainedModel)


def sample_next(
    logits: Float[Tensor, "batch vocab"], gen: torch.Generator | None, *,
    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
) -> Int[Tensor, " batch"]:
    """One token per row from ``logits`` (module docstring: greedy at ``temperature == 0``,
    else top-k / top-p filtered sampling drawing from ``gen``)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(dim=-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep a token when the mass before it is below top_p: the smallest set reaching top_p.
        before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def generate(
    apply_fn: ApplyFn,
    params: Tree,
    buffers: Tree,
    prompt: Int[Tensor, "batch prompt"],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: Tensor | None = None,
    *,
    gather_logits: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Int[Tensor, "batch total"], Tensor | None]:
    """``(prompt followed by max_new_tokens sampled tokens, the new rng)`` (module docstring).

    ``rng``: the sampling generator's state (needed unless ``temperature == 0``; the returned
    rng is then the given one). ``gather_logits``: what makes the model's logits whole over
    the vocabulary, for a tensor-parallel state whose LM head is vocab-split
    (``logits_gatherer(step)``); every rank then draws the same tokens from the same rng.
    """
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"generate: temperature must be finite and >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p}")
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: the prompt must be [batch, >= 1 tokens], got shape "
                         f"{tuple(prompt.shape)}")
    if getattr(apply_fn, "context_parallel", None) is not None:
        raise ValueError("generate: the apply_fn is context_parallel's (each rank attends over "
                         "its chunks of every sequence), which decoding cannot use; the params "
                         "are whole under context parallelism: decode with the model's own "
                         "apply_fn (functionalize(model)) on them")
    gen = None
    if temperature > 0:
        if rng is None:
            raise ValueError("generate: sampling (temperature > 0) needs rng=, a generator "
                             "state (funcpar.state.generator_state(device, seed))")
        kind = prompt.device if prompt.device.type == "cuda" else torch.device("cpu")
        gen = torch.Generator(device=kind)
        gen.set_state(rng)
    tokens, cache, new = prompt, None, prompt
    for _ in range(max_new_tokens):
        logits, cache = decode(apply_fn, params, buffers, new, cache)
        last = logits[:, -1]
        if gather_logits is not None:
            last = gather_logits(last)
        nxt = sample_next(last.to(prompt.device) if gen is None else last.to(gen.device),
                          gen, temperature=temperature, top_k=top_k, top_p=top_p)
        new = nxt.to(prompt.device)[:, None]
        tokens = torch.cat((tokens, new), dim=1)
    return tokens, (rng if gen is None else gen.get_state())


def logits_gatherer(step: Any) -> Callable[[Tensor], Tensor] | None:
    """For a transformed step whose LM head is vocab-split over tensor-parallel axes: the
    gather of its logits' last dim over them (None when the logits are whole). The head's
    leaf is ``lm_head.weight`` (funcpar's Llama), else the embedding it is tied to; a ZeRO-3
    partition's own axis is left out (its ``apply_fn`` gathers the weight whole over it)."""
    from funcpar.shard import comm

    layouts = getattr(step, "layouts", None)
    if layouts is None:
        return None
    name = next((n for n in ("lm_head.weight", "model.embed_tokens.weight",
                             "embed_tokens.weight") if n in layouts), None)
    lay = None if name is None else layouts[name]
    if lay is None:
        return None
    zero = getattr(getattr(step, "partition", None), "axis", None)
    axes = [a for a in lay.dim_axes[0] if a != zero]
    if not axes:
        return None
    if len(axes) > 1:
        raise ValueError(f"generate: {name} is split over {axes} along the vocabulary; one "
                         "tensor-parallel axis is supported")
    axis, mesh = axes[0], lay.mesh
    sizes = comm.chunk_sizes(lay.global_shape[0], mesh.size(axis))

    def gather(logits: Tensor) -> Tensor:
        return comm.all_gather(logits.contiguous(), mesh, axis, dim=logits.dim() - 1, sizes=sizes,
                               purpose="generate: logits")

    return gather
