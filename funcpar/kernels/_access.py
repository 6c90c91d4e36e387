"""Global-memory access of the multi-tensor kernels: full tiles in 16-byte vectors.

A multi-tensor kernel finds each leaf's tensors by addresses loaded from its leaf table, so
Triton knows nothing of their alignment, and every access is masked by ``offs < numel`` with a
``numel`` also loaded at run time. Either alone keeps the compiler from vectorizing: the PTX then
holds one 4-byte ``ld.global`` per element (benchmarks/compile_kernels.py counts them), where a
bandwidth-bound kernel wants 16-byte ones (fewer instructions and memory transactions per byte).

So a kernel's body is written once as a ``@triton.jit`` function with a ``FULL`` constexpr and
called twice: for a *full* tile (every element inside the leaf) of a launch whose tensors all
start on 16-byte boundaries (``ALIGNED``, checked on the host by
:attr:`funcpar.kernels._launch.LeafGroup.aligned`), with unmasked loads and stores from
addresses marked 16-byte aligned; for the leaf's last, partial tile (or any tile of an unaligned
launch), masked as before. The two compiled bodies compute the same values.

``leaf_load(row, col, offs, mask, TY, FULL)`` reads the tensor whose address is in column
``col`` of the leaf's table row as ``TY``; ``leaf_store`` writes one; ``full_tile`` says which
body a program runs; ``param_load`` and ``update_store`` are the parameter read and the
update (or new parameter) write that the AdamW, SGD and Lamb steps share.
"""

from __future__ import annotations

from typing import Any, no_type_check

from funcpar.kernels import _launch

__all__ = ["access"]


def _build() -> Any:
    # Module globals: under the interpreter a jit function finds those it calls there.
    global tl, leaf_load, leaf_store
    import triton
    import triton.language as tl

    @triton.jit
    @no_type_check
    def full_tile(tiles, pid, n, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        # The program's tile lies wholly inside its leaf, and vector accesses are allowed.
        end = (tl.load(tiles + 2 * pid + 1).to(tl.int64) + 1) * BLOCK
        return (end <= n) & ALIGNED

    @triton.jit
    @no_type_check
    def leaf_load(row, col, offs, mask, TY: tl.constexpr, FULL: tl.constexpr):
        ptr = tl.load(row + col).to(tl.pointer_type(TY))
        if FULL:
            return tl.load(tl.multiple_of(ptr, 16) + offs)
        else:
            return tl.load(ptr + offs, mask=mask)

    @triton.jit
    @no_type_check
    def leaf_store(row, col, offs, value, mask, TY: tl.constexpr, FULL: tl.constexpr):
        ptr = tl.load(row + col).to(tl.pointer_type(TY))
        if FULL:
            tl.store(tl.multiple_of(ptr, 16) + offs, value.to(TY))
        else:
            tl.store(ptr + offs, value.to(TY), mask=mask)

    @triton.jit
    @no_type_check
    def param_load(row, col, offs, mask, dflag, like, P: tl.constexpr,
                   WRITE_PARAMS: tl.constexpr, FULL: tl.constexpr):
        # The parameter in float32, read only where it is needed: to write p + u, or for a
        # leaf with weight decay (dflag 1); zeros otherwise. Not tl.zeros_like: a standard
        # library function, see _launch.combine_fn.
        if WRITE_PARAMS:
            p = leaf_load(row, col, offs, mask, P, FULL).to(tl.float32)
        else:
            p = tl.full(like.shape, 0.0, tl.float32)
            if dflag != 0:
                p = leaf_load(row, col, offs, mask, P, FULL).to(tl.float32)
        return p

    @triton.jit
    @no_type_check
    def update_store(row, col, offs, p, u, mask, P: tl.constexpr, U: tl.constexpr,
                     WRITE_PARAMS: tl.constexpr, FULL: tl.constexpr):
        # The update u (as U), or the new parameter p + u.to(U).to(P), as apply_updates
        # computes it from the updates (GradientTransformation.apply).
        if WRITE_PARAMS:
            u = u.to(U).to(P).to(tl.float32)
            leaf_store(row, col, offs, p + u, mask, P, FULL)
        else:
            leaf_store(row, col, offs, u, mask, U, FULL)

    return full_tile, leaf_load, leaf_store, param_load, update_store


#: ``access()``: ``(full_tile, leaf_load, leaf_store, param_load, update_store)`` in the
#: current mode, bound by a kernel
#: module to globals of those names before it defines its kernels (as ``_launch.leaf_tile``).
access = _launch.lazy_kernels(_build)
