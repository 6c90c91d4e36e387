"""SUMMA on a ``q x q`` grid: ``C = AB``, ``ABᵀ``, ``AᵀB`` with exact forward and backward.

Van de Geijn and Watts, "SUMMA: Scalable Universal Matrix Multiplication Algorithm" (1997), as
used for 2D tensor parallelism by Xu et al., "An Efficient 2D Method for Training Super-Large
Deep Learning Models" (Optimus, arXiv 2104.05343) and Colossal-AI's ``2d`` mode.

The grid is two mesh axes of one size ``q``: :data:`ROW` (the grid row ``i`` of a rank) and
:data:`COL` (its grid column ``j``). A matrix ``M [r, c]`` is *grid-partitioned* when rank
``(i, j)`` holds the block ``M_ij``: rows chunk ``i`` (over :data:`ROW`), columns chunk ``j``
(over :data:`COL`), both cut as ``torch.chunk`` cuts (:func:`funcpar.shard.comm.chunk_sizes`;
uneven pieces allowed, empty ones refused by the callers). The ranks sharing ``i`` form grid
row ``i`` and talk over the :data:`COL` axis; those sharing ``j`` form column ``j`` and talk over
:data:`ROW`.

* ``C = A B`` (:func:`summa_ab`): ``C_ij = sum_k A_ik B_kj``. For each ``k``, ``A_ik`` is
  broadcast along grid row ``i`` from column ``k`` and ``B_kj`` along grid column ``j`` from row
  ``k``; each rank adds their product.
* ``C = A Bᵀ`` (:func:`summa_abt`, ``A [m, n]``, ``B [k, n]``): ``C_ij = sum_l A_il B_jlᵀ``.
  For each ``j'``, ``B_j'l`` is broadcast along column ``l`` from row ``j'``; rank ``(i, l)``
  forms the partial ``A_il B_j'lᵀ``, and the partials are summed along grid row ``i`` onto
  ``(i, j')``.
* ``C = Aᵀ B`` (:func:`summa_atb`, ``A [k, m]``, ``B [k, n]``): ``C_ij = sum_l A_liᵀ B_lj``.
  For each ``i'``, ``A_li'`` is broadcast along grid row ``l`` from column ``i'``; rank
  ``(l, j)`` forms ``A_li'ᵀ B_lj``, summed along grid column ``j`` onto ``(i', j)``.

SUMMA's ``q`` reduces (one per ``j'`` or ``i'``) are issued as one reduce-scatter of the ``q``
partials laid side by side: the same bytes (a reduce-scatter's input is the ``q`` partials; a
reduce moves one each), ``q - 1`` fewer messages, and a traceable collective. The panels are
broadcast one at a time (:func:`funcpar.shard.comm.broadcast`, recorded in ``comm_log``), so a
rank holds one panel of each operand at a time, never the gathered row or column.

Backward (each an instance of the three): for ``C = AB``, ``dA = dC Bᵀ`` and ``dB = Aᵀ dC``;
for ``C = ABᵀ``, ``dA = dC B`` and ``dB = dCᵀ A``; for ``C = AᵀB``, ``dA = B dCᵀ`` and
``dB = A dC``. Only the operands' own blocks are saved for the backward (the panels are
broadcast again there), so the memory an activation costs is its block: ``1 / q²`` of it.

Per ``C = AB`` with ``A [m, K]``, ``B [K, N]`` the forward broadcasts ``m/q x K`` (``A``'s
panels) and ``K x N/q`` (``B``'s) per rank, the backward the same two again plus one
reduce-scatter of each gradient's ``q`` partials: Colossal-AI's ``6 (q - 1) / q`` bandwidth term
counts these six panel sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh

__all__ = [
    "COL",
    "ROW",
    "Grid",
    "all_reduce_both",
    "summa_ab",
    "summa_abt",
    "summa_atb",
]

#: The mesh axis of a rank's grid row index ``i`` (ranks along it form one grid *column*).
ROW = "tp_row"
#: The mesh axis of a rank's grid column index ``j`` (ranks along it form one grid *row*).
COL = "tp_col"


@dataclass(frozen=True)
class Grid:
    """A ``q x q`` grid over the mesh axes ``row`` and ``col`` (default :data:`ROW`,
    :data:`COL`); ``purpose`` prefixes the recorded collectives."""

    mesh: DeviceMesh
    row: str = ROW
    col: str = COL
    #: The tensor-parallel mode the grid serves (error messages, collective purposes).
    mode: ClassVar[str] = "2d"

    def __post_init__(self) -> None:
        for a in (self.row, self.col):
            if a not in self.mesh.axis_names:
                raise ValueError(f"a 2D grid needs mesh axes {self.row!r} and {self.col!r}; "
                                 f"the mesh has {self.mesh.axis_names}")
        if self.mesh.size(self.row) != self.mesh.size(self.col):
            raise ValueError(f"a 2D grid is square: {self.row}={self.mesh.size(self.row)} but "
                             f"{self.col}={self.mesh.size(self.col)}")

    @property
    def q(self) -> int:
        return self.mesh.size(self.row)

    @property
    def i(self) -> int:
        return self.mesh.rank(self.row)

    @property
    def j(self) -> int:
        return self.mesh.rank(self.col)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes cutting the batch rows, outermost first: the grid row's."""
        return (self.row,)


def _panel(mine: Tensor, src: int, here: int, shape: tuple[int, ...], grid: Grid, axis: str,
           purpose: str) -> Tensor:
    """The block of the rank at ``src`` along ``axis``, broadcast from it (``mine`` there)."""
    t = mine if src == here else mine.new_empty(shape)
    return comm.broadcast(t, grid.mesh, axis, src=src, purpose=purpose)


