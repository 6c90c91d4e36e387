"""``zero_partition``: ZeRO stages 1-3 (Rajbhandari et al. 2020, arXiv 1910.02054) over ``dp``.

``step, state = zero_partition(stage, mesh)(step, state)`` partitions, over the ``dp`` axis:

* stage 1: the optimizer state. After the data-parallel gradient mean each rank updates only
  its part of every leaf and the updated parts are all-gathered;
* stage 2: also the gradients: the backward's gradients are reduce-scattered instead of
  all-reduced, so each rank keeps only its part: one collective per bucket of leaves
  (``bucket_mb``, :mod:`funcpar.shard.buckets`), started from the backward's hooks as soon as
  the bucket's last gradient completes (stages 1-2 gather the updated parts in the same
  buckets);
* stage 3: also the parameters: ``state.params`` holds each rank's part. The leaves travel in
  *groups* (:func:`gather_groups`): each block's (the elements of the model's outermost
  ``nn.ModuleList``, as FSDP wraps transformer blocks) and the leaves outside every block
  (embeddings, final norm, head). A group is one all-gather per dtype: a block's when it
  starts, released when it ends, with the next ``prefetch`` blocks' gathers launched then so
  they travel while it computes; the leaves outside the blocks whole for the forward. The
  backward keeps none of them: the first use of a saved leaf gathers its whole group again
  (saved-tensor hooks) and launches the ``prefetch`` groups before it, and the group's
  gradients are reduce-scattered in one collective when its backward is done. So
  ``1 + prefetch`` blocks, plus the leaves outside them, are whole at a time, and a step
  issues three collectives per group where per-leaf collectives issued three per leaf.

**How a leaf is partitioned.** Each leaf is cut along one dim of its local (tensor-parallel)
shape that is not a blocked split and has at least as many entries as ranks: the one whose
largest piece is smallest (the least padding), the first of those (dim 0's pieces are
contiguous, so the fused optimizer kernels and the bucket copies read them directly), into
``torch.chunk`` pieces: its :class:`~funcpar.shard.layout.Layout` gains ``dp`` as the
innermost axis of that dim (``layout.split(dim, "dp")``). A leaf that cannot be cut (a scalar, a
dim shorter than ``dp``) stays whole on every rank. Keeping leaves as tensors rather than flat
buffers buys exactness for free (the collectives still travel in flat buckets: each rank's
pieces of a bucket's leaves, rank-major, one buffer; an uncut leaf whole in every rank's
segment): the optimizer runs on the parts with their layouts, so every row/column statistic,
RMS or norm it takes through :mod:`funcpar.shard.reduce` is all-reduced over exactly the axes
that cut it (DESIGN principle 2); a factored optimizer keeps its rows and columns. Per rank, a
partitioned leaf holds ``ceil(n / dp)`` of its ``n`` entries along the cut dim at most: the
padding bound.

Composition: apply after :func:`~funcpar.transforms.shard_params` (the partition cuts the
tensor-parallel shards); with :func:`~funcpar.transforms.data_parallel` over the same axis in
either order (it splits the batch; the gradient reduction is this transform's from stage 2).
The state must be fresh (step 0). ``step.layouts`` then describes ``state.params`` (partitioned
at stage 3) and ``step.grad_layouts`` the gradients the optimizer sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from funcpar.kernels.inplace import inplace_allowed
from funcpar.optim.base import GradientTransformation, init_laid_out
from funcpar.shard import comm
from funcpar.shard.buckets import bucket_indices
from funcpar.shard.layout import Layout
from funcpar.shard.mesh import DeviceMesh
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, leaves_like, named_leaves, tree_flatten, tree_unflatten
from funcpar.train.step import TrainStep
from funcpar.transforms.compose import require_fresh

__all__ = ["ZeroPlan", "plan_partition", "zero_partition"]


class _Leaves(NamedTuple):
    """A bucket's collective in flight: ``wait()`` gives ``{flat index: tensor}``."""

    wait: Callable[[], dict[int, Tensor]]


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Per flat leaf: the dim cut over ``axis`` (None: whole) and the layout of the part."""

    stage: int
    mesh: DeviceMesh
    axis: str
    names: tuple[str, ...]
    dims: tuple[int | None, ...]
    lengths: tuple[int, ...]  # the local (tensor-parallel) length of the cut dim, or 0
    layouts: tuple[Layout, ...]  # of the parts (the base layout where the leaf is whole)
    shapes: tuple[tuple[int, ...], ...] = ()  # the local (tensor-parallel) whole shapes
    buckets: tuple[tuple[int, ...], ...] = ()  # flat leaf indices per bucket (shard/buckets)
    prefetch: int = 1  # ZeRO-3: blocks gathered ahead of the one computing
    reshard: bool = True  # ZeRO-3: the forward's wholes dropped and gathered again (backward)

    def _pieces(self, i: int) -> list[int]:
        return comm.chunk_sizes(self.lengths[i], self.mesh.size(self.axis))

    def _piece_shape(self, i: int, r: int) -> list[int]:
        shape = list(self.shapes[i])
        if self.dims[i] is not None:
            shape[self.dims[i]] = self._pieces(i)[r]
        return shape

    def segment_sizes(self, idx: Sequence[int]) -> list[int]:
        """Entries per rank of a bucket's flat buffer: each leaf's piece of that rank (a whole
        uncut leaf in every rank's segment)."""
        return [sum(math.prod(self._piece_shape(i, r)) for i in idx)
                for r in range(self.mesh.size(self.axis))]

    def _flat_piece(self, i: int, x: Tensor, r: int) -> Tensor:
        # Rank r's piece of the whole leaf x, flat; an uncut leaf is every rank's piece.
        d = self.dims[i]
        if d is None:
            return x.reshape(-1)
        pieces = self._pieces(i)
        return x.narrow(d, sum(pieces[:r]), pieces[r]).reshape(-1)

    def scatter_bucket(self, idx: Sequence[int], grads: Any, label: str | None = None
                       ) -> _Leaves:
        """The mean over ``axis`` of the gradients ``grads[i]`` (``i`` in ``idx``, one dtype),
        of which this rank keeps its parts: one reduce-scatter of the rank-major
        concatenation of every leaf's pieces (an uncut leaf is in every rank's segment, so
        every rank gets its whole mean); ``wait()`` gives ``{i: part}``. Elementwise
        the sums and the division are those of one reduce-scatter per leaf."""
        n, me = self.mesh.size(self.axis), self.mesh.rank(self.axis)
        flat = torch.cat([self._flat_piece(i, grads[i], r) for r in range(n) for i in idx])
        sizes = self.segment_sizes(idx)
        label = f"{len(idx)} leaves" if label is None else label
        pending = comm.reduce_scatter(flat, self.mesh, self.axis, sizes=sizes, async_op=True,
                                      purpose=f"{label}: zero grads")

        def parts() -> dict[int, Tensor]:
            mine, out, offset = pending.wait() / n, {}, 0
            for i in idx:
                shape = self._piece_shape(i, me)
                k = math.prod(shape)
                out[i] = mine[offset:offset + k].view(shape)
                offset += k
            return out

        return _Leaves(parts)

    def gather_bucket(self, idx: Sequence[int], parts: Any, purpose: str,
                      label: str | None = None, into: Any = None) -> _Leaves:
        """The whole leaves of the parts ``parts[i]`` (``i`` in ``idx``: cut leaves of one
        dtype): one all-gather of this rank's parts concatenated. ``wait()``: ``{i: whole}``.
        ``label`` names the leaves in the comm log (default: their count). ``into[i]``: a
        whole tensor to write leaf ``i`` into (a donated parameter whose own part the
        optimizer updated in place: only the other ranks' pieces are copied, and no new
        leaf-sized tensor is made); else each whole is new, copied once from the receive
        buffers."""
        n, me = self.mesh.size(self.axis), self.mesh.rank(self.axis)
        sizes = self.segment_sizes(idx)
        label = f"{len(idx)} leaves" if label is None else label
        pending = comm.all_gather(torch.cat([parts[i].reshape(-1) for i in idx]), self.mesh,
                                  self.axis, sizes=sizes, async_op=True, concat=False,
                                  purpose=f"{label}: {purpose}")

        def wholes() -> dict[int, Tensor]:
            segments = pending.wait()
            offsets = [0] * n
            out = {}
            for i in idx:
                pieces = []
                for r in range(n):
                    shape = self._piece_shape(i, r)
                    k = math.prod(shape)
                    pieces.append(segments[r][offsets[r]:offsets[r] + k].view(shape))
                    offsets[r] += k
                if into is None:
                    out[i] = torch.cat(pieces, dim=self.dims[i])
                    continue
                whole, d, start = into[i], self.dims[i], 0
                for r, piece in enumerate(pieces):
                    dst = whole.narrow(d, start, piece.shape[d])
                    start += piece.shape[d]
                    if r == me and _same_view(dst, parts[i]):
                        continue  # updated in place already
                    with torch.no_grad():
                        dst.copy_(piece)
                out[i] = whole
            return out

        return _Leaves(wholes)

    def part(self, i: int, x: Tensor) -> Tensor:
        """This rank's part of leaf ``i`` (``x`` its local tensor-parallel shard)."""
        d = self.dims[i]
        if d is None:
            return x
        pieces, r = self._pieces(i), self.mesh.rank(self.axis)
        return x.narrow(d, sum(pieces[:r]), pieces[r])

    def flatten(self, tree: Tree) -> tuple[list[Any], Any]:
        """``tree``'s leaves (one per planned leaf, checked) and its structure."""
        leaves, spec = tree_flatten(tree)
        if len(leaves) != len(self.dims):
            raise ValueError(f"zero_partition: a tree of {len(leaves)} leaves against a plan "
                             f"of {len(self.dims)}")
        return leaves, spec

    def one_dtype(self, idx: Sequence[int], tensors: Any) -> list[list[int]]:
        """``idx`` as one bucket, or as one bucket per leaf where ``tensors`` mix dtypes (a
        flat buffer has one; the buckets are cut on the params' dtypes)."""
        return [list(idx)] if len({tensors[i].dtype for i in idx}) <= 1 else [[i] for i in idx]

    def map(self, fn: Callable[[int, Tensor], Tensor], tree: Tree) -> Tree:
        leaves, spec = self.flatten(tree)
        return tree_unflatten(spec, [x if x is None else fn(i, x) for i, x in enumerate(leaves)])

    def to_parts(self, tree: Tree) -> Tree:
        return self.map(self.part, tree)

    def gather_tree(self, tree: Tree, purpose: str, into: Tree | None = None) -> Tree:
        """Every cut leaf of ``tree`` (parts) whole again, bucket by bucket: every bucket's
        all-gather is started before the first is waited for. ``into``: whole tensors (a
        donated tree) to write the leaves into (:meth:`gather_bucket`)."""
        leaves, spec = self.flatten(tree)
        dst = None if into is None else self.flatten(into)[0]
        pending = []
        for b in self.buckets:
            idx = [i for i in b if self.dims[i] is not None and leaves[i] is not None]
            if idx:
                pending += [self.gather_bucket(one, leaves, purpose, into=dst)
                            for one in self.one_dtype(idx, leaves)]
        out = list(leaves)
        for p in pending:
            for i, whole in p.wait().items():
                out[i] = whole
        return tree_unflatten(spec, out)

    def part_layouts(self, like: Tree) -> Tree:
        return tree_unflatten(tree_flatten(like)[1], list(self.layouts))


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same storage."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def plan_partition(params: Tree, layouts: Tree | None, mesh: DeviceMesh, stage: int,
                   axis: str = "dp", bucket_bytes: int = 25 << 20, prefetch: int = 1,
                   reshard: bool = True) -> ZeroPlan:
    """Choose each leaf's cut dim (see the module docstring) and the buckets its collectives
    travel in (:func:`~funcpar.shard.buckets.bucket_indices`, ``bucket_bytes`` each)."""
    n = mesh.size(axis)
    names, dims, lengths, parts, leaves = [], [], [], [], []
    lays = leaves_like(params, layouts, what="layouts", against="params")
    for (name, x), lay in zip(named_leaves(params), lays):
        leaves.append(x)
        base = lay if lay is not None else Layout(mesh, tuple(x.shape), None, name=name)
        if axis in {a for axes in base.dim_axes for a in axes}:
            raise ValueError(f"{name!r} is already split over {axis!r}: zero_partition once, "
                             "after shard_params")
        local = tuple(x.shape)
        candidates = [d for d in range(len(local))
                      if local[d] >= n and base.dim_blocks[d] == 1]
        # The least padding (the smallest largest piece), then the first dim: dim 0's pieces
        # are contiguous, where a later dim's strided parts cost the fused optimizer kernels a
        # dense copy each way and the bucket copies a strided read.
        numel = math.prod(local)
        d = (min(candidates, key=lambda k: (-(-local[k] // n) * (numel // local[k]), k))
             if candidates and n > 1 else None)
        names.append(name)
        dims.append(d)
        lengths.append(local[d] if d is not None else 0)
        parts.append(base.named(name) if d is None else base.split(d, axis).named(name))
    buckets = bucket_indices([x.numel() * x.element_size() for x in leaves],
                             [x.dtype for x in leaves], bucket_bytes)
    return ZeroPlan(stage, mesh, axis, tuple(names), tuple(dims), tuple(lengths), tuple(parts),
                    tuple(tuple(x.shape) for x in leaves), tuple(tuple(b) for b in buckets),
                    prefetch, reshard)


class _GatherGroup(torch.autograd.Function):
    """Forward: a group's whole leaves from their parts (``pending``: its all-gathers, one per
    dtype, already in flight). Backward: the gradients' mean over the zero axis, one
    reduce-scatter per dtype (each rank's loss is the mean over its part of the batch), after
    ``release()`` has dropped what the backward gathered again of the group."""

    @staticmethod
    def forward(ctx, plan: ZeroPlan, idx: list[int], label: str, pending: list[_Leaves],
                release: Callable[[], None], *parts: Tensor) -> tuple[Tensor, ...]:
        ctx.plan, ctx.idx, ctx.label, ctx.release = plan, idx, label, release
        wholes: dict[int, Tensor] = {}
        for p in pending:
            wholes.update(p.wait())
        return tuple(wholes[i] for i in idx)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        ctx.release()
        g = dict(zip(ctx.idx, grads))  # unused outputs' gradients come as zeros (materialized)
        scattered = [ctx.plan.scatter_bucket(one, g, ctx.label)
                     for one in ctx.plan.one_dtype(ctx.idx, g)]
        parts: dict[int, Tensor] = {}
        for p in scattered:
            parts.update(p.wait())
        return (None, None, None, None, None, *(parts[i] for i in ctx.idx))


class _ScatterGrads:
    """Stage 2/3's gradient reduction, as a :class:`~funcpar.train.step.GradSync`: bucket by
    bucket (:meth:`ZeroPlan.scatter_bucket`), each bucket's reduce-scatter started from the
    backward's hooks as soon as its last gradient is in, so it travels while the backward
    goes on. At stage 3 a cut leaf's gradient comes reduce-scattered already (by
    :class:`_GatherPart`'s backward) and only the uncut leaves are left to reduce here."""

    def __init__(self, plan: ZeroPlan):
        self.plan, self.got, self.pending = plan, {}, {}
        keep = [[i for i in b if plan.stage < 3 or plan.dims[i] is None] for b in plan.buckets]
        self.buckets = [b for b in keep if b]
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}

    def _launch(self, k: int, grads: Any) -> None:
        self.pending[k] = [self.plan.scatter_bucket(one, grads)
                           for one in self.plan.one_dtype(self.buckets[k], grads)]

    def ready(self, i: int, grad: Tensor) -> None:
        k = self.bucket_of.get(i)
        if k is None:
            return  # reduced already (stage 3)
        self.got[i] = grad
        if k not in self.pending and all(j in self.got for j in self.buckets[k]):
            self._launch(k, self.got)

    def finish(self, grads: Tree) -> Tree:
        leaves, spec = self.plan.flatten(grads)
        for k in range(len(self.buckets)):
            if k not in self.pending:
                self._launch(k, {i: self.got.get(i, leaves[i]) for i in self.buckets[k]})
        out = list(leaves)
        for k in range(len(self.buckets)):
            for p in self.pending[k]:
                for i, part in p.wait().items():
                    out[i] = part
        return tree_unflatten(spec, out)


def _partitioned(inner: GradientTransformation, plan: ZeroPlan) -> GradientTransformation:
    """``inner`` on this rank's parts; at stages 1-2 the updates are gathered whole again."""

    def init(params: Tree) -> Any:
        parts = params if plan.stage == 3 else plan.to_parts(params)
        return init_laid_out(inner, parts, plan.part_layouts(parts))

    def parts(grads: Tree, params: Tree | None) -> tuple[Tree, Tree | None, Tree]:
        g = grads if plan.stage >= 2 else plan.to_parts(grads)
        p = params if params is None or plan.stage == 3 else plan.to_parts(params)
        return g, p, plan.part_layouts(grads)

    def update(grads: Tree, state: Any, params: Tree | None = None, *, layouts: Tree = None):
        del layouts  # the parts' layouts are the plan's
        g, p, part_layouts = parts(grads, params)
        updates, state = inner.update(g, state, p, layouts=part_layouts)
        if plan.stage < 3:
            updates = plan.gather_tree(updates, "zero update gather")
        return updates, state

    # What it wraps, for a transform applied later that must sit inside the partition (offload
    # stores each rank's parts and rebuilds this wrapper around its own optimizer).
    update.zero_inner = inner
    if inner.apply is None:
        return GradientTransformation(init, update)

    def apply(grads: Tree, state: Any, params: Tree, *, layouts: Tree = None):
        # The fused step on the parts; stages 1-2 then gather the new parameters (the same
        # bytes as gathering the updates, and the same values: p + u is elementwise).
        del layouts
        g, p, part_layouts = parts(grads, params)
        new, state = inner.apply(g, state, p, layouts=part_layouts)
        if plan.stage < 3:
            # Donated: the other ranks' pieces go straight into the parameters (whose own
            # piece the fused step has just written, when it ran in place), and the step hands
            # the same tensors back; else new whole tensors.
            new = plan.gather_tree(new, "zero update gather",
                                   into=params if inplace_allowed() else None)
        return new, state

    return GradientTransformation(init, update, apply)


def zero_partition(
    stage: int, mesh: DeviceMesh, *, axis: str = "dp", bucket_mb: float = 25.0,
    prefetch: int = 1, reshard_after_forward: bool = True,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The ZeRO transform of ``stage`` (1, 2 or 3) over mesh axis ``axis``; the gradients'
    reduce-scatters and the updated parameters' all-gathers travel in buckets of at most
    ``bucket_mb`` MiB (:func:`~funcpar.shard.buckets.bucket_indices`). At stage 3,
    ``prefetch`` blocks are gathered ahead of the one computing, in the forward and the
    backward (0: each block when it starts; more hides more latency and holds that many more
    blocks whole).

    ``reshard_after_forward=False`` (stage 3; FSDP2's flag of that name, its SHARD_GRAD_OP):
    the backward uses the forward's gathered leaves instead of gathering them again, so a step
    moves ZeRO-2's bytes (one all-gather, in the forward, prefetched behind the compute, and
    one reduce-scatter) and has no all-gather after the optimizer, while the state between
    steps stays partitioned; the price is every block whole from its forward to its backward
    (ZeRO-2's parameter memory during the step)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_partition stage must be 1, 2 or 3, got {stage!r}")
    if not reshard_after_forward and stage != 3:
        raise ValueError(f"reshard_after_forward=False is a ZeRO-3 option (stage 1-2 keep the "
                         f"parameters whole), got stage {stage}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r}: its axes are {mesh.axis_names}")

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if step.partition is not None:
            raise ValueError("the step is already partitioned: apply zero_partition once")
        require_fresh(state, "zero_partition", "repartition trained states via a checkpoint")
        if step.dp_axis not in (None, axis):
            raise ValueError(f"data_parallel is over {step.dp_axis!r} but zero_partition over "
                             f"{axis!r}: they must share the axis")
        plan = plan_partition(state.params, step.layouts, mesh, stage, axis,
                              int(bucket_mb * 2**20), prefetch, reshard_after_forward)
        part_layouts = plan.part_layouts(state.params)
        opt = _partitioned(step.optimizer, plan)
        changes: dict[str, Any] = {"optimizer": opt, "partition": plan}
        params = state.params
        if stage >= 2:
            changes["grad_layouts"] = part_layouts
            changes["overlap_grads"] = lambda leaves: _ScatterGrads(plan)
        if stage == 3:
            params = plan.to_parts(params)
            params = plan.map(lambda i, x: x.clone(), params)  # own the parts, free the whole
            changes["layouts"] = part_layouts
            changes["apply_fn"] = _gathered(step.apply_fn, plan)
        new_state = state._replace(params=params, opt_state=opt.init(params))
        return dataclasses.replace(step, **changes), new_state

    return transform


class _Regather(NamedTuple):
    """A saved gathered leaf (or a view of it: ``F.linear`` saves ``weight.t()``), dropped
    after the forward and gathered again with its group, then viewed alike, when the backward
    needs it."""

    group: int
    i: int
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None


def _units(module: nn.Module, names: tuple[str, ...]) -> tuple[list[tuple[nn.Module, list[int]]],
                                                               list[int]]:
    """The blocks (elements of the outermost ``nn.ModuleList``s, as FSDP wraps transformer
    blocks) with the flat indices of their leaves, and the leaves outside every block."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(b + ".") for b, _ in blocks):
            blocks += [(f"{name}.{k}" if name else k, child) for k, child in m.named_children()]
    members: dict[str, list[int]] = {b: [] for b, _ in blocks}
    rest = []
    for i, n in enumerate(names):
        owner = next((b for b, _ in blocks if n.startswith(b + ".")), None)
        (members[owner] if owner is not None else rest).append(i)
    return [(m, members[b]) for b, m in blocks if members[b]], rest


def gather_groups(module: nn.Module, plan: ZeroPlan) -> list[tuple[str, list[int]]]:
    """ZeRO-3's gather units: ``(label, cut leaf indices)``, first the leaves outside every
    block (whole for the whole forward), then each block's in the model's order. Each group
    travels as one all-gather per dtype, forward and backward, and one reduce-scatter of its
    gradients (the plan prices them from here)."""
    blocks, rest = _units(module, plan.names)
    by_module = {id(m): n for n, m in module.named_modules()}
    groups = [("outside blocks", rest)] + [(by_module[id(m)], idx) for m, idx in blocks]
    return [(label, [i for i in idx if plan.dims[i] is not None]) for label, idx in groups]


def _gathered(apply_fn: Callable, plan: ZeroPlan) -> Callable:
    """``apply_fn`` over the parts, group by group (:func:`gather_groups`): a block's leaves
    are gathered (one all-gather per dtype) when the block starts and released when it ends,
    the next block's gathers launched then (prefetch); the leaves outside every block are whole
    for the forward. What the backward saved of a group is gathered again, the whole group at
    its first use, kept until the group's gradients are reduce-scattered
    (:class:`_GatherGroup`) and the ``plan.prefetch`` groups before it prefetched meanwhile,
    so at most ``1 + prefetch`` blocks (and the leaves outside them) are whole at a time."""
    module = apply_fn.module
    blocks, _ = _units(module, plan.names)
    groups = gather_groups(module, plan)
    owners = {}
    for i, n in enumerate(plan.names):
        prefix, _, attr = n.rpartition(".")
        owners[i] = (module.get_submodule(prefix) if prefix else module, attr)

    def apply(params: Tree, buffers: Tree, *args: Any, **kwargs: Any) -> Any:
        parts, spec = tree_flatten(params)
        detached = [p.detach() for p in parts]
        # id(whole) -> (weakref to it, group, i): the saved-tensor hooks outlive the forward
        # (the graph keeps them), so a strong reference here would keep every gathered leaf
        # whole through the backward.
        live: dict[int, tuple[weakref.ref, int, int]] = {}
        inflight: dict[int, list[_Leaves]] = {}  # group -> its gathers on their way
        regathered: dict[int, dict[int, Tensor]] = {}  # group -> the backward's wholes

        def launch(g: int, purpose: str) -> list[_Leaves]:
            label, idx = groups[g]
            return [plan.gather_bucket(one, detached, purpose, label)
                    for one in plan.one_dtype(idx, detached)]

        def prefetch(g: int, purpose: str) -> None:
            if 0 <= g < len(groups) and groups[g][1] and g not in inflight:
                inflight[g] = launch(g, purpose)

        def release(g: int) -> Callable[[], None]:
            def done() -> None:
                regathered.pop(g, None)
                if g == 0:  # the last group of the backward: nothing may stay in flight
                    for pending in inflight.values():
                        for p in pending:
                            p.wait()
                    inflight.clear()
            return done

        def gather(g: int) -> dict[int, Tensor]:
            label, idx = groups[g]
            if not idx:
                return {}
            pending = inflight.pop(g, None) or launch(g, "zero3 param gather")
            wholes = _GatherGroup.apply(plan, idx, label, pending, release(g),
                                        *(parts[i] for i in idx))
            for i, w in zip(idx, wholes):
                live[id(w)] = (weakref.ref(w), g, i)
            return dict(zip(idx, wholes))

        def enter(k: int, idx: list[int]) -> Callable:
            def hook(mod: nn.Module, inputs: Any) -> None:
                wholes = gather(k + 1)
                for i in idx:
                    owner, attr = owners[i]
                    owner._parameters[attr] = wholes.get(i, parts[i])
                for g in range(k + 2, k + 2 + plan.prefetch):
                    prefetch(g, "zero3 param gather")
            return hook

        def leave(idx: list[int]) -> Callable:
            def hook(mod: nn.Module, inputs: Any, output: Any) -> None:
                for i in idx:
                    owner, attr = owners[i]
                    live.pop(id(owner._parameters[attr]), None)
                    owner._parameters[attr] = parts[i]
            return hook

        def pack(t: Tensor) -> Any:
            base = t if t._base is None else t._base
            hit = live.get(id(base))
            if hit is None or hit[0]() is not base:
                return t
            view = None if base is t else (tuple(t.shape), t.stride(), t.storage_offset())
            return _Regather(hit[1], hit[2], view)

        def unpack(x: Any) -> Tensor:
            if not isinstance(x, _Regather):
                return x
            if x.group not in regathered:
                wholes: dict[int, Tensor] = {}
                for p in inflight.pop(x.group, None) or launch(
                        x.group, "zero3 regather for backward"):
                    wholes.update(p.wait())
                regathered[x.group] = wholes
                # The blocks before it, whose backward comes next (group 0, outside the blocks,
                # is gathered when first used: its first use opened the backward).
                for g in range(x.group - 1, max(0, x.group - 1 - plan.prefetch), -1):
                    prefetch(g, "zero3 regather for backward")
            # The gather is contiguous, as the forward's was, so a view's strides carry over.
            whole = regathered[x.group][x.i]
            return whole if x.view is None else whole.as_strided(*x.view)

        outside = gather(0)
        tree = tree_unflatten(spec, [outside.get(i, p) for i, p in enumerate(parts)])
        for g in range(1, 1 + plan.prefetch):
            prefetch(g, "zero3 param gather")
        handles = []
        for k, (m, idx) in enumerate(blocks):
            handles.append(m.register_forward_pre_hook(enter(k, idx)))
            handles.append(m.register_forward_hook(leave(idx)))
        # Not resharding, the graph keeps what it saved of the forward's wholes.
        saving = (torch.autograd.graph.saved_tensors_hooks(pack, unpack) if plan.reshard
                  else contextlib.nullcontext())
        try:
            with saving:
                return apply_fn(tree, buffers, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            for g in [g for g in inflight if g > 0]:  # a block that did not run: finish it
                for p in inflight.pop(g):
                    p.wait()

    apply.module = module
    return apply
