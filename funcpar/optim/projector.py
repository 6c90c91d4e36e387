"""GaLore's low-rank gradient projector (Zhao et al. 2024, arXiv 2403.03507), as galore-torch
1.0's ``GaLoreProjector``, written as pure functions over a :class:`Projector` of tensors.

All of the projection math (the SVD at a refresh, the projection, the projection back) is in
this file and each function receives the leaf's layout (``None``: whole on this process, and
every function is then the plain torch computation). Sharded leaves (tensor parallel, or any
other :class:`~funcpar.shard.layout.Layout`) are exact, with no branch on the kind of sharding:

* refresh: the gradient is gathered whole (:func:`~funcpar.shard.layout.unshard`, one
  all-gather per axis that splits it, purpose ``galore refresh: gather gradient``; or
  :func:`gather_many` for many leaves: one all-gather per mesh axis for all of them) and every
  rank computes the same SVD in the same dtype, so the projector is the single-process one;
  each rank keeps the rows of ``P`` / the columns of ``Q`` that match its shard of the leaf
  (:func:`side_layout` says which);
* projection: on a side whose dim is split, ``P^T G`` (``G Q^T``) is a contraction over the
  split dim, so the local product is a partial sum, completed by one all-reduce over the axes
  that split that dim (:func:`~funcpar.shard.reduce.sum_partial`, purpose ``galore
  projection``; no message when that dim is whole); the unprojected dim keeps its split, so
  the low-rank gradient is sharded like the leaf on that dim and whole on the projected one
  (:func:`low_rank_layout`, which the inner optimizer's reductions then use);
* projection back: ``P_local L`` / ``L Q_local`` is this rank's shard of ``P L`` / ``L Q``,
  with no communication.

A 2-D gradient ``G`` (n, m) with SVD ``U S V^T`` is projected on its top-``rank`` singular
subspace on one side (or both, ``"full"``):

* right: ``Q = V[:, :r]^T`` (r, m), stored as ``right``; ``G -> G Q^T`` (n, r); back ``L Q``;
* left: ``P = U[:, :r]`` (n, r), stored as ``left``; ``G -> P^T G`` (r, m); back ``P L``;
* full: both: ``G -> P^T G Q^T`` (r, r); back ``P L Q``.

The side for each ``proj_type``: ``"std"`` projects on the smaller side (right when
``n >= m``, else left), ``"reverse_std"`` on the larger one, ``"left"``/``"right"``/``"full"``
as named. The projection back is multiplied by ``scale``. (galore-torch decides the side of the
projection back from the low-rank matrix's shape; for ``"reverse_std"`` with ``m > n == rank``
that picks the wrong side and fails: here the side is the one chosen at projection time.)

SVD precision: galore-torch computes ``torch.linalg.svd`` in float32 (casting any other dtype
there and the singular vectors back); ``svd_dtype=torch.float32`` does the same, so float64
gradients get float32-accurate projectors, exactly as the reference's. ``svd_dtype=None``
computes in the gradient's own dtype (float32 for half precisions, which linalg.svd lacks).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.kernels.inplace import fast_path_ok
from funcpar.shard import comm
from funcpar.shard.layout import Layout, Shard, _levels, shard_tensor, unshard
from funcpar.shard.reduce import Reducible, global_shape, sum_partial

__all__ = [
    "PROJECTION",
    "PROJ_TYPES",
    "REFRESH",
    "Gather",
    "Projector",
    "fit_projector",
    "gather_many",
    "init_projector",
    "local_projection",
    "low_rank_layout",
    "low_rank_shape",
    "project",
    "project_back",
    "projection_sides",
    "projector_from",
    "side_layout",
]

#: The purposes of the refresh's gradient gathers and of the projection's all-reduce.
REFRESH = "galore refresh: gather gradient"
PROJECTION = "galore projection"

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


class Projector(NamedTuple):
    """A leaf's projection matrices (``None`` on an unprojected side)."""

    left: Tensor | None  # (n, rank): orthonormal columns, the top left singular vectors
    right: Tensor | None  # (rank, m): orthonormal rows, the top right singular vectors


def projection_sides(shape: tuple[int, ...] | torch.Size, proj_type: str) -> tuple[bool, bool]:
    """``(left, right)``: which sides a gradient of ``shape`` is projected on."""
    if len(shape) != 2:
        raise ValueError(f"GaLore projects 2-D gradients, got shape {tuple(shape)}")
    tall = shape[0] >= shape[1]
    sides = {
        "std": (not tall, tall),
        "reverse_std": (tall, not tall),
        "left": (True, False),
        "right": (False, True),
        "full": (True, True),
    }
    if proj_type not in sides:
        raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")
    return sides[proj_type]


