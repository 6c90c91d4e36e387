"""``data_parallel``: the batch split over a mesh axis, gradients averaged over it.

``step, state = data_parallel(mesh)(step, state)``: every rank of the ``dp`` axis holds the
same parameters and takes its contiguous slice of the global batch (dim 0 of every tensor of
``(inputs, targets)``); after the backward, the gradients are averaged over ``dp`` so that every
rank applies the update of the whole batch. For a loss that is a mean over equal-size slices,
this is exactly the single-process step on the global batch; the reported loss is the mean
over ranks too.

Gradients travel in buckets: leaves are packed in order into flat buffers of at most
``bucket_mb`` (one dtype per buffer), each all-reduced asynchronously so that the buckets'
transfers overlap one another, and unpacked when they land. The step's backward is one
``torch.autograd.grad`` call that returns all gradients together, so the all-reduces start
after the backward rather than during it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, tree_flatten, tree_unflatten
from funcpar.train.step import TrainStep

__all__ = ["bucketed_mean", "data_parallel", "split_batch"]


def split_batch(batch: Any, mesh: DeviceMesh, axis: str) -> Any:
    """This rank's contiguous slice along dim 0 of every tensor in ``batch``."""
    n, r = mesh.size(axis), mesh.rank(axis)
    leaves, spec = tree_flatten(batch)
    out = []
    for x in leaves:
        if not torch.is_tensor(x):
            out.append(x)
            continue
        if x.dim() == 0 or x.shape[0] % n:
            raise ValueError(f"data_parallel over {axis}={n}: a batch dim of "
                             f"{tuple(x.shape)[:1] or '()'} does not split into {n} equal parts")
        k = x.shape[0] // n
        out.append(x[r * k : (r + 1) * k])
    return tree_unflatten(spec, out)


def bucketed_mean(grads: Tree, mesh: DeviceMesh, axis: str, bucket_bytes: int) -> Tree:
    """The mean of ``grads`` over ``axis``, all-reduced in flat buckets."""
    n = mesh.size(axis)
    leaves, spec = tree_flatten(grads)
    if n == 1:
        return grads
    buckets: list[list[int]] = []
    size = 0
    for i, g in enumerate(leaves):
        if g is None:
            continue
        nbytes = g.numel() * g.element_size()
        fits = buckets and size + nbytes <= bucket_bytes and leaves[buckets[-1][0]].dtype == g.dtype
        if not fits:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    pending = []
    for b in buckets:
        flat = torch.cat([leaves[i].reshape(-1) for i in b])
        pending.append((b, comm.all_reduce(flat, mesh, axis, purpose=f"dp grads ({len(b)} leaves)",
                                           inplace=True, async_op=True)))
    out = list(leaves)
    for b, work in pending:
        flat = work.wait() / n
        offset = 0
        for i in b:
            k = leaves[i].numel()
            out[i] = flat[offset : offset + k].view_as(leaves[i])
            offset += k
    return tree_unflatten(spec, out)


def data_parallel(
    mesh: DeviceMesh, *, axis: str = "dp", bucket_mb: float = 25.0
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The data-parallel transform over ``axis`` (see the module docstring)."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r}: its axes are {mesh.axis_names}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    bucket_bytes = int(bucket_mb * 2**20)

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        inner_batch, inner_sync, inner_loss = step.local_batch, step.sync_grads, step.sync_loss

        def local_batch(batch: Any) -> Any:
            batch = split_batch(batch, mesh, axis)
            return inner_batch(batch) if inner_batch is not None else batch

        def sync_grads(grads: Tree) -> Tree:
            grads = inner_sync(grads) if inner_sync is not None else grads
            return bucketed_mean(grads, mesh, axis, bucket_bytes)

        def sync_loss(loss: Tensor) -> Tensor:
            loss = inner_loss(loss) if inner_loss is not None else loss
            return comm.all_reduce(loss, mesh, axis, purpose="dp loss") / mesh.size(axis)

        return dataclasses.replace(
            step, local_batch=local_batch, sync_grads=sync_grads, sync_loss=sync_loss
        ), state

    return transform
