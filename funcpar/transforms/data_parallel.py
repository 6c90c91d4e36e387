"""``data_parallel``: the batch split over a mesh axis, gradients averaged over it.

``step, state = data_parallel(mesh)(step, state)``: every rank of the ``dp`` axis holds the
same parameters and takes its contiguous slice of the global batch (dim 0 of every tensor of
``(inputs, targets)``); after the backward, the gradients are averaged over ``dp`` so that every
rank applies the update of the whole batch. For a loss that is a mean over equal-size slices,
this is exactly the single-process step on the global batch; the reported loss is the mean
over ranks too.

Gradients travel in buckets: leaves, in reverse order (the order the backward produces them),
are packed into flat buffers of at most ``bucket_mb`` (one dtype per buffer), and each bucket is
all-reduced asynchronously as soon as the backward has produced all of its gradients (tensor
hooks on the differentiated leaves, :attr:`~funcpar.train.step.TrainStep.overlap_grads`), so
the transfers overlap the rest of the backward. Under ``compile=True`` the hooks are not
installed and every bucket starts after the backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.buckets import bucket_indices
from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, tree_flatten, tree_unflatten
from funcpar.train.step import TrainStep

__all__ = ["BucketedMean", "bucketed_mean", "data_parallel", "mean_loss", "split_batch"]


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


class BucketedMean:
    """The mean over ``axis`` of one step's gradients, all-reduced bucket by bucket.

    ``ready(i, grad)`` (from the backward's hooks, ``i`` the leaf's flat index) launches a
    bucket's asynchronous all-reduce once all its leaves are in; ``finish(grads)`` launches the
    buckets still waiting (all of them when no hook ran; a leaf the loss does not reach gets
    its zero gradient there), waits, and returns the averaged tree.
    """

    def __init__(self, leaves: list[Tensor], mesh: DeviceMesh, axis: str, bucket_bytes: int):
        self.mesh, self.axis = mesh, axis
        self.buckets = bucket_indices([g.numel() * g.element_size() for g in leaves],
                                      [g.dtype for g in leaves], bucket_bytes)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.got: dict[int, Tensor] = {}
        self.pending: dict[int, comm.Pending] = {}

    def _launch(self, b: int, grads: Sequence[Tensor] | Mapping[int, Tensor]) -> None:
        idx = self.buckets[b]
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        self.pending[b] = comm.all_reduce(flat, self.mesh, self.axis, inplace=True,
                                          async_op=True, purpose=f"dp grads ({len(idx)} leaves)")

    def ready(self, i: int, grad: Tensor) -> None:
        self.got[i] = grad
        b = self.bucket_of[i]
        if b not in self.pending and all(j in self.got for j in self.buckets[b]):
            self._launch(b, self.got)

    def finish(self, grads: Tree) -> Tree:
        leaves, spec = tree_flatten(grads)
        for b in range(len(self.buckets)):
            if b not in self.pending:
                self._launch(b, leaves)
        n = self.mesh.size(self.axis)
        out = list(leaves)
        for b, idx in enumerate(self.buckets):
            flat = self.pending[b].wait() / n
            offset = 0
            for i in idx:
                k = leaves[i].numel()
                out[i] = flat[offset : offset + k].view_as(leaves[i])
                offset += k
        return tree_unflatten(spec, out)


def bucketed_mean(grads: Tree, mesh: DeviceMesh, axis: str, bucket_bytes: int) -> Tree:
    """The mean of ``grads`` over ``axis``, all-reduced in flat buckets (after the backward)."""
    if mesh.size(axis) == 1:
        return grads
    return BucketedMean(tree_flatten(grads)[0], mesh, axis, bucket_bytes).finish(grads)


def mean_loss(inner: Callable[[Tensor], Tensor] | None, mesh: DeviceMesh, axis: str,
              purpose: str) -> Callable[[Tensor], Tensor]:
    """A ``sync_loss``: ``inner``'s (when given), then the mean over ``axis``."""

    def sync_loss(loss: Tensor) -> Tensor:
        loss = inner(loss) if inner is not None else loss
        return comm.all_reduce(loss, mesh, axis, purpose=purpose) / mesh.size(axis)

    return sync_loss


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
        if step.dp_axis is not None:
            raise ValueError(f"data_parallel is already applied (over {step.dp_axis!r}): "
                             "apply it once")
        inner_batch = step.local_batch

        def local_batch(batch: Any) -> Any:
            batch = split_batch(batch, mesh, axis)
            return inner_batch(batch) if inner_batch is not None else batch

        def overlap_grads(leaves: list[Tensor]) -> BucketedMean:
            return BucketedMean(leaves, mesh, axis, bucket_bytes)

        if mesh.size(axis) == 1:
            return step, state
        zero = step.partition
        if zero is not None and zero.axis != axis:
            raise ValueError(f"zero_partition is over {zero.axis!r} but data_parallel over "
                             f"{axis!r}: they must share the axis")
        # From ZeRO stage 2 on, the gradient reduction is the partition's reduce-scatter.
        keep = zero is not None and zero.stage >= 2
        return dataclasses.replace(
            step, local_batch=local_batch, dp_axis=axis,
            sync_loss=mean_loss(step.sync_loss, mesh, axis, "dp loss"),
            overlap_grads=step.overlap_grads if keep else overlap_grads,
        ), state

    return transform
