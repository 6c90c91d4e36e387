"""2.5D tensor parallelism (Tesseract) on a ``q x q x d`` grid: SUMMA in each depth slice.

Wang et al., "Tesseract: Parallelize the Tensor Parallelism Efficiently" (arXiv 2105.14500);
Colossal-AI's ``2.5d`` mode. ``P = d q²`` ranks on three mesh axes: :data:`DEP` (``tp_dep``,
the depth index ``k``) and the 2D grid's :data:`~funcpar.shard.summa.ROW` x
:data:`~funcpar.shard.summa.COL` (``i``, ``j``).

* The batch rows are cut over depth first, then over the grid row: rank ``(k, i, j)`` holds
  rows chunk ``i`` of depth chunk ``k`` (``d q`` row chunks in all, Colossal-AI's
  ``[m / dq, ..., k / q]``), hidden chunk ``j``.
* A weight is grid-partitioned over the ``q x q`` slice as in 2D and *replicated over depth*
  (parameters ``O(1/q²)``).
* Each depth slice multiplies its own batch rows by SUMMA (:mod:`funcpar.shard.summa`: the
  same ``AB``, ``ABᵀ``, ``AᵀB`` with the same panels), so computation and activations are
  ``O(1 / d q²)``; the activation panels SUMMA broadcasts shrink with ``d``, the weight panels
  do not, which is the seed's ``3 (q - 1)(d + 1) / (d q)`` bandwidth: three activation-panel
  sets over ``d`` plus three weight-panel sets.
* A weight's gradient from one slice covers that slice's rows only: the ``d`` slices' gradients
  are summed over :data:`DEP` after the backward (one all-reduce of this rank's gradient
  bytes, which the seed's formula leaves out), so every replica applies the same update.

At ``d = 1`` this is 2D exactly. The transform is :func:`funcpar.transforms.tp_modes.
shard_params_2d` with this grid (``shard_params(rules, mesh, mode="2.5d")``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from funcpar.shard.summa import Grid

__all__ = ["DEP", "Tesseract"]

#: The mesh axis of a rank's depth index ``k`` (ranks along it hold the same weight blocks).
DEP = "tp_dep"


@dataclass(frozen=True)
class Tesseract(Grid):
    """A ``q x q`` grid (``row`` x ``col``) replicated over ``d`` depth slices (``dep``)."""

    dep: str = DEP
    mode: ClassVar[str] = "2.5d"

    def __post_init__(self) -> None:
        axes = (self.dep, self.row, self.col)
        if any(a not in self.mesh.axis_names for a in axes):
            raise ValueError(f"a 2.5D grid needs mesh axes {axes} (depth, grid row, grid "
                             f"column); the mesh has {self.mesh.axis_names}")
        super().__post_init__()

    @property
    def d(self) -> int:
        return self.mesh.size(self.dep)

    @property
    def k(self) -> int:
        return self.mesh.rank(self.dep)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Depth, then the grid row: rows chunk ``i`` of depth chunk ``k``."""
        return (self.dep, self.row)
