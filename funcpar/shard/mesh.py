"""A device mesh with named axes over torch.distributed process groups.

The world's ranks are laid out row-major over the axes in the order they are given:
``DeviceMesh.from_env(dp=2, tp=2)`` puts global rank ``r`` at ``dp = r // 2, tp = r % 2``, so
the last axis (here ``tp``) holds neighbouring ranks, as torch's ``init_device_mesh`` and
Megatron do. Each axis has one process group per fibre (the ranks that differ only in that
axis's coordinate); :meth:`DeviceMesh.group` gives this rank's.

Three kinds of mesh, one interface:

* :meth:`DeviceMesh.from_env` - the torchrun world (``RANK``/``WORLD_SIZE``/``MASTER_*``), over
  torch's own :class:`torch.distributed.device_mesh.DeviceMesh` (gloo on CPU, NCCL on CUDA).
  With a world of one process it is a *local* mesh and torch.distributed is never initialised.
* a local mesh (every axis of size 1): the single-device run; size-1 axes issue no collective,
  so every sharded code path runs unchanged.
* :meth:`DeviceMesh.virtual` - the shape of a mesh seen from one chosen rank, with no process
  groups: for computing local shapes and slices of any rank in one process (tests, resharding).
  A collective over one of its axes of size > 1 raises.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "DeviceMesh", "default_timeout"]


def _dist() -> Any:
    """torch.distributed, or None where this torch build has none."""
    import torch.distributed as dist

    return dist if dist.is_available() else None


def _distributed_world() -> int | None:
    """The initialised default group's size, or None when torch.distributed is not initialised."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        return dist.get_world_size()
    return None


def _check_axes(axes: Mapping[str, int], *, allow_infer: bool) -> None:
    if not axes:
        raise ValueError("a DeviceMesh needs at least one axis, e.g. DeviceMesh.from_env(dp=2)")
    for name, size in axes.items():
        if not name.isidentifier():
            raise ValueError(f"mesh axis name {name!r} is not an identifier")
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"mesh axis {name!r} size must be an int, got {size!r}")
        if size < 1 and not (allow_infer and size == -1):
            what = "a positive int or -1 (the rest of the world)" if allow_infer else "positive"
            raise ValueError(f"mesh axis {name!r} size must be {what}, got {size}")
    if allow_infer and sum(1 for s in axes.values() if s == -1) > 1:
        raise ValueError(f"at most one mesh axis may be -1 (inferred), got {dict(axes)}")


def _resolve_sizes(axes: Mapping[str, int], world: int) -> dict[str, int]:
    """Axis sizes with a -1 replaced by what the world leaves; their product must be ``world``."""
    known = math.prod(s for s in axes.values() if s != -1)
    sizes = dict(axes)
    for name, size in axes.items():
        if size == -1:
            if world % known:
                raise ValueError(
                    f"mesh axes {dict(axes)}: world size {world} is not divisible by the product "
                    f"{known} of the given axis sizes, so axis {name!r} cannot be inferred"
                )
            sizes[name] = world // known
    product = math.prod(sizes.values())
    if product != world:
        raise ValueError(
            f"mesh axes {sizes} have product {product} but the world size is {world}; "
            f"the product of the mesh axis sizes must equal the number of processes"
        )
    return sizes


