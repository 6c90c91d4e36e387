"""Turn an ``nn.Module`` into a pure function over parameter and buffer trees."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ApplyFn", "functionalize"]

#: ``apply_fn(params, buffers, *args, **kwargs) -> (output, new_buffers)``
ApplyFn = Callable[..., tuple[Any, dict[str, Tensor]]]


def functionalize(module: nn.Module) -> tuple[ApplyFn, dict[str, Tensor], dict[str, Tensor]]:
    """``(apply_fn, params, buffers)`` for ``module``, via ``torch.func.functional_call``.

    ``params`` and ``buffers`` are flat dicts keyed by the dotted names of
    ``named_parameters`` / ``named_buffers`` (tied weights appear once). They are detached
    *views* of the module's tensors, not copies: funcpar never writes a tensor in place, so the
    module's own tensors stay as they are and no memory is doubled.

    ``apply_fn(params, buffers, *args, **kwargs) -> (output, new_buffers)`` is pure. Modules
    that update buffers in their forward (BatchNorm's running statistics) work on copies of the
    buffers, which are returned as ``new_buffers``; the ``buffers`` passed in are never mutated.
    The module's train/eval mode is fixed at the time of ``functionalize`` (it decides, for
    example, whether BatchNorm updates its statistics), so a later ``module.eval()`` does not
    change ``apply_fn``: functionalize again for the other mode. ``apply_fn.module`` is the
    module, for transforms that need its structure.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize expects an nn.Module, got {type(module).__name__}")
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    param_names, buffer_names = set(params), set(buffers)
    training = module.training

    def apply_fn(params: dict[str, Tensor], buffers: dict[str, Tensor], *args, **kwargs):
        if set(params) != param_names:
            _mismatch("params", param_names, set(params))
        if set(buffers) != buffer_names:
            _mismatch("buffers", buffer_names, set(buffers))
        # Copies, so that in-place buffer updates land in the returned tree, not the caller's.
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        was_training = module.training
        module.train(training)
        try:
            out = torch.func.functional_call(
                module, (params, new_buffers), args, kwargs, tie_weights=True, strict=True
            )
        finally:
            module.train(was_training)
        return out, new_buffers

    # Transforms (tensor parallel, remat) look at the module's structure through this.
    apply_fn.module = module
    return apply_fn, params, buffers


def _mismatch(what: str, expected: set[str], got: set[str]) -> None:
    missing, extra = sorted(expected - got), sorted(got - expected)
    raise KeyError(
        f"{what} do not match the module: missing {missing[:5]}, unexpected {extra[:5]}"
    )
