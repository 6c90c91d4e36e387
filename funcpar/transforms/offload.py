"""``offload``: the optimizer state (and the fp32 master params) kept in a tensor store between
steps.

``step, state = offload("nvme", path="/scratch/run1")(step, state)`` moves
``state.opt_state`` into a :class:`~funcpar.offload.NvmeStore` under ``path`` (``"cpu"``: a
:class:`~funcpar.offload.CpuStore`, pinned when CUDA is available) and wraps the step's
optimizer, as ZeRO-Offload / ZeRO-Infinity do (Ren et al. 2021, arXiv 2101.06840; Rajbhandari
et al. 2021, arXiv 2104.07857) and Colossal-AI's Gemini does with its chunks. Each update:

1. reads the state in, the store reading ahead (``prefetch``) of the leaf being taken through
   its bounded pool of buffers, each file's checksum verified;
2. runs the wrapped optimizer's update over it, so the result is the in-memory optimizer's to
   the bit. Either over the whole tree at once (``chunk_bytes=None``, the default: exact for
   every optimizer), or **chunk by chunk** (``chunk_bytes=N``): the parameters are grouped, in
   flattening order, into chunks of about ``N`` bytes of state, and the update runs on each
   chunk's sub-trees in turn while the next chunk is read ahead into a reused page-aligned
   arena (``O_DIRECT`` straight into it) and the previous one is written behind; at most
   ``max_resident`` chunks are in host memory at once (read, being updated, or being written).
   With ``update_on="cpu"`` (default) the update runs on the host, next to the state (ZeRO-
   Offload's CPU update: each chunk's leaves are whole tensors, so every op is vectorized over
   them); with ``update_on="device"`` each chunk is copied to the parameters' device - on CUDA
   on a side stream, the next chunk's copy overlapping this chunk's update - and the new state
   copied back (ZeRO-Infinity's streamed update).
3. writes the new state behind: each leaf is copied into a store buffer and written by the
   store's threads while the step goes on (the next update's read of a leaf waits for its
   write).

**Chunked updates are exact when the optimizer's update of a parameter depends on that
parameter's gradient and state alone** (plus shared scalars such as step counts and
hyperparameters): SGD, AdamW, Adafactor, CAME, Lamb (per-leaf trust ratio), GaLore, the 8-bit
states. A *global* transformation (``clip_by_global_norm``) needs every gradient: the leading
parts of a :func:`~funcpar.optim.chain` that keep no per-parameter state (clipping) run first
on the whole gradient tree, and the rest runs chunk by chunk, so ``chain(clip_by_global_norm,
adamw)`` stays exact. Shared state leaves (the count) must come out of every chunk equal; a
difference is a ValueError naming the leaf (such an optimizer is not separable). Chunking
needs the parameters as (nested) dicts, as :func:`~funcpar.state.functionalize` makes them.

**fp32 master params** (``what=("opt_state", "master_params")``, after ``amp_cast``): the
float32 masters of the leaves amp_cast computes in half precision go into the store too, and
``state.params`` keeps only their compute-dtype copies (bf16/fp16: half the bytes on the
device). The half-precision leaf's gradient is the in-memory run's float32 gradient rounded by
nothing: amp_cast's cast backward only upcasts the half-precision gradient, so the offloaded
step upcasts it right after the backward - inside the step's overlapped reduction, before
data_parallel's bucketed all-reduce or ZeRO-2/3's reduce-scatter sees it, whose buckets are
planned for float32 leaves as in the in-memory run - and before the fp16 unscale, the norm and
the optimizer. The update, run on the float32 masters read from the store, is the in-memory
update to the bit; the new compute copies are the new masters cast down. Without amp_cast the
parameters the step computes with *are* the masters (float32), so there is nothing to keep
elsewhere: refused. A transform applied after offload that replaces the step's gradient
reduction (data_parallel) would reduce the half-precision gradients: the first step refuses it
(ValueError, before the optimizer); zero_partition applied after offload(master_params) is
refused when it builds its state (the masters would be the half-precision copies); and
pipeline_split with masters is refused (its stage gradient exchange is not covered).

**Under ZeRO** (offload after zero_partition, as amp_cast must follow it at stage 3 and offload
follows amp_cast) offload sits *inside* the partition: it rebuilds zero_partition's optimizer
wrapper around its own offloaded version of the optimizer zero_partition wrapped, so each rank's
update (on the host, whole or chunk by chunk) takes its parts of the gradients, and the store
holds only this rank's parts of the optimizer state and of the masters (ZeRO-Offload's
arrangement, Ren et al. 2021: each data-parallel rank offloads its own partition). At stages 1-2
the new compute copies of a rank's parts (cast down first: half the bytes) are all-gathered
whole, as zero_partition gathers the new params; at stage 3 they stay parts, gathered per block
by zero_partition's forward (in the compute dtype, as with amp_cast alone). Casting before the
gather is elementwise the same as gathering the float32 masters and casting after, so the
model sees the in-memory run's compute values to the bit.

**What ``state.opt_state`` holds.** An :class:`OffloadedState` ``(version, tree, masters)``:
``version`` a 0-d int64 tensor counting the updates written, ``tree`` the wrapped optimizer's
state with every stored leaf (a tensor of at least ``min_numel`` entries) replaced by a *meta*
tensor of the same shape and dtype, which takes no memory; smaller leaves (step counts, the
0-d hyperparameters of :mod:`funcpar.optim.hyperparams`, so ``lr`` stays visible to the step's
metrics) stay in the tree as they are. ``masters``: ``None``, or a tree like the params with a
meta handle per stored master. :func:`read_state` / :func:`read_masters` read them back (for
a checkpoint, say): under ZeRO this rank's parts (``read_masters(..., partition=)``).

**Versions keep the step pure.** Leaf ``i`` of version ``v`` is stored under the key
``<prefix>.r<rank>.<i>.<name>.s<v % 2>`` (a master: ``...m<i>...``) with tag ``v``: an update
reads slot ``v % 2`` and writes slot ``(v + 1) % 2``, so calling the step twice on one state
reads the same data twice (DESIGN principle 1). The store holds two copies of the state for
that; a state older than the last two versions is refused with a clear error (its slot was
overwritten). One store directory (and ``prefix``) per training run.

Composition: with :func:`~funcpar.transforms.zero_partition` (stages 1-3; with stage 3 this is
Colossal-AI's Gemini: parameters partitioned and gathered per block, each rank's optimizer
state parts on NVMe) in either order for the optimizer state alone, after it with masters (the
store then holds this rank's parts: the rank is in every key, so ranks can share a directory);
chunked (``chunk_bytes``) in either order too. With :func:`~funcpar.transforms.data_parallel`
(each rank stores the whole state and masters, which data parallelism replicates) and
:func:`~funcpar.transforms.shard_params`, whose layouts pass through to the wrapped optimizer
unchanged. Apply offload last.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from funcpar.offload.store import BLOCK, CpuStore, NvmeStore, TensorStore, aligned_empty
from funcpar.optim.base import GradientTransformation, apply_updates, chain, update_params
from funcpar.state.train_state import TrainState
from funcpar.state.tree import (
    NAMESPACE,
    Tree,
    device_of,
    named_leaves,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)
from funcpar.train.step import TrainStep
from funcpar.transforms.zero_partition import _partitioned

__all__ = ["OffloadedState", "offload", "offloaded", "read_masters", "read_state"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class OffloadedState(NamedTuple):
    """``version``: 0-d int64, updates written; ``tree``: the state, stored leaves as meta
    tensors (shape and dtype only); ``masters``: ``None`` or the params' tree with a meta
    handle per fp32 master kept in the store (``None`` for a leaf kept in ``state.params``)."""

    version: Tensor
    tree: Tree
    masters: Tree = None


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _key(prefix: str, rank: int, i: int, name: str, version: int, kind: str = "") -> str:
    # The flat index makes the key unique; the name (made file-safe, shortened) says which
    # leaf a file holds to whoever looks at the directory or an error message.
    return f"{prefix}.r{rank}.{kind}{i:05d}.{_UNSAFE.sub('_', name)[:120]}.s{version % 2}"


def _stored(x: Any) -> bool:
    return torch.is_tensor(x) and x.is_meta


def _meta(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


class _Stats:
    """Counters of the chunked update (tests read them): chunks per update, the most chunks
    resident in host memory at once, the arena's bytes."""

    def __init__(self) -> None:
        self.chunks = 0
        self.peak_resident = 0
        self.arena_bytes = 0


