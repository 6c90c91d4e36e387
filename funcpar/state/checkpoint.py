"""Sharded, atomic, reshardable checkpoints of a whole :class:`~funcpar.state.TrainState`.

``save(state, path, step=step)`` writes every leaf of the state (params, buffers, optimizer
state, step, RNG, extras such as the loss scale and the data position); ``load(path, like,
step=step)`` reads it back into the layout of ``like`` (a fresh state built the same way as the
one to resume, under any mesh: the checkpoint is resharded from global slices).

**Format** (``FORMAT``, our own; see docs/CHECKPOINTS.md). A checkpoint is a directory::

    path/rank00000.safetensors   each rank's tensors, keyed by the leaf's dotted name
    path/rank00001.safetensors   ...
    path/index.json              rank 0: per leaf, its kind, global shape, dtype, split spec and
                                 which file holds which global slice; per file, size+sha256
    path/COMPLETE                rank 0, written last: the sha256 of index.json

torch.distributed.checkpoint was not used: our layouts nest ZeRO's ``dp`` inside ``tp`` on one
dim (not DTensor's mesh order, its ``_StridedShard``) and split fused projections blockwise,
neither of which DCP's planner reshards, and its per-directory commit is not atomic against a
kill. A leaf is stored in one of three *kinds*:

* ``sharded``: a parameter, or an optimizer-state leaf that mirrors its parameter's layout (the
  same local shape: moments; a dim reduced to 1: ``torch.optim.Adafactor``'s ``row_var`` /
  ``col_var``; one dim fewer: Adafactor / CAME's factored ``*_row`` / ``*_col`` statistics,
  whose layout keeps the parameter's splits on the kept dims and replicates over the axes of
  the dropped one). Each distinct shard is written once, by the lowest rank holding it (its
  replicas over the axes that do not split the leaf skip it), with its per-dim
  ``(start, length)`` inside each block;
* ``replicated``: anything else that is identical on every rank holding it (checked at save
  time by a digest gathered from all ranks): counts, hyperparameters, step, RNG, extras,
  buffers, states of parameters that are whole everywhere. Its first holder writes it;
* ``per_rank``: a leaf that differs between its holders but does not map to a global slice
  (8-bit quantized blocks and GaLore's low-rank states of a sharded parameter). Every holder
  writes its own; it loads only into the same mesh (other layouts are refused naming the leaf).

**Ranks that hold different leaves.** Every leaf is named globally - ``params.<the module's
dotted name>``, ``opt_state.<path with that name>`` - and the plan of who writes what is made
from every rank's list of leaves (gathered first), so a rank need not hold every leaf: under
``pipeline_split`` each rank holds its stages' leaves, the checkpoint gets the union, each
leaf once with its whole (logical) shape, and a weight tied between two stages once (from its
first holder; the copies hold the same bits). Nothing here knows about pipelines: a load into
any layout takes, on each rank, the leaves that rank's ``like`` holds, and a leaf of the
checkpoint that no rank takes is refused.

Under ``zero_partition`` the optimizer state lives on the ZeRO parts, so its leaves take the
layouts of ``step.partition.layouts``; otherwise those of ``step.layouts``.

**Atomicity.** All ranks write into ``.<name>.partial`` beside ``path``; each file is fsynced;
rank 0 writes the index and ``COMPLETE`` last, fsyncs the directory, then renames it into
place (an existing checkpoint at ``path`` is first renamed to ``.<name>.old`` and removed after).
A save killed at any point leaves the previous checkpoint at ``path`` (or, in the instant
between the two renames, at ``.<name>.old``, which :func:`load`'s error names). A directory
without ``COMPLETE``, or whose index or files do not match their checksums, is refused. The
index is checked for structure before use (:func:`_check_index`): only plain file names it
lists are opened, and a malformed one is a :class:`CheckpointError`. The checksums give
integrity, not authenticity: whoever can write the directory can recompute them.

**Loading** checks the fit first on every rank (names, kinds, global shapes) and exchanges the
verdicts, so a misfit raises on every rank together; then it assembles each leaf's global
tensor from the shards that hold it (one leaf at a time: peak extra memory is one whole leaf)
and cuts this rank's shard under the new layout.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from funcpar.state.donation import check_not_donated
from funcpar.state.train_state import TrainState
from funcpar.state.tree import (
    NAMESPACE,
    Tree,
    leaves_like,
    named_leaves,
    path_name,
    tree_flatten,
    tree_unflatten,
)

__all__ = [
    "FORMAT",
    "CheckpointError",
    "export_params",
    "latest_checkpoint",
    "leaf_layouts",
    "load",
    "read_index",
    "save",
]

FORMAT = "funcpar-checkpoint/2"
#: Formats load reads: /1 kept every replicated leaf in rank 0's file.
READABLE = ("funcpar-checkpoint/1", FORMAT)
INDEX = "index.json"
COMPLETE = "COMPLETE"
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: half-written, corrupt, or of another model/layout."""


