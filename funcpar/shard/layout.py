"""Layouts: which dims of a leaf are split over which mesh axes.

A :class:`Layout` is metadata beside a tensor, not a tensor type (DESIGN principle 3): the mesh,
the global shape, and for each tensor dim the mesh axes that split it. A ``layouts`` pytree
parallels ``params`` (``None`` where a leaf is whole on every rank), and each leaf's layout is
what :mod:`funcpar.shard.reduce` consults: :meth:`Layout.all_reduce` is the
:class:`~funcpar.shard.reduce.Reducible` contract.

Vocabulary is DTensor's: ``Layout(mesh, shape, {"tp": Shard(0)})`` splits dim 0 over ``tp`` and
replicates over every other axis (``Replicate()``). :meth:`Layout.from_spec` takes the per-dim
form (JAX's PartitionSpec): ``Layout.from_spec(mesh, shape, ("tp", None))``.

What is supported:

* any number of dims, each split over any number of axes, each axis splitting at most one dim;
* one dim over several axes (ZeRO's ``dp`` on top of ``tp``): nested, outermost first - the dim
  is cut over the first axis, each piece again over the next one. In the mapping form the order
  of the mapping is the nesting order; in DTensor's sequence form (one placement per mesh axis)
  it is mesh order, as in DTensor. :attr:`Layout.placements` is a valid DTensor placement tuple
  only when the nesting follows mesh order.

Uneven splits follow torch.chunk (and DTensor's ``Shard``): a dim of ``n`` over ``k`` ranks gives
``ceil(n / k)`` to each rank in coordinate order and what is left to the last ones - fewer, or
none (``7`` over 4: ``2, 2, 2, 1``; ``6`` over 4: ``2, 2, 2, 0``). Shards may be empty; the
reductions handle that. Splitting a dim shorter than the number of pieces is an error.

A dim may also be split *blocked*: ``blocks={dim: k}`` views the dim as ``k`` equal blocks laid
end to end (a fused ``[q | k | v]`` projection, ``k = 3``) and cuts each block as above; a rank's
shard is its piece of every block, in block order. The shard is then not one slice of the global
tensor (:meth:`Layout.local_slices` refuses), but reductions over the dim are unchanged: every
element is still on exactly one rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.state.tree import (
    Tree,
    named_leaves,
    tree_map,
    tree_map_with_path,
    tree_structure_check,
)

__all__ = [
    "Layout",
    "Placement",
    "Replicate",
    "Shard",
    "check_layouts",
    "shard_tensor",
    "shard_tree",
    "unshard",
    "unshard_tree",
    "with_leaf_names",
]

@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` over a mesh axis (DTensor's ``Shard``; torch's own is accepted
    too, and :meth:`Layout.torch_placements` converts back)."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Whole on every rank of a mesh axis (DTensor's ``Replicate``)."""


def _placement(p: Any) -> Shard | Replicate | None:
    """Ours or torch's placement as ours; None for anything else (Partial, _StridedShard).

    torch's are recognised by type name so that importing this module does not import
    torch.distributed.tensor (seconds).
    """
    if isinstance(p, (Shard, Replicate)):
        return p
    kind = type(p).__name__
    if kind == "Replicate" and type(p).__module__.startswith("torch."):
        return Replicate()
    if kind == "Shard" and type(p).__module__.startswith("torch.") and isinstance(p.dim, int):
        return Shard(p.dim)
    return None


Placement = Shard | Replicate


def _who(name: str) -> str:
    return f"layout of {name!r}" if name else "layout"