def offloaded(inner: GradientTransformation, store: TensorStore, *, prefix: str = "opt",
              min_numel: int = 2, rank: int | None = None, chunk_bytes: int | None = None,
              max_resident: int = 2, update_on: str = "cpu",
              masters: tuple[torch.dtype, list[bool]] | None = None,
              stats: _Stats | None = None) -> GradientTransformation:
    """``inner`` with its state in ``store`` between updates (see the module docstring).

    ``masters``: ``(compute dtype, per-param-leaf flags)``: the flagged leaves' fp32 masters
    are in the store and the params given to ``apply`` are their compute copies; the
    transformation then has ``apply`` (``update_params`` takes it) and no usable ``update``.
    """
    if min_numel < 1:
        raise ValueError(f"offloaded: min_numel must be >= 1, got {min_numel}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]*", prefix):
        raise ValueError(f"offloaded: prefix must be [A-Za-z0-9_-], got {prefix!r}")
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"offloaded: chunk_bytes must be >= 1 (or None), got {chunk_bytes}")
    if max_resident < 1:
        raise ValueError(f"offloaded: max_resident must be >= 1 chunk, got {max_resident}")
    if update_on not in ("cpu", "device"):
        raise ValueError(f"offloaded: update_on must be 'cpu' or 'device', got {update_on!r}")
    stats = stats if stats is not None else _Stats()
    arena: list[Tensor | None] = [None] * max_resident

    def r_() -> int:
        return _rank() if rank is None else rank

    def put_leaf(name: str, i: int, x: Any, version: int, kind: str = "") -> Any:
        if torch.is_tensor(x) and not x.is_meta and x.numel() >= min_numel:
            store.put(_key(prefix, r_(), i, name, version, kind), x, tag=version)  # behind
            return _meta(x)
        return x

    def save(tree: Tree, version: int) -> Tree:
        spec = tree_flatten(tree)[1]
        return tree_unflatten(spec, [put_leaf(n, i, x, version)
                                     for i, (n, x) in enumerate(named_leaves(tree))])

    def init(params: Tree) -> OffloadedState:
        handles = None
        if masters is not None:
            flags = masters[1]
            named = named_leaves(params)
            if len(named) != len(flags):
                raise ValueError(f"offloaded(masters): params of {len(named)} leaves, planned "
                                 f"for {len(flags)}")
            for (name, p), f in zip(named, flags):
                if f and p.dtype != torch.float32:
                    # zero_partition applied after offload(master_params) builds its state
                    # from the half-precision compute copies: the masters would be lost.
                    raise ValueError(f"offloaded(masters): the master of {name!r} must be "
                                     f"float32, got {p.dtype}: apply offload(master_params) "
                                     "after amp_cast and after zero_partition / "
                                     "data_parallel (last)")
        tree = save(inner.init(params), 0)
        if masters is not None:
            handles = tree_unflatten(tree_flatten(params)[1], [
                store_master(n, i, p, 0) if f else None
                for i, ((n, p), f) in enumerate(zip(named_leaves(params), flags))])
        return OffloadedState(torch.tensor(0, dtype=torch.int64), tree, handles)

    def store_master(name: str, i: int, p: Tensor, version: int) -> Tensor:
        store.put(_key(prefix, r_(), i, name, version, "m"), p, tag=version)
        return _meta(p)

    def check(state: Any) -> None:
        store.check()  # a write of an earlier update that failed: reported before reading
        if not isinstance(state, OffloadedState):
            raise TypeError(f"an offloaded optimizer takes an OffloadedState, got "
                            f"{type(state).__name__}: was the state built by this optimizer's "
                            "init (or the offload transform)?")
        if (state.masters is None) != (masters is None):
            raise ValueError("offloaded: the state's masters do not match this optimizer's "
                             "plan (built by another offload transform?)")

    def update(grads: Tree, state: Any, params: Tree | None = None, *, layouts: Tree = None):
        check(state)
        if masters is not None:
            raise TypeError("an offloaded optimizer with fp32 master params updates the "
                            "params itself: call update_params / .apply, not .update")
        device = device_of(grads)
        if chunk_bytes is None:
            tree = load(state, store, prefix=prefix, rank=rank)
            if device.type != "cpu":  # the update runs on the host, next to the state
                grads, params = _to(grads, "cpu"), _to(params, "cpu")
            updates, new = inner.update(grads, tree, params, layouts=layouts)
            if device.type != "cpu":
                updates = _to(updates, device)
            new_state = OffloadedState(_version(state) + 1, save(new, int(state.version) + 1))
        else:
            updates, new_tree, _ = chunked(grads, state, params, layouts, None, False)
            new_state = OffloadedState(_version(state) + 1, new_tree)
        store.check()  # this update's writes that already failed (fast: read-only, full)
        return updates, new_state

    def apply(grads: Tree, state: Any, params: Tree, *, layouts: Tree = None):
        """New params and state. The in-memory step's ``update_params(inner, ...)`` is
        matched exactly: ``inner.apply`` where it has one (a fused update rounds as its own
        kernel does), ``inner.update`` + ``apply_updates`` otherwise."""
        check(state)
        v = int(state.version)
        device = device_of(grads)
        if masters is None:
            if chunk_bytes is not None:
                _, new_tree, new_p = chunked(grads, state, params, layouts, None, True)
                return new_p, OffloadedState(_version(state) + 1, new_tree)
            tree = load(state, store, prefix=prefix, rank=rank)
            if device.type != "cpu":  # the update runs on the host, next to the state
                grads, params_h = _to(grads, "cpu"), _to(params, "cpu")
            else:
                params_h = params
            new_p, new = update_params(inner, grads, tree, params_h, layouts=layouts)
            if device.type != "cpu":
                new_p = _to(new_p, device)
            return new_p, OffloadedState(_version(state) + 1, save(new, v + 1))
        dtype, flags = masters
        if chunk_bytes is None:
            full = _with_masters(params, state.masters, store, prefix, r_(), v)
            tree = load(state, store, prefix=prefix, rank=rank)
            if device.type != "cpu":
                grads, full = _to(grads, "cpu"), _to(full, "cpu")
            new_full, new = update_params(inner, grads, tree, full, layouts=layouts)
            new_tree = save(new, v + 1)
        else:
            _, new_tree, new_full = chunked(grads, state, params, layouts, dtype, True)
        # New masters written behind, their compute copies returned as the params.
        out, handles = [], []
        spec = tree_flatten(params)[1]
        for i, ((name, p), m, f) in enumerate(zip(named_leaves(params), tree_leaves(new_full),
                                                    flags)):
            if f:
                handles.append(store_master(name, i, m, v + 1))
                out.append(m.to(device=p.device, dtype=dtype))
            else:
                handles.append(None)
                out.append(m.to(p.device))
        return tree_unflatten(spec, out), OffloadedState(
            _version(state) + 1, new_tree, tree_unflatten(spec, handles))

    def chunked(grads: Tree, state: OffloadedState, params: Tree, layouts: Tree,
                half: torch.dtype | None, want_params: bool) -> tuple[Any, Tree, Any]:
        """The chunk-by-chunk update: ``(updates, new state tree, None)``, or with
        ``want_params`` ``(None, new state tree, new params)`` (with ``half``, the masters'
        plan, the new float32 masters on the host)."""
        v, r = int(state.version), r_()
        _check_dicts(params)
        p_named = named_leaves(params)
        p_leaves = [x for _, x in p_named]
        pspec = tree_flatten(params)[1]
        s_named = named_leaves(state.tree)
        s_leaves, s_spec = tree_flatten(state.tree)
        index = tree_unflatten(s_spec, list(range(len(s_leaves))))
        parts, p_index, k = _split_chain(inner, index, pspec)
        if parts is None:
            rest, rest_index = inner, index
        elif len(parts) - k == 1:
            rest, rest_index = parts[k], p_index[k]
        else:
            rest, rest_index = chain(*parts[k:]), tuple(p_index[k:])
        # What update_params(inner) would do: the fused apply where the optimizer has one (a
        # chain has one when its last part does: the earlier parts' updates, then that apply),
        # else update + apply_updates. Both round differently, so the choice must match.
        fused = inner.apply is not None and rest.apply is not None
        dev = device_of(grads) if update_on == "device" else torch.device("cpu")
        host = torch.device("cpu")
        m_handles = tree_leaves(state.masters) if half is not None else [None] * len(p_named)
        grads = _to(grads, dev)
        new_leaves: list[Any] = [None] * len(s_leaves)
        done = [False] * len(s_leaves)

        def value(i: int) -> Any:
            x = s_leaves[i]
            return store.get(_key(prefix, r, i, s_named[i][0], v), tag=v) if _stored(x) else x

        # 1. The leading chain parts without per-parameter state (global clipping) run on the
        # whole tree, with the real params (None with masters: they would need every fp32
        # master at once, which is what chunking avoids; a part that needs them says so).
        if parts is not None:
            full = None if half is not None else _to(params, dev)
            for j in range(k):
                ids = tree_leaves(p_index[j])
                sj = tree_unflatten(tree_flatten(p_index[j])[1],
                                    [_to(value(i), dev) for i in ids])
                grads, nj = parts[j].update(grads, sj, full, layouts=layouts)
                for i, x in zip(ids, tree_leaves(nj)):
                    new_leaves[i] = put_leaf(s_named[i][0], i, _to(x, host), v + 1)
                    done[i] = True

        # 2. The rest, chunk by chunk.
        rest_ids = tree_leaves(rest_index)
        owner = dict(zip(rest_ids, _owners(rest_index, pspec)))
        sizes = [0] * len(p_named)
        for i in rest_ids:
            if owner[i] >= 0 and _stored(s_leaves[i]):
                sizes[owner[i]] += _round(s_leaves[i])
        for p, h in enumerate(m_handles):
            if h is not None:
                sizes[p] += _round(h)
        groups = _group(sizes, chunk_bytes)
        # Leaves no parameter owns (counts, hyperparameters): read once, given to every chunk.
        shared_in = {i: _to(value(i), dev) for i in rest_ids if owner[i] < 0}
        shared_out: dict[int, Any] = {}
        stats.chunks = len(groups)
        g_leaves = tree_leaves(grads)
        lay_leaves = pspec.flatten_up_to(layouts) if layouts is not None else None
        u_leaves: list[Any] = [None] * len(p_named)
        new_params: list[Any] = [None] * len(p_named)

        def plan(c: int) -> list[tuple[str, Tensor, int]]:
            """(key, meta handle, offset in the arena slot) of chunk ``c``'s stored leaves."""
            members, out, off = set(groups[c]), [], 0
            for i in rest_ids:
                if owner[i] in members and _stored(s_leaves[i]):
                    out.append((_key(prefix, r, i, s_named[i][0], v), s_leaves[i], off))
                    off += _round(s_leaves[i])
            for p in groups[c]:
                if m_handles[p] is not None:
                    out.append((_key(prefix, r, p, p_named[p][0], v, "m"), m_handles[p], off))
                    off += _round(m_handles[p])
            return out

        plans = [plan(c) for c in range(len(groups))]
        written: list[list[str]] = [[] for _ in groups]
        views: dict[int, dict[str, Tensor]] = {}
        resident: list[int] = []

        def start(c: int) -> None:
            """Read chunk ``c`` ahead into its arena slot, once the chunk that used the slot
            before is written (its new state may alias the slot, and the bound counts it)."""
            if c >= len(groups) or c in views:
                return
            slot, before = c % max_resident, c - max_resident
            if before >= 0:
                store.wait(written[before])
                resident.remove(before)
            need = sum(_round(h) for _, h, _ in plans[c])
            buf = arena[slot]
            if buf is None or buf.numel() < need:
                buf = arena[slot] = aligned_empty((max(need, BLOCK),), torch.uint8)
                stats.arena_bytes = sum(a.numel() for a in arena if a is not None)
            vs = {}
            for key, h, off in plans[c]:
                vs[key] = buf[off:off + h.numel() * h.element_size()].view(h.dtype).reshape(
                    h.shape)
                store.prefetch(key, out=vs[key])
            views[c] = vs
            resident.append(c)
            stats.peak_resident = max(stats.peak_resident, len(resident))

        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

        def to_device(c: int) -> tuple[dict[str, Tensor], Any]:
            """Chunk ``c``'s leaves, read (checksums checked) and on ``dev``: on CUDA copied
            on a side stream, with the event the update waits for (untested here: no GPU
            was lent to this task)."""
            got = {key: store.get(key, tag=v, out=views[c][key]) for key, _, _ in plans[c]}
            if stream is None:
                return {key: t.to(dev) for key, t in got.items()}, None
            with torch.cuda.stream(stream):
                on = {key: t.to(dev, non_blocking=True) for key, t in got.items()}
                ev = torch.cuda.Event()
                ev.record(stream)
            return on, ev

        for c in range(min(max(max_resident - 1, 1), len(groups))):
            start(c)
        pending: dict[int, Any] = {}
        for c, members in enumerate(groups):
            loaded, ev = pending.pop(c) if c in pending else to_device(c)
            if ev is not None:
                torch.cuda.current_stream(dev).wait_event(ev)
            sub_spec = tree_flatten(_subset(params, members))[1]
            sub_index = _cut(rest_index, pspec, sub_spec, members)
            sub_ids, sub_ispec = tree_flatten(sub_index)
            sub_state = tree_unflatten(sub_ispec, [
                shared_in[i] if owner[i] < 0
                else loaded[_key(prefix, r, i, s_named[i][0], v)] if _stored(s_leaves[i])
                else _to(s_leaves[i], dev) for i in sub_ids])
            sub_grads = tree_unflatten(sub_spec, [g_leaves[p] for p in members])
            sub_p = tree_unflatten(sub_spec, [
                _to(p_leaves[p], dev) if m_handles[p] is None
                else loaded[_key(prefix, r, p, p_named[p][0], v, "m")] for p in members])
            sub_lay = (None if lay_leaves is None
                       else tree_unflatten(sub_spec, [lay_leaves[p] for p in members]))
            if want_params and fused:
                u, new_sub = rest.apply(sub_grads, sub_state, sub_p, layouts=sub_lay)
            else:
                u, new_sub = rest.update(sub_grads, sub_state, sub_p, layouts=sub_lay)
                if want_params:
                    u = apply_updates(sub_p, u)
            if c + 1 < len(groups) and c + 1 in views:
                # Launched before this chunk's results come back: on CUDA the next chunk's
                # copy runs while this chunk's update does.
                pending[c + 1] = to_device(c + 1)
            for p, x in zip(members, tree_leaves(u)):
                if want_params:
                    new_params[p] = _to(x, host if half is not None else p_leaves[p].device)
                else:
                    u_leaves[p] = x
            for i, x in zip(sub_ids, tree_leaves(new_sub)):
                x = _to(x, host)
                if owner[i] < 0 and i in shared_out:  # shared: the same from every chunk
                    if not _same(shared_out[i], x):
                        raise ValueError(
                            f"offloaded chunked update: the shared state leaf "
                            f"{s_named[i][0]!r} differs between chunks, so this optimizer's "
                            "update is not separable by parameter (use chunk_bytes=None)")
                    continue
                if owner[i] < 0:
                    shared_out[i] = x
                new_leaves[i] = put_leaf(s_named[i][0], i, x, v + 1)
                done[i] = True
                if _stored(new_leaves[i]):
                    written[c].append(_key(prefix, r, i, s_named[i][0], v + 1))
            del loaded, sub_state, u, new_sub
            start(c + max(max_resident - 1, 1))
        missing = [s_named[i][0] for i in range(len(s_leaves)) if not done[i]]
        if missing:
            raise ValueError(f"offloaded chunked update: state leaves {missing[:3]} belong to "
                             "no parameter and came out of no chunk")
        new_tree = tree_unflatten(s_spec, new_leaves)
        if want_params:
            return None, new_tree, tree_unflatten(pspec, new_params)
        return tree_unflatten(pspec, [_to(u, p.device)
                                      for u, p in zip(u_leaves, p_leaves)]), new_tree, None

    def checked_apply(grads: Tree, state: Any, params: Tree, *, layouts: Tree = None):
        out = apply(grads, state, params, layouts=layouts)
        store.check()  # this update's writes that already failed (fast: read-only, full)
        return out

    checked_apply.__doc__ = apply.__doc__
    return GradientTransformation(init, update, checked_apply)


