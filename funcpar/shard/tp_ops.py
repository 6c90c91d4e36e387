"""The tensor-parallel building blocks (Shoeybi et al. 2019, Megatron-LM, arXiv 1909.08053).

Two conjugate autograd functions carry every tensor-parallel region:

* :func:`enter_region` (Megatron's *f*): identity forward, all-reduce of the gradient backward.
  A replicated activation that feeds column-parallel weights gets a partial gradient from each
  rank's columns; the sum is its true gradient.
* :func:`exit_region` (Megatron's *g*): all-reduce forward, identity backward. A row-parallel
  product leaves each rank with a partial sum of the output.

:func:`gather_last_dim` (all-gather forward, slice backward) and its conjugate
:func:`split_last_dim` (slice forward, all-gather backward) carry Hugging Face's
``colwise_gather_output`` / ``rowwise_split_input`` pair, where the activation between two
linears is whole on every rank (Phi-3's fused qkv, OLMo-2's q/k norms over all heads).

On top of them, vocab-parallel embedding lookup and vocab-parallel cross-entropy, which never
gather the full logits: each rank holds the logits of its vocabulary slice, and only per-token
maxima and sums cross the wire.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) replaces *f* and *g* by
another conjugate pair that keeps the activations between the regions split on the sequence
dim (rank ``r`` holds ``sizes[r]`` positions):

* :func:`gather_seq` (Megatron's *g-bar*): all-gather over the sequence forward,
  reduce-scatter backward. Every rank's column-parallel weights give a partial gradient of the
  whole gathered input; the sum, cut back to this rank's positions, is the true gradient of
  its chunk.
* :func:`reduce_scatter_seq` (*g-bar*'s conjugate): reduce-scatter forward (the row-parallel
  partial sums, summed and cut to this rank's positions), all-gather backward (the chunk's
  gradient is what every position of the partial product receives).

Same bytes as one all-reduce (which is a reduce-scatter followed by an all-gather), but the
norms and residual adds between the regions run on ``1 / tp`` of the positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpar.shard.comm import all_gather, all_reduce, all_to_all, reduce_scatter
from funcpar.shard.mesh import DeviceMesh

__all__ = [
    "all_to_all_grad",
    "enter_region",
    "exit_region",
    "gather_last_dim",
    "gather_seq",
    "reduce_scatter_seq",
    "split_last_dim",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, send: list[int],
                recv: list[int], purpose: str) -> Tensor:
        ctx.args = mesh, axis, send, recv, purpose
        return all_to_all(x, mesh, axis, send, recv, purpose=purpose)

    @staticmethod
    def backward(ctx, grad: Tensor):
        mesh, axis, send, recv, purpose = ctx.args
        back = all_to_all(grad, mesh, axis, recv, send, purpose=f"{purpose} grad")
        return back, None, None, None, None, None


def all_to_all_grad(x: Tensor, mesh: DeviceMesh, axis: str, send: list[int], recv: list[int],
                    purpose: str) -> Tensor:
    """:func:`~funcpar.shard.comm.all_to_all` (rows of dim 0) whose backward sends the
    gradients back the reverse way (purpose ``"<purpose> grad"``): expert parallelism's token
    routing, Ulysses' sequence-to-head exchange."""
    return _AllToAll.apply(x, mesh, axis, list(send), list(recv), purpose)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, purpose: str) -> Tensor:
        ctx.mesh, ctx.axis, ctx.purpose = mesh, axis, purpose
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = all_reduce(grad, ctx.mesh, ctx.axis, purpose=ctx.purpose + " (grad)")
        return out, None, None, None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, purpose: str) -> Tensor:
        return all_reduce(x, mesh, axis, purpose=purpose)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], purpose: str):
        ctx.start = sum(sizes[: mesh.rank(axis)])
        ctx.n = x.shape[-1]
        return all_gather(x, mesh, axis, dim=x.dim() - 1, sizes=sizes, purpose=purpose)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # The loss is computed whole on every rank: each rank's slice of the gradient is its own.
        return grad[..., ctx.start : ctx.start + ctx.n], None, None, None, None


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], purpose: str):
        ctx.mesh, ctx.axis, ctx.sizes, ctx.purpose = mesh, axis, sizes, purpose
        start = sum(sizes[: mesh.rank(axis)])
        return x[..., start : start + sizes[mesh.rank(axis)]]

    @staticmethod
    def backward(ctx, grad: Tensor):
        # x was whole on every rank and each rank used its slice: the true gradient of x is
        # every rank's slice gradient side by side.
        out = all_gather(grad.contiguous(), ctx.mesh, ctx.axis, dim=grad.dim() - 1,
                         sizes=ctx.sizes, purpose=ctx.purpose + " (grad)")
        return out, None, None, None, None


