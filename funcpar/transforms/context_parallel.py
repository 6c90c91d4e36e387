"""``context_parallel``: the sequences cut over a mesh axis, attention made exact across the cut.

``step, state = context_parallel(mesh, axis="cp", mode="ring" | "ulysses")(step, state)``: every
rank of the ``cp`` axis holds the whole model and ``1 / cp`` of every sequence's tokens, so the
activations of a step - the residual stream, the MLPs, the norms and attention's own - fall by
``cp`` on each rank; only the attention needs other ranks' tokens.

**The cut (zigzag).** A sequence of ``S`` tokens is cut into ``2 N`` chunks of ``c = S / (2 N)``
(``N`` the axis size) and rank ``i`` holds chunks ``i`` and ``2N - 1 - i``
(:func:`zigzag_positions`; Brandon et al. 2023, "Striped Attention", arXiv 2311.09431, and
Colossal-AI's ``ring_attn`` / Megatron-LM's context parallelism use this load balance). Under
the causal mask a query chunk ``a`` attends to the chunks ``< a`` in full and to itself
triangularly, so rank ``i`` computes ``i + (2N - 1 - i) = 2N - 1`` full chunk pairs plus two
triangles: the same on every rank. Every tensor of the batch ``(inputs, targets)`` is cut along
dim 1 (its sequence dim) the same way, so labels shifted before the cut (the targets of
``(ids[:, :-1], ids[:, 1:])``) stay with their tokens. A length ``S`` that does not divide by
``2 N`` is padded at the end to the next multiple (:func:`pad_sequences`: token id 0, targets
``ignore_index``), which is exact: under the causal mask no real position attends to a later
one, and a pad's target is not counted (its output's gradient is exactly zero). With MoE blocks
the pads would be routed and enter the router losses, so there the length must divide (a
ValueError naming the numbers).
The model sees each token's global position (funcpar's :class:`~funcpar.models.Llama`:
``positions=``, passed by the wrapped ``apply_fn``), so rotary embeddings are unchanged.

**Ring attention** (:func:`ring_attention`; Liu et al. 2023, "Ring Attention with Blockwise
Transformers", arXiv 2310.01889; Li et al. 2021, arXiv 2105.13120). Each rank keeps its
queries; the key/value block (``2 x batch x kv_heads x 2c x head_dim``: the kv heads, never
repeated to the query heads under grouped-query attention) travels around the ring by
point-to-point sends (:func:`funcpar.shard.comm.batch_p2p`, so every send and receive is in
:data:`~funcpar.shard.comm.comm_log`), ``N - 1`` hops. Each arriving block's scores ``s_b``
join the running softmax of each query chunk (online softmax, Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022): with the row maxima ``m' = max(m, max s_b)``,
``l' = l e^{m - m'} + sum e^{s_b - m'}`` and ``acc' = acc e^{m - m'} + e^{s_b - m'} v_b``; the
output is ``acc / l`` and its log-sum-exp ``m + log l`` at the end. All in float32 (float64 for
float64 inputs) whatever the inputs' dtype; one rescale per block and one division at the end,
so the rounding does not grow with the ring (measured: the float32 error against a float64
reference is one process's at cp2 and cp4, docs/CONTEXT_PARALLEL.md). Only the chunk pairs
the causal mask leaves are computed, each holding a ``c x c`` score tile: no rank holds the
sequence's ``S x S`` scores nor its whole keys and values. The backward (a
``torch.autograd.Function``) saves the inputs, the output and its log-sum-exp; it sends the
key/value block around the ring again, and with it the block's gradient accumulator
``(dK, dV)`` (float32 or float64), to which every rank adds its queries' contribution
``dS = P * (dP - rowsum(dO * O))`` (FlashAttention's backward); after ``N`` hops each
accumulator is home, complete. ``overlap=True`` posts the next block's transfer before
computing on the current one (``False``: after, for the benchmark's comparison).

**Ulysses** (:func:`ulysses_attention`; Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv
2309.14509). One all_to_all turns ``q, k, v`` from sequence-split (all heads) to head-split
(all of the sequence, ``heads / N`` heads per rank); the rank reorders the gathered sequence
from zigzag to natural order, runs ``scaled_dot_product_attention`` (causal, grouped-query),
reorders back, and a second all_to_all returns the output to sequence-split. The backward is
the two all_to_alls the other way. The query heads (per tensor-parallel rank) must divide by
``N``; the kv heads must divide by ``N`` or divide ``N`` - then each rank receives the one kv
head its query heads share (a repeat of ``N / kv_heads``), so the bytes grow with the kv heads
only as far as the split needs. Anything else is a ValueError naming the numbers.

**Which to pick** (docs/CONTEXT_PARALLEL.md): Ulysses moves ``~4 / N`` of the layer's q/k/v/o
per rank in two all_to_alls (latency-bound hops: 2 per layer per direction), needs heads
divisible by ``N`` and holds one head group's full ``S x S`` scores where the attention kernel
materialises them (math SDPA on the CPU); ring moves the kv block ``N - 1`` times (its bytes
grow with ``N``, but overlap the compute) and works for any head count.

**Loss and gradients.** The step's loss must be a token mean (declared by the attribute
``token_cross_entropy = True``, as ``funcpar.models.lm_loss`` does; its ``ignore_index``
attribute, default -100, marks the targets it does not count). Each rank's loss is weighted by
``N n_r / n`` (``n_r`` its counted targets, ``n`` the total, one all-reduce of an int64), so the
mean over ``cp`` of the reported losses and of the gradients is the global token mean's, exactly,
however the ignored targets fall. The gradients are averaged over ``cp`` after the backward
(``sync_grads``, in flat buckets of ``bucket_mb``) and the reported loss is the mean over
``cp``: every rank applies one process's update. A rank whose chunk holds no counted target
gives nan (a mean over no token), as one process would for a batch of none.

**Models.** funcpar's :class:`~funcpar.models.Llama` (its ``Attention.attend`` is swapped for
the call; remat records and reinstalls it for the recompute), and Hugging Face decoders that
attend through ``scaled_dot_product_attention`` (``attn_implementation="sdpa"``): their causal
self-attention modules (``num_key_value_groups``, ``is_causal``) get, for the call, a shallow
copy of their config naming an attention function registered with transformers, which calls
the cp attention on the unrepeated kv heads; the model gets ``position_ids`` (the global
positions) and a prepared placeholder mask (so that transformers builds none: its
packed-sequence detection would read the zigzag positions' jump as a new sequence; any other
mask reaching the attention is a ValueError). Such a model takes only the token ids under cp.
Eager attention, attention dropout, and models with no such module (BERT) are refused by name.

**MoE blocks** (funcpar's :class:`~funcpar.models.moe.MoE`, with ``funcpar.models.moe_lm_loss``).
Dropless routing (``capacity_factor=None``) chooses each token's experts and gates from that
token alone, so the block's output is one process's token by token. Its router losses are not
per token: per sequence ``E sum_e f_e P_e`` (``f_e`` the share of the sequence's assignments
to ``e``, ``P_e`` its mean router probability) and the z-loss ``mean_t logsumexp(l_t)^2``.
The block's ``route`` (an instance attribute for the call, like ``attend``) sums, per
sequence, the assignment counts and router probabilities and the tokens' squared
log-sum-exps over ``cp`` in one all-reduce, and forms the losses from the sums: every rank
holds the whole sequences' router losses. The all-reduce's backward all-reduces the
gradients (sum forward, sum backward: ``enter_region`` then ``exit_region``), so each rank's
router gradient is ``N`` times its tokens' share and the mean over ``cp`` is one process's;
the loss adds the router term unweighted to the weighted token mean
(``(L - R) N n_r / n + R``). Capacity-limited routing is refused: the capacity
``ceil(f k T / E)`` and the order in which assignments claim it are per sequence, and a rank
holds ``T / N`` of it, so other assignments would be dropped than in one process. Router
noise is refused (each rank would draw its tokens' noise from its own generator).

**Pipelines.** Under :func:`~funcpar.transforms.pipeline_split` (applied first) the wrapped
``apply_fn`` is a stage's: the attention of every stage's blocks runs over ``cp`` and the
stage functions get ``positions=`` (:mod:`funcpar.pipeline.stages`), the activations sent
between stages are each rank's zigzag chunk (``[micro-batch, S / N, dim]``), and the loss is
weighted per micro-batch on the last stage (the pipeline's loss is the mean of its
micro-batches' losses, each of them here the micro-batch's global token mean). The ranks of a
cp group run the same schedule, so their ring transfers and all_to_alls meet in order.

**Composition.** ``context_parallel`` rewrites ``apply_fn``, ``local_batch``, ``loss_fn``,
``sync_grads`` and ``sync_loss`` by wrapping the inner ones, so it composes with
``data_parallel`` (any order; the batch is cut on dim 0 by dp, on dim 1 by cp),
``zero_partition`` 1-3, ``remat`` and ``amp_cast`` in any order, and with ``shard_params``
(with or without sequence parallelism) applied *before* it (the vocab-parallel loss replaces the
step's loss; ``context_parallel`` then weights that one), and ``pipeline_split`` applied
before it. ``compile=True``: Ulysses compiles as one whole-step region (its all_to_alls and
all-reduces are functional collectives); the ring is refused, naming both (point-to-point
sends have no functional collective, so the step cannot be traced as one region).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from funcpar.models.moe import Routing, route
from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.tp_ops import all_to_all_grad, enter_region, exit_region
from funcpar.state.train_state import TrainState
from funcpar.state.tree import tree_flatten, tree_unflatten
from funcpar.train.step import TrainStep
from funcpar.transforms.data_parallel import bucketed_mean, mean_loss

__all__ = [
    "ContextParallel",
    "context_parallel",
    "pad_sequences",
    "ring_attention",
    "ulysses_attention",
    "ulysses_kv_heads",
    "zigzag_positions",
    "zigzag_split",
]

MODES = ("ring", "ulysses")
#: Models whose attention this transform knows how to replace, by qualified name (the
#: transforms do not import the models): model class -> its attention modules' class.
_MODELS = {"funcpar.models.llama.Llama": "funcpar.models.llama.Attention"}
_MOE = "funcpar.models.moe.MoE"


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------------------ the zigzag cut
def _chunk(seq: int, n: int, who: str) -> int:
    if seq % (2 * n) or seq == 0:
        raise ValueError(f"context_parallel over {n} ranks cuts each sequence into 2 x {n} = "
                         f"{2 * n} equal chunks (zigzag), but {who} has {seq} positions: pad "
                         f"to a multiple of {2 * n} (targets ignore_index)")
    return seq // (2 * n)


def zigzag_positions(seq: int, n: int, rank: int, *,
                     device: torch.device | None = None) -> Int[Tensor, " local"]:
    """The global positions rank ``rank`` of ``n`` holds of a ``seq``-token sequence: chunks
    ``rank`` and ``2n - 1 - rank`` of ``2n`` equal chunks, in that order."""
    c = _chunk(seq, n, "the sequence")
    ar = torch.arange(c, device=device)
    return torch.cat([ar + rank * c, ar + (2 * n - 1 - rank) * c])


def zigzag_split(batch: Any, mesh: DeviceMesh, axis: str) -> Any:
    """This rank's zigzag chunks (:func:`zigzag_positions`) along dim 1 of every tensor of
    ``batch``; they must all have the same length there."""
    n, r = mesh.size(axis), mesh.rank(axis)
    leaves, spec = tree_flatten(batch)
    lengths = {x.shape[1] if torch.is_tensor(x) and x.dim() >= 2 else None for x in leaves}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"context_parallel over {axis}={n} cuts dim 1 (the sequence) of every "
                         "tensor of the batch: they must all be tensors of at least 2 dims "
                         f"with one length there; got shapes "
                         f"{[tuple(getattr(x, 'shape', ())) for x in leaves]}")
    c = _chunk(leaves[0].shape[1], n, f"the batch (shape {tuple(leaves[0].shape)})")
    out = [torch.cat([x[:, r * c:(r + 1) * c], x[:, (2 * n - 1 - r) * c:(2 * n - r) * c]], 1)
           for x in leaves]
    return tree_unflatten(spec, out)


def _chunk_ids(n: int, rank: int) -> tuple[int, int]:
    return rank, 2 * n - 1 - rank


# -------------------------------------------------------------------------- ring attention
def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # The running output and log-sum-exp in float32 at least (float64 stays float64), so the
    # merge's rounding does not grow with the ring's length.
    return torch.promote_types(dtype, torch.float32)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """``q k^T * scale`` of one chunk pair, the query heads of a kv head stacked as rows
    (``[b, kv, group * cq, ck]``), the causal triangle of a diagonal pair at -inf."""
    b, h, cq, d = q.shape
    kv = k.shape[1]
    s = q.reshape(b, kv, (h // kv) * cq, d) @ k.transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(cq, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask.repeat(h // kv, 1), float("-inf"))
    return s


class _Online:
    """The running softmax of one query chunk (FlashAttention's forward, Dao et al. 2022): the
    row maxima ``m``, ``l = sum exp(s - m)`` and ``acc = sum exp(s - m) v`` over the key chunks
    seen so far, rows as ``[b, kv, group * cq]`` (grouped-query heads share their kv head
    without a repeat). Each new chunk rescales ``acc`` once; the division comes at the end."""

    def __init__(self) -> None:
        self.m: Tensor | None = None
        self.l: Tensor | None = None
        self.acc: Tensor | None = None

    def add(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> None:
        s = _scores(q, k, causal, scale)
        # Every row has a finite maximum: a diagonal pair keeps its own position.
        m = s.amax(-1) if self.m is None else torch.maximum(self.m, s.amax(-1))
        p = torch.exp(s - m[..., None])
        if self.m is None:
            self.l, self.acc = p.sum(-1), p @ v
        else:
            alpha = torch.exp(self.m - m)
            self.l = self.l * alpha + p.sum(-1)
            self.acc = self.acc * alpha[..., None] + p @ v
        self.m = m

    def result(self, shape: torch.Size) -> tuple[Tensor, Tensor]:
        """``(softmax(s) v, logsumexp(s))`` over every key seen, as ``[b, h, cq, d]`` and
        ``[b, h, cq]``."""
        b, h, cq, d = shape
        out = self.acc / self.l[..., None]
        return out.view(b, h, cq, d), (self.m + self.l.log()).view(b, h, cq)


def _block_grads(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one chunk pair given the final output's ``lse`` and
    ``delta = rowsum(dO * O)``: ``P = exp(s - lse)``, ``dV = P^T dO``,
    ``dS = P * (dO V^T - delta)``, ``dQ = dS K * scale``, ``dK = dS^T Q * scale``."""
    b, h, cq, d = q.shape
    kv = k.shape[1]
    rows = (b, kv, (h // kv) * cq)
    p = torch.exp(_scores(q, k, causal, scale) - lse.reshape(rows)[..., None])
    dog = do.reshape(*rows, d)
    ds = p * (dog @ v.transpose(-1, -2) - delta.reshape(rows)[..., None])
    dq = (ds @ k * scale).view(b, h, cq, d)
    return dq, ds.transpose(-1, -2) @ q.reshape(*rows, d) * scale, p.transpose(-1, -2) @ dog


def _pairs(n: int, rank: int, src: int) -> Iterator[tuple[int, int, bool]]:
    """The (query chunk, key chunk, diagonal) pairs of this rank's queries and ``src``'s keys
    that the causal mask leaves (local indices 0/1 of each side's two chunks)."""
    for a, qa in enumerate(_chunk_ids(n, rank)):
        for bb, kb in enumerate(_chunk_ids(n, src)):
            if kb <= qa:
                yield a, bb, kb == qa


def _exchange(buf: Tensor, mesh: DeviceMesh, axis: str, tag: int, purpose: str
              ) -> tuple[Tensor, list[comm.Pending]]:
    """Post the send of ``buf`` to the next rank of the ring and the receive of the previous
    rank's into a new buffer; returns the buffer and the transfers to wait for."""
    n, r = mesh.size(axis), mesh.rank(axis)
    nxt = torch.empty_like(buf)
    pend = comm.batch_p2p([comm.P2POp("send", buf, (r + 1) % n, tag, purpose),
                           comm.P2POp("recv", nxt, (r - 1) % n, tag, purpose)], mesh, axis)
    return nxt, pend


def _wait(pend: list[comm.Pending]) -> None:
    for p in pend:
        p.wait()


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mesh: DeviceMesh, axis: str,
                scale: float, overlap: bool, purpose: str) -> Tensor:
        n, r = mesh.size(axis), mesh.rank(axis)
        work = _work_dtype(q.dtype)
        c = q.shape[2] // 2
        qs = q.to(work).split(c, 2)
        kv = torch.stack([k, v]).contiguous()  # one buffer travels: the kv heads, input dtype
        runs = [_Online(), _Online()]
        for j in range(n):
            pend: list[comm.Pending] = []
            last = j == n - 1
            if overlap and not last:
                nxt, pend = _exchange(kv, mesh, axis, 0, f"{purpose}: ring kv")
            kw, vw = (x.split(c, 2) for x in kv.to(work))
            for a, bb, diag in _pairs(n, r, (r - j) % n):
                runs[a].add(qs[a], kw[bb], vw[bb], diag, scale)
            if not last:
                if not overlap:
                    nxt, pend = _exchange(kv, mesh, axis, 0, f"{purpose}: ring kv")
                _wait(pend)
                kv = nxt
        out, lse = zip(*(run.result(x.shape) for run, x in zip(runs, qs)))
        o = torch.cat(out, 2).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, 2))
        ctx.args = mesh, axis, scale, overlap, purpose
        return o

    @staticmethod
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        mesh, axis, scale, overlap, purpose = ctx.args
        n, r = mesh.size(axis), mesh.rank(axis)
        work = lse.dtype
        c = q.shape[2] // 2
        qs = q.to(work).split(c, 2)
        dow = do.to(work)
        dos, lses = dow.split(c, 2), lse.split(c, 2)
        deltas = (dow * o.to(work)).sum(-1).split(c, 2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        # The accumulator of the kv block now here travels with it and comes home complete.
        dkv = torch.zeros(kv.shape, dtype=work, device=kv.device)
        for j in range(n):
            pend: list[comm.Pending] = []
            last = j == n - 1
            if overlap and not last:
                nxt, pend = _exchange(kv, mesh, axis, 0, f"{purpose}: ring kv (grad)")
            kw, vw = (x.split(c, 2) for x in kv.to(work))
            dk, dv = dkv[0].split(c, 2), dkv[1].split(c, 2)
            for a, bb, diag in _pairs(n, r, (r - j) % n):
                g_q, g_k, g_v = _block_grads(qs[a], kw[bb], vw[bb], dos[a], lses[a],
                                             deltas[a], diag, scale)
                dq[a] += g_q
                dk[bb].add_(g_k.view_as(dk[bb]))
                dv[bb].add_(g_v.view_as(dv[bb]))
            if n > 1:
                if not overlap and not last:
                    nxt, pend = _exchange(kv, mesh, axis, 0, f"{purpose}: ring kv (grad)")
                dkv, more = _exchange(dkv, mesh, axis, 1, f"{purpose}: ring dkv (grad)")
                _wait(pend + more)
                if not last:
                    kv = nxt
        return (torch.cat(dq, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def _check_heads(q: Tensor, k: Tensor, v: Tensor, who: str) -> None:
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"{who}: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must be [batch, heads, seq, head_dim] alike")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{who}: the {k.shape[1]} kv heads do not divide the {q.shape[1]} "
                         "query heads")


def ring_attention(
    q: Float[Tensor, "batch heads seq head_dim"],
    k: Float[Tensor, "batch kv_heads seq head_dim"],
    v: Float[Tensor, "batch kv_heads seq head_dim"],
    mesh: DeviceMesh,
    axis: str = "cp",
    *,
    scale: float | None = None,
    overlap: bool = True,
    purpose: str = "attention",
) -> Float[Tensor, "batch heads seq head_dim"]:
    """Causal attention of this rank's zigzag chunks (``seq = 2c`` positions) against the whole
    sequence spread over ``axis``, by ring (module docstring). ``scale`` defaults to
    ``1 / sqrt(head_dim)``; query head ``i`` uses kv head ``i // (heads / kv_heads)``."""
    _check_heads(q, k, v, "ring_attention")
    _chunk(q.shape[2] * mesh.size(axis), mesh.size(axis), "ring_attention's q")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _Ring.apply(q, k, v, mesh, axis, scale, overlap, purpose)


# --------------------------------------------------------------------------------- Ulysses
def ulysses_kv_heads(heads: int, kv_heads: int, n: int) -> list[int] | None:
    """The kv heads to send to each of ``n`` ranks (concatenated in rank order) when the kv
    heads do not split into ``n`` (None: they do); a ValueError when no split fits."""
    if heads % n:
        raise ValueError(f"ulysses over cp={n} splits the query heads: {heads} (per "
                         f"tensor-parallel rank) do not divide by {n}")
    if kv_heads % n == 0:
        return None
    if n % kv_heads:
        raise ValueError(f"ulysses over cp={n}: the {kv_heads} kv heads (per tensor-parallel "
                         f"rank) must divide by {n} or divide {n}")
    return [j * kv_heads // n for j in range(n)]


def _seq_to_heads(x: Tensor, n: int) -> Tensor:
    """``[b, n, h, t, d]`` (the rank dim split out of the heads) to ``[n * h, b, t, d]``
    (destination rank first, as all_to_all sends rows)."""
    b, _, h, t, d = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(n * h, b, t, d)


def _gathered(x: Tensor, n: int) -> Tensor:
    """The received ``[n * h, b, t, d]`` (source rank first) to ``[b, h, n * t, d]``."""
    _, b, t, d = x.shape
    return x.view(n, -1, b, t, d).permute(2, 1, 0, 3, 4).reshape(b, -1, n * t, d)


def ulysses_attention(
    q: Float[Tensor, "batch heads seq head_dim"],
    k: Float[Tensor, "batch kv_heads seq head_dim"],
    v: Float[Tensor, "batch kv_heads seq head_dim"],
    mesh: DeviceMesh,
    axis: str = "cp",
    *,
    scale: float | None = None,
    purpose: str = "attention",
) -> Float[Tensor, "batch heads seq head_dim"]:
    """Causal attention of this rank's zigzag chunks against the whole sequence spread over
    ``axis``, by two all_to_alls (module docstring)."""
    _check_heads(q, k, v, "ulysses_attention")
    n = mesh.size(axis)
    b, h, t, d = q.shape
    seq = t * n
    _chunk(seq, n, "ulysses_attention's q")
    repeat = ulysses_kv_heads(h, k.shape[1], n)
    if repeat is not None:  # each rank gets the one kv head its query heads share
        idx = torch.tensor(repeat, device=k.device)
        k, v = k.index_select(1, idx), v.index_select(1, idx)
    hq, hk = h // n, k.shape[1] // n
    # One all_to_all for q, k and v: per destination rank, its query heads then its kv heads.
    parts = [x.view(b, n, -1, t, d) for x in (q, k, v)]
    sent = _seq_to_heads(torch.cat(parts, 2), n)
    rows = sent.shape[0] // n
    got = _gathered(all_to_all_grad(sent, mesh, axis, [rows] * n, [rows] * n,
                                    f"{purpose}: ulysses qkv"), n)
    # The gathered sequence is the ranks' zigzag chunks in rank order: to natural order and back.
    order = torch.cat([zigzag_positions(seq, n, i, device=q.device) for i in range(n)])
    qg, kg, vg = got.index_select(2, torch.argsort(order)).split([hq, hk, hk], 1)
    out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale,
                                         enable_gqa=hq != hk)
    back = _seq_to_heads(out.index_select(2, order).view(b, hq, n, t, d).transpose(1, 2), n)
    back = all_to_all_grad(back, mesh, axis, [hq] * n, [hq] * n, f"{purpose}: ulysses out")
    return back.view(n, hq, b, t, d).permute(2, 0, 1, 3, 4).reshape(b, h, t, d)


# ------------------------------------------------------------------------------ the transform
@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """What :func:`context_parallel` did to a step, kept on its loss function (attribute
    ``context_parallel``) for the plan (:mod:`funcpar.presets.plan`) and the other transforms:
    ``attention`` lists ``(name, heads, kv_heads, head_dim)`` of every attention module,
    ``moe`` ``(name, experts)`` of every MoE block."""

    axis: str
    mode: str
    overlap: bool
    bucket_bytes: int
    attention: tuple[tuple[str, int, int, int], ...]
    moe: tuple[tuple[str, int], ...] = ()

    def attention_comm(self, n: int, batch: int, local_seq: int, dtype: torch.dtype,
                       tp: int = 1, recomputed: tuple[str, ...] = ()
                       ) -> list[tuple[str, int, str, int]]:
        """``(op, total bytes, what, count)`` of the attention's (and the MoE blocks' router
        statistics') traffic in one step over ``n`` ranks: ``batch`` sequences of
        ``local_seq`` positions on this rank, in ``dtype``, the heads cut over ``tp`` (in
        :mod:`funcpar.shard.comm`'s convention: a send and its receive are each recorded with
        the buffer's bytes). ``recomputed``: the modules remat checkpoints, whose forward
        traffic the backward's recompute repeats."""
        size = torch.empty((), dtype=dtype).element_size()
        work = torch.empty((), dtype=_work_dtype(dtype)).element_size()
        router = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()

        def times(name: str) -> int:  # forward passes: 2 when inside a rematted module
            return 1 + any(name == r or name.startswith(r + ".") for r in recomputed)

        out = []
        for name, heads, kv, d in self.attention:
            h, k = heads // tp, kv // tp
            per_head = batch * local_seq * d
            f = times(name)
            if self.mode == "ring":
                kv_bytes = 2 * k * per_head
                for op in ("send", "recv"):
                    out += [(op, f * (n - 1) * kv_bytes * size, "cp ring: kv blocks (forward)",
                             f * (n - 1)),
                            (op, (n - 1) * kv_bytes * size, "cp ring: kv blocks (backward)",
                             n - 1),
                            (op, n * kv_bytes * work, "cp ring: dkv accumulators (backward)",
                             n)]
            else:
                repeat = ulysses_kv_heads(h, k, n)
                sent = h + 2 * (k if repeat is None else len(repeat))
                for what, c in (("forward", f), ("backward", 1)):
                    out += [("all_to_all", c * sent * per_head * size,
                             f"cp ulysses: qkv ({what})", c),
                            ("all_to_all", c * h * per_head * size, f"cp ulysses: out ({what})",
                             c)]
        for name, e in self.moe:
            # Per sequence the counts and probabilities of every expert, and the z-loss sum.
            nbytes = (2 * batch * e + 1) * router
            f = times(name)
            out += [("all_reduce", f * nbytes, "cp: MoE router stats (forward)", f),
                    ("all_reduce", nbytes, "cp: MoE router stats (backward)", 1)]
        return out


def _is_hf(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _moe_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The MoE blocks (funcpar's :class:`~funcpar.models.moe.MoE`) of ``module``, refused where
    their routing is not per token (module docstring, "MoE blocks")."""
    found = {name: m for name, m in module.named_modules() if _qualname(m) == _MOE}
    for name, m in found.items():
        if m.capacity_factor is not None:
            raise ValueError(
                f"context_parallel and capacity-limited MoE routing ({name}: capacity_factor="
                f"{m.capacity_factor}): the capacity and the order in which assignments claim "
                "it are per sequence, and under cp each rank holds 1/cp of every sequence, so "
                "other assignments would be dropped than in one process: use "
                "capacity_factor=None (dropless routing, exact under cp)")
        if m.noise_std > 0:
            raise ValueError(
                f"context_parallel and MoE router noise ({name}: noise_std={m.noise_std}): "
                "each rank would draw its tokens' noise from its own stream, not one "
                "process's draws: set router_noise=0 under cp")
    return found


def _attention_modules(module: nn.Module) -> dict[str, nn.Module]:
    if _is_hf(module):
        return _hf_attention_modules(module)
    want = _MODELS.get(_qualname(module))
    if want is None:
        raise ValueError(f"context_parallel does not know how to replace the attention of "
                         f"{_qualname(module)}: supported models are {sorted(_MODELS)} and "
                         "Hugging Face decoders attending through scaled_dot_product_attention")
    found = {name: m for name, m in module.named_modules() if _qualname(m) == want}
    if not found:
        raise ValueError(f"context_parallel: {_qualname(module)} has no {want} module")
    return found


def _hf_attention_modules(module: nn.Module) -> dict[str, nn.Module]:
    """A Hugging Face decoder's causal self-attention modules (those that dispatch on
    ``config._attn_implementation`` and carry ``num_key_value_groups``), when the model attends
    through ``scaled_dot_product_attention`` ("sdpa") without dropout."""
    cfg = getattr(module, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"context_parallel: {_qualname(module)} attends through {impl!r}, "
                         "not scaled_dot_product_attention: load it with "
                         "attn_implementation='sdpa'")
    if getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(f"context_parallel: {_qualname(module)} has attention dropout "
                         f"{cfg.attention_dropout}: not supported (set attention_dropout=0)")
    found = {name: m for name, m in module.named_modules()
             if hasattr(m, "num_key_value_groups") and getattr(m, "is_causal", False)
             and hasattr(m, "config") and hasattr(m, "head_dim")}
    if not found:
        raise ValueError(f"context_parallel does not know how to replace the attention of "
                         f"{_qualname(module)}: no causal self-attention module dispatching "
                         "on config._attn_implementation (num_key_value_groups, is_causal)")
    return found


def _heads(m: nn.Module) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) of an attention module (funcpar's or Hugging Face's)."""
    if hasattr(m, "n_heads"):
        return m.n_heads, m.n_kv, m.head_dim
    cfg = m.config
    return cfg.num_attention_heads, cfg.num_key_value_heads, m.head_dim


#: The attention implementation registered with transformers for the call's duration; it
#: reads the attention module's ``_funcpar_attend`` (set per call, recorded by remat).
_HF_IMPL = "funcpar_context_parallel"


def _hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[Tensor, None]:
    attend, dummy = module.__dict__["_funcpar_attend"]
    if attention_mask is not dummy:
        raise ValueError("context_parallel: a Hugging Face attention got a mask it did not "
                         "make (padding or packed sequences are not supported under cp)")
    if dropout:
        raise ValueError("context_parallel: attention dropout is not supported")
    # HF passes the kv heads unrepeated: the ring sends those.
    return attend(query, key, value, scaling).transpose(1, 2).contiguous(), None


def _register_hf() -> None:
    from transformers import AttentionInterface

    if _HF_IMPL not in AttentionInterface._global_mapping:
        AttentionInterface.register(_HF_IMPL, _hf_attention)


@contextmanager
def _installed_hf(attn: dict[str, nn.Module], make: Callable[[str], Callable], dummy: Tensor
                  ) -> Iterator[None]:
    """Each attention module dispatching to :func:`_hf_attention` for one call: its ``config``
    is a shallow copy naming that implementation, its ``_funcpar_attend`` the cp attention
    (both instance attributes, which remat records and reinstalls for its recompute)."""
    for name, m in attn.items():
        if "_funcpar_attend" in m.__dict__:
            raise ValueError(f"{name} already has a context-parallel attention: "
                             "context_parallel is applied twice (apply it once)")
    saved = [(m, m.config) for m in attn.values()]
    for name, m in attn.items():
        cfg = copy.copy(m.config)
        cfg._attn_implementation_internal = _HF_IMPL
        m.config = cfg
        m._funcpar_attend = (make(name), dummy)
    try:
        yield
    finally:
        for m, cfg in saved:
            m.config = cfg
            m.__dict__.pop("_funcpar_attend", None)


@contextmanager
def _installed(mods: dict[str, nn.Module], make: Callable[[str], Callable],
               attr: str = "attend") -> Iterator[None]:
    """Each module's ``attr`` (an attention's ``attend``, an MoE block's ``route``) replaced
    for one call (an instance attribute, which remat records at a block's forward and
    reinstalls for its recompute)."""
    for name, m in mods.items():
        if attr in m.__dict__:
            raise ValueError(f"{name}.{attr} is already replaced: context_parallel is applied "
                             "twice (apply it once)")
    for name, m in mods.items():
        setattr(m, attr, make(name))
    try:
        yield
    finally:
        for m in mods.values():
            m.__dict__.pop(attr, None)


def _cp_route(mesh: DeviceMesh, axis: str, purpose: str) -> Callable[..., Routing]:
    """:func:`funcpar.models.moe.route` (dropless) on this rank's tokens, its router losses
    those of the whole sequences (module docstring, "MoE blocks"): per sequence the
    assignment counts and router probabilities summed over cp, and the tokens' squared
    log-sum-exps, in one all-reduce whose backward all-reduces the gradients too."""
    n = mesh.size(axis)

    def cp_route(logits: Tensor, top_k: int, capacity_factor: float | None) -> Routing:
        r = route(logits, top_k, capacity_factor)  # the choices and gates are per token
        groups, t, e = logits.shape
        probs = logits.softmax(-1)
        counts = F.one_hot(r.expert, e).sum((1, 2)).to(probs.dtype)  # [groups, e]
        local = torch.cat([counts.reshape(-1), probs.sum(1).reshape(-1),
                           torch.logsumexp(logits, -1).pow(2).sum()[None]])
        # Sum forward, sum of the ranks' gradients backward: every rank's loss holds the
        # same router losses, and the gradient mean over cp then counts each rank's tokens
        # once (module docstring).
        total = exit_region(enter_region(local, mesh, axis, purpose), mesh, axis, purpose)
        seq, ge = t * n, groups * e
        frac = total[:ge].view(groups, e) / seq / top_k
        aux = e * (frac * (total[ge:2 * ge].view(groups, e) / seq)).sum(-1).mean()
        return r._replace(aux_loss=aux, z_loss=total[-1] / (groups * seq))

    return cp_route


def context_parallel(
    mesh: DeviceMesh, *, axis: str = "cp", mode: str = "ring", overlap: bool = True,
    bucket_mb: float = 25.0,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The context-parallel transform over ``axis`` (see the module docstring). ``mode``:
    ``"ring"`` or ``"ulysses"``; ``overlap``: the ring's next transfer posted before the
    current block's compute; ``bucket_mb``: the gradient all-reduce's buckets."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r}: its axes are {mesh.axis_names}")
    if mode not in MODES:
        raise ValueError(f"context_parallel mode must be one of {MODES}, got {mode!r}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    n = mesh.size(axis)

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        module = getattr(step.apply_fn, "module", None)
        if module is None:
            raise TypeError("context_parallel needs a step built on functionalize(module)'s "
                            "apply_fn")
        if step.pipeline is not None and _is_hf(module):
            raise ValueError("context_parallel and pipeline_split: a Hugging Face model under "
                             "both is not supported (its stages would need the global "
                             "position_ids and the attention hook per stage)")
        if step.compile and mode == "ring":
            raise ValueError("context_parallel (ring) and compile=True do not compose: the "
                             "ring's point-to-point sends have no functional collective, so "
                             "the whole step cannot be traced as one region (use "
                             "mode='ulysses', whose all_to_alls trace in, or leave compile off)")
        if getattr(step.apply_fn, "context_parallel", None) is not None:
            raise ValueError("context_parallel is already applied: apply it once")
        attn = _attention_modules(module)
        moe = _moe_modules(module)
        if getattr(step.loss_fn, "tp_mode", None) is not None:
            raise ValueError(f"context_parallel and shard_params(mode="
                             f"{step.loss_fn.tp_mode!r}) do not compose yet: that mode cuts "
                             "the batch rows and hidden dims over its grid and computes the "
                             "loss over it, which context_parallel's sequence cut and "
                             "token-weighted loss do not account for")
        if not getattr(step.loss_fn, "token_cross_entropy", False):
            raise ValueError("context_parallel needs a token-mean loss (declared by "
                             "token_cross_entropy = True, as funcpar.models.lm_loss): each rank "
                             "weights its mean by its share of the counted targets")
        if getattr(step.loss_fn, "extra_loss", None) is not None and not moe:
            raise ValueError("context_parallel: the loss adds a term of the output "
                             "(extra_loss) that is not a token mean, and the model has no MoE "
                             "block whose router losses cp makes the whole sequences'")
        if n == 1:
            return step, state
        return dataclasses.replace(
            step, apply_fn=_cp_apply(step.apply_fn, attn, moe, module, mesh, axis, mode,
                                     overlap, staged=step.pipeline is not None),
            local_batch=_cp_local_batch(step.local_batch, mesh, axis,
                                        getattr(step.loss_fn, "ignore_index", -100),
                                        sorted(moe), _limit(module)),
            loss_fn=_cp_loss(step.loss_fn, mesh, ContextParallel(
                axis, mode, overlap, int(bucket_mb * 2**20),
                tuple((name, *_heads(m)) for name, m in attn.items()),
                tuple((name, m.n_experts) for name, m in moe.items()))),
            sync_grads=_cp_grads(step.sync_grads, mesh, axis, int(bucket_mb * 2**20)),
            sync_loss=mean_loss(step.sync_loss, mesh, axis, "cp loss"),
        ), state

    return transform


def _cp_apply(apply_fn: Callable, attn: dict[str, nn.Module], moe: dict[str, nn.Module],
              module: nn.Module, mesh: DeviceMesh, axis: str, mode: str, overlap: bool,
              staged: bool) -> Callable:
    """``apply_fn`` with the cp attention (and MoE routing) installed and the global positions
    passed; ``staged``:
    ``apply_fn`` is a pipeline stage's (:func:`funcpar.pipeline.stages.stage_apply`), whose
    stage index and received activation come before the token ids."""
    n, r = mesh.size(axis), mesh.rank(axis)
    lead = 2 if staged else 0
    hf = _is_hf(module)
    limit = _limit(module)
    if limit is not None:  # the batch's own length is checked before the padding
        limit = -(-limit // (2 * n)) * 2 * n

    def make(name: str) -> Callable:
        if mode == "ring":
            return lambda q, k, v, scale=None: ring_attention(
                q, k, v, mesh, axis, scale=scale, overlap=overlap, purpose=name)
        return lambda q, k, v, scale=None: ulysses_attention(q, k, v, mesh, axis, scale=scale,
                                                             purpose=name)

    def route_of(name: str) -> Callable:
        return _cp_route(mesh, axis, f"{name}: cp router stats")

    if hf:
        _register_hf()

    def apply(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = args[lead]
        seq = tokens.shape[1] * n
        if limit is not None and seq > limit:
            raise ValueError(f"sequence length {seq} exceeds the model's limit {limit}")
        positions = zigzag_positions(seq, n, r, device=tokens.device)
        if not hf:
            with _installed(attn, make), _installed(moe, route_of, "route"):
                return apply_fn(params, buffers, *args, positions=positions, **kwargs)
        args = args[1:]
        if args or kwargs:
            raise ValueError("context_parallel: a Hugging Face model takes only the token ids "
                             f"under cp (got {len(args)} more inputs and {sorted(kwargs)})")
        # A prepared 4-D mask is passed through as is: HF builds none (its packed-sequence
        # detection would read the zigzag positions' jump as a new sequence), and the cp
        # attention checks that it got this one.
        dummy = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=tokens.device)
        with _installed_hf(attn, make, dummy):
            return apply_fn(params, buffers, tokens, attention_mask=dummy, use_cache=False,
                            position_ids=positions[None].expand(tokens.shape[0], -1))

    for attr in ("module", "precision", "remat", "remat_modules"):
        if hasattr(apply_fn, attr):
            setattr(apply, attr, getattr(apply_fn, attr))
    apply.context_parallel = axis
    return apply


def pad_sequences(batch: Any, multiple: int, ignore_index: int = -100) -> Any:
    """``(inputs, targets)`` with dim 1 padded at the end to a multiple of ``multiple``: the
    token ids with 0, the targets with ``ignore_index``. Exact for causal attention: no real
    position attends to a later one, and a pad's target is not counted."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError("a batch must be a pair (inputs, targets)")
    leaves, spec = tree_flatten(batch[0])
    targets = batch[1]
    if not torch.is_tensor(targets) or targets.dim() < 2:
        raise ValueError("context_parallel pads the targets along dim 1: they must be a "
                         f"tensor of at least 2 dims, got {getattr(targets, 'shape', targets)}")
    extra = -targets.shape[1] % multiple
    if extra == 0:
        return batch

    def pad(x: Tensor, value: int) -> Tensor:
        if not torch.is_tensor(x) or x.dim() < 2 or x.is_floating_point():
            raise ValueError("context_parallel pads the sequences (dim 1) of integer token ids "
                             "and targets only; got an input "
                             f"{getattr(x, 'dtype', type(x).__name__)} "
                             f"{tuple(getattr(x, 'shape', ()))}: pad to a multiple of "
                             f"{multiple} yourself")
        fill = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
        return torch.cat([x, fill], 1)

    inputs = tree_unflatten(spec, [pad(x, 0) for x in leaves])
    return type(batch)((inputs, pad(targets, ignore_index)))


def _limit(module: nn.Module) -> int | None:
    """The longest sequence the model declares (funcpar's ``max_seq_len``, HF's
    ``max_position_embeddings``)."""
    if _is_hf(module):
        return getattr(getattr(module, "config", None), "max_position_embeddings", None)
    return getattr(getattr(module, "cfg", None), "max_seq_len", None)


def _cp_local_batch(inner: Callable | None, mesh: DeviceMesh, axis: str, ignore_index: int,
                    moe: list[str], limit: int | None) -> Callable:
    n = mesh.size(axis)

    def local_batch(batch: Any) -> Any:
        seq = getattr(batch[1], "shape", (0, 0))[1] if isinstance(batch, (tuple, list)) else 0
        if limit is not None and seq > limit:
            raise ValueError(f"sequence length {seq} exceeds the model's limit {limit}")
        if seq % (2 * n) and moe:
            raise ValueError(f"context_parallel over {n} ranks needs sequences of a multiple "
                             f"of {2 * n} positions with MoE blocks ({moe[0]}): padding would "
                             f"enter the router losses; got {seq}")
        batch = zigzag_split(pad_sequences(batch, 2 * n, ignore_index), mesh, axis)
        return inner(batch) if inner is not None else batch

    return local_batch


def _cp_loss(inner: Callable, mesh: DeviceMesh, info: ContextParallel) -> Callable:
    axis = info.axis
    n = mesh.size(axis)
    ignore = getattr(inner, "ignore_index", -100)
    extra = getattr(inner, "extra_loss", None)

    def loss(output: Any, targets: Tensor) -> Tensor:
        # The global token mean is sum_r n_r L_r / n; a rank's share, times n so that the
        # mean over cp (of losses and gradients) is it.
        mine = (targets != ignore).sum()
        total = comm.all_reduce(mine, mesh, axis, purpose="cp token count")
        value = inner(output, targets)
        # In the loss's dtype: int64 / int64 would divide in the default dtype (float32).
        weight = mine.to(value.dtype) * n / total.to(value.dtype)
        if extra is None:
            return value * weight
        # An MoE model's router losses: the whole sequences' on every rank (_cp_route), so
        # added unweighted; the token mean is the rest.
        term = extra(output).to(value.dtype)
        return (value - term) * weight + term

    def group_count(targets: Tensor) -> Tensor:
        # The counted targets of the sequences the cp group holds together: what weighs this
        # loss's cp-mean (their token mean) among other pieces of a batch (funcpar.train.eval).
        return comm.all_reduce((targets != ignore).sum(), mesh, axis, purpose="cp token count")

    loss.context_parallel = info
    loss.group_count = group_count
    if extra is not None:
        loss.extra_loss = extra
    return loss


def _cp_grads(inner: Callable | None, mesh: DeviceMesh, axis: str, bucket_bytes: int
              ) -> Callable:
    def sync_grads(grads: Any) -> Any:
        grads = inner(grads) if inner is not None else grads
        return bucketed_mean(grads, mesh, axis, bucket_bytes)

    return sync_grads