def _levels(n: int, sizes: Sequence[int], coords: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, length), ...]`` of a dim of ``n`` cut over nested axes, outermost first.

    Entry 0 is the whole dim; entry ``j`` is the piece held after the first ``j`` axes.
    """
    out = [(0, n)]
    start, length = 0, n
    for k, c in zip(sizes, coords):
        pieces = comm.chunk_sizes(length, k)
        start, length = start + sum(pieces[:c]), pieces[c]
        out.append((start, length))
    return out


class Layout:
    """Per leaf: the mesh, the global shape, and which mesh axes split which tensor dims.

    ``placements``: a mapping ``{axis: Shard(dim) | Replicate()}`` (axes left out replicate;
    mapping order is the nesting order on a shared dim), or a sequence with one placement per
    mesh axis in mesh order (DTensor's form), or None (replicated). ``name`` (the leaf's dotted
    path) goes into error messages and into the ``purpose`` of the layout's collectives.
    """

    __slots__ = ("dim_axes", "dim_blocks", "global_shape", "mesh", "name")
    mesh: DeviceMesh
    global_shape: tuple[int, ...]
    dim_axes: tuple[tuple[str, ...], ...]
    dim_blocks: tuple[int, ...]
    name: str

    def __init__(
        self,
        mesh: DeviceMesh,
        global_shape: Sequence[int] | torch.Size,
        placements: Mapping[str, Any] | Sequence[Any] | None = None,
        *,
        blocks: Mapping[int, int] | None = None,
        name: str = "",
    ) -> None:
        shape = tuple(int(s) for s in global_shape)
        nd = len(shape)
        if placements is None:
            items: list[tuple[str, Any]] = []
        elif isinstance(placements, Mapping):
            items = list(placements.items())
        else:
            placements = list(placements)
            if len(placements) != len(mesh.axis_names):
                raise ValueError(
                    f"{_who(name)}: {len(placements)} placements for a mesh of "
                    f"{len(mesh.axis_names)} axes {mesh.axis_names} (one per mesh axis, or "
                    f"pass a mapping {{axis: placement}})"
                )
            items = list(zip(mesh.axis_names, placements))
        dim_axes: list[list[str]] = [[] for _ in range(nd)]
        for axis, p in items:
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{_who(name)}: mesh has no axis {axis!r}; its axes are {mesh.axis_names}"
                )
            q = _placement(p)
            if isinstance(q, Replicate):
                continue
            if q is None:
                raise TypeError(
                    f"{_who(name)}: placement for axis {axis!r} must be Shard(dim) or "
                    f"Replicate(), got {p!r}"
                )
            if not -nd <= q.dim < nd:
                raise ValueError(
                    f"{_who(name)}: Shard({q.dim}) over {axis!r} but the leaf has {nd} dims "
                    f"(global shape {shape})"
                )
            dim_axes[q.dim % nd].append(axis)
        dim_blocks = [1] * nd
        for d, k in (blocks or {}).items():
            if not -nd <= d < nd or isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"{_who(name)}: blocks must map dims of {nd} to counts >= 1, "
                                 f"got {dict(blocks or {})}")
            dim_blocks[d % nd] = k
        self._set(mesh, shape, tuple(tuple(a) for a in dim_axes), name, tuple(dim_blocks))

    @classmethod
    def from_spec(
        cls,
        mesh: DeviceMesh,
        global_shape: Sequence[int] | torch.Size,
        spec: Sequence[str | Sequence[str] | None],
        *,
        name: str = "",
    ) -> Layout:
        """Per-dim form: ``spec[d]`` is None, an axis, or axes (outermost first) splitting dim
        ``d``; a spec shorter than the rank leaves the trailing dims whole."""
        shape = tuple(int(s) for s in global_shape)
        if len(spec) > len(shape):
            raise ValueError(
                f"{_who(name)}: spec {tuple(spec)} has {len(spec)} entries for a leaf of "
                f"{len(shape)} dims (global shape {shape})"
            )
        dim_axes = []
        for entry in list(spec) + [None] * (len(shape) - len(spec)):
            if entry is None:
                dim_axes.append(())
            elif isinstance(entry, str):
                dim_axes.append((entry,))
            else:
                dim_axes.append(tuple(entry))
        return cls._make(mesh, shape, tuple(dim_axes), name)

    @classmethod
    def replicated(
        cls, mesh: DeviceMesh, global_shape: Sequence[int] | torch.Size, *, name: str = ""
    ) -> Layout:
        return cls(mesh, global_shape, None, name=name)

    @classmethod
    def _make(cls, mesh: DeviceMesh, shape: tuple[int, ...],
              dim_axes: tuple[tuple[str, ...], ...], name: str,
              dim_blocks: tuple[int, ...] | None = None) -> Layout:
        obj = cls.__new__(cls)
        obj._set(mesh, shape, dim_axes, name, dim_blocks)
        return obj

    def _set(self, mesh: DeviceMesh, shape: tuple[int, ...],
             dim_axes: tuple[tuple[str, ...], ...], name: str,
             dim_blocks: tuple[int, ...] | None = None) -> None:
        dim_blocks = dim_blocks or (1,) * len(shape)
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{_who(name)}: mesh must be a funcpar DeviceMesh, got {mesh!r}")
        if any(s < 0 for s in shape):
            raise ValueError(f"{_who(name)}: negative size in global shape {shape}")
        seen: dict[str, int] = {}
        for d, axes in enumerate(dim_axes):
            for axis in axes:
                if axis not in mesh.axis_names:
                    raise ValueError(
                        f"{_who(name)}: mesh has no axis {axis!r}; its axes are {mesh.axis_names}"
                    )
                if axis in seen:
                    raise ValueError(
                        f"{_who(name)}: mesh axis {axis!r} splits both dim {seen[axis]} and dim "
                        f"{d}; an axis may split one dim only"
                    )
                seen[axis] = d
            parts = math.prod(mesh.size(a) for a in axes)
            k = dim_blocks[d]
            if shape[d] % k:
                raise ValueError(f"{_who(name)}: dim {d} of size {shape[d]} (global shape "
                                 f"{shape}) is not {k} equal blocks")
            if parts > 1 and shape[d] // k < parts:
                over = " x ".join(f"{a} ({mesh.size(a)})" for a in axes)
                what = f"a block of {shape[d] // k} of " if k > 1 else ""
                raise ValueError(
                    f"{_who(name)}: {what}dim {d} of size {shape[d]} (global shape {shape}) "
                    f"cannot be split over {over}: it is smaller than the {parts} pieces"
                )
        for attr, value in (("mesh", mesh), ("global_shape", shape), ("dim_axes", dim_axes),
                            ("dim_blocks", dim_blocks), ("name", name)):
            object.__setattr__(self, attr, value)

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError("a Layout is immutable; use split() or named() for a new one")

    # ------------------------------------------------------------------------------ derived
    def split(self, dim: int, axis: str) -> Layout:
        """This layout with ``dim`` further cut over ``axis`` (innermost): ZeRO over a TP shard."""
        nd = len(self.global_shape)
        if not -nd <= dim < nd:
            raise ValueError(f"{_who(self.name)}: dim {dim} out of range for {nd} dims")
        d = dim % nd
        dim_axes = tuple(a + (axis,) if i == d else a for i, a in enumerate(self.dim_axes))
        return Layout._make(self.mesh, self.global_shape, dim_axes, self.name, self.dim_blocks)

    def named(self, name: str) -> Layout:
        return Layout._make(self.mesh, self.global_shape, self.dim_axes, name, self.dim_blocks)

    @property
    def spec(self) -> tuple[tuple[str, ...], ...]:
        """Per dim, the axes splitting it, outermost first (``()``: whole)."""
        return self.dim_axes

    @property
    def placements(self) -> tuple[Any, ...]:
        """DTensor placements, one per mesh axis in mesh order."""
        where = {a: d for d, axes in enumerate(self.dim_axes) for a in axes}
        return tuple(Shard(where[a]) if a in where else Replicate() for a in self.mesh.axis_names)

    def torch_placements(self) -> tuple[Any, ...]:
        """:attr:`placements` as torch's DTensor objects (for ``DTensor.from_local`` with
        ``mesh.torch_mesh``); valid only when nested splits follow mesh order."""
        from torch.distributed.tensor.placement_types import Replicate as TR
        from torch.distributed.tensor.placement_types import Shard as TS

        return tuple(TS(p.dim) if isinstance(p, Shard) else TR() for p in self.placements)

    @property
    def is_sharded(self) -> bool:
        """Whether any dim is actually cut (over an axis of size > 1)."""
        return any(self.mesh.size(a) > 1 for axes in self.dim_axes for a in axes)

    def axes_for(self, dims: Sequence[int]) -> tuple[str, ...]:
        """The mesh axes (mesh order) that split any of ``dims``."""
        nd = len(self.global_shape)
        wanted = {self.dim_axes[d % nd] for d in dims} if nd else set()
        split = {a for axes in wanted for a in axes}
        return tuple(a for a in self.mesh.axis_names if a in split)

    def _intervals(self, rank: int | None) -> list[tuple[int, int]]:
        """Per dim, ``(start, length)`` of the rank's piece within one block of the dim."""
        coords = self.mesh.coords(rank)
        out = []
        for n, axes, k in zip(self.global_shape, self.dim_axes, self.dim_blocks):
            lv = _levels(n // k, [self.mesh.size(a) for a in axes], [coords[a] for a in axes])
            out.append(lv[-1])
        return out

    @property
    def is_blocked(self) -> bool:
        return any(k > 1 for k in self.dim_blocks)

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """The shape of the shard held by global ``rank`` (this process when None)."""
        return tuple(k * length for (_, length), k in zip(self._intervals(rank), self.dim_blocks))

    def local_slices(self, rank: int | None = None) -> tuple[slice, ...]:
        """Where ``rank``'s shard sits in the global tensor (not for blocked splits, whose
        shard is several slices)."""
        if self.is_blocked:
            raise ValueError(f"{_who(self.name)}: a blocked split (blocks {self.dim_blocks}) "
                             "has no single slice; use shard_tensor")
        return tuple(slice(s, s + n) for s, n in self._intervals(rank))

    def local_indices(self, rank: int | None = None) -> tuple[Tensor, ...]:
        """Per dim, the global indices (int64, in shard order) of ``rank``'s shard along it.

        ``x[torch.meshgrid(*idx, indexing="ij")]`` is ``shard_tensor(x, self, rank)``, blocked
        splits included (a rank's piece of every block, in block order): lazy initialization
        (:mod:`funcpar.init`) computes a shard's values from these indices alone.
        """
        out = []
        for (start, length), n, k in zip(self._intervals(rank), self.global_shape,
                                         self.dim_blocks):
            piece = torch.arange(start, start + length, dtype=torch.int64)
            blocks = torch.arange(k, dtype=torch.int64)[:, None] * (n // k)
            out.append((blocks + piece).reshape(-1))
        return tuple(out)

    # ------------------------------------------------------------------------------ contract
    def _purpose(self, purpose: str) -> str:
        return f"{self.name}: {purpose}" if self.name else purpose

    def all_reduce(self, t: Tensor, dims: tuple[int, ...], op: str, purpose: str) -> Tensor:
        """Combine a locally reduced ``t`` over exactly the axes that split ``dims``.

        One all-reduce per such axis of size > 1, in mesh order (a sum or max over the union of
        the axes is the sum or max of per-axis ones); none when no axis splits ``dims``.
        """
        for axis in self.axes_for(dims):
            t = comm.all_reduce(t, self.mesh, axis, op=op, purpose=self._purpose(purpose))
        return t

    # ---------------------------------------------------------------------------- dunder
    def _key(self) -> tuple[Any, ...]:
        return (id(self.mesh), self.global_shape, self.dim_axes, self.dim_blocks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self.mesh is other.mesh and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        spec = ", ".join(
            "None" if not a else (repr(a[0]) if len(a) == 1 else repr(a)) for a in self.dim_axes
        )
        name = f", name={self.name!r}" if self.name else ""
        blocks = {d: k for d, k in enumerate(self.dim_blocks) if k > 1}
        blocked = f", blocks={blocks}" if blocks else ""
        return f"Layout({list(self.global_shape)}, spec=({spec}){blocked}{name})"


# ----------------------------------------------------------------------------- tensor level
def shard_tensor(x: Tensor, layout: Layout, rank: int | None = None) -> Tensor:
    """``rank``'s shard (this process's when None) of the global tensor ``x``, as a new tensor
    (not a view: the global tensor can be freed)."""
    if tuple(x.shape) != layout.global_shape:
        raise ValueError(
            f"{_who(layout.name)}: global shape {layout.global_shape} but the tensor to shard "
            f"has shape {tuple(x.shape)}"
        )
    for d, ((start, n), k) in enumerate(zip(layout._intervals(rank), layout.dim_blocks)):
        # Each of the k blocks of dim d gives its piece [start, start + n).
        x = x.unflatten(d, (k, -1)).narrow(d + 1, start, n).flatten(d, d + 1)
    return x.clone(memory_format=torch.contiguous_format)


def unshard(local: Tensor, layout: Layout, *, purpose: str | None = None) -> Tensor:
    """The global tensor, gathered from every rank's shard (uneven pieces included).

    Each split dim is gathered over its axes innermost first, each an all_gather along that
    dim. Returns ``local`` itself when nothing is cut.
    """
    want = layout.local_shape()
    if tuple(local.shape) != want:
        raise ValueError(
            f"{_who(layout.name)}: this rank's shard should have shape {want} (global "
            f"{layout.global_shape}) but has {tuple(local.shape)}"
        )
    mesh = layout.mesh
    coords = mesh.coords()
    why = purpose if purpose is not None else layout._purpose("unshard")
    t = local
    for d, (axes, k) in enumerate(zip(layout.dim_axes, layout.dim_blocks)):
        if not axes:
            continue
        sizes = [mesh.size(a) for a in axes]
        lv = _levels(layout.global_shape[d] // k, sizes, [coords[a] for a in axes])
        t = t.unflatten(d, (k, -1))  # gather each block's pieces side by side
        for j in reversed(range(len(axes))):
            pieces = comm.chunk_sizes(lv[j][1], sizes[j])
            t = comm.all_gather(t, mesh, axes[j], dim=d + 1, sizes=pieces, purpose=why)
        t = t.flatten(d, d + 1)
    return t


# ------------------------------------------------------------------------------- tree level
def with_leaf_names(layouts: Tree) -> Tree:
    """Each unnamed :class:`Layout` named after its leaf's dotted path (for errors, reports)."""
    return tree_map_with_path(
        lambda n, lay: lay.named(n) if isinstance(lay, Layout) and not lay.name else lay, layouts
    )


def check_layouts(tree: Tree, layouts: Tree, *, what: str = "params",
                  shapes: str | None = "local") -> None:
    """Raise a clear error unless ``layouts`` fits ``tree``.

    The structures must match leaf for leaf; each layout is a :class:`Layout` or None; and each
    tensor's shape is its layout's ``local_shape()`` (``shapes="local"``), its ``global_shape``
    (``"global"``), or is not checked (None).
    """
    if shapes not in ("local", "global", None):
        raise ValueError(f"shapes must be 'local', 'global' or None, got {shapes!r}")
    tree_structure_check(tree, layouts, what="layouts", against=what)
    for (name, x), (_, lay) in zip(named_leaves(tree), named_leaves(layouts)):
        if lay is None:
            continue
        if not isinstance(lay, Layout):
            raise TypeError(f"layouts[{name!r}] must be a Layout or None, got {lay!r}")
        if x is None or shapes is None:
            continue
        want = lay.local_shape() if shapes == "local" else lay.global_shape
        if tuple(x.shape) != want:
            raise ValueError(
                f"{what}[{name!r}] has shape {tuple(x.shape)} but its layout says the {shapes} "
                f"shape is {want} (global {lay.global_shape}, spec {lay.dim_axes})"
            )


def shard_tree(tree: Tree, layouts: Tree) -> Tree:
    """This rank's shards of a tree of global tensors (leaves with a None layout kept whole)."""
    check_layouts(tree, layouts, shapes="global")
    return tree_map(
        lambda x, lay: x if lay is None or x is None else shard_tensor(x, lay), tree, layouts
    )


def unshard_tree(tree: Tree, layouts: Tree) -> Tree:
    """The global tree from every rank's shards (a collective: every rank calls it)."""
    check_layouts(tree, layouts, shapes="local")
    return tree_map(lambda x, lay: x if lay is None or x is None else unshard(x, lay),
                    tree, layouts)