def split_last_dim(
    x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], purpose: str = "tp split"
) -> Tensor:
    """This rank's slice (``sizes[rank]`` entries) of the last dim of ``x``, which is whole and
    the same on every rank; backward, the slices' gradients are all-gathered (the conjugate of
    :func:`gather_last_dim`)."""
    if mesh.size(axis) == 1:
        return x
    if x.shape[-1] != sum(sizes):
        raise ValueError(f"split_last_dim ({purpose}): the last dim of {tuple(x.shape)} is not "
                         f"the {sum(sizes)} entries split as {list(sizes)}")
    return _SplitLast.apply(x, mesh, axis, [int(s) for s in sizes], purpose)


def gather_last_dim(
    x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], purpose: str = "tp gather"
) -> Tensor:
    """All-gather of ``x`` along its last dim (rank ``r`` holds ``sizes[r]`` entries)."""
    if mesh.size(axis) == 1:
        return x
    return _GatherLast.apply(x, mesh, axis, list(sizes), purpose)


def enter_region(x: Tensor, mesh: DeviceMesh, axis: str, purpose: str = "tp enter") -> Tensor:
    """Identity forward; the gradient is summed over ``axis`` backward."""
    if mesh.size(axis) == 1:
        return x
    return _Enter.apply(x, mesh, axis, purpose)


def exit_region(x: Tensor, mesh: DeviceMesh, axis: str, purpose: str = "tp exit") -> Tensor:
    """Sum over ``axis`` forward; the gradient passes through unchanged backward."""
    if mesh.size(axis) == 1:
        return x
    return _Exit.apply(x, mesh, axis, purpose)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], dim: int,
                purpose: str) -> Tensor:
        ctx.mesh, ctx.axis, ctx.sizes, ctx.dim, ctx.purpose = mesh, axis, sizes, dim, purpose
        return all_gather(x, mesh, axis, dim=dim, sizes=sizes, purpose=purpose)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # Each rank's gradient of the gathered tensor is partial (its columns of the weights
        # that consumed it): sum over ranks, keep this rank's positions.
        out = reduce_scatter(grad, ctx.mesh, ctx.axis, dim=ctx.dim, sizes=ctx.sizes,
                             purpose=ctx.purpose + " (grad)")
        return out, None, None, None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], dim: int,
                purpose: str) -> Tensor:
        ctx.mesh, ctx.axis, ctx.sizes, ctx.dim, ctx.purpose = mesh, axis, sizes, dim, purpose
        return reduce_scatter(x, mesh, axis, dim=dim, sizes=sizes, purpose=purpose)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # d(sum_r x_r)[chunk q] / d x_r = identity on chunk q for every r: every rank's partial
        # product receives the gradient of all positions, gathered from their owners.
        out = all_gather(grad, ctx.mesh, ctx.axis, dim=ctx.dim, sizes=ctx.sizes,
                         purpose=ctx.purpose + " (grad)")
        return out, None, None, None, None, None


def gather_seq(
    x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], purpose: str = "sp gather",
    *, dim: int = 1,
) -> Tensor:
    """The whole sequence from the chunks of ``axis`` (rank ``r`` holds ``sizes[r]`` positions
    of dim ``dim``); backward, the gradient is reduce-scattered back to the chunks."""
    if mesh.size(axis) == 1:
        return x
    if x.dim() < 1:
        raise ValueError(f"gather_seq ({purpose}): a 0-d tensor has no sequence dim {dim}")
    return _GatherSeq.apply(x, mesh, axis, [int(s) for s in sizes], dim % x.dim(), purpose)


