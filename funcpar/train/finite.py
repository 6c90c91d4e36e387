"""The skipped-step verdict every :class:`~funcpar.train.step.LossScaler` gives: are all the
gradients finite, on every rank?

A step is skipped on every rank or on none: a rank skipping alone would leave its parameters
behind and hang the next collective of the optimizer it did not run. So the verdict is one
0-d flag all-reduced (max) over every axis of the parallel transforms' mesh, and a scaler
under more than one process must be given that mesh. ``amp_cast("fp16")``'s loss scaler and
``skip_nonfinite``'s guard both use this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh

__all__ = ["all_finite", "check_agreement_mesh"]


def all_finite(leaves: Sequence[Tensor | None], mesh: DeviceMesh | None,
               purpose: str = "non-finite gradient check",
               device: torch.device | None = None) -> Tensor:
    """0-d bool: no entry of any of ``leaves`` on any rank of ``mesh`` is inf or nan (the
    same value on every rank: an all-reduce max over each axis of ``mesh`` in turn, recorded
    under ``purpose``). ``device``: where the flag lives when this rank has no entries
    (default: the first leaf's, else the CPU)."""
    tensors = [g for g in leaves if g is not None and g.numel()]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    bad = torch.zeros((), dtype=torch.float32, device=device)
    if tensors:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in tensors]).any().float()
    if mesh is not None:
        for axis in mesh.axis_names:
            if mesh.size(axis) > 1:
                bad = comm.all_reduce(bad, mesh, axis, op="max", purpose=purpose)
    return bad == 0


def check_agreement_mesh(mesh: DeviceMesh | None, who: str) -> None:
    """Refuse a scaler that could not agree: more than one process and no ``mesh``, or a mesh
    that does not cover the world (ValueError naming ``who``)."""
    world = _world_size()
    if world > 1 and mesh is None:
        raise ValueError(f"{who} under {world} processes needs mesh= (the mesh of the parallel "
                         "transforms) to agree on skipped steps")
    if mesh is not None and world > 1 and mesh.world_size != world:
        raise ValueError(f"{who}: the mesh has {mesh.world_size} ranks but the world {world}")


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