# ------------------------------------------------------------------------------ distributed
def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def _gather(obj: Any) -> list[Any]:
    dist = _dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (how an error found on rank 0 reaches every rank)."""
    dist = _dist()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------ leaf layouts
def _layout_type() -> Any:
    from funcpar.shard.layout import Layout  # funcpar.shard sits above state: import lazily

    return Layout


def _reduced_layout(lay: Any, keep: list[int], ones: list[int], name: str) -> Any:
    """``lay`` restricted to the dims ``keep`` (in order); dims in ``ones`` become size 1 whole."""
    Layout = _layout_type()
    shape, axes, blocks = [], [], []
    for d in keep:
        whole = d in ones
        shape.append(1 if whole else lay.global_shape[d])
        axes.append(() if whole else lay.dim_axes[d])
        blocks.append(1 if whole else lay.dim_blocks[d])
    return Layout._make(lay.mesh, tuple(shape), tuple(axes), name, tuple(blocks))


def _state_leaf_layout(name: str, x: Any, lay: Any) -> Any:
    """The layout of optimizer-state leaf ``x`` of a parameter with layout ``lay``, or None
    when ``x`` does not map to a slice of a global tensor (see the module docstring)."""
    if lay is None or not torch.is_tensor(x) or not x.is_floating_point():
        return None
    local, shape, nd = lay.local_shape(), tuple(x.shape), len(lay.global_shape)
    cand = None
    if shape == local:
        cand = lay.named(name)
    elif len(shape) == nd and nd and all(a == b or (a == 1 and b != 1)
                                         for a, b in zip(shape, local)):
        ones = [d for d in range(nd) if shape[d] == 1 and local[d] != 1]
        cand = _reduced_layout(lay, list(range(nd)), ones, name)
    elif len(shape) == nd - 1 and nd >= 2:
        key = name.rsplit(".", 1)[-1].lower()
        drops = [d for d in (nd - 1, nd - 2)
                 if shape == local[:d] + local[d + 1:]]
        if len(drops) == 2:  # square local shape: the state's name says which dim it reduces
            drops = [nd - 1] if "row" in key else [nd - 2] if "col" in key else []
        if len(drops) == 1:
            d = drops[0]
            cand = _reduced_layout(lay, [k for k in range(nd) if k != d], [], name)
    if cand is None or cand.local_shape() != shape:
        return None
    return cand


def _is_params_like(node: Any, spec: Any) -> bool:
    if node is None or torch.is_tensor(node):
        return spec.num_leaves == 1 and spec.num_nodes == 1 and torch.is_tensor(node)
    try:
        spec.flatten_up_to(node)
    except (ValueError, TypeError):
        return False
    return True


def leaf_layouts(state: TrainState, *, step: Any = None, layouts: Tree = None) -> dict[str, Any]:
    """``{dotted name: Layout or None}`` for every leaf of ``state`` (None: not a slice).

    ``step`` (a :class:`~funcpar.train.TrainStep`) gives ``layouts`` and, under
    ``zero_partition``, the parts' layouts of the optimizer state; or pass ``layouts`` (of
    ``state.params``) alone for an unpartitioned run.
    """
    Layout = _layout_type()
    from funcpar.shard.layout import with_leaf_names

    plan = None
    if step is not None:
        if layouts is not None:
            raise ValueError("pass step= or layouts=, not both (step carries its layouts)")
        layouts, plan = step.layouts, step.partition
    params = state.params
    p_names = [n for n, _ in named_leaves(params)]
    p_lays = leaves_like(params, with_leaf_names(layouts) if layouts is not None else None,
                         what="layouts", against="state.params")
    for n, lay in zip(p_names, p_lays):
        if lay is not None and not isinstance(lay, Layout):
            raise TypeError(f"layouts[{n!r}] must be a Layout or None, got {lay!r}")
    o_lays = list(plan.layouts) if plan is not None else p_lays
    if len(o_lays) != len(p_names):
        raise ValueError(f"the ZeRO plan has {len(o_lays)} leaves but state.params "
                         f"{len(p_names)}")
    out: dict[str, Any] = {}
    for n, lay in zip(p_names, p_lays):
        out[f"params.{n}" if n else "params"] = lay.named(f"params.{n}") if lay else None

    spec = tree_flatten(params)[1]
    # Sub-trees of the optimizer state shaped like params (exp_avg, a dict per leaf of
    # Adafactor statistics, ...) are cut at their params-level nodes; each leaf under the
    # node for parameter i takes its layout from parameter i's.
    paths, nodes, _ = optree.tree_flatten_with_path(
        state.opt_state, is_leaf=lambda t: _is_params_like(t, spec), none_is_leaf=True,
        namespace=NAMESPACE)
    for path, node in zip(paths, nodes):
        prefix = "opt_state" + ("." + path_name(path) if path else "")
        if not _is_params_like(node, spec):
            out[prefix] = None
            continue
        for i, sub in enumerate(spec.flatten_up_to(node)):
            for sub_name, x in named_leaves(sub):
                name = ".".join(s for s in (prefix, p_names[i], sub_name) if s)
                out[name] = _state_leaf_layout(name, x, o_lays[i])
    return out


# ------------------------------------------------------------------------------ file helpers
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: str, *, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _digest(x: Tensor) -> str:
    t = x.detach().to("cpu").contiguous().reshape(-1)
    h = hashlib.sha1(str((tuple(x.shape), str(x.dtype))).encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _owned(x: Tensor, seen: set[int]) -> Tensor:
    """A contiguous CPU tensor that shares storage with no other saved one (safetensors
    refuses shared storage)."""
    t = x.detach().to("cpu")
    ptr = t.untyped_storage().data_ptr()
    if (not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes
            or (ptr in seen and t.nbytes)):
        t = t.clone(memory_format=torch.contiguous_format)
    seen.add(t.untyped_storage().data_ptr())
    return t


def _rank_file(r: int) -> str:
    return f"rank{r:05d}.safetensors"


def _siblings(path: str) -> tuple[str, str, str]:
    path = os.path.abspath(path)
    parent, base = os.path.split(path.rstrip(os.sep))
    return path, os.path.join(parent, f".{base}.partial"), os.path.join(parent, f".{base}.old")


def _named(state: TrainState) -> list[tuple[str, Any]]:
    """``(name, leaf)`` in flattening order, named by field (``params.<leaf>``,
    ``opt_state.<path>``, ``step``, ``rng``, ``extras.<key>``) rather than tuple index."""
    out = []
    for field in TrainState._fields:
        for n, x in named_leaves(getattr(state, field)):
            out.append((f"{field}.{n}" if n else field, x))
    return out


def _json_value(name: str, x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"checkpoint: leaf {name!r} is a {type(x).__name__}; a state's leaves must "
                    "be tensors, None or plain numbers/strings")


def _held(name: str, x: Any, lay: Any) -> dict[str, Any]:
    """What this rank holds of leaf ``name``, as every rank tells the others before a save:
    a sharded leaf's layout and slice, another tensor's shape and digest, a plain value."""
    if not torch.is_tensor(x):
        try:
            return {"kind": "value", "value": _json_value(name, x)}
        except TypeError as err:  # raised by every rank after the gather, not by this one alone
            return {"kind": "invalid", "error": str(err)}
    if x.is_meta:  # no data here to save: refused on every rank, naming where it lives
        return {"kind": "invalid", "error": (
            f"checkpoint: leaf {name!r} is a meta tensor (shape {tuple(x.shape)}), which holds "
            "no data: an optimizer state moved out by the offload transform lives in its "
            "store (pass step=, the offloaded step, and save reads it from there; or read it "
            "with funcpar.transforms.offload.read_state; docs/OFFLOAD.md), and a "
            "lazily-initialized state must be materialized first")}
    dtype = str(x.dtype).removeprefix("torch.")
    if lay is not None:
        return {"kind": "sharded", "dtype": dtype, "global_shape": list(lay.global_shape),
                "spec": [list(a) for a in lay.dim_axes], "blocks": list(lay.dim_blocks),
                "slice": [list(iv) for iv in lay._intervals(None)]}
    return {"kind": "tensor", "dtype": dtype, "shape": list(x.shape), "digest": _digest(x)}


class _SavePlan(NamedTuple):
    """Per leaf (union over ranks, first-held order): its index record (shards' files
    included) and the ranks that write it; the same on every rank (computed from what every
    rank holds)."""

    records: dict[str, dict[str, Any]]
    writers: dict[str, list[int]]


def _plan_save(every: list[dict[str, dict[str, Any]]]) -> _SavePlan:
    """Who writes what (see :func:`save`). ValueError, naming the leaf and the ranks, when the
    holders of a leaf disagree on what it is (sharded on one, whole on another; another global
    shape or split)."""
    order = list(dict.fromkeys(n for held in every for n in held))
    records: dict[str, dict[str, Any]] = {}
    writers: dict[str, list[int]] = {}
    for name in order:
        holders = [r for r, held in enumerate(every) if name in held]
        first = every[holders[0]][name]
        bad = next((every[r][name] for r in holders if every[r][name]["kind"] == "invalid"),
                   None)
        if bad is not None:
            raise TypeError(bad["error"])
        kinds = {every[r][name]["kind"] for r in holders}
        if len(kinds) > 1:
            raise ValueError(
                f"checkpoint: leaf {name!r} is held as " + ", ".join(
                    f"{every[r][name]['kind']} on rank {r}" for r in holders)
                + ": its holders must agree (a layout on every holder or on none)")
        if first["kind"] == "value":
            records[name] = {"kind": "value", "value": first["value"]}
            continue
        if first["kind"] == "sharded":
            keys = ("global_shape", "spec", "blocks", "dtype")
            for r in holders:
                if any(every[r][name][k] != first[k] for k in keys):
                    raise ValueError(
                        f"checkpoint: leaf {name!r} is sharded as "
                        f"{[first[k] for k in keys]} on rank {holders[0]} but as "
                        f"{[every[r][name][k] for k in keys]} on rank {r} (global shape, "
                        "split axes, blocks, dtype)")
            # Each distinct slice once, by the lowest rank holding it: replicas over the axes
            # that do not split the leaf, and the second holder of a tied weight, skip it.
            by_slice: dict[str, int] = {}
            for r in holders:
                by_slice.setdefault(json.dumps(every[r][name]["slice"]), r)
            rec = {k: first[k] for k in ("kind", "dtype", "global_shape", "spec", "blocks")}
            rec["shards"] = [{"file": _rank_file(r), "slice": json.loads(sl)}
                             for sl, r in by_slice.items()]
            records[name], writers[name] = rec, sorted(by_slice.values())
        elif all(every[r][name]["digest"] == first["digest"] for r in holders):
            records[name] = {"kind": "replicated", "dtype": first["dtype"],
                             "global_shape": first["shape"], "file": _rank_file(holders[0])}
            writers[name] = [holders[0]]
        else:
            shapes: list[list[int] | None] = [None] * len(every)
            for r in holders:
                shapes[r] = every[r][name]["shape"]
            records[name] = {"kind": "per_rank", "dtype": first["dtype"], "shapes": shapes}
            writers[name] = holders
    return _SavePlan(records, writers)


def _mesh_of(step: Any, lays: Mapping[str, Any]) -> Any:
    """The run's mesh: the layouts', else the pipeline's (pp alone lays out no leaf)."""
    mesh = next((lay.mesh for lay in lays.values() if lay is not None), None)
    pipeline = getattr(step, "pipeline", None)
    if mesh is None and pipeline is not None:
        mesh = pipeline.mesh
    return mesh