#: Read by :func:`default_timeout`: seconds a collective waits before failing.
TIMEOUT_ENV = "FUNCPAR_DIST_TIMEOUT"
DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_timeout() -> timedelta:
    """The process-group timeout ``DeviceMesh.from_env`` uses when given none:
    ``$FUNCPAR_DIST_TIMEOUT`` seconds if set, else :data:`DEFAULT_TIMEOUT` (10 minutes; long
    enough for a first step that compiles or a checkpoint save, short of torch's 30)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"${TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return timedelta(seconds=seconds)


class DeviceMesh:
    """Named mesh axes; ``size(axis)``, ``rank(axis)``, ``group(axis)`` per axis.

    Build one with :meth:`from_env`, :meth:`local` or :meth:`virtual`, not directly.
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        *,
        rank: int = 0,
        groups: Mapping[str, Any] | None = None,
        torch_mesh: Any = None,
        device: torch.device | None = None,
        kind: str = "local",
    ) -> None:
        _check_axes(sizes, allow_infer=False)
        self._sizes = dict(sizes)
        self._world = math.prod(self._sizes.values())
        if not 0 <= rank < self._world:
            raise ValueError(f"rank {rank} is outside a mesh of {self._world} processes")
        self._rank = rank
        self._groups = dict(groups or {})
        self._torch_mesh = torch_mesh
        self._device = device if device is not None else torch.device("cpu")
        self._kind = kind
        self._coords = self.coords(rank)

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def from_env(
        cls,
        *,
        backend: str | None = None,
        timeout: timedelta | None = None,
        **axes: int,
    ) -> DeviceMesh:
        """The mesh over the torchrun world (or over the already initialised default group).

        ``axes`` in order, outermost first; one may be ``-1`` (what the world leaves). No axes:
        one axis ``dp`` over the whole world. The product of the sizes must equal the world size,
        checked before torch.distributed is initialised or any collective runs. With a world of
        one process the mesh is local and torch.distributed is left alone. ``backend``: default
        NCCL when CUDA is available, else gloo (ignored when the default group already exists,
        whose backend then decides the device). ``timeout``: how long a collective waits for
        the other ranks before it fails, default :func:`default_timeout` (10 minutes, or
        ``$FUNCPAR_DIST_TIMEOUT`` seconds) rather than torch's 30 minutes, so that a rank that
        never joins a collective ends the run in bounded time.
        """
        axes = axes or {"dp": -1}
        _check_axes(axes, allow_infer=True)
        world = _distributed_world()
        if world is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        sizes = _resolve_sizes(axes, world)
        if world == 1:
            return cls.local(**sizes)

        dist = _dist()
        if dist is None:
            raise RuntimeError(
                f"a mesh of {world} processes needs torch.distributed, which this torch lacks"
            )
        if not dist.is_initialized():
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if "nccl" in backend:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timeout or default_timeout())
        device = _device_of_backend(dist.get_backend())
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(sizes)
        tmesh = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=names)
        groups = {n: tmesh.get_group(n) for n in names}
        mesh = cls(sizes, rank=dist.get_rank(), groups=groups, torch_mesh=tmesh, device=device,
                   kind="distributed")
        for n in names:
            # Our row-major coordinates must be torch's, or layouts and groups would disagree.
            if tmesh.get_local_rank(n) != mesh.rank(n):
                raise RuntimeError(
                    f"torch's DeviceMesh puts rank {mesh.rank()} at {n}={tmesh.get_local_rank(n)}"
                    f", expected {mesh.rank(n)}"
                )
        return mesh

    @classmethod
    def local(cls, **axes: int) -> DeviceMesh:
        """The single-process mesh: every axis of size 1 (default one axis ``dp``)."""
        axes = axes or {"dp": 1}
        _check_axes(axes, allow_infer=False)
        big = {n: s for n, s in axes.items() if s != 1}
        if big:
            raise ValueError(f"a local (single-process) mesh has axes of size 1 only, got {big}")
        return cls(axes, kind="local")

    @classmethod
    def virtual(cls, *, rank: int = 0, **axes: int) -> DeviceMesh:
        """The mesh's shape as seen from ``rank``, without process groups (no communication)."""
        return cls(axes, rank=rank, kind="virtual")

    def at_rank(self, rank: int) -> DeviceMesh:
        """A virtual mesh of this shape seen from another rank (shapes and slices only)."""
        return DeviceMesh(self._sizes, rank=rank, kind="virtual")

    # ---------------------------------------------------------------------------- accessors
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._sizes)

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` in mesh order."""
        return dict(self._sizes)

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: CUDA with NCCL, else CPU."""
        return self._device

    @property
    def kind(self) -> str:
        """``"distributed"``, ``"local"`` or ``"virtual"``."""
        return self._kind

    @property
    def torch_mesh(self) -> Any:
        """torch's DeviceMesh underneath (None for local and virtual meshes), for DTensor
        interop."""
        return self._torch_mesh

    def _axis(self, axis: str) -> str:
        if axis not in self._sizes:
            raise KeyError(f"mesh has no axis {axis!r}; its axes are {self.axis_names}")
        return axis

    def size(self, axis: str | None = None) -> int:
        """The number of ranks along ``axis`` (the whole mesh when None)."""
        return self._world if axis is None else self._sizes[self._axis(axis)]

    def rank(self, axis: str | None = None) -> int:
        """This process's coordinate along ``axis`` (its global rank when None)."""
        return self._rank if axis is None else self._coords[self._axis(axis)]

    def group(self, axis: str) -> Any:
        """This rank's process group along ``axis``; None for a size-1 axis without groups."""
        self._axis(axis)
        if axis in self._groups:
            return self._groups[axis]
        if self._sizes[axis] == 1:
            return None
        raise RuntimeError(
            f"{self!r} is virtual: it has no process group for axis {axis!r} of size "
            f"{self._sizes[axis]}; build the mesh with DeviceMesh.from_env to communicate"
        )

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{axis: coordinate}`` of a global rank (this one when None), row-major."""
        r = self._rank if rank is None else rank
        if not 0 <= r < self._world:
            raise ValueError(f"rank {r} is outside {self!r}")
        out = {}
        stride = self._world
        for name, size in self._sizes.items():
            stride //= size
            out[name] = (r // stride) % size
        return out

    def rank_of(self, **coords: int) -> int:
        """The global rank at ``coords``; axes left out take this rank's coordinate."""
        full = {**self._coords, **coords}
        unknown = set(coords) - set(self._sizes)
        if unknown:
            raise KeyError(f"mesh has no axes {sorted(unknown)}; its axes are {self.axis_names}")
        r = 0
        for name, size in self._sizes.items():
            if not 0 <= full[name] < size:
                raise ValueError(f"coordinate {name}={full[name]} outside axis of size {size}")
            r = r * size + full[name]
        return r

    def group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``, by coordinate on that axis."""
        return [self.rank_of(**{axis: i}) for i in range(self.size(axis))]

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self._sizes.items())
        return f"DeviceMesh({axes}; rank={self._rank}, {self._kind})"


def _device_of_backend(backend: str) -> torch.device:
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
