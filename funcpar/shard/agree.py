"""Ranks agree on their run before the first step: ``check_ranks_agree(mesh, config, params)``.

Ranks launched with different arguments either hang (one rank runs more steps and waits in a
collective the others never join) or diverge silently (different seeds, learning rates or
optimizers on data-parallel replicas). At start, every rank gathers every rank's ``config``
(a dict of plain values, e.g. ``vars(args)``) and a SHA-256 digest per leaf of ``params``
(the initial whole parameters, which every rank builds alike) with one ``all_gather_object``
over gloo, and all raise the same ``ValueError`` naming the first key or leaf that differs and
its value on each rank. One small collective at start; nothing after.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from funcpar.shard.mesh import DeviceMesh

__all__ = ["check_ranks_agree", "tensor_digest"]


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (on CPU, contiguous)."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    data = t.detach().to("cpu").contiguous()
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _gloo_group(mesh_or_group: Any) -> Any:
    import torch.distributed as dist

    group = mesh_or_group
    if isinstance(mesh_or_group, DeviceMesh):
        group = None  # every rank of the mesh is in the default group
    if dist.get_backend(group) != "gloo":
        # Objects travel as CPU bytes; under NCCL a gloo group over the same ranks carries them.
        ranks = None if group is None else dist.get_process_group_ranks(group)
        group = dist.new_group(ranks=ranks, backend="gloo")
    return group


def check_ranks_agree(mesh_or_group: Any, config: Mapping[str, Any],
                      params: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise ``ValueError`` on every rank if the ranks' ``config`` or ``params`` differ.

    ``mesh_or_group``: a :class:`DeviceMesh` (its world) or a process group. A local mesh (one
    process) or an uninitialised torch.distributed has nothing to compare and returns at once.
    The message names the key (``--seed`` style for argparse names) or the parameter leaf, and
    the value on each rank that differs from rank 0's.
    """
    import torch.distributed as dist

    if isinstance(mesh_or_group, DeviceMesh) and mesh_or_group.world_size == 1:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = _gloo_group(mesh_or_group)
    digests = {k: tensor_digest(v) for k, v in (params or {}).items()}
    mine = (dict(config), digests)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    ref_config, ref_digests = gathered[0]
    for rank, (cfg, dig) in enumerate(gathered[1:], start=1):
        for key in sorted(set(ref_config) | set(cfg)):
            a, b = ref_config.get(key, "<absent>"), cfg.get(key, "<absent>")
            if a != b:
                flag = "--" + key.replace("_", "-")
                raise ValueError(
                    f"the ranks were launched with different arguments: {flag} is {a!r} on rank "
                    f"0 and {b!r} on rank {rank}; launch every rank with the same flags"
                )
        for leaf in sorted(set(ref_digests) | set(dig)):
            if ref_digests.get(leaf) != dig.get(leaf):
                raise ValueError(
                    f"the ranks' initial parameters differ: leaf {leaf!r} on rank {rank} is not "
                    "rank 0's (every rank must build the same model from the same seed)"
                )