def _mesh_sizes(mesh: Any) -> dict[str, int] | None:
    return {a: mesh.size(a) for a in mesh.axis_names} if mesh is not None else None


# ------------------------------------------------------------------------------------- save
def save(
    state: TrainState,
    path: str | os.PathLike,
    *,
    step: Any = None,
    layouts: Tree = None,
    extra_meta: Mapping[str, Any] | None = None,
    on_file: Callable[[str], None] | None = None,
) -> str:
    """Write ``state`` to the checkpoint directory ``path``, sharded and atomically.

    A collective: every rank calls it with its own shards (under ``pipeline_split``: its
    stages' leaves). ``step`` (the composed :class:`~funcpar.train.TrainStep`) gives the
    params' layouts, the ZeRO plan and the pipeline's stages (recorded in the index); or pass
    ``layouts`` (of ``state.params``) for an unpartitioned run; neither for a single process.
    Holders of one leaf that disagree on its layout are a ValueError naming the leaf and the
    ranks, raised on every rank before anything is written. Under ``offload`` pass the
    offloaded ``step``: the optimizer state (and fp32 masters) are read back from its store and
    saved as a run without offload holds them (load into a state built without offload, then
    apply offload); without it a meta leaf is refused (TypeError naming it and offload).
    ``extra_meta`` (JSON-able) is stored in the index (:func:`read_index`). ``on_file(path)`` is
    called after each file is written and fsynced (progress; tests use it to kill a save
    midway). An existing checkpoint at ``path`` is replaced only once the new one is complete.
    Returns the absolute path.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if not isinstance(state, TrainState):
        raise TypeError(f"save takes a TrainState, got {type(state).__name__}")
    check_not_donated(state, "save")  # a consumed state's storage holds the next step's values
    final, tmp, old = _siblings(os.fspath(path))
    rank, world = _rank_world()
    # Leaves kept out of memory by the step (offload's store) are read back by it: the
    # offloaded optimizer's update carries ``plain_state``, the state as it would be without
    # offload, which is what the checkpoint holds (load it into a state built without offload).
    plain = getattr(getattr(getattr(step, "optimizer", None), "update", None), "plain_state",
                    None)
    if plain is not None:
        state = plain(state)
    lays = leaf_layouts(state, step=step, layouts=layouts)
    leaves = _named(state)
    # Every rank's view of its leaves first (under a pipeline each holds only its stages'), so
    # that every rank computes the same plan - or the same error, before anything is written.
    every = _gather({name: _held(name, x, lays.get(name)) for name, x in leaves})
    plan = _plan_save(every)
    meta_err = None
    if extra_meta is not None:
        try:
            json.dumps(dict(extra_meta))
        except TypeError as err:
            meta_err = f"extra_meta is not JSON-serialisable: {err}"
    if rank == 0 and meta_err is None:
        # A directory holding only what a save writes (a damaged checkpoint: index or marker
        # deleted, a rank file missing) is replaced like an intact one; anything else there
        # (a file a save never writes) means it is not ours to delete.
        foreign = (sorted(set(os.listdir(final)) - set(_checkpoint_files(final)))
                   if os.path.isdir(final) and not os.path.exists(os.path.join(final, INDEX))
                   else [])
        if os.path.exists(final) and not os.path.isdir(final):
            meta_err = f"{final} exists and is not a directory; refusing to replace it"
        elif foreign:
            meta_err = (f"{final} exists and is not a funcpar checkpoint (it holds "
                        f"{foreign[:3]}, which a save never writes); refusing to replace it")
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # a killed save's leftovers
            try:
                os.makedirs(tmp)
            except OSError as err:
                meta_err = CheckpointError(f"cannot write checkpoint {final} (creating {tmp}: "
                                           f"{_cause(err)})")
    meta_err = _broadcast(meta_err)
    if isinstance(meta_err, CheckpointError):
        raise meta_err
    if meta_err is not None:
        raise ValueError(meta_err)

    writes = [name for name, x in leaves if torch.is_tensor(x) and name in plan.writers
              and rank in plan.writers[name]]
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    by_name = dict(leaves)
    for name in writes:
        tensors[name] = _owned(by_name[name], seen)
    fname = _rank_file(rank)
    fpath = os.path.join(tmp, fname)
    file_info, failed = None, None
    try:
        save_file(tensors, fpath, metadata={"format": FORMAT, "rank": str(rank)})
        file_info = {"size": os.path.getsize(fpath), "sha256": _sha256_file(fpath, fsync=True)}
    except (OSError, RuntimeError, SafetensorError) as err:  # safetensors' own for I/O
        failed = f"{f'rank {rank}: ' if world > 1 else ''}writing {fpath}: {_cause(err)}"
    tensors.clear()
    if file_info is not None and on_file is not None:
        on_file(fpath)

    # Every rank learns whether any rank failed, so that all raise together (no rank left
    # waiting in the next collective) and rank 0 removes the partial directory.
    gathered = _gather((file_info, failed))
    failed = next((f for _, f in gathered if f is not None), None)
    if failed is None and rank == 0:
        try:
            _commit(state, step, lays, plan, [fi for fi, _ in gathered], extra_meta, world,
                    final, tmp, old, on_file)
        except OSError as err:
            failed = _cause(err)
    failed = _broadcast(failed)
    if failed is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final} ({failed}); the partial "
                              "checkpoint was removed, earlier checkpoints are untouched")
    _barrier()
    return final


def _cause(err: BaseException) -> str:
    """An I/O failure in words: the errno's name and text where there is one (ENOSPC, EDQUOT,
    EFBIG, EROFS, EACCES, EIO ...), else the message."""
    if isinstance(err, OSError) and err.errno:
        return f"{errno.errorcode.get(err.errno, err.errno)}: {os.strerror(err.errno)}"
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    # safetensors says "I/O error: File too large (os error 27)": name the errno too.
    code = re.search(r"os error (\d+)\)", text)
    if code and int(code.group(1)) in errno.errorcode:
        return f"{errno.errorcode[int(code.group(1))]}: {text}"
    return text


def _commit(state: TrainState, step: Any, lays: Mapping[str, Any], plan: _SavePlan,
            files: list[dict[str, Any]], extra_meta: Mapping[str, Any] | None, world: int,
            final: str, tmp: str, old: str, on_file: Callable[[str], None] | None) -> None:
    """Rank 0: the index and the marker into ``tmp``, then ``tmp`` renamed to ``final``."""
    pipeline = getattr(step, "pipeline", None)
    index: dict[str, Any] = {
        "format": FORMAT,
        "world_size": world,
        "mesh": _mesh_sizes(_mesh_of(step, lays)),
        "step": int(state.step) if torch.is_tensor(state.step) else None,
        "leaves": plan.records,
        "files": {_rank_file(r): fi for r, fi in enumerate(files)},
        "extra_meta": dict(extra_meta or {}),
    }
    if pipeline is not None:  # for the reader: which blocks each stage ran
        index["pipeline"] = {"axis": pipeline.axis, "stages": pipeline.plan.n_stages,
                             "blocks": [list(r) for r in pipeline.plan.ranges]}
    text = json.dumps(index, indent=1)
    _write_text(os.path.join(tmp, INDEX), text)
    if on_file is not None:
        on_file(os.path.join(tmp, INDEX))
    _write_text(os.path.join(tmp, COMPLETE),
                hashlib.sha256(text.encode()).hexdigest() + "\n")
    _fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------- load
def read_index(path: str | os.PathLike, *, verify_files: bool = True) -> dict[str, Any]:
    """The checkpoint's index, after checking that it is complete, intact and well-formed.

    Raises :class:`CheckpointError` for a missing directory (naming the ``.old`` copy an
    interrupted replacement left), a missing ``COMPLETE`` marker (a half-written save), a
    missing or unreadable index, an index whose sha256 is not the marker's, a malformed index
    (not JSON, a key missing or of the wrong type, a file name that is not a plain name inside
    the checkpoint directory, a shard outside its leaf: :func:`_check_index`), or
    (``verify_files``) a rank file missing or of another size or sha256.

    The marker's sha256 detects damage (integrity), not tampering: whoever can write the
    directory can recompute it. The checks on the index's contents make a tampered index fail
    cleanly (no file outside the directory is read), not be detected.
    """
    final, _, old = _siblings(os.fspath(path))
    if not os.path.isdir(final):
        hint = ""
        if os.path.isdir(old):
            hint = f"; a save interrupted while replacing it left the previous one at {old}"
        raise CheckpointError(f"no checkpoint at {final}{hint}")
    marker = os.path.join(final, COMPLETE)
    if not os.path.exists(marker):
        raise CheckpointError(
            f"{final} has no {COMPLETE} marker: it is half-written (a save was interrupted) "
            "or not a funcpar checkpoint; refusing to load it")
    if not os.path.isfile(os.path.join(final, INDEX)):
        raise CheckpointError(f"{final} has a {COMPLETE} marker but no {INDEX}: the checkpoint "
                              "is damaged (its index was deleted or lost)")
    try:
        with open(os.path.join(final, INDEX), "rb") as f:
            raw = f.read()
        with open(marker) as f:
            want = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{final}: cannot read {INDEX} or {COMPLETE}: {err}") from err
    got = hashlib.sha256(raw).hexdigest()
    if got != want:
        raise CheckpointError(f"{final}/{INDEX} is corrupt: sha256 {got[:16]}... but "
                              f"{COMPLETE} records {want[:16]}...")
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{final}/{INDEX} is not valid JSON: {err}") from err
    if not isinstance(index, dict):
        raise CheckpointError(f"{final}/{INDEX} holds a {type(index).__name__}, not an object")
    if index.get("format") not in READABLE:
        raise CheckpointError(f"{final}: format {index.get('format')!r}, expected {FORMAT!r}")
    _check_index(final, index)
    if verify_files:
        _check_files(final, index, digest=True)
    return index


def _check_files(final: str, index: dict[str, Any], *, digest: bool) -> None:
    """Every rank file of ``index`` present with its recorded size (and ``digest``: sha256)."""
    for fname, fi in index["files"].items():
        fp = os.path.join(final, fname)
        if not os.path.isfile(fp):
            raise CheckpointError(f"{final}: file {fname} is missing")
        size = os.path.getsize(fp)
        if size != fi["size"] or (digest and _sha256_file(fp) != fi["sha256"]):
            raise CheckpointError(f"{final}: file {fname} is corrupt (size {size}, "
                                  f"expected {fi['size']}, or its sha256 differs)")


def _plain_name(name: Any) -> bool:
    """A file name that can only mean a file directly inside the checkpoint directory."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and "/" not in name and os.sep not in name
            and (os.altsep is None or os.altsep not in name))


