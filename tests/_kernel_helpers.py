"""Helpers shared by the multi-tensor kernel tests (tests/test_kernels_adamw.py,
tests/test_kernels_sgd_lamb.py): the Triton skip mark, the output check against a reference,
a few optimizer steps, and a count of the kernel launches (the ``interpret`` fixture is in
conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from conftest import max_rel_err as _max_rel_err

import funcpar.optim as fo
from funcpar.kernels import _launch, triton_available
from funcpar.state.tree import tree_leaves

needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not installed: the "
                                  "kernels cannot run (the references are tested regardless)")


def max_rel_err(a, b):
    """conftest's error, 0 for empty tensors (a leaf of shape (0,) is among the cases)."""
    return _max_rel_err(a, b) if b.numel() else 0.0


def check_outputs(kernel_out, ref_out, tol):
    """Each kernel output has the reference's shape and dtype, no element left unwritten (the
    outputs are poisoned with NaN under ``_launch.poisoned_outputs``), and is within ``tol``
    (max relative error, in float32)."""
    for k, r in zip(kernel_out, ref_out, strict=True):
        if r is None:
            assert k is None
            continue
        assert k.shape == r.shape and k.dtype == r.dtype, (k.shape, r.shape, k.dtype, r.dtype)
        assert not k.isnan().any(), "an output element was not written (poisoned with NaN)"
        assert max_rel_err(k.float(), r.float()) <= tol, max_rel_err(k.float(), r.float())


def grads_like(params, step):
    """Step ``step``'s gradients: normal, of the parameters' shapes and dtypes."""
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}


def train(opt, params, steps, *, fused=True):
    """``steps`` steps of ``opt`` from ``params``: by its fused ``apply``
    (``update_params``), or by ``update`` and ``apply_updates``."""
    state = opt.init(params)
    for i in range(steps):
        grads = grads_like(params, i)
        if fused:
            params, state = fo.update_params(opt, grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = fo.apply_updates(params, updates)
    return params, state


def check_apply_equals_update(opt, params, steps, tol):
    """``steps`` of ``opt`` by its ``apply`` (``update_params``) and by ``update`` +
    ``apply_updates``: the same bits on the per-leaf reference (parameters that require grad,
    grad mode on: there ``apply`` is ``p + u``), and within ``tol`` (max relative error; 0:
    bit for bit) on the default path, where ``apply`` may run torch's fused CPU kernel, which
    rounds the new parameter as one expression (the contract of funcpar.optim.base)."""
    with torch.enable_grad():
        ref = {k: x.clone().requires_grad_() for k, x in params.items()}
        ra, rb = train(opt, ref, steps), train(opt, ref, steps, fused=False)
    for x, y in zip(leaves_of(ra), leaves_of(rb), strict=True):
        assert torch.equal(x.detach(), y.detach())
    a, b = train(opt, params, steps), train(opt, params, steps, fused=False)
    for x, y in zip(leaves_of(a), leaves_of(b), strict=True):
        if tol and x.is_floating_point():
            assert max_rel_err(x, y) <= tol, max_rel_err(x, y)
        else:
            assert torch.equal(x, y)


def leaves_of(tree):
    return [x for x in tree_leaves(tree) if torch.is_tensor(x)]


@contextlib.contextmanager
def counting_launches() -> Iterator[list]:
    """Inside: every tile table built (one per kernel launch) is appended to the list yielded,
    so a test can tell that the kernels ran."""
    calls: list = []
    real = _launch.tile_table
    _launch.tile_table = lambda *a: calls.append(a) or real(*a)
    try:
        yield calls
    finally:
        _launch.tile_table = real