def _ab(a: Tensor, b: Tensor, grid: Grid, k_sizes: list[int], purpose: str) -> Tensor:
    # C_ij = sum_k A_ik B_kj: A's panels along the grid row, B's along the grid column.
    m, n = a.shape[0], b.shape[1]
    out = a.new_zeros((m, n))
    for k, kk in enumerate(k_sizes):
        ak = _panel(a, k, grid.j, (m, kk), grid, grid.col, purpose + " A panel")
        bk = _panel(b, k, grid.i, (kk, n), grid, grid.row, purpose + " B panel")
        out.addmm_(ak, bk)
    return out


def _abt(a: Tensor, b: Tensor, grid: Grid, k_sizes: list[int], purpose: str) -> Tensor:
    # C_ij = sum_l A_il B_jl^T: B's panels along the grid column, partials summed along the row.
    n = b.shape[1]
    parts = [a @ _panel(b, jj, grid.i, (kk, n), grid, grid.row, purpose + " B panel").T
             for jj, kk in enumerate(k_sizes)]
    return comm.reduce_scatter(torch.cat(parts, dim=1), grid.mesh, grid.col, dim=1,
                               sizes=k_sizes, purpose=purpose + " partials")


def _atb(a: Tensor, b: Tensor, grid: Grid, m_sizes: list[int], purpose: str) -> Tensor:
    # C_ij = sum_l A_li^T B_lj: A's panels along the grid row, partials summed along the column.
    k = a.shape[0]
    parts = [_panel(a, ii, grid.j, (k, mm), grid, grid.col, purpose + " A panel").T @ b
             for ii, mm in enumerate(m_sizes)]
    return comm.reduce_scatter(torch.cat(parts, dim=0), grid.mesh, grid.row, dim=0,
                               sizes=m_sizes, purpose=purpose + " partials")


# Each product's forward (its function and the size list it cuts by) and the two products that
# give its gradients: (kind, first operand, second operand) from (dC, A, B).
_PRODUCTS = {"ab": (_ab, "k"), "abt": (_abt, "k"), "atb": (_atb, "m")}
_GRADS = {
    # C = A B: dA = dC B^T, dB = A^T dC (both over the inner dim k).
    "ab": (("abt", "k", lambda dc, a, b: (dc, b)), ("atb", "k", lambda dc, a, b: (a, dc))),
    # C = A B^T [m, k]: dA = dC B (inner dim k), dB = dC^T A (result rows k).
    "abt": (("ab", "k", lambda dc, a, b: (dc, b)), ("atb", "k", lambda dc, a, b: (dc, a))),
    # C = A^T B [m, n], A [k, m]: dA = B dC^T (result cols m), dB = A dC (inner dim m).
    "atb": (("abt", "m", lambda dc, a, b: (b, dc)), ("ab", "m", lambda dc, a, b: (a, dc))),
}


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, grid, kind, sizes, purpose):
        ctx.save_for_backward(a, b)
        ctx.grid, ctx.kind, ctx.sizes, ctx.purpose = grid, kind, sizes, purpose
        fn, cut = _PRODUCTS[kind]
        return fn(a, b, grid, sizes[cut], purpose)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        grads = []
        for needed, (kind, cut, operands) in zip(ctx.needs_input_grad, _GRADS[ctx.kind]):
            fn = _PRODUCTS[kind][0]
            grads.append(fn(*operands(dc, a, b), ctx.grid, ctx.sizes[cut],
                            ctx.purpose + " (grad)") if needed else None)
        return grads[0], grads[1], None, None, None, None


def summa_ab(a: Float[Tensor, "m ka"], b: Float[Tensor, "kb n"], grid: Grid, k: int,
             purpose: str = "summa AB") -> Float[Tensor, "m n"]:
    """This rank's block of ``A B`` from its blocks of ``A [M, k]`` and ``B [k, N]`` (``k``:
    the global inner size; module docstring). Differentiable in both."""
    return _Summa.apply(a, b, grid, "ab", {"k": comm.chunk_sizes(k, grid.q)}, purpose)


def summa_abt(a: Float[Tensor, "m n"], b: Float[Tensor, "kb n"], grid: Grid, k: int,
              purpose: str = "summa ABt") -> Float[Tensor, "m kc"]:
    """This rank's block of ``A Bᵀ`` from its blocks of ``A [M, n]`` and ``B [k, n]`` (``k``:
    the global row count of ``B``, the result's column count)."""
    return _Summa.apply(a, b, grid, "abt", {"k": comm.chunk_sizes(k, grid.q)}, purpose)


def summa_atb(a: Float[Tensor, "k ma"], b: Float[Tensor, "k n"], grid: Grid, m: int,
              purpose: str = "summa AtB") -> Float[Tensor, "mc n"]:
    """This rank's block of ``Aᵀ B`` from its blocks of ``A [k, m]`` and ``B [k, N]`` (``m``:
    the global column count of ``A``, the result's row count)."""
    return _Summa.apply(a, b, grid, "atb", {"m": comm.chunk_sizes(m, grid.q)}, purpose)


class _AllReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, purpose):
        ctx.mesh, ctx.axis, ctx.purpose = mesh, axis, purpose
        return comm.all_reduce(x, mesh, axis, purpose=purpose)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.mesh, ctx.axis, purpose=ctx.purpose + " (grad)"), None, \
            None, None


def all_reduce_both(x: Tensor, mesh: DeviceMesh, axis: str, purpose: str = "") -> Tensor:
    """The sum over ``axis`` forward, and of the gradient backward: for a statistic summed over
    ranks whose consumers differ per rank (a norm's mean square over a split hidden dim, used
    by each rank for its own columns), so each rank's part receives every consumer's gradient.
    """
    if mesh.size(axis) == 1:
        return x
    return _AllReduceBoth.apply(x, mesh, axis, purpose)