def _ints(x: Any, n: int | None = None, low: int = 0) -> bool:
    """``x`` is a list of ints >= ``low`` (of length ``n`` when given); bools are not ints."""
    return (isinstance(x, list) and (n is None or len(x) == n)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in x))


def _check_index(final: str, index: dict[str, Any]) -> None:
    """CheckpointError naming the index and what is wrong, for any index :func:`load` could
    not read cleanly: so that a damaged or hand-edited index never surfaces as a KeyError or
    TypeError mid-load, and no file name in it reaches outside the checkpoint directory."""
    where = f"{final}/{INDEX}"

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is malformed: {what}")

    ws = index.get("world_size")
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise bad(f"'world_size' is {ws!r}, not a positive int")
    st = index.get("step")
    if st is not None and (not isinstance(st, int) or isinstance(st, bool)):
        raise bad(f"'step' is {st!r}, not an int or null")
    for key in ("leaves", "files"):
        if not isinstance(index.get(key), dict):
            raise bad(f"{key!r} is {type(index.get(key)).__name__}, not an object")
    if not isinstance(index.get("extra_meta", {}), dict):
        raise bad("'extra_meta' is not an object")
    if index.get("mesh") is not None and not isinstance(index["mesh"], dict):
        raise bad("'mesh' is not an object or null")
    files = index["files"]
    for fname, fi in files.items():
        if not _plain_name(fname):
            raise bad(f"file name {fname!r} is not a plain name inside the checkpoint "
                      "directory (no path separators, '.' or '..')")
        if not (isinstance(fi, dict) and _ints([fi.get("size")])
                and isinstance(fi.get("sha256"), str)):
            raise bad(f"files[{fname!r}] is {fi!r}, not {{'size': int, 'sha256': str}}")

    def known(name: str, fname: Any) -> None:
        if fname not in files:
            raise bad(f"leaf {name!r} names file {fname!r}, which is not one of the "
                      f"checkpoint's files {sorted(files)}")

    for name, rec in index["leaves"].items():
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "value":
            if "value" not in rec:
                raise bad(f"leaf {name!r} (a value) has no 'value'")
            continue
        if kind not in ("sharded", "replicated", "per_rank"):
            raise bad(f"leaf {name!r} has kind {kind!r}; expected value, sharded, replicated "
                      "or per_rank")
        if not isinstance(rec.get("dtype"), str):
            raise bad(f"leaf {name!r} has no dtype string")
        if kind == "per_rank":
            shapes = rec.get("shapes")
            if not (isinstance(shapes, list)
                    and all(s is None or _ints(s) for s in shapes)):
                raise bad(f"leaf {name!r} (per_rank) has shapes {shapes!r}, not a list of "
                          "int lists or nulls")
            continue
        shape = rec.get("global_shape")
        if not _ints(shape):
            raise bad(f"leaf {name!r} has global_shape {shape!r}, not a list of ints >= 0")
        if kind == "replicated":
            known(name, rec.get("file", _rank_file(0)))
            continue
        nd = len(shape)
        blocks = rec.get("blocks")
        if not _ints(blocks, nd, 1) or any(s % k for s, k in zip(shape, blocks)):
            raise bad(f"leaf {name!r} has blocks {blocks!r}, not {nd} ints that divide its "
                      f"global shape {shape}")
        shards = rec.get("shards")
        if not isinstance(shards, list) or not shards:
            raise bad(f"leaf {name!r} (sharded) has no list of shards")
        for sh in shards:
            if not isinstance(sh, dict):
                raise bad(f"leaf {name!r} has shard {sh!r}, not an object")
            known(name, sh.get("file"))
            slc = sh.get("slice")
            if not (isinstance(slc, list) and len(slc) == nd
                    and all(_ints(iv, 2) and iv[0] + iv[1] <= s // k
                            for iv, s, k in zip(slc, shape, blocks))):
                raise bad(f"leaf {name!r} has shard slice {slc!r}, not {nd} [start, length] "
                          f"pairs inside its blocks of {shape} / {blocks}")


