"""When an optimizer step may take a fast path, and when it may write into its inputs.

The contract (re-exported by :mod:`funcpar.kernels.dispatch`):

* **Purity by default.** Outside :func:`inplace_updates` an optimizer's ``update``/``apply``
  never modifies the tensors it is given (gradients, parameters, optimizer state); the fast
  paths below then run on clones of the tensors they overwrite.
* **Donation.** Inside :func:`inplace_updates` (entered by a donated train step around the
  optimizer call, ``make_train_step(..., donate=True)``) the fast path MAY overwrite the given
  parameters and optimizer-state tensors in place and return them as the new values. Gradients
  are never written. The caller must treat the inputs as consumed.
* **One maths path.** Donated or not, the same in-place fused/foreach code computes the result
  (on the inputs or on their clones), so the two are bit-identical.
* **torch's fused kernels.** On CPU, a parameter-writing step (``apply``) of AdamW or SGD runs
  torch's own fused kernel (``torch._fused_adamw_``/``torch._fused_sgd_``, what
  ``torch.optim.AdamW(fused=True)``/``SGD(fused=True)`` run) where :func:`fused_leaves_ok`
  allows: one pass, no temporaries. Its rounding of the new parameter is its own, so there
  ``apply`` equals ``update`` + ``apply_updates`` to round-off (funcpar.optim.base).
* **Stepping aside.** The fast paths are in-place and not differentiable, and in-place writes
  into a ``torch.func.vmap``-batched tensor are refused; :func:`fast_path_ok` says False when the
  step must be differentiable (:func:`funcpar.kernels.dispatch.differentiable`) or runs under a
  torch.func transform, and the optimizer then takes its plain out-of-place reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "FUSED_DTYPES", "copies", "decay_calls", "fast_path_ok", "fused_leaves_ok",
    "inplace_allowed", "inplace_updates", "writable",
]

_depth: list[bool] = []


@contextlib.contextmanager
def inplace_updates(enabled: bool = True) -> Iterator[None]:
    """Let the enclosed optimizer steps overwrite their parameter and state inputs in place
    (``enabled=False`` restores purity inside an outer scope)."""
    _depth.append(bool(enabled))
    try:
        yield
    finally:
        _depth.pop()


def inplace_allowed() -> bool:
    """Whether the innermost :func:`inplace_updates` scope allows in-place writes (False
    outside any scope)."""
    return bool(_depth) and _depth[-1]


def fast_path_ok(*tensors: object) -> bool:
    """Whether a step over ``tensors`` may run the in-place multi-tensor (``torch._foreach_*``)
    or fused (``torch._fused_*``) path. Those are plain torch, so the kernel mode does not
    matter; but never when the step must be differentiable, nor under a torch.func transform
    (vmap, grad, jvp), where the wrapped tensors accept no in-place write from unwrapped ones."""
    from funcpar.kernels import dispatch  # dispatch re-exports this module: import at call time

    if dispatch.differentiable(*tensors):
        return False
    return torch._C._functorch.maybe_current_level() is None


def writable(tensors: Sequence[Tensor | None]) -> list[Tensor | None]:
    """``tensors`` themselves inside :func:`inplace_updates`, else clones (``None`` kept): the
    buffers a fast path may overwrite without touching the caller's values."""
    if inplace_allowed():
        return list(tensors)
    return copies(tensors)


def copies(tensors: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Clones of ``tensors`` (``None`` kept): buffers a fast path may overwrite whatever the
    scope (:func:`writable` outside :func:`inplace_updates`)."""
    return [None if t is None else t.clone() for t in tensors]


# The dtypes torch's CPU fused AdamW/SGD kernels dispatch on.
FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def fused_leaves_ok(*columns: Sequence[Tensor | None],
                    dtypes: Sequence[torch.dtype] = FUSED_DTYPES) -> bool:
    """Whether torch's CPU fused optimizer kernels can run over these lists of leaves
    (``columns[k][i]``: tensor ``k`` of leaf ``i``, ``None`` skipped): every tensor on the CPU
    and the tensors of each leaf of one dtype among ``dtypes`` (they do not promote; a kernel
    may trust fewer than :data:`FUSED_DTYPES`). Strided leaves are accepted: the caller runs
    the kernel on :func:`dense` copies of them (the kernels walk raw storage and would accept
    a strided view silently)."""
    for row in zip(*columns, strict=True):
        first = row[0] if row[0] is not None else next(t for t in row if t is not None)
        dtype = first.dtype
        if dtype not in dtypes:
            return False
        for t in row:
            if t is not None and (t.dtype != dtype or not t.is_cpu):
                return False
    return True


def dense(tensors: Sequence[Tensor | None]) -> tuple[list[Tensor | None],
                                                     list[tuple[Tensor, Tensor]]]:
    """``tensors`` for a fused kernel: each contiguous one itself, a strided one (a ZeRO part
    cut along a later dim, say) as a contiguous copy; and the ``(original, copy)`` pairs that
    :func:`write_back` copies back after the kernel wrote the copies. So a leaf takes the fused
    maths whatever its strides, and a layout that cuts leaves into strided parts rounds as
    one that does not (an all-or-nothing fallback made ZeRO parts round differently from an
    offloaded run's dense copies of the same values)."""
    out: list[Tensor | None] = []
    pairs: list[tuple[Tensor, Tensor]] = []
    for t in tensors:
        if t is None or t.is_contiguous():
            out.append(t)
        else:
            c = t.contiguous()
            out.append(c)
            pairs.append((t, c))
    return out, pairs


def write_back(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Copy each kernel-written dense copy of :func:`dense` into its strided original."""
    if not pairs:  # the usual case: no grad-mode switch for nothing
        return
    with torch.no_grad():
        for t, c in pairs:
            t.copy_(c)


def decay_calls(decay: Sequence[bool], weight_decay: float) -> list[tuple[float, list[int]]]:
    """The fused kernels' calls under a weight-decay mask, ``[(weight_decay, leaf indices)]``:
    the masked-out leaves in a call of their own with a decay of 0 (the kernels take one decay
    per call and skip a zero one); empty groups left out."""
    every = list(range(len(decay)))
    if weight_decay == 0:
        return [(weight_decay, every)] if every else []
    calls = [(weight_decay, [i for i in every if decay[i]]),
             (0.0, [i for i in every if not decay[i]])]
    return [(wd, ids) for wd, ids in calls if ids]
