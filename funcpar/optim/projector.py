"""GaLore's low-rank gradient projector (Zhao et al. 2024, arXiv 2403.03507), as galore-torch
1.0's ``GaLoreProjector``, written as pure functions over a :class:`Projector` of tensors.

All of the projection math (the SVD at a refresh, the projection, the projection back) is in
this file and each function receives the leaf's layout: under tensor parallelism the projector
must be the single-device one, which a sharded leaf will get by gathering the gradient at a
refresh (one all-gather every ``update_proj_gap`` steps); for now a sharded leaf is refused.

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

from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.shard.reduce import Reducible, global_shape

__all__ = [
    "PROJ_TYPES",
    "Projector",
    "fit_projector",
    "init_projector",
    "low_rank_shape",
    "project",
    "project_back",
    "projection_sides",
]

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
    shape: tuple[int, ...] | torch.Size, rank: int, proj_type: str
) -> tuple[int, int]:
    """The shape of the projected gradient (and of the inner optimizer's state)."""
    left, right = projection_sides(shape, proj_type)
    return (rank if left else shape[0], rank if right else shape[1])


def init_projector(
    shape: tuple[int, ...] | torch.Size,
    rank: int,
    proj_type: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> Projector:
    """Zero matrices of the right shapes; the first update always fits them."""
    left, right = projection_sides(shape, proj_type)
    n, m = shape
    return Projector(
        torch.zeros((n, rank), dtype=dtype, device=device) if left else None,
        torch.zeros((rank, m), dtype=dtype, device=device) if right else None,
    )


def _whole(g: Tensor, layout: Reducible | None, what: str) -> None:
    if global_shape(g, layout) != tuple(g.shape):
        raise NotImplementedError(
            f"GaLore {what} of a sharded leaf (local shape {tuple(g.shape)}, global shape "
            f"{global_shape(g, layout)}) is not supported yet: it needs the gradient gathered "
            "at each projector refresh"
        )


def fit_projector(
    g: Float[Tensor, "n m"],
    rank: int,
    proj_type: str,
    *,
    svd_dtype: torch.dtype | None = torch.float32,
    layout: Reducible | None = None,
) -> Projector:
    """The projector of ``g``: its top-``rank`` singular vectors on the chosen side(s)."""
    _whole(g, layout, "projector refresh")
    left, right = projection_sides(g.shape, proj_type)
    if svd_dtype is None:
        svd_dtype = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
    u, _, vh = torch.linalg.svd(g.to(svd_dtype), full_matrices=False)
    return Projector(
        u[:, :rank].to(g.dtype) if left else None,
        vh[:rank, :].to(g.dtype) if right else None,
    )


def project(
    g: Float[Tensor, "n m"], proj: Projector, *, layout: Reducible | None = None
) -> Float[Tensor, "a b"]:
    """``P^T g``, ``g Q^T`` or ``P^T g Q^T``, as the projector's sides say."""
    _whole(g, layout, "projection")
    if proj.left is not None:
        g = torch.matmul(proj.left.t(), g)
    if proj.right is not None:
        g = torch.matmul(g, proj.right.t())
    return g


def project_back(
    low: Float[Tensor, "a b"],
    proj: Projector,
    scale: float | Tensor,
    *,
    layout: Reducible | None = None,
) -> Float[Tensor, "n m"]:
    """``scale * (P low)``, ``scale * (low Q)`` or ``scale * (P low Q)``."""
    if proj.left is not None:
        low = torch.matmul(proj.left, low)
    if proj.right is not None:
        low = torch.matmul(low, proj.right)
    _whole(low, layout, "projection back")
    return low * scale