def _block_view(t: Tensor, blocks: list[int], slc: list[list[int]]) -> Tensor:
    """The view of global ``t`` holding a shard: per dim, ``[start, start + n)`` of each of
    the dim's blocks (dims are kept unflattened as (blocks, n) pairs so it stays a view)."""
    for d, (k, (start, n)) in enumerate(zip(blocks, slc)):
        t = t.unflatten(2 * d, (k, -1)).narrow(2 * d + 1, start, n)
    return t


def _assemble(rec: dict[str, Any], name: str, read: Callable[[str, str], Tensor]) -> Tensor:
    shape = rec["global_shape"]
    out = None
    covered = 0
    for sh in rec["shards"]:
        part = read(sh["file"], name)
        if out is None:
            out = torch.empty(shape, dtype=part.dtype)
        pairs = [s for k, (_, n) in zip(rec["blocks"], sh["slice"]) for s in (k, n)]
        if part.numel() != math.prod(pairs) or part.dtype != out.dtype:
            raise CheckpointError(f"checkpoint leaf {name!r}: the shard in {sh['file']} has "
                                  f"{part.numel()} {part.dtype} elements, its index slice "
                                  f"{sh['slice']} takes {math.prod(pairs)} {out.dtype}")
        _block_view(out, rec["blocks"], sh["slice"]).copy_(part.reshape(pairs))
        covered += part.numel()
    total = 1
    for s in shape:
        total *= s
    if out is None or covered != total:
        raise CheckpointError(f"checkpoint leaf {name!r}: its shards cover {covered} of "
                              f"{total} elements (global shape {tuple(shape)})")
    return out


