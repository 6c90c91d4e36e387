"""Factored second-moment statistics, shared by Adafactor (both variants) and CAME.

A leaf ``x`` of shape ``(..., n, m)`` is summarised by its row and column means over the last
two dims (Shazeer & Stern 2018, arXiv 1804.04235, section 3):

    R = mean_cols(x)  (shape (..., n)),   C = mean_rows(x)  (shape (..., m)),

and ``x`` is approximated by the rank-1 outer product ``R C^T / mean(R)``. These statistics span
whole dims, so a sharded leaf needs collectives for them: every reduction here goes through
:mod:`funcpar.shard.reduce` with the leaf's layout, on tensors kept in the *leaf's* coordinates
(``keepdim=True``: ``(..., n, 1)`` and ``(..., 1, m)``), so a reduced dim is always the leaf's
own dim index. Messages are O(n + m).

The optimizers' passes over the leaf (statistics, the update's norm, CAME's residual, the update
itself) are :mod:`funcpar.kernels.factored`'s dispatchers: a Triton kernel on CUDA, elsewhere a
plain-torch reference or its in-place eager form (:mod:`funcpar.kernels.foreach_factored`).
Between the passes, :func:`factored_moment` and :func:`clip_divisor` complete the local sums
over the shards with :mod:`funcpar.shard.reduce` (O(n + m) and 0-d messages), so the
same code runs on whole leaves and on TP/ZeRO shards. Their ``*_phases`` forms are the same steps
written as phases (:func:`funcpar.shard.reduce.run_phased`): the optimizers run those of all
leaves in lockstep, so each phase's reductions of the whole tree travel in one all-reduce per
mesh axis instead of one per leaf and axis.

Stored shapes: Hugging Face / fairseq / came-pytorch store ``R`` with shape ``shape[:-1]`` and
``C`` with ``shape[:-2] + shape[-1:]``; torch.optim.Adafactor keeps the ``keepdim`` shapes.
:func:`to_leaf_coords` / :func:`from_leaf_coords` convert; the math runs on ``keepdim`` tensors.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from funcpar.kernels import factored as kernels
from funcpar.kernels.factored import Factors, compute_dtype, decoupled_decay, ema
from funcpar.shard.reduce import (
    Partial,
    Pass,
    Reducible,
    global_shape,
    reduce_mean,
    reduce_sum,
    rms,
    run_phased,
)

__all__ = [
    "RESIDUAL",
    "SECOND_MOMENT",
    "Factors",
    "MomentNames",
    "clip_by_rms",
    "clip_divisor",
    "clip_divisor_phases",
    "compute_dtype",
    "decoupled_decay",
    "ema",
    "ema_rsqrt",
    "eps_pair",
    "factored_moment",
    "factored_moment_phases",
    "factored_rsqrt",
    "from_leaf_coords",
    "init_moment",
    "is_factored",
    "mean_over_rows",
    "no_grad_unless_needed",
    "one_pass",
    "row_col_mean_squares",
    "row_col_means",
    "second_moment",
    "second_moment_phases",
    "to_leaf_coords",
]


class MomentNames(NamedTuple):
    """State keys of one running statistic: its row and column factors and its full form."""

    row: str
    col: str
    full: str | None  # None: the statistic is kept only in factored form (CAME's residual)


SECOND_MOMENT = MomentNames("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")
RESIDUAL = MomentNames("exp_avg_res_row", "exp_avg_res_col", None)


def is_factored(shape: tuple[int, ...] | torch.Size, min_dim_size_to_factor: int = 0) -> bool:
    """Factor over the last two dims iff the leaf has >= 2 dims, both at least the threshold.

    With the default threshold 0 every leaf with >= 2 dims is factored, as in Hugging Face,
    fairseq, came-pytorch and torch.optim.Adafactor.
    """
    shape = tuple(shape)
    return len(shape) >= 2 and min(shape[-2], shape[-1]) >= min_dim_size_to_factor


def init_moment(
    shape: tuple[int, ...] | torch.Size,
    *,
    dtype: torch.dtype,
    device: torch.device | str | None,
    names: MomentNames,
    factored: bool,
    keepdim: bool = False,
) -> dict[str, Tensor]:
    """Zero statistics for a leaf of ``shape``: ``{row, col}`` when factored, else ``{full}``.

    ``keepdim`` stores ``(..., n, 1)`` / ``(..., 1, m)`` (torch.optim.Adafactor's shapes)
    instead of ``shape[:-1]`` / ``shape[:-2] + shape[-1:]``.
    """
    shape = tuple(shape)
    if not factored:
        if names.full is None:
            return {}
        return {names.full: torch.zeros(shape, dtype=dtype, device=device)}
    if keepdim:
        row_shape, col_shape = shape[:-1] + (1,), shape[:-2] + (1,) + shape[-1:]
    else:
        row_shape, col_shape = shape[:-1], shape[:-2] + shape[-1:]
    return {
        names.row: torch.zeros(row_shape, dtype=dtype, device=device),
        names.col: torch.zeros(col_shape, dtype=dtype, device=device),
    }


def to_leaf_coords(row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
    """Stored factors (``shape[:-1]``, ``shape[:-2] + shape[-1:]``) in the leaf's coordinates
    (``(..., n, 1)``, ``(..., 1, m)``)."""
    return row.unsqueeze(-1), col.unsqueeze(-2)


def from_leaf_coords(row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`to_leaf_coords`."""
    return row.squeeze(-1), col.squeeze(-2)


def row_col_means(
    x: Float[Tensor, "*batch rows cols"], *, layout: Reducible | None = None
) -> tuple[Float[Tensor, "*batch rows 1"], Float[Tensor, "*batch 1 cols"]]:
    """Means of ``x`` over its last dim (one per row) and over its second-last (one per column)."""
    row = reduce_mean(x, -1, layout=layout, keepdim=True, purpose="factored row mean")
    col = reduce_mean(x, -2, layout=layout, keepdim=True, purpose="factored column mean")
    return row, col


def row_col_mean_squares(
    g: Float[Tensor, "*batch rows cols"], *, layout: Reducible | None = None
) -> tuple[Float[Tensor, "*batch rows 1"], Float[Tensor, "*batch 1 cols"]]:
    """:func:`row_col_means` of ``g^2``, formed as torch.optim.Adafactor forms them: squared
    (local) norms, summed over the shards, divided by the global size of the dim."""
    shape = global_shape(g, layout)
    row, col = (
        reduce_sum(
            torch.linalg.vector_norm(g, dim=d, keepdim=True).square(),
            d,
            layout=layout,
            keepdim=True,
            purpose=f"factored {what} mean",
        )
        / shape[d]
        for d, what in ((-1, "row"), (-2, "column"))
    )
    return row, col


def mean_over_rows(
    row: Float[Tensor, "*batch rows 1"], *, layout: Reducible | None = None
) -> Float[Tensor, "*batch 1 1"]:
    """The mean of the row factor over the rows (the normaliser of the rank-1 estimate)."""
    return reduce_mean(row, -2, layout=layout, keepdim=True, purpose="factored mean of row stats")


def factored_rsqrt(
    row: Float[Tensor, "*batch rows 1"],
    col: Float[Tensor, "*batch 1 cols"],
    *,
    layout: Reducible | None = None,
) -> Float[Tensor, "*batch rows cols"]:
    """``1 / sqrt(R C^T / mean(R))`` computed as ``rsqrt(R / mean(R)) * rsqrt(C)`` (fairseq's
    order of operations, which Hugging Face and came-pytorch copy)."""
    return (row / mean_over_rows(row, layout=layout)).rsqrt() * col.rsqrt()


def ema_rsqrt(
    x: Tensor,
    stats: dict[str, Tensor],
    names: MomentNames,
    decay: float | Tensor,
    *,
    layout: Reducible | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Update the running statistic of ``x`` kept in ``stats`` and return its inverse square
    root estimate (shape of ``x``) with the new statistics.

    Factored (``names.row`` in ``stats``): ``R <- d R + (1-d) mean_cols(x)``,
    ``C <- d C + (1-d) mean_rows(x)``, estimate ``rsqrt(R / mean(R)) * rsqrt(C)``.
    Full: ``V <- d V + (1-d) x``, estimate ``rsqrt(V)``. Which one is decided by the keys the
    state was initialised with, so the choice is made once, at init.
    """
    if names.row in stats:
        row_mean, col_mean = row_col_means(x, layout=layout)
        row, col = to_leaf_coords(stats[names.row], stats[names.col])
        row, col = ema(row, row_mean, decay), ema(col, col_mean, decay)
        est = factored_rsqrt(row, col, layout=layout)
        row, col = from_leaf_coords(row, col)
        return est, {names.row: row, names.col: col}
    if names.full is None or names.full not in stats:
        raise KeyError(f"state has neither {names.row!r} nor {names.full!r}: {sorted(stats)}")
    v = ema(stats[names.full], x, decay)
    return v.rsqrt(), {names.full: v}


def clip_by_rms(
    u: Tensor, threshold: float | Tensor, *, layout: Reducible | None = None
) -> Tensor:
    """``u / max(1, RMS(u) / threshold)``, RMS over the whole (global) leaf."""
    scale = (rms(u, layout=layout, purpose="update rms") / threshold).clamp(min=1.0)
    return u / scale.to(u.dtype)


def eps_pair(who: str, eps: Any) -> tuple[Any, Any]:
    """``(eps1, eps2)`` from the optimizers' ``eps`` argument, or a clear error."""
    try:
        eps1, eps2 = eps
    except (TypeError, ValueError):
        raise ValueError(f"{who}: eps must be a pair (eps1, eps2), got {eps!r}") from None
    return eps1, eps2


# --------------------------------------------------------------------------------------------
# The passes of Adafactor and CAME, with the layout-aware reductions between them
# --------------------------------------------------------------------------------------------


def no_grad_unless_needed(*inputs: Any) -> contextlib.AbstractContextManager:
    """``torch.no_grad()`` for a step none of whose ``inputs`` (tensors, and lists, tuples and
    dicts of them, nested; anything else ignored) requires grad; else a context that does
    nothing.

    Every tensor of a step derives from its inputs (gradients, parameters, state,
    hyperparameters), so when none of those requires grad no result can, and grad mode off
    changes no value (it records nothing that would have been recorded). It tells the passes
    so once for the whole step: while grad mode is on, each pass asks, leaf by leaf, whether
    any tensor among its arguments requires grad before it takes a fast path
    (:func:`funcpar.kernels.factored.execute_batched`). Under a torch.func transform (wrapped
    tensors) grad mode is left as it is."""
    if not torch.is_grad_enabled() or torch._C._functorch.maybe_current_level() is not None:
        return contextlib.nullcontext()
    todo = list(inputs)
    while todo:
        x = todo.pop()
        if isinstance(x, Tensor):
            if x.requires_grad:
                return contextlib.nullcontext()
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return torch.no_grad()


def one_pass(run, *args, final: bool = False, **kwargs):
    """A phased step (:func:`funcpar.shard.reduce.run_phased`) of one phase: the pass
    ``run`` (a batched pass of :mod:`funcpar.kernels.factored`, e.g. ``sq_row_col_sums_batch``)
    over this leaf's ``args``/``kwargs``; returns its result. ``yield from`` it in a phased
    step: the driver runs the passes of all leaves that reach it in the same round as one
    call (one launch), not one per leaf. ``final``: the result feeds no reduction (the update
    pass; it then waits for every pending reduction, so all leaves' update passes share one
    launch)."""
    (result,) = yield [Pass(run, args, kwargs, final)]
    return result


def factored_moment(
    row_sum: Float[Tensor, "*batch rows 1"],
    col_sum: Float[Tensor, "*batch 1 cols"],
    stats: dict[str, Tensor],
    names: MomentNames,
    decay: float | Tensor,
    *,
    shape: tuple[int, ...],
    layout: Reducible | None = None,
) -> tuple[Factors, dict[str, Tensor]]:
    """New running factors from this shard's row/column sums of ``x`` (the statistics pass).

    ``R <- decay R + (1 - decay) sum_{-1}(x) / m``, ``C <- decay C + (1 - decay) sum_{-2}(x) / n``
    with ``(n, m)`` the leaf's *global* last two dims and the sums completed over the shards
    (:func:`funcpar.shard.reduce.sum_partials` with the leaf's layout; no collective when those
    dims are whole). Returns the :class:`Factors` (with ``mean(R)`` over all rows, also
    completed over the shards) and the new stored statistics. One leaf at a time; the
    optimizers run :func:`factored_moment_phases` of all leaves together instead.
    """
    return run_phased([factored_moment_phases(row_sum, col_sum, stats, names, decay,
                                              shape=shape, layout=layout)])[0]


def factored_moment_phases(row_sum, col_sum, stats, names, decay, *, shape, layout=None):
    """:func:`factored_moment` as a phased step (:func:`funcpar.shard.reduce.run_phased`):
    the row and column sums are completed, the factors' EMAs and mean(R) formed in one
    batched pass (:func:`funcpar.kernels.factored.factor_ema_reference`), then (sharded leaves
    only) the sum of the new row factor over the rows completed."""
    nd = len(shape)
    row_s, col_s = row_sum, col_sum
    if layout is not None:  # whole leaves: nothing to complete, no round of their own
        row_s, col_s = yield [Partial(row_sum, layout, nd - 1, "factored row mean"),
                              Partial(col_sum, layout, nd - 2, "factored column mean")]
    row, col = to_leaf_coords(stats[names.row], stats[names.col])
    # The EMAs and mean(R) (or, sharded, this shard's sum of R), batched over the leaves.
    row, col, part = yield from one_pass(kernels.factor_ema_batch, row_s, col_s, row, col,
                                         decay, shape[-2], shape[-1], layout is not None)
    if layout is None:
        mean_r = part
    else:
        # reduce_mean's arithmetic (local sum, completed, over the global count of rows).
        (r_sum,) = yield [Partial(part, layout, nd - 2, "factored mean of row stats")]
        mean_r = r_sum / shape[-2]
    factors = Factors(row, col, mean_r)
    row, col = from_leaf_coords(row, col)
    return factors, {names.row: row, names.col: col}


def second_moment(
    g: Tensor,
    stats: dict[str, Tensor],
    names: MomentNames,
    decay: float | Tensor,
    eps1: float,
    *,
    layout: Reducible | None = None,
) -> tuple[Factors | Tensor, dict[str, Tensor], Tensor]:
    """Update the second moment of ``g^2 + eps1`` kept in ``stats`` and return
    ``(preconditioner, new statistics, ||g rsqrt(V)|| over this shard)``.

    Factored (``names.row`` in ``stats``, decided at init): the statistics pass
    (:func:`funcpar.kernels.factored.sq_row_col_sums`), :func:`factored_moment`, then the norm
    pass; the preconditioner is :class:`Factors`. Full: one pass updates ``V`` and takes the norm;
    the preconditioner is the new ``V``. The norm feeds :func:`clip_divisor`. One leaf at a time;
    :func:`second_moment_phases` is the phased step.
    """
    return run_phased([second_moment_phases(g, stats, names, decay, eps1, layout=layout)])[0]


def second_moment_phases(g, stats, names, decay, eps1, *, layout=None):
    """:func:`second_moment` as a phased step: the statistics pass, the phases of
    :func:`factored_moment_phases`, the norm pass (factored); the one pass of a full moment."""
    if names.row in stats:
        row_sum, col_sum = yield from one_pass(kernels.sq_row_col_sums_batch, g, eps1)
        factors, new = yield from factored_moment_phases(
            row_sum, col_sum, stats, names, decay, shape=global_shape(g, layout), layout=layout)
        local_norm = yield from one_pass(kernels.scaled_norm_batch, g, factors)
        return factors, new, local_norm
    if names.full is None or names.full not in stats:
        raise KeyError(f"state has neither {names.row!r} nor {names.full!r}: {sorted(stats)}")
    v, local_norm = yield from one_pass(kernels.full_moment_batch, g, stats[names.full], decay,
                                        eps1)
    return v, {names.full: v}, local_norm


def clip_divisor(
    local_norm: Tensor,
    threshold: float | Tensor,
    *,
    shape: tuple[int, ...],
    layout: Reducible | None = None,
) -> Tensor:
    """``max(1, RMS(u) / threshold)`` for the update ``u`` whose norm over this shard is
    ``local_norm``; ``RMS`` over the whole (global) leaf of ``shape``: the squared local norms
    are summed over the shards, as :func:`funcpar.shard.reduce.norm` does. One leaf at a time;
    :func:`clip_divisor_phases` is the phased step."""
    return run_phased([clip_divisor_phases(local_norm, threshold, shape=shape,
                                           layout=layout)])[0]


def clip_divisor_phases(local_norm, threshold, *, shape, layout=None):
    """:func:`clip_divisor` as a phased step: the squared norm completed (sharded leaves
    only), then the divisor formed in one batched pass
    (:func:`funcpar.kernels.factored.clip_divisor_reference`)."""
    norm, squared = local_norm, False
    if layout is not None:
        (norm,) = yield [Partial(local_norm.square(), layout, tuple(range(len(shape))),
                                 "update rms")]
        squared = True
    # max(1, RMS / threshold), batched over the leaves.
    return (yield from one_pass(kernels.clip_divisor_batch, norm, threshold, math.prod(shape),
                                squared))
