"""3D tensor parallelism on a ``q x q x q`` cube: ``C = AB`` with exact forward and backward.

Bian et al., "Maximizing Parallelism in Distributed Training for Huge Neural Networks" (arXiv
2105.14450); Colossal-AI's ``3d`` mode. ``P = q³`` ranks on three mesh axes of one size ``q``:
:data:`IN` (``tp_in``), :data:`WGT` (``tp_w``) and :data:`OUT` (``tp_out``).

A product ``C [M, N] = A [M, K] B [K, N]`` (a linear layer: ``A`` the activations, ``B = Wᵀ``)
reads ``A`` on one face of the cube and writes ``C`` on another. For a layer of *parity* ``p``
its input axis ``I`` and output axis ``O`` are ``(tp_in, tp_out)`` when ``p = 0`` and swapped
when ``p = 1``; rank ``(i, w, o)`` (its coordinates along ``I``, :data:`WGT`, ``O``) holds

* ``A``: rows chunk ``w`` then ``i`` (``M / q²``), columns ``K`` chunk ``o`` (``K / q``);
* ``B``: rows ``K`` chunk ``o``, columns ``N`` chunk ``i`` then ``w`` (``N / q²``);
* ``C``: rows chunk ``w`` then ``o``, columns ``N`` chunk ``i``: the layout a layer of parity
  ``1 - p`` reads, so consecutive layers alternate and no activation is moved between them
  (Colossal-AI swaps its input and output groups from one layer to the next the same way).

Forward: ``A`` is all-gathered over ``I`` (rows chunk ``w``, ``M / q``), ``B`` over
:data:`WGT` (``N`` chunk ``i``), their product is the partial sum over ``K`` chunk ``o`` of
``C``'s block ``(w, i)``, and a reduce-scatter over ``O`` sums the partials and cuts the rows.
Backward: ``dC`` is all-gathered over ``O``; ``dA = dC Bᵀ`` (an ``ABᵀ``) is a partial over
``N`` chunk ``i``, reduce-scattered over ``I``; ``dB = Aᵀ dC`` (an ``AᵀB``) a partial over the
rows chunk ``w``, reduce-scattered over :data:`WGT`. Only the rank's own blocks of ``A`` and
``B`` are saved (they are gathered again in the backward), so an activation costs ``1 / q³``
of itself, at two all-gathers more than the six the seed's ``6 (q - 1) / q³`` counts (a
backward keeping the gathered blocks, as Colossal-AI's ``linear_3d`` keeps its gathered input,
holds ``1 / q²`` of the activation instead).

Rows are not cut unevenly here: every rank's ``A`` has the same row count (the transform cuts
the batch into ``q²`` equal chunks and refuses a batch that does not), as the input and output
faces hold different row chunks and a model's code between layers may read a row count from
either; ``K`` and ``N`` may be cut unevenly (``torch.chunk``'s pieces).

Vectors along a hidden dim (biases, norm weights, the embedding table's columns) live on one
layout: its hidden chunk, further cut over its two row axes (``1 / q³`` per rank), gathered
over them for use (:func:`gather_vector`; backward, reduce-scattered: the rows' sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.tp_ops import gather_seq

__all__ = ["IN", "OUT", "WGT", "Cube", "cube_ab", "gather_vector"]

#: The input axis of the layers of parity 0 (those reading the residual stream); their output
#: axis in parity 1.
IN = "tp_in"
#: The weight axis: cuts the activations' rows outermost and the weights' columns innermost.
WGT = "tp_w"
#: The output axis of the layers of parity 0; their input axis in parity 1.
OUT = "tp_out"


@dataclass(frozen=True)
class Cube:
    """A ``q x q x q`` cube over the mesh axes ``inp``, ``wgt``, ``out`` (default
    :data:`IN`, :data:`WGT`, :data:`OUT`)."""

    mesh: DeviceMesh
    inp: str = IN
    wgt: str = WGT
    out: str = OUT

    def __post_init__(self) -> None:
        axes = (self.inp, self.wgt, self.out)
        if any(a not in self.mesh.axis_names for a in axes):
            raise ValueError(f"a 3D cube needs mesh axes {axes}; the mesh has "
                             f"{self.mesh.axis_names}")
        sizes = {a: self.mesh.size(a) for a in axes}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"a 3D cube has equal sides: {sizes}")

    @property
    def q(self) -> int:
        return self.mesh.size(self.wgt)

    def io(self, parity: int) -> tuple[str, str]:
        """``(I, O)``: the input and output axes of a layer of ``parity``."""
        return (self.inp, self.out) if parity == 0 else (self.out, self.inp)

    def row_axes(self, parity: int) -> tuple[str, str]:
        """The axes cutting the rows of the activations a layer of ``parity`` reads, outer
        first: :data:`WGT`, then ``I``."""
        return (self.wgt, self.io(parity)[0])

    def col_axis(self, parity: int) -> str:
        """The axis cutting their hidden dim: ``O``."""
        return self.io(parity)[1]

    def chunk(self, n: int, axis: str) -> int:
        """This rank's piece of ``n`` cut over ``axis``."""
        return comm.chunk_sizes(n, self.q)[self.mesh.rank(axis)]