def _fit_error(final: str, index: dict[str, Any], names: list[str], leaves: list[Any],
               lays: Mapping[str, Any], rank: int, world: int,
               here: dict[str, int] | None) -> str | None:
    """Why this rank's part of ``like`` does not fit the checkpoint (the first reason), or
    None: a leaf the checkpoint lacks, a value where a tensor is (or back), another global
    shape, a ``per_rank`` leaf on another mesh or local shape."""
    saved = index["leaves"]
    missing = [n for n in names if n not in saved]
    if missing:
        what = ("optimizer (or optimizer settings)" if missing[0].startswith("opt_state")
                else "model")
        return (f"checkpoint {final} has no leaf {missing[0]!r} (of {len(missing)} missing); "
                f"it was saved from another {what}")
    for n, x in zip(names, leaves):  # shapes first, before any tensor is read
        rec = saved[n]
        if not torch.is_tensor(x):
            if rec["kind"] != "value":
                return f"checkpoint leaf {n!r} is a tensor but the state's is {x!r}"
            continue
        if rec["kind"] == "value":
            return (f"checkpoint leaf {n!r} is {rec['value']!r} but the state's is a tensor of "
                    f"shape {tuple(x.shape)}")
        if rec["kind"] == "per_rank":
            same = index["world_size"] == world and index["mesh"] == here
            shape = rec["shapes"][rank] if rank < len(rec["shapes"]) else None
            if not same or shape is None or tuple(shape) != tuple(x.shape):
                return (f"checkpoint leaf {n!r} was saved per rank (it maps to no global slice: "
                        f"e.g. 8-bit blocks or a low-rank state of a sharded parameter), so it "
                        f"loads only into the mesh it was saved from ({index['mesh']}, world "
                        f"{index['world_size']}, this rank's shape "
                        f"{None if shape is None else tuple(shape)}); here: mesh {here}, world "
                        f"{world}, shape {tuple(x.shape)}")
            continue
        want = tuple(lays[n].global_shape) if lays.get(n) is not None else tuple(x.shape)
        if tuple(rec["global_shape"]) != want:
            what = "optimizer state" if n.startswith("opt_state") else "model shape"
            return (f"checkpoint leaf {n!r} has global shape {tuple(rec['global_shape'])} but "
                    f"the state's is {want}: the checkpoint is of another {what}")
    return None


