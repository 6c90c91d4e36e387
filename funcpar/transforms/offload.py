"""``offload``: the optimizer state kept in a tensor store (host memory or NVMe) between steps.

``step, state = offload("nvme", path="/scratch/run1")(step, state)`` moves
``state.opt_state`` into a :class:`~funcpar.offload.NvmeStore` under ``path`` (``"cpu"``: a
:class:`~funcpar.offload.CpuStore`, pinned when CUDA is available) and wraps the step's
optimizer, as ZeRO-Offload / ZeRO-Infinity do (Ren et al. 2021, arXiv 2101.06840; Rajbhandari
et al. 2021, arXiv 2104.07857) and Colossal-AI's Gemini does with its chunks. Each update:

1. reads the state in, leaf by leaf in flattening order, the store reading ahead (``prefetch``)
   of the leaf being taken through its bounded pool of buffers, each file's CRC-32 checked;
2. runs the wrapped optimizer's ``update`` on the CPU over the whole tree, so the result is the
   in-memory optimizer's to the bit (global clipping, name masks and step counts see the same
   tree); gradients and parameters on a GPU are copied to the host for it and the updates
   copied back, the parameters themselves stay where they are;
3. writes the new state behind: each leaf is copied into a store buffer and written by the
   store's threads while the step goes on (the next update's read of a leaf waits for its
   write).

**What ``state.opt_state`` holds.** An :class:`OffloadedState` ``(version, tree)``: ``version``
a 0-d int64 tensor counting the updates written, and ``tree`` the wrapped optimizer's state with
every stored leaf (a tensor of at least ``min_numel`` entries) replaced by a *meta* tensor of
the same shape and dtype, which takes no memory; smaller leaves (step counts, the 0-d
hyperparameters of :mod:`funcpar.optim.hyperparams`, so ``lr`` stays visible to the step's
metrics) stay in the tree as they are. It is a plain pytree of tensors that the step carries;
:func:`read_state` gives the whole state back (for a checkpoint, say).

**Versions keep the step pure.** Leaf ``i`` of version ``v`` is stored under the key
``<prefix>.r<rank>.<i>.<name>.s<v % 2>`` with tag ``v``: an update reads slot ``v % 2`` and
writes slot ``(v + 1) % 2``, so calling the step twice on one state reads the same data twice
(DESIGN principle 1). The store holds two copies of the state for that; a state older than the
last two versions is refused with a clear error (its slot was overwritten). One store directory
(and ``prefix``) per training run.

Composition: with :func:`~funcpar.transforms.zero_partition` in either order (the store then
holds this rank's parts: the rank is in every key, so ranks can share a directory) and with
:func:`~funcpar.transforms.data_parallel` and :func:`~funcpar.transforms.shard_params`, whose
layouts pass through to the wrapped optimizer unchanged.

Not done: offloading fp32 master parameters (``what=("params",)``), and an update streamed
leaf by leaf (or to a GPU chunk by chunk) that never holds the whole state at once: the
optimizer API updates a whole tree, so the state is whole in host memory during ``update``
(and only then).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from funcpar.offload.store import CpuStore, NvmeStore, TensorStore
from funcpar.optim.base import GradientTransformation
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, named_leaves, tree_flatten, tree_map, tree_unflatten
from funcpar.train.step import TrainStep

__all__ = ["OffloadedState", "offload", "offloaded", "read_state"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")


class OffloadedState(NamedTuple):
    """``version``: 0-d int64, updates written; ``tree``: the state, stored leaves as meta
    tensors (shape and dtype only)."""

    version: Tensor
    tree: Tree


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _key(prefix: str, rank: int, i: int, name: str, version: int) -> str:
    # The flat index makes the key unique; the name (made file-safe, shortened) says which
    # leaf a file holds to whoever looks at the directory or an error message.
    return f"{prefix}.r{rank}.{i:05d}.{_UNSAFE.sub('_', name)[:120]}.s{version % 2}"


def _stored(x: Any) -> bool:
    return torch.is_tensor(x) and x.is_meta


def offloaded(inner: GradientTransformation, store: TensorStore, *, prefix: str = "opt",
              min_numel: int = 2, rank: int | None = None) -> GradientTransformation:
    """``inner`` with its state in ``store`` between updates (see the module docstring)."""
    if min_numel < 1:
        raise ValueError(f"offloaded: min_numel must be >= 1, got {min_numel}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]*", prefix):
        raise ValueError(f"offloaded: prefix must be [A-Za-z0-9_-], got {prefix!r}")

    def save(tree: Tree, version: int) -> OffloadedState:
        r = _rank() if rank is None else rank
        spec, out = tree_flatten(tree)[1], []
        for i, (name, x) in enumerate(named_leaves(tree)):
            if torch.is_tensor(x) and not x.is_meta and x.numel() >= min_numel:
                store.put(_key(prefix, r, i, name, version), x, tag=version)  # written behind
                out.append(torch.empty(x.shape, dtype=x.dtype, device="meta"))
            else:
                out.append(x)
        return OffloadedState(torch.tensor(version, dtype=torch.int64), tree_unflatten(spec, out))

    def init(params: Tree) -> OffloadedState:
        return save(inner.init(params), 0)

    def update(grads: Tree, state: Any, params: Tree | None = None, *, layouts: Tree = None):
        if not isinstance(state, OffloadedState):
            raise TypeError(f"an offloaded optimizer takes an OffloadedState, got "
                            f"{type(state).__name__}: was the state built by this optimizer's "
                            "init (or the offload transform)?")
        tree = load(state, store, prefix=prefix, rank=rank)
        device = _device_of(grads)
        if device.type != "cpu":  # the update runs on the host, next to the state
            grads, params = _to(grads, "cpu"), _to(params, "cpu")
        updates, new = inner.update(grads, tree, params, layouts=layouts)
        if device.type != "cpu":
            updates = _to(updates, device)
        return updates, save(new, int(state.version) + 1)

    return GradientTransformation(init, update)


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


def read_state(opt_state: OffloadedState, store: TensorStore, *, prefix: str = "opt",
               rank: int | None = None) -> Tree:
    """The optimizer state that ``opt_state`` stands for, read back whole from ``store``."""
    store.flush()
    return load(opt_state, store, prefix=prefix, rank=rank)


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
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The transform keeping ``what`` (the optimizer state) on ``target`` (``"cpu"`` or
    ``"nvme"``, files under ``path``). ``store`` overrides the store made from ``target``;
    ``workers``, ``max_inflight`` and ``o_direct`` configure the NVMe store (see
    :class:`~funcpar.offload.NvmeStore`). The returned transform has the store as ``.store``
    (flush or close it when training ends)."""
    what = (what,) if isinstance(what, str) else tuple(what)
    if set(what) != {"opt_state"}:
        raise ValueError(f"offload: what={what!r}; only ('opt_state',) is implemented (fp32 "
                         "master parameters are not offloaded yet)")
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

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        if isinstance(state.opt_state, OffloadedState):
            raise ValueError("the optimizer state is already offloaded: apply offload once")
        opt = offloaded(step.optimizer, store, prefix=prefix, min_numel=min_numel)
        # Keep the state as it is (a trained one too): store it as version 0.
        moved = _adopt(state.opt_state, store, prefix, min_numel)
        return dataclasses.replace(step, optimizer=opt), state._replace(opt_state=moved)

    transform.store = store
    return transform


def _adopt(tree: Tree, store: TensorStore, prefix: str, min_numel: int) -> OffloadedState:
    """An existing state put into ``store`` as version 0 (what ``init`` would have done)."""
    keep = GradientTransformation(lambda params: tree, None)
    return offloaded(keep, store, prefix=prefix, min_numel=min_numel).init(None)


def _device_of(tree: Tree) -> torch.device:
    for x in tree_flatten(tree)[0]:
        if torch.is_tensor(x):
            return x.device
    return torch.device("cpu")


def _to(tree: Tree, device: Any) -> Tree:
    return tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x, tree)
