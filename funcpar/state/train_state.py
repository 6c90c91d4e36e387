"""The whole training state as one pytree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from funcpar.state.tree import Tree, device_of

__all__ = ["TrainState", "generator_state", "init_state"]


@runtime_checkable
class _Initializable(Protocol):
    # funcpar.optim.GradientTransformation; named structurally because state sits below optim.
    init: Callable[[Any], Any]


class TrainState(NamedTuple):
    """Everything a training step reads and writes; a pytree of tensors.

    ``step`` is a 0-d int64 tensor: steps taken (batches consumed; under fp16 loss scaling a
    skipped step counts, while the optimizer's own count does not). ``rng`` is the state of the
    random generator of the parameters' device (``torch.get_rng_state()``'s kind on CPU, a
    CUDA generator's 16 bytes on CUDA: :func:`generator_state`); the step
    restores it around the forward and stores what follows, so dropout-like randomness is part
    of the state and a step repeated on the same state repeats its random draws. ``extras`` is
    a dict of tensors owned by the transforms (``amp_cast``'s loss scale, a data loader's
    position), carried through every step unchanged unless a transform updates it; ``{}``
    from :func:`init_state`.
    """

    params: Tree
    buffers: Tree
    opt_state: Tree
    step: Tensor
    rng: Tensor
    extras: Tree = None


def init_state(
    params: Tree, buffers: Tree, optimizer: _Initializable, seed: int = 0
) -> TrainState:
    """The state of a step that has taken none: ``optimizer.init(params)``, step 0, and the
    generator of the params' device (their first tensor's; the CPU for none) seeded with
    ``seed``."""
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(params),
        step=torch.zeros((), dtype=torch.int64),
        rng=generator_state(device_of(params), seed),
        extras={},
    )


def generator_state(device: torch.device | str, seed: int) -> Tensor:
    """The state of a fresh generator of ``device``'s kind seeded with ``seed``: a CUDA
    generator's on CUDA (its seed and offset, 16 bytes), the CPU's Mersenne Twister otherwise
    (the meta device's too: a lazily built state is materialized later). The two kinds do not
    convert into each other, so a state's ``rng`` must be made for the device its parameters
    live on (``materialize(device=...)`` makes a new one when it moves them)."""
    device = torch.device(device)
    kind = device if device.type == "cuda" else torch.device("cpu")
    return torch.Generator(device=kind).manual_seed(seed).get_state()