def load(
    path: str | os.PathLike,
    like: TrainState,
    *,
    step: Any = None,
    layouts: Tree = None,
    verify_files: bool = True,
) -> TrainState:
    """The checkpoint at ``path`` as a state laid out like ``like`` (a collective).

    ``like`` is a state built the way the run builds it (same model, optimizer and transforms,
    any values): its structure, this rank's local shapes, dtypes and devices are kept, its values
    replaced. ``step``/``layouts`` describe ``like`` as for :func:`save`; the checkpoint may
    come from any other mesh and layout (resharded from the saved global slices; a pipeline's
    ranks each take their stages' leaves), except for ``per_rank`` leaves, which need the mesh
    they were saved from. Tensors are cast to ``like``'s dtypes.

    Before any tensor is read every rank checks its part of ``like`` against the index and the
    ranks exchange verdicts, so a misfit raises :class:`CheckpointError` on every rank at once
    (naming the rank that found it when there are several): a leaf the checkpoint lacks
    (another model or optimizer), a leaf no rank of ``like`` holds, another global shape (both
    shapes named), a ``per_rank`` leaf on another mesh.
    """
    from safetensors import SafetensorError, safe_open

    if not isinstance(like, TrainState):
        raise TypeError(f"load takes a TrainState to fill (like=), got {type(like).__name__}")
    final = _siblings(os.fspath(path))[0]
    rank, world = _rank_world()
    err: str | None = None
    index = None
    try:
        index = read_index(final, verify_files=verify_files and rank == 0)
    except CheckpointError as e:
        err = str(e)
    err = _broadcast(err)
    if err is not None:
        raise CheckpointError(err)
    assert index is not None
    lays = leaf_layouts(like, step=step, layouts=layouts)
    here = _mesh_sizes(_mesh_of(step, lays))
    leaves, spec = tree_flatten(like)
    names = [n for n, _ in _named(like)]
    saved = index["leaves"]
    mine = _fit_error(final, index, names, leaves, lays, rank, world, here)
    # Every rank's verdict and names: under a pipeline a rank holds only its stages' leaves, so
    # a leaf of the checkpoint that no rank takes is seen only from the union, and a misfit one
    # rank finds must stop them all (never a rank left waiting in the barrier below).
    views = _gather((mine, names))
    bad = [(r, e) for r, (e, _) in enumerate(views) if e is not None]
    if bad:
        r, e = bad[0]
        raise CheckpointError(e if world == 1 else f"rank {r}: {e}")
    taken = {n for _, ns in views for n in ns}
    extra = [n for n in saved if n not in taken]
    if extra:
        raise CheckpointError(f"checkpoint {final} has leaf {extra[0]!r} that the state lacks "
                              f"({len(extra)} such); it was saved from another model or "
                              "optimizer")

    handles: dict[str, Any] = {}

    def read(fname: str, key: str) -> Tensor:
        # File names come from the checked index (plain names listed in its files); a rank
        # file that does not hold what the index says is a CheckpointError, not a library one.
        try:
            if fname not in handles:
                handles[fname] = safe_open(os.path.join(final, fname), framework="pt")
            return handles[fname].get_tensor(key)
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{final}: cannot read leaf {key!r} from {fname}: "
                                  f"{err}") from err

    out = []
    for n, x in zip(names, leaves):
        rec = saved[n]
        if not torch.is_tensor(x):
            out.append(rec["value"])
            continue
        lay = lays.get(n)
        if rec["kind"] == "per_rank":
            t = read(_rank_file(rank), n)
        else:
            # Format /1 kept replicated leaves in rank 0's file; /2 names the first holder's.
            g = (_assemble(rec, n, read) if rec["kind"] == "sharded"
                 else read(rec.get("file", _rank_file(0)), n))
            if lay is not None:
                from funcpar.shard.layout import shard_tensor

                t = shard_tensor(g, lay)
            else:
                t = g
            if tuple(t.shape) != tuple(x.shape):
                raise CheckpointError(f"checkpoint leaf {n!r}: shard of shape {tuple(t.shape)} "
                                      f"but the state's is {tuple(x.shape)}")
        out.append(t.to(device=x.device, dtype=x.dtype).clone()
                   if t.dtype != x.dtype or t.device != x.device else t.clone())
    _barrier()  # no rank leaves while another still reads (files may be replaced next)
    return tree_unflatten(spec, out)


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The complete checkpoint under ``directory`` with the highest step (``directory``
    itself when it is one), or None.

    Hidden entries (a save's ``.partial``/``.old`` directories) and directories holding no
    checkpoint file are passed over in silence. A directory that holds checkpoint files but
    is not a complete, intact checkpoint (no ``COMPLETE`` or ``index.json``, a malformed index,
    a rank file missing or of another size) is skipped with a ``UserWarning`` naming it and
    why, so that a resume that falls back to an older step says so. A later :func:`save` to
    that path replaces it. Rank files' sha256 are not recomputed here (:func:`load` does).
    """
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(os.path.join(directory, COMPLETE)):
        return directory
    best, best_step = None, -1
    if not os.path.isdir(directory):
        return None
    for entry in sorted(os.listdir(directory)):
        p = os.path.join(directory, entry)
        if entry.startswith(".") or not os.path.isdir(p) or not _checkpoint_files(p):
            continue
        try:
            index = read_index(p, verify_files=False)
            _check_files(p, index, digest=False)
        except (CheckpointError, OSError) as err:
            warnings.warn(f"latest_checkpoint: skipping {p}, which is not a complete "
                          f"checkpoint: {err}", stacklevel=2)
            continue
        s = index["step"]
        if s is not None and s > best_step:
            best, best_step = p, s
    return best


_RANK_FILE = re.compile(r"rank\d{5}\.safetensors")


def _checkpoint_files(path: str) -> list[str]:
    """The entries of directory ``path`` that a save writes (index, marker, rank files)."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return [n for n in names if n in (INDEX, COMPLETE) or _RANK_FILE.fullmatch(n)]


# ------------------------------------------------------------------------------------ export
def export_params(
    params: Tree | TrainState,
    layouts: Tree = None,
    path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """The whole parameters as a Hugging Face-style state dict (the module's own dotted names,
    as ``named_parameters``), written to one safetensors file at ``path`` by rank 0.

    A collective when ``layouts`` shard anything (each sharded leaf is gathered; pass
    ``step.layouts``, which under ZeRO-3 describe the parts). ``dtype`` casts floating leaves.
    The file is written to a temporary name, fsynced and renamed, so it is complete or absent.
    """
    from safetensors.torch import save_file

    from funcpar.shard.layout import unshard_tree

    if isinstance(params, TrainState):
        params = params.params
    whole = params if layouts is None else unshard_tree(params, layouts)
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, x in named_leaves(whole):
        if x is None:
            continue
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        out[name] = _owned(x, seen)
    rank, _ = _rank_world()
    if path is not None and rank == 0:
        final = os.path.abspath(os.fspath(path))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = final + ".partial"
        save_file(out, tmp, metadata={"format": "pt", "producer": "funcpar"})
        _sha256_file(tmp, fsync=True)
        os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final))
    _barrier()
    return out