def low_rank_shape(
    shape: tuple[int, ...] | torch.Size,
    rank: int,
    proj_type: str,
    *,
    global_shape: tuple[int, ...] | torch.Size | None = None,
) -> tuple[int, int]:
    """The shape of the projected gradient (and of the inner optimizer's state).

    ``shape`` is the leaf's shape on this process; the side(s) are chosen from the whole leaf's
    ``global_shape`` (default ``shape``), so a shard is projected on the single-process side.
    """
    left, right = projection_sides(shape if global_shape is None else global_shape, proj_type)
    return (rank if left else shape[0], rank if right else shape[1])


def init_projector(
    shape: tuple[int, ...] | torch.Size,
    rank: int,
    proj_type: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    global_shape: tuple[int, ...] | torch.Size | None = None,
) -> Projector:
    """Zero matrices of this process's shapes (the first update always fits them): the rows of
    ``P`` and the columns of ``Q`` that match a leaf shard of ``shape``, the sides chosen from
    ``global_shape`` (default ``shape``)."""
    left, right = projection_sides(shape if global_shape is None else global_shape, proj_type)
    n, m = shape
    return Projector(
        torch.zeros((n, rank), dtype=dtype, device=device) if left else None,
        torch.zeros((rank, m), dtype=dtype, device=device) if right else None,
    )


# --------------------------------------------------------------------------------------------
# Layouts of the projection's tensors, derived from the leaf's
# --------------------------------------------------------------------------------------------


def _resized(layout: Reducible | None, sizes: dict[int, int], what: str) -> Layout | None:
    """``layout`` with each dim ``d`` of ``sizes`` made whole and of size ``sizes[d]``; the
    other dims keep their size, their axes (in nesting order) and their blocks."""
    if layout is None:
        return None
    if not isinstance(layout, Layout):
        raise TypeError(f"GaLore {what}: a sharded leaf needs a funcpar Layout (to gather its "
                        f"gradient at a refresh and shard the projector), got {layout!r}")
    placements = {a: Shard(d) for d, axes in enumerate(layout.dim_axes) if d not in sizes
                  for a in axes}
    blocks = {d: k for d, k in enumerate(layout.dim_blocks) if d not in sizes and k > 1}
    shape = [sizes.get(d, n) for d, n in enumerate(layout.global_shape)]
    return Layout(layout.mesh, shape, placements, blocks=blocks, name=layout.name)


def side_layout(layout: Reducible | None, rank: int, side: str) -> Layout | None:
    """The layout of a leaf's ``"left"`` projector ``P`` (n, rank) or ``"right"`` one ``Q``
    (rank, m): split on the leaf's dim (rows of ``P`` as the leaf's rows, columns of ``Q`` as
    its columns), whole on the rank dim. None for a whole leaf."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    return _resized(layout, {1 if side == "left" else 0: rank}, "projector")


def low_rank_layout(layout: Reducible | None, rank: int, proj_type: str) -> Layout | None:
    """The layout of the projected gradient of a leaf of ``layout``: the projected dim(s) of
    size ``rank`` and whole, the other dim split as the leaf's. None for a whole leaf."""
    if layout is None:
        return None
    left, right = projection_sides(tuple(layout.global_shape), proj_type)
    sizes = {d: rank for d, on in ((0, left), (1, right)) if on}
    return _resized(layout, sizes, "low-rank state")


def _needs_gather(g: Tensor, layout: Reducible | None) -> bool:
    """Whether ``g`` is a cut shard (with a funcpar Layout; a bare Reducible of a cut leaf is a
    TypeError: its pieces cannot be placed)."""
    if layout is None:
        return False
    if not isinstance(layout, Layout):
        if global_shape(g, layout) == tuple(g.shape):
            return False
        _resized(layout, {}, "refresh")  # raises the TypeError
    return True


def _gather(g: Tensor, layout: Reducible | None, purpose: str) -> Tensor:
    if not _needs_gather(g, layout):
        return g
    return unshard(g, layout, purpose=f"{layout.name}: {purpose}" if layout.name else purpose)


class Gather(NamedTuple):
    """A phased step's request for the whole tensor of its shard ``x`` (a refresh's gradient),
    completed for many leaves at once by :func:`gather_many`."""

    x: Tensor
    layout: Reducible | None
    purpose: str