def reduce_scatter_seq(
    x: Tensor, mesh: DeviceMesh, axis: str, sizes: list[int], purpose: str = "sp reduce-scatter",
    *, dim: int = 1,
) -> Tensor:
    """The sum over ``axis`` of ``x`` (whole sequence, partial sums), of which this rank keeps
    its ``sizes[rank]`` positions of dim ``dim``; backward, the gradient is all-gathered."""
    if mesh.size(axis) == 1:
        return x
    if x.dim() < 1:
        raise ValueError(f"reduce_scatter_seq ({purpose}): a 0-d tensor has no sequence dim")
    return _ReduceScatterSeq.apply(x, mesh, axis, [int(s) for s in sizes], dim % x.dim(),
                                   purpose)


def vocab_parallel_embedding(
    ids: Tensor, weight: Tensor, start: int, mesh: DeviceMesh, axis: str, purpose: str = "embed",
    *, padding_idx: int | None = None, seq_sizes: list[int] | None = None,
) -> Tensor:
    """Rows ``ids`` of an embedding whose rows ``[start, start + weight.shape[0])`` live here.

    Each rank looks up the ids in its slice, zeroes the others, and the sum over ``axis`` is the
    full lookup; backward, each rank's rows get exactly their tokens' gradients. A global
    ``padding_idx`` (``nn.Embedding``'s: that row gets no gradient) is kept by the rank that
    holds the row. With ``seq_sizes`` (sequence parallelism) the sum is a reduce-scatter over
    dim 1 of ``ids``: this rank gets the embeddings of its ``seq_sizes[rank]`` positions only.
    """
    n = weight.shape[0]
    local = ids - start
    inside = (local >= 0) & (local < n)
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < n else None
    out = F.embedding(local.clamp(0, max(n - 1, 0)), weight, padding_idx=pad) if n else (
        weight.new_zeros((*ids.shape, weight.shape[1]))
    )
    out = out * inside.unsqueeze(-1).to(out.dtype)
    if seq_sizes is not None:
        return reduce_scatter_seq(out, mesh, axis, seq_sizes, purpose, dim=1)
    return exit_region(out, mesh, axis, purpose)


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    start: int,
    mesh: DeviceMesh,
    axis: str,
    *,
    ignore_index: int = -100,
    purpose: str = "cross_entropy",
) -> Tensor:
    """Mean cross-entropy over tokens of logits split on the vocabulary (last) dim.

    ``logits[..., j]`` here is the logit of token ``start + j``. ``log sum exp`` is assembled
    from the per-rank maximum (all-reduce max, no gradient: any constant shift gives the same
    value) and the per-rank sums of exponentials (all-reduce sum); the target's logit comes
    from the one rank that holds it. Autograd through :func:`exit_region` then gives each rank
    ``softmax - onehot`` for its slice. Tokens equal to ``ignore_index`` do not count, as in
    ``F.cross_entropy``.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    n_local = z.shape[-1]
    local_max = z.detach().amax(dim=-1) if n_local else z.new_full(z.shape[:-1], -torch.inf)
    shift = all_reduce(local_max, mesh, axis, op="max", purpose=purpose + " max")
    shifted = z - shift.unsqueeze(-1)
    sum_exp = exit_region(shifted.exp().sum(dim=-1), mesh, axis, purpose + " sum_exp")
    local_t = targets - start
    here = (local_t >= 0) & (local_t < n_local)
    if n_local:
        picked = shifted.gather(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
    else:  # an empty vocabulary shard (uneven split): holds no target
        picked = shifted.new_zeros(targets.shape)
    target_logit = exit_region(picked * here.to(z.dtype), mesh, axis, purpose + " target")
    loss = sum_exp.log() - target_logit
    keep = targets != ignore_index
    return (loss * keep.to(loss.dtype)).sum() / keep.sum().clamp_min(1)