# -- helpers of the chunked update --------------------------------------------------------------


def _round(x: Tensor) -> int:
    """Bytes of ``x`` rounded up to whole 4 KiB blocks (its room in an arena slot)."""
    return -(-x.numel() * x.element_size() // BLOCK) * BLOCK


def _check_dicts(params: Tree) -> None:
    if type(params) is not dict or not all(
            type(x) is dict or torch.is_tensor(x) or x is None for x in _nodes(params)):
        raise ValueError("offloaded(chunk_bytes=...) needs the params as (nested) dicts of "
                         "tensors, as functionalize() makes them: chunks are sub-dicts, so "
                         f"the leaves keep their names; got {type(params).__name__}")


def _nodes(tree: dict) -> list[Any]:
    out = []
    for x in tree.values():
        out.append(x)
        if type(x) is dict:
            out.extend(_nodes(x))
    return out


def _subset(params: dict, members: Sequence[int]) -> dict:
    """The sub-dict of ``params`` holding the flat leaves ``members`` (names kept)."""
    keep = set(members)
    out: dict = {}
    paths = optree.tree_flatten_with_path(params, none_is_leaf=True, namespace=NAMESPACE)[0]
    for i, path in enumerate(paths):
        if i in keep:
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = i
    return out


def _param_node(pspec: optree.PyTreeSpec) -> Callable[[Any], bool]:
    """Whether a node of a state tree has the params' structure (a per-parameter sub-tree)."""
    def is_node(x: Any) -> bool:
        if not isinstance(x, (dict, list, tuple)):
            return False
        try:
            pspec.flatten_up_to(x)
        except (ValueError, TypeError):
            return False
        return True
    return is_node


def _top(index: Tree, pspec: optree.PyTreeSpec) -> tuple[list[Any], optree.PyTreeSpec]:
    """``index`` flattened down to its per-parameter nodes (kept whole) and other leaves."""
    return optree.tree_flatten(index, is_leaf=_param_node(pspec), none_is_leaf=True,
                               namespace=NAMESPACE)


def _owners(index: Tree, pspec: optree.PyTreeSpec) -> list[int]:
    """For each leaf of ``index`` (flattening order): the flat parameter index whose
    per-parameter sub-tree holds it, or -1 (a shared leaf: a count, a hyperparameter)."""
    out: list[int] = []
    is_node = _param_node(pspec)
    for node in _top(index, pspec)[0]:
        if is_node(node):
            for p, sub in enumerate(pspec.flatten_up_to(node)):
                out.extend([p] * len(tree_leaves(sub)))
        else:
            out.append(-1)
    return out


def _cut(index: Tree, pspec: optree.PyTreeSpec, sub_spec: optree.PyTreeSpec,
         members: Sequence[int]) -> Tree:
    """``index`` with each per-parameter node cut down to the parameters ``members``."""
    top, tspec = _top(index, pspec)
    is_node = _param_node(pspec)
    cut = []
    for node in top:
        if is_node(node):
            per = pspec.flatten_up_to(node)
            cut.append(optree.tree_unflatten(sub_spec, [per[p] for p in members]))
        else:
            cut.append(node)
    return optree.tree_unflatten(tspec, cut)


def _group(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Consecutive parameters in chunks of at most ``chunk_bytes`` of state (a larger one
    alone); parameters without stored state join the chunk at hand."""
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for p, n in enumerate(sizes):
        if cur and total + n > chunk_bytes:
            groups.append(cur)
            cur, total = [], 0
        cur.append(p)
        total += n
    if cur:
        groups.append(cur)
    return groups


def _split_chain(opt: GradientTransformation, index: Tree, pspec: optree.PyTreeSpec
                 ) -> tuple[list[GradientTransformation] | None, list[Tree], int]:
    """``(parts, states, k)``: a chain's parts (nested chains flattened) and their state index
    trees, of which the first ``k`` keep no per-parameter state (global transformations such
    as clipping, run on the whole tree); ``(None, [index], 0)`` when ``opt`` is not a chain
    (it is updated chunk by chunk as a whole)."""
    parts = _flat_chain(opt, index)
    if parts is None:
        return None, [index], 0
    k = 0
    while k < len(parts) and all(o < 0 for o in _owners(parts[k][1], pspec)):
        k += 1
    return [t for t, _ in parts], [i for _, i in parts], k


def _flat_chain(opt: GradientTransformation,
                index: Tree) -> list[tuple[GradientTransformation, Tree]] | None:
    parts = _chain_parts(opt)
    if parts is None or not isinstance(index, tuple) or len(index) != len(parts):
        return None
    out = []
    for t, i in zip(parts, index):
        out.extend(_flat_chain(t, i) or [(t, i)])
    return out


def _chain_parts(opt: GradientTransformation) -> list[GradientTransformation] | None:
    """The transformations of a :func:`funcpar.optim.chain` (its ``update`` carries them, under
    the type checkers' wrappers), or None for any other optimizer."""
    fn, parts = opt.update, None
    while parts is None and fn is not None:  # on the checker's wrapper or on what it wraps
        parts = getattr(fn, "chain_parts", None)
        fn = getattr(fn, "__wrapped__", None)
    return list(parts) if parts is not None else None


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a is None and b is None


def _version(state: OffloadedState) -> Tensor:
    return torch.tensor(int(state.version), dtype=torch.int64)


# -- reading back, the transform ----------------------------------------------------------------


def load(state: OffloadedState, store: TensorStore, *, prefix: str = "opt",
         rank: int | None = None) -> Tree:
    """The whole state of ``state`` read from ``store``, reading ahead as buffers allow."""
    r = _rank() if rank is None else rank
    v = int(state.version)
    named = named_leaves(state.tree)
    leaves, spec = tree_flatten(state.tree)
    todo = [i for i, x in enumerate(leaves) if _stored(x)]
    keys = [_key(prefix, r, i, named[i][0], v) for i in todo]
    ahead = 0
    for j, i in enumerate(todo):
        # Keep the store's spare buffers busy with the next leaves while this one is taken.
        while ahead < len(todo) and store.prefetch(keys[ahead]):
            ahead += 1
        t = store.get(keys[j], tag=v)
        want = leaves[i]
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            raise ValueError(f"offloaded state leaf {named[i][0]!r}: the store has "
                             f"{tuple(t.shape)} {t.dtype} under {keys[j]!r}, the state expects "
                             f"{tuple(want.shape)} {want.dtype}")
        leaves[i] = t
        ahead = max(ahead, j + 1)
    return tree_unflatten(spec, leaves)


def _with_masters(params: Tree, handles: Tree, store: TensorStore, prefix: str, rank: int,
                  version: int) -> Tree:
    """``params`` with each leaf that has a master handle replaced by the stored master."""
    spec = tree_flatten(params)[1]
    out = []
    for i, ((name, p), h) in enumerate(zip(named_leaves(params), tree_leaves(handles))):
        if h is None:
            out.append(p)
            continue
        t = store.get(_key(prefix, rank, i, name, version, "m"), tag=version)
        if tuple(t.shape) != tuple(h.shape) or t.dtype != h.dtype:
            raise ValueError(f"offloaded master {name!r}: the store has {tuple(t.shape)} "
                             f"{t.dtype}, the state expects {tuple(h.shape)} {h.dtype}")
        out.append(t)
    return tree_unflatten(spec, out)


def read_state(opt_state: OffloadedState, store: TensorStore, *, prefix: str = "opt",
               rank: int | None = None) -> Tree:
    """The optimizer state that ``opt_state`` stands for, read back whole from ``store``."""
    store.flush()
    return load(opt_state, store, prefix=prefix, rank=rank)


def read_masters(params: Tree, opt_state: OffloadedState, store: TensorStore, *,
                 prefix: str = "opt", rank: int | None = None, partition: Any = None) -> Tree:
    """The float32 master params: ``params`` (the compute copies in ``state.params``) with
    each offloaded master read back from ``store`` (for a checkpoint, say). Under ZeRO pass
    ``partition=step.partition``: the result is then this rank's part of every leaf (the
    layouts ``partition.part_layouts``), since the store holds only this rank's parts of the
    masters (at stage 3 ``params`` are the parts already)."""
    if partition is not None and partition.stage < 3:
        params = partition.to_parts(params)
    if opt_state.masters is None:
        return params
    store.flush()
    return _with_masters(params, opt_state.masters, store, prefix,
                         _rank() if rank is None else rank, int(opt_state.version))


def offload(
    target: str = "cpu",
    what: Sequence[str] = ("opt_state",),
    *,
    path: str | os.PathLike | None = None,
    store: TensorStore | None = None,
    prefix: str = "opt",
    min_numel: int = 2,
    workers: int = 2,
    max_inflight: int = 4,
    o_direct: bool = True,
    chunk_bytes: int | None = None,
    max_resident: int = 3,
    update_on: str = "cpu",
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The transform keeping ``what`` on ``target`` (``"cpu"`` or ``"nvme"``, files under
    ``path``): ``("opt_state",)``, or ``("opt_state", "master_params")`` after ``amp_cast``.
    ``store`` overrides the store made from ``target``; ``workers``, ``max_inflight`` and
    ``o_direct`` configure the NVMe store (see :class:`~funcpar.offload.NvmeStore`).
    ``chunk_bytes``: update chunk by chunk, about that many bytes of state each, at most
    ``max_resident`` chunks in host memory at once; ``update_on``: ``"cpu"`` or ``"device"``
    (the params' device; see the module docstring). The returned transform has the store as
    ``.store`` (flush or close it when training ends) and the chunk counters as ``.stats``."""
    what = (what,) if isinstance(what, str) else tuple(what)
    known = {"opt_state", "master_params"}
    if not what or not set(what) <= known or "opt_state" not in what:
        raise ValueError(f"offload: what={what!r}; use ('opt_state',) or ('opt_state', "
                         "'master_params')")
    with_masters = "master_params" in what
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"offload: chunk_bytes must be >= 1 (or None), got {chunk_bytes}")
    if max_resident < 1:
        raise ValueError(f"offload: max_resident must be >= 1 chunk, got {max_resident}")
    if update_on not in ("cpu", "device"):
        raise ValueError(f"offload: update_on must be 'cpu' or 'device', got {update_on!r}")
    if store is None:
        if target == "cpu":
            store = CpuStore()
        elif target == "nvme":
            if path is None:
                raise ValueError("offload('nvme') needs path=, the directory for the files")
            store = NvmeStore(path, workers=workers, max_inflight=max_inflight,
                              o_direct=o_direct)
        else:
            raise ValueError(f"offload target must be 'cpu' or 'nvme', got {target!r}")
    stats = _Stats()

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if isinstance(state.opt_state, OffloadedState):
            raise ValueError("the optimizer state is already offloaded: apply offload once")
        if chunk_bytes is not None and getattr(step, "pipeline", None) is not None:
            raise ValueError("offload(chunk_bytes=...) after pipeline_split is not supported: "
                             "pipeline_split's optimizer wrapper hides the chain's clip, which "
                             "would then see one chunk at a time; use chunk_bytes=None")
        plan = _master_plan(step, state) if with_masters else None
        zero = step.partition
        inner = step.optimizer if zero is None else _zero_inner(step.optimizer)
        opt = offloaded(inner, store, prefix=prefix, min_numel=min_numel,
                        chunk_bytes=chunk_bytes, max_resident=max_resident,
                        update_on=update_on, masters=plan, stats=stats)
        # Keep the state as it is (a trained one too): store it as version 0. Under ZeRO the
        # state is this rank's parts already, and the masters stored are the parts of the
        # params (stages 1-2 hold them whole; stage 3 holds the parts).
        keep = GradientTransformation(lambda params: state.opt_state, None)
        own = state.params if zero is None or zero.stage == 3 else zero.to_parts(state.params)
        moved = offloaded(keep, store, prefix=prefix, min_numel=min_numel,
                          masters=plan).init(own)
        if zero is not None:
            # Inside the partition, as when offload is applied before zero_partition: each
            # rank's update (on the host) sees its parts, and the new params (the compute
            # copies, with masters) are gathered after it, on the params' device.
            opt = _partitioned(opt, zero)
        changes: dict[str, Any] = {"optimizer": opt}

        def plain_state(st: TrainState) -> TrainState:
            """``st`` with its optimizer state (and fp32 masters, as the params) read back
            from the store: the state the run would hold without offload, for
            :func:`funcpar.state.save` (which calls this through the step's optimizer)."""
            if not isinstance(st.opt_state, OffloadedState):
                return st
            params = st.params
            if plan is not None:
                if zero is not None and zero.stage < 3:
                    raise ValueError(
                        "save of a state with offloaded fp32 master params under "
                        f"zero_partition(stage={zero.stage}) is not supported: the store holds "
                        "this rank's parts of the masters, the checkpoint wants the whole "
                        "params; use stage 3, or offload the optimizer state alone")
                params = read_masters(params, st.opt_state, store, prefix=prefix)
            return st._replace(params=params,
                               opt_state=read_state(st.opt_state, store, prefix=prefix))

        opt.update.plain_state = plain_state  # what save looks for (a function attribute)
        params = state.params
        if plan is not None:
            dtype, flags = plan
            spec = tree_flatten(params)[1]
            params = tree_unflatten(spec, [p.to(dtype) if f else p
                                           for p, f in zip(tree_leaves(params), flags)])
            seen = [False]
            changes["overlap_grads"] = _upcast_overlap(step.overlap_grads, flags, seen)
            changes["sync_grads"] = _upcast_then(step.sync_grads, flags, seen)
        return (dataclasses.replace(step, **changes),
                state._replace(params=params, opt_state=moved))

    transform.store = store
    transform.stats = stats
    return transform


def _zero_inner(opt: GradientTransformation) -> GradientTransformation:
    """The optimizer that zero_partition's wrapper steps on each rank's parts."""
    fn = opt.update
    while fn is not None:  # on the checker's wrapper or on what it wraps
        inner = getattr(fn, "zero_inner", None)
        if inner is not None:
            return inner
        fn = getattr(fn, "__wrapped__", None)
    raise ValueError("offload after zero_partition needs zero_partition's optimizer as the "
                     "step's optimizer (offload sits inside the partition, on each rank's "
                     "parts); another transform wrapped it in between: apply offload right "
                     "after zero_partition (and amp_cast)")


def _master_plan(step: TrainStep, state: TrainState) -> tuple[torch.dtype, list[bool]]:
    """(compute dtype, which param leaves have their fp32 master offloaded)."""
    if step.precision is None:
        raise ValueError("offload(what=(..., 'master_params')) needs amp_cast applied first: "
                         "without it the params the step computes with are the float32 "
                         "masters themselves, so there is nothing to keep elsewhere (offload "
                         "what=('opt_state',) and keep the params resident)")
    if step.pipeline is not None:
        raise ValueError("offload(master_params) after pipeline_split is not supported: the "
                         "stages' gradient exchange and pipeline_split's optimizer wrapper "
                         "are not covered by the master-gradient upcast (not done); offload "
                         "what=('opt_state',) instead")
    keep = _amp_keep(step.apply_fn)
    named = named_leaves(state.params)
    if keep is None or len(keep) != len(named):
        raise ValueError("offload(master_params): cannot tell which leaves amp_cast keeps in "
                         "float32 (its apply_fn exposes no keep mask): apply offload right "
                         "after amp_cast")
    flags = [bool(torch.is_tensor(p) and p.dtype == torch.float32 and not k)
             for (_, p), k in zip(named, keep)]
    return _HALF[step.precision], flags


def _amp_keep(apply_fn: Callable) -> list[bool] | None:
    """amp_cast's per-leaf keep_fp32 mask from its apply function."""
    keep = getattr(apply_fn, "keep_fp32", None)
    return None if keep is None else [bool(k) for k in keep]


class _UpcastSync:
    """The gradients of the half-precision compute copies upcast to float32 before the step's
    own overlapped reduction (``inner``: data_parallel's bucketed mean, ZeRO-2/3's reduce-
    scatter, or none) sees them. Exact: in the in-memory amp run the same half-precision
    gradient reaches the float32 master leaf through amp_cast's cast backward, which upcasts
    it, and the reduction runs on that. The float32 copies made in ``ready`` are kept for
    ``finish`` (a GradSync may read any gradient there): until the backward ends a flagged
    entry's gradient takes 6 B (the autograd's bf16 one and this copy), 4 B in the in-memory
    run."""

    def __init__(self, inner: Any, flags: list[bool], seen: list[bool]):
        self.inner, self.flags, self.seen = inner, flags, seen
        self.up: dict[int, Tensor] = {}

    def ready(self, i: int, grad: Tensor) -> None:
        if self.inner is not None:
            self.up[i] = grad.float() if self.flags[i] else grad
            self.inner.ready(i, self.up[i])

    def finish(self, grads: Tree) -> Tree:
        leaves, spec = tree_flatten(grads)
        up = tree_unflatten(spec, [
            self.up[i] if i in self.up else g.float() if f and g is not None else g
            for i, (g, f) in enumerate(zip(leaves, self.flags))])
        self.up = {}
        self.seen[0] = True  # this step's gradients went through here (see _upcast_then)
        return up if self.inner is None else self.inner.finish(up)


def _upcast_overlap(factory: Callable[[list[Tensor]], Any] | None, flags: list[bool],
                    seen: list[bool]) -> Callable[[list[Tensor]], _UpcastSync]:
    """The step's ``overlap_grads`` with :class:`_UpcastSync` in front; the inner reduction is
    planned for float32 leaves (zero-stride stand-ins: shape and dtype, no memory), as in the
    in-memory run, so data_parallel's buckets are the same."""
    def overlap_grads(leaves: list[Tensor]) -> _UpcastSync:
        if factory is None:
            return _UpcastSync(None, flags, seen)
        like = [torch.empty((), dtype=torch.float32, device=p.device).expand(p.shape)
                if f else p for p, f in zip(leaves, flags)]
        return _UpcastSync(factory(like), flags, seen)
    return overlap_grads


def _upcast_then(sync: Callable[[Tree], Tree] | None, flags: list[bool],
                 seen: list[bool]) -> Callable:
    """The step's own ``sync_grads`` after a check that the gradients were upcast by
    :class:`_UpcastSync` (a data_parallel applied after offload replaces it, and its
    all-reduce would have run on the half-precision gradients: refused, not silently less
    precise), and the upcast again for a path without the hook (a no-op when done)."""
    def sync_grads(grads: Tree) -> Tree:
        if not seen[0]:
            raise ValueError("offload(master_params): the gradients reached sync_grads without "
                             "its float32 upcast; a transform applied after offload "
                             "(data_parallel?) replaced the step's overlap_grads and reduced "
                             "the half-precision gradients: apply offload last")
        seen[0] = False
        leaves, spec = tree_flatten(grads)
        up = tree_unflatten(spec, [g.float() if f and g is not None else g
                                   for g, f in zip(leaves, flags)])
        return up if sync is None else sync(up)
    return sync_grads


def _to(tree: Tree, device: Any) -> Tree:
    return tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x, tree)