def gather_many(xs: list[Tensor], layouts: list[Reducible | None], *,
                purpose: str = REFRESH) -> list[Tensor]:
    """The whole tensors of many shards: :func:`~funcpar.shard.layout.unshard` of each, with
    one all-gather per mesh axis (and per dtype and device) for all leaves instead of one per
    leaf and axis.

    Each leaf's gathers are unshard's (each split dim over its axes innermost first, the pieces
    of every block side by side); gathers of different dims commute (data movement only), so a
    round takes, for each mesh axis in mesh order, every leaf for which that axis is the next
    one of some dim, and sends their pieces as one flat buffer (every rank's length is known
    from the layouts; uneven lengths travel padded to the longest, as in
    :func:`funcpar.shard.comm.all_gather`). One round when every dim is split by at most one
    axis; a dim split over nested axes needs one round per nesting level. The values are
    exactly unshard's (tested).
    """
    if len(xs) != len(layouts):
        raise ValueError(f"gather_many: {len(xs)} tensors but {len(layouts)} layouts")
    out = list(xs)
    # Per leaf: its layout and, per split dim, the (axis, every rank's piece length) gathers
    # still to do, innermost last.
    todo: dict[int, tuple[Layout, dict[int, list[tuple[str, list[int]]]]]] = {}
    for i, (x, lay) in enumerate(zip(xs, layouts)):
        if not _needs_gather(x, lay):
            continue
        if tuple(x.shape) != lay.local_shape():
            raise ValueError(f"gather_many: the shard of {lay.name or f'leaf {i}'} has shape "
                             f"{tuple(x.shape)}, but its layout (global {lay.global_shape}) "
                             f"gives {lay.local_shape()}")
        coords = lay.mesh.coords()
        dims: dict[int, list[tuple[str, list[int]]]] = {}
        for d, (axes, k) in enumerate(zip(lay.dim_axes, lay.dim_blocks)):
            sizes = [lay.mesh.size(a) for a in axes]
            lv = _levels(lay.global_shape[d] // k, sizes, [coords[a] for a in axes])
            steps = [(a, comm.chunk_sizes(lv[j][1], sizes[j]))
                     for j, a in enumerate(axes) if sizes[j] > 1]
            if steps:
                dims[d] = steps
        if dims:
            todo[i] = (lay, dims)
    while todo:
        meshes = {id(lay.mesh): lay.mesh for lay, _ in todo.values()}
        for mesh in meshes.values():
            for axis in mesh.axis_names:
                picked = [(i, d) for i, (lay, dims) in todo.items() if lay.mesh is mesh
                          for d, steps in dims.items() if steps and steps[-1][0] == axis]
                groups: dict[tuple, list[tuple[int, int]]] = {}
                for i, d in picked:
                    groups.setdefault((out[i].dtype, out[i].device), []).append((i, d))
                for members in groups.values():
                    _gather_round(out, todo, members, mesh, axis, purpose)
                for i, d in picked:
                    todo[i][1][d].pop()
        todo = {i: v for i, v in todo.items() if any(v[1].values())}
    return out


def _gather_round(out: list[Tensor], todo: dict, members: list[tuple[int, int]], mesh: object,
                  axis: str, purpose: str) -> None:
    """One all-gather over ``axis`` of the next piece of each of ``members`` (leaf, dim)."""
    k, me = mesh.size(axis), mesh.rank(axis)
    views, shapes = [], []  # per member: this rank's piece, flat; every rank's piece shape
    for i, d in members:
        lay = todo[i][0]
        pieces = todo[i][1][d][-1][1]
        u = out[i].unflatten(d, (lay.dim_blocks[d], -1))  # each block's piece side by side
        views.append(u.reshape(-1))
        shapes.append([(*u.shape[:d + 1], n, *u.shape[d + 2:]) for n in pieces])
    lengths = [sum(math.prod(sh[r]) for sh in shapes) for r in range(k)]
    mine = torch.cat(views)
    if mine.numel() != lengths[me]:
        raise AssertionError(f"gather_many: {mine.numel()} elements on this rank, the layouts "
                             f"say {lengths[me]}")
    whole = comm.all_gather(mine, mesh, axis, dim=0, sizes=lengths, purpose=purpose)
    per_rank = whole.split(lengths)
    parts = [per_rank[r].split([math.prod(sh[r]) for sh in shapes]) for r in range(k)]
    for j, (i, d) in enumerate(members):
        full = torch.cat([parts[r][j].view(shapes[j][r]) for r in range(k)], dim=d + 1)
        out[i] = full.flatten(d, d + 1)


def _local(x: Tensor, layout: Layout | None) -> Tensor:
    return x if layout is None else shard_tensor(x, layout)


# --------------------------------------------------------------------------------------------
# The projection
# --------------------------------------------------------------------------------------------


def fit_projector(
    g: Float[Tensor, "n m"],
    rank: int,
    proj_type: str,
    *,
    svd_dtype: torch.dtype | None = torch.float32,
    layout: Reducible | None = None,
) -> Projector:
    """The projector of the whole gradient: its top-``rank`` singular vectors on the chosen
    side(s), of which this process keeps the part matching its shard ``g``.

    A sharded ``g`` is gathered first (one all-gather of the gradient per splitting axis, every
    refresh); every rank then runs the same SVD on the same tensor.
    """
    return projector_from(_gather(g, layout, REFRESH), g, rank, proj_type, svd_dtype=svd_dtype,
                          layout=layout)


def projector_from(
    whole: Float[Tensor, "n m"],
    g: Float[Tensor, "a b"],
    rank: int,
    proj_type: str,
    *,
    svd_dtype: torch.dtype | None = torch.float32,
    layout: Reducible | None = None,
) -> Projector:
    """:func:`fit_projector` given the whole gradient ``whole`` (gathered from the shards
    ``g``, e.g. by :func:`gather_many`): the SVD, and this process's part of the vectors."""
    left, right = projection_sides(whole.shape, proj_type)
    if svd_dtype is None:
        svd_dtype = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
    u, _, vh = torch.linalg.svd(whole.to(svd_dtype), full_matrices=False)
    return Projector(
        _local(u[:, :rank].to(g.dtype), side_layout(layout, rank, "left")) if left else None,
        _local(vh[:rank, :].to(g.dtype), side_layout(layout, rank, "right")) if right else None,
    )


def project(
    g: Float[Tensor, "n m"], proj: Projector, *, layout: Reducible | None = None
) -> Float[Tensor, "a b"]:
    """``P^T g``, ``g Q^T`` or ``P^T g Q^T``, as the projector's sides say.

    For a shard ``g`` (with this rank's part of the projector) the local product is a partial
    sum over the projected dims; it is completed by one all-reduce over the axes that split
    them (none when they are whole). The result is this rank's shard of the low-rank gradient
    (:func:`low_rank_layout`).
    """
    partial, dims = local_projection(g, proj)
    return sum_partial(partial, dims, layout=layout, purpose=PROJECTION)


def local_projection(
    g: Float[Tensor, "n m"], proj: Projector
) -> tuple[Float[Tensor, "a b"], tuple[int, ...]]:
    """This rank's ``P^T g`` / ``g Q^T`` / ``P^T g Q^T`` and the leaf dims it contracted: the
    partial sum :func:`project` completes (e.g. as a :class:`funcpar.shard.reduce.Partial`)."""
    dims = []
    if proj.left is not None:
        g = torch.matmul(proj.left.t(), g)
        dims.append(0)
    if proj.right is not None:
        g = torch.matmul(g, proj.right.t())
        dims.append(1)
    return g, tuple(dims)


def project_back(
    low: Float[Tensor, "a b"],
    proj: Projector,
    scale: float | Tensor,
    *,
    layout: Reducible | None = None,
) -> Float[Tensor, "n m"]:
    """``scale * (P low)``, ``scale * (low Q)`` or ``scale * (P low Q)``: for a sharded leaf,
    this rank's shard of it, from this rank's rows of ``P`` / columns of ``Q`` and its shard of
    ``low`` (no communication)."""
    back = low
    if proj.left is not None:
        back = torch.matmul(proj.left, back)
    if proj.right is not None:
        back = torch.matmul(back, proj.right)
    if isinstance(layout, Layout) and tuple(back.shape) != layout.local_shape():
        raise ValueError(f"GaLore projection back of {layout.name or 'a leaf'}: got shape "
                         f"{tuple(back.shape)}, but the shard of global {layout.global_shape} "
                         f"is {layout.local_shape()}")
    if back is not low and (isinstance(scale, float) or fast_path_ok(back, scale)):
        # The product is this call's own: scaled where it lies, the same bits without a second
        # leaf-sized tensor (on a CPU a fresh one costs more than the multiply). By a number
        # that is differentiable and vmappable as it is; by a tensor only off the autograd
        # and torch.func paths.
        return back.mul_(scale)
    return back * scale