def _gather(t: Tensor, cube: Cube, axis: str, dim: int, sizes: Sequence[int],
            purpose: str) -> Tensor:
    return comm.all_gather(t, cube.mesh, axis, dim=dim, sizes=list(sizes), purpose=purpose)


def _scatter(t: Tensor, cube: Cube, axis: str, dim: int, sizes: Sequence[int],
             purpose: str) -> Tensor:
    return comm.reduce_scatter(t, cube.mesh, axis, dim=dim, sizes=list(sizes), purpose=purpose)


class _CubeAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, cube, parity, n, purpose):
        i_ax, o_ax = cube.io(parity)
        rows = [a.shape[0]] * cube.q
        cols = comm.chunk_sizes(cube.chunk(n, i_ax), cube.q)
        ctx.save_for_backward(a, b)
        ctx.cube, ctx.axes, ctx.rows, ctx.cols, ctx.purpose = cube, (i_ax, o_ax), rows, cols, \
            purpose
        ag = _gather(a, cube, i_ax, 0, rows, purpose + " A gather")
        bg = _gather(b, cube, cube.wgt, 1, cols, purpose + " B gather")
        return _scatter(ag @ bg, cube, o_ax, 0, rows, purpose + " C partials")

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        cube, (i_ax, o_ax), rows, cols = ctx.cube, ctx.axes, ctx.rows, ctx.cols
        why = ctx.purpose + " (grad)"
        dcg = _gather(dc.contiguous(), cube, o_ax, 0, rows, why + " dC gather")
        da = db = None
        if ctx.needs_input_grad[0]:
            bg = _gather(b, cube, cube.wgt, 1, cols, why + " B gather")
            da = _scatter(dcg @ bg.T, cube, i_ax, 0, rows, why + " dA partials")
        if ctx.needs_input_grad[1]:
            ag = _gather(a, cube, i_ax, 0, rows, why + " A gather")
            db = _scatter(ag.T @ dcg, cube, cube.wgt, 1, cols, why + " dB partials")
        return da, db, None, None, None, None


def cube_ab(a: Float[Tensor, "m ka"], b: Float[Tensor, "kb nb"], cube: Cube, parity: int,
            n: int, purpose: str = "cube AB") -> Float[Tensor, "m nc"]:
    """This rank's block of ``A B`` on the output face of a layer of ``parity`` (module
    docstring), from its blocks of ``A`` and ``B`` (``n``: the global column count of ``B``).
    Differentiable in both; every rank's ``A`` has the same row count."""
    if parity not in (0, 1):
        raise ValueError(f"cube_ab: parity is 0 or 1, got {parity}")
    return _CubeAB.apply(a, b, cube, parity, n, purpose)


def gather_vector(w: Tensor, cube: Cube, parity: int, n: int, dim: int,
                  purpose: str) -> Tensor:
    """The hidden chunk (over ``O`` of ``parity``) of a dim of ``n`` cut over ``(O, WGT, I)``
    (``dim`` of ``w``), gathered over ``I`` then :data:`WGT` (each backward a reduce-scatter,
    which sums the gradients of the ranks' different rows)."""
    (wgt, i_ax), o_ax = cube.row_axes(parity), cube.col_axis(parity)
    h = cube.chunk(n, o_ax)
    hw = comm.chunk_sizes(h, cube.q)
    w = gather_seq(w, cube.mesh, i_ax, comm.chunk_sizes(hw[cube.mesh.rank(wgt)], cube.q),
                   purpose, dim=dim)
    return gather_seq(w, cube.mesh, wgt, hw, purpose, dim=dim)
