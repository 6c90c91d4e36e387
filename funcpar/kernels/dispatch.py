"""Which implementation runs a fused optimizer step: a Triton kernel or the plain-torch reference.

Every kernel in :mod:`funcpar.kernels` has a reference written in plain torch that computes the
same thing; the optimizers call :func:`use_kernels` with the tensors of a step and take the
kernel only when it says so. The mode comes from :func:`kernel_mode` (a context manager, for
tests and benchmarks) or else the ``FUNCPAR_KERNELS`` environment variable:

* ``auto`` (default): the kernel when every tensor is on a CUDA device and Triton imports;
* ``reference``: always the plain-torch reference;
* ``triton``: always the kernel (but where a step is differentiated, vmapped or traced by
  ``torch.compile``, below). On CPU tensors this needs ``TRITON_INTERPRET=1`` set before
  Triton is first imported (Triton's interpreter runs the kernel in numpy); CI tests the
  kernels on tiny shapes this way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "MODES", "current_mode", "differentiable", "kernel_mode", "triton_available", "use_kernels",
]

MODES = ("auto", "reference", "triton")
_ENV = "FUNCPAR_KERNELS"
_forced: list[str] = []


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` can succeed (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def current_mode() -> str:
    """The innermost :func:`kernel_mode`, else ``$FUNCPAR_KERNELS``, else ``auto``."""
    mode = _forced[-1] if _forced else os.environ.get(_ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@contextlib.contextmanager
def kernel_mode(mode: str) -> Iterator[None]:
    """Run the enclosed steps with ``mode`` (one of :data:`MODES`)."""
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: expected one of {', '.join(MODES)}")
    _forced.append(mode)
    try:
        yield
    finally:
        _forced.pop()


def differentiable(*tensors: object) -> bool:
    """True when grad mode is on and some tensor among ``tensors`` requires grad.

    Then a step must run the plain out-of-place reference, the only path autograd can
    differentiate (Triton kernels and in-place/foreach fast paths are not); non-tensors (numbers,
    ``None``) are ignored. See docs/FUNCTIONAL.md.
    """
    if not torch.is_grad_enabled():
        return False
    # isinstance, not torch.is_tensor (a Python call per tensor): every optimizer step scans
    # all its leaves' tensors here.
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return True
    if torch._C._functorch.maybe_current_level() is None:
        return False
    # A vmap wrapper reports requires_grad=False even when the tensor it batches requires grad
    # (a per-task vmap inside an outer backward: MAML's inner loop), so look through it.
    return any(isinstance(t, torch.Tensor) and _batched_requires_grad(t) for t in tensors)


def _batched_requires_grad(t: torch.Tensor) -> bool:
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


def use_kernels(*tensors: torch.Tensor | None, hyper: Sequence[object] = ()) -> bool:
    """True when the step over ``tensors`` (``None`` entries ignored) should run a kernel.

    False whenever the step must be differentiable (:func:`differentiable`, over ``tensors``
    and the step's ``hyper``-parameters: an ``lr`` that requires grad counts); in mode
    ``triton`` that is an error instead, never a silent detach.
    """
    mode = current_mode()
    if mode == "reference":
        return False
    if torch.compiler.is_compiling():
        # Traced by torch.compile or the whole-step region: inductor fuses the reference's
        # operations itself, and the launchers read numbers out of 0-d tensors, which a trace
        # cannot; every mode takes the reference, as the eager fast paths do.
        return False
    if differentiable(*tensors, *hyper):
        if mode == "triton":
            raise RuntimeError(
                f"{_ENV}=triton: the Triton kernels are not differentiable, but this step has "
                "inputs that require grad with grad mode on; use kernel mode 'reference' "
                "(or 'auto', which takes the reference here) to differentiate through updates"
            )
        return False
    live = [t for t in tensors if t is not None]
    if any(torch._C._functorch.is_batchedtensor(t) for t in live):
        # Under torch.func.vmap (funcpar.train.vmap): a kernel sees one member's storage, not
        # the batch, so every mode takes the reference, which vmap batches.
        return False
    on_cuda = bool(live) and all(t.is_cuda for t in live)
    if mode == "auto":
        return on_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(f"{_ENV}=triton but Triton is not installed (pip install triton)")
    if not on_cuda and not _interpreting():
        raise RuntimeError(
            f"{_ENV}=triton on non-CUDA tensors needs TRITON_INTERPRET=1 set before Triton is "
            "first imported (Triton's CPU interpreter)"
        )
    return True


# The in-place contract lives in its own module; importable from here (see its docstring).
from funcpar.kernels.inplace import fast_path_ok, inplace_allowed, inplace_updates  # noqa: E402, F401
