"""Layout-aware reductions: the one place where optimizers meet sharding.

Every global quantity an optimizer needs (a row sum, a column mean, a norm, a max) is computed
here from the *local* tensor and the leaf's layout. With ``layout=None`` (a tensor that is whole
on this process) each function is the plain torch op. A layout is any object with

* ``global_shape`` - the shape of the whole tensor, and
* ``all_reduce(t, dims, op, purpose)`` - combine a locally reduced ``t`` over exactly the mesh
  axes that split ``dims`` (a no-op when none does), with ``op`` in ``{"sum", "max"}``.

so optimizer code never asks "which parallelism is this?": it asks for a reduction over dims.
A layout may also offer ``axes_for(dims)`` (the mesh axes that split ``dims``):
:func:`total_sum_of_squares` then sums many leaves with one collective per distinct set of
axes instead of one per leaf, and :func:`sum_partials` (given also the layout's ``mesh``)
completes many leaves' partial sums with one collective per mesh axis.

A layout describes one leaf. A *tree* can be split too: under pipeline parallelism each rank
of the ``pp`` axis holds other leaves (its stages'), so a tree-wide quantity (the global
gradient norm) is a sum over those ranks as well. :func:`tree_split_over` says so for the code
it encloses: :func:`total_sum_of_squares`, the only tree-wide reduction the optimizers make
(every other function here reduces one leaf, which lives whole on one stage), then adds one
all-reduce of its final sum over the named axes. Outside that context nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import struct
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "Partial",
    "Pass",
    "Reducible",
    "active_tree_split",
    "global_shape",
    "local_sum_of_squares",
    "norm",
    "reduce_max",
    "reduce_mean",
    "reduce_sum",
    "rms",
    "run_phased",
    "run_requests",
    "sum_of_squares",
    "sum_partial",
    "sum_partials",
    "together",
    "total_sum_of_squares",
    "tree_split_over",
]


@runtime_checkable
class Reducible(Protocol):
    """What a reduction needs to know of a leaf's layout."""

    global_shape: tuple[int, ...]

    def all_reduce(self, t: Tensor, dims: tuple[int, ...], op: str, purpose: str) -> Tensor: ...


def _dims(x: Tensor, dims: int | Sequence[int] | None) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(x.dim()))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted(d % x.dim() for d in dims)) if x.dim() else ()


def global_shape(x: Tensor, layout: Reducible | None) -> tuple[int, ...]:
    return tuple(x.shape) if layout is None else tuple(layout.global_shape)


def _finish(
    local: Tensor, dims: tuple[int, ...], layout: Reducible | None, op: str, purpose: str
) -> Tensor:
    if layout is None or not dims:
        return local
    return layout.all_reduce(local, dims, op, purpose)


def reduce_sum(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    layout: Reducible | None = None,
    keepdim: bool = False,
    purpose: str = "sum",
) -> Tensor:
    """Sum of the whole (global) tensor over ``dims``, given this process's shard ``x``."""
    d = _dims(x, dims)
    local = x.sum(dim=d, keepdim=keepdim) if d else x.clone()
    return _finish(local, d, layout, "sum", purpose)


def reduce_mean(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    layout: Reducible | None = None,
    keepdim: bool = False,
    purpose: str = "mean",
) -> Tensor:
    """Mean over ``dims`` of the global tensor: the global sum over the global element count."""
    d = _dims(x, dims)
    if layout is None:
        return x.mean(dim=d, keepdim=keepdim) if d else x.clone()
    shape = global_shape(x, layout)
    count = math.prod(shape[i] for i in d)
    return reduce_sum(x, d, layout=layout, keepdim=keepdim, purpose=purpose) / count


def reduce_max(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    layout: Reducible | None = None,
    keepdim: bool = False,
    purpose: str = "max",
) -> Tensor:
    d = _dims(x, dims)
    if layout is not None and any(x.shape[i] == 0 for i in d):
        # An uneven split can leave this rank an empty shard: it contributes max's identity
        # (amax itself refuses an empty reduced dim).
        shape = [1 if i in d else n for i, n in enumerate(x.shape) if keepdim or i not in d]
        lowest = -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
        local = x.new_full(shape, lowest)
    else:
        local = x.amax(dim=d, keepdim=keepdim) if d else x.clone()
    return _finish(local, d, layout, "max", purpose)


def sum_of_squares(
    x: Tensor, *, layout: Reducible | None = None, purpose: str = "sum_of_squares"
) -> Tensor:
    """``sum(x**2)`` over the whole global tensor, as a 0-d tensor."""
    d = _dims(x, None)
    local = torch.linalg.vector_norm(x).square() if x.numel() else x.new_zeros(())
    return _finish(local, d, layout, "sum", purpose)


def total_sum_of_squares(
    xs: Sequence[Tensor], layouts: Sequence[Reducible | None], *, purpose: str = "sum_of_squares"
) -> Tensor:
    """``sum over leaves of sum(x**2)``, each leaf whole (global), as a 0-d tensor.

    Local sums are accumulated in float32 (float64 for float64 leaves) and grouped by the mesh
    axes that split them, so a tree of sharded leaves costs one all-reduce per distinct set of
    axes (one per leaf for a layout without ``axes_for``), not one per leaf. Under
    :func:`tree_split_over` the result is summed over the tree's split axes as well (one more
    all-reduce), leaving out the leaves it declares held elsewhere.
    """
    if len(xs) != len(layouts):
        raise ValueError(f"{len(xs)} tensors but {len(layouts)} layouts")
    split = _TREE_SPLIT.get()
    missing = 0
    if split is not None and split.held_elsewhere:
        # Leaves another rank counts (tied weights) are left out here (module docstring).
        skip = {id(t) for t in split.held_elsewhere}
        missing = len(skip - {id(x) for x in xs})
        kept = [(x, lay) for x, lay in zip(xs, layouts) if id(x) not in skip]
        xs, layouts = [x for x, _ in kept], [lay for _, lay in kept]
    total = _local_total(xs, layouts, purpose)
    if split is None:
        return total
    if not xs:  # a rank holding no leaf of the tree still takes part in the all-reduce
        total = torch.zeros((), dtype=torch.float64, device=split.mesh.device)
    return _split_total(split, total, missing, purpose)


def _local_total(
    xs: Sequence[Tensor], layouts: Sequence[Reducible | None], purpose: str
) -> Tensor:
    unsharded = all(lay is None for lay in layouts)
    if unsharded and (on_host := _host_fold(xs)) is not None:
        return on_host
    squares = _local_squares(xs)
    if squares and unsharded:
        unsharded = _fold_unsharded(squares)
        if unsharded is not None:
            return unsharded
    groups: dict[tuple, tuple[Tensor, Reducible | None, int]] = {}
    for i, (x, lay) in enumerate(zip(xs, layouts)):
        acc = squares[i].dtype
        local = squares[i]
        dims = tuple(range(x.dim()))
        if lay is None or not dims:
            key: tuple = (acc, ())
        elif hasattr(lay, "axes_for"):
            key = (acc, tuple(lay.axes_for(dims)))
        else:
            key = (acc, ("leaf", i))
        total, rep, nd = groups.get(key, (None, lay, len(dims)))
        groups[key] = (local if total is None else total + local.to(total.device), rep, nd)
    sums = [
        total if rep is None or not key[1] else rep.all_reduce(total, tuple(range(nd)), "sum",
                                                               purpose)
        for key, (total, rep, nd) in groups.items()
    ]
    if not sums:
        return torch.zeros(())
    acc = torch.float64 if any(t.dtype == torch.float64 for t in sums) else torch.float32
    return torch.stack([t.to(acc).to(sums[0].device) for t in sums]).sum()


def _fold_unsharded(squares: list[Tensor]) -> Tensor | None:
    """:func:`_local_total`'s sum when no leaf is sharded and all share one accumulation dtype
    and device (the grad-norm metric of one process, every step): the same left fold in the
    same dtype, so the same bits, without the general path's per-leaf grouping; ``None``
    otherwise."""
    first = squares[0]
    if any(sq.dtype != first.dtype or sq.device != first.device for sq in squares):
        return None
    total = first
    for sq in squares[1:]:
        total = total + sq
    # The general path ends with a one-element stack summed: the value itself, bit for bit.
    return total if len(squares) > 1 else first.clone()


_FLOAT32 = struct.Struct("f")


def _acc_of(x: Tensor) -> torch.dtype:
    # Squares accumulate in float32, float64 tensors' in float64.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _host_fold(xs: Sequence[Tensor]) -> Tensor | None:
    """:func:`_fold_unsharded` of :func:`_local_squares`, bit for bit, with the squares and the
    fold done on the host: eager CPU tensors of one dtype that nothing differentiates (the
    grad-norm metric of a CPU step), where the 2n tensor ops of the squares and the fold cost
    more than the norms themselves. ``None`` otherwise.

    The same bits: one multi-tensor norm gives the same per-leaf norms; in float64 the
    host's multiplications and additions are the tensor ops' own. In float32 each product
    and sum is formed in float64 and rounded to float32: a product of two float32 numbers is
    exact in float64, and a float64 sum of two float32 numbers rounded to float32 is the
    correctly rounded float32 sum (Figueroa, "When is double rounding innocuous?", SIGNUM
    1995), so each step is the float32 operation's result; a sum past float32's range is inf,
    as in float32 (CPUs that flush float32 subnormals, ``torch.set_flush_denormal``, could
    differ below 1e-38)."""
    if (len(xs) < 2 or torch.compiler.is_compiling()
            or torch._C._functorch.maybe_current_level() is not None):
        return None
    x0 = xs[0]
    if x0.device.type != "cpu" or not all(
            x.dtype == x0.dtype and x.device == x0.device and x.numel() and not x.requires_grad
            for x in xs):
        return None
    acc = _acc_of(x0)
    norms = torch.stack(torch._foreach_norm(list(xs), 2, dtype=acc)).tolist()
    if acc == torch.float64:
        total = norms[0] * norms[0]
        for v in norms[1:]:
            total = total + v * v
        return torch.tensor(total, dtype=acc)
    pack, unpack = _FLOAT32.pack, _FLOAT32.unpack
    try:
        total = unpack(pack(norms[0] * norms[0]))[0]
        for v in norms[1:]:
            total = unpack(pack(total + unpack(pack(v * v))[0]))[0]
    except OverflowError:  # a finite float64 that rounds past float32's largest: inf
        total = math.inf
    return torch.tensor(total, dtype=acc)


def _local_squares(xs: Sequence[Tensor]) -> list[Tensor]:
    """Each tensor's ``sum(x**2)``, accumulated in float32 (float64 for float64 tensors), 0 for
    an empty one. Eagerly, outside torch.func transforms, by one multi-tensor norm per
    accumulation dtype and device (the same per-tensor kernel, so the same values as one
    ``vector_norm`` per tensor, at one call for the whole tree: the grad-norm metric runs every
    step); else one ``vector_norm`` per tensor (foreach ops have no vmap rule)."""
    batched = (len(xs) > 1 and not torch.compiler.is_compiling()
               and torch._C._functorch.maybe_current_level() is None)
    if batched:
        # The common tree: one dtype, one device, no empty leaf: one norm call, no buckets.
        x0 = xs[0]
        if all(x.dtype == x0.dtype and x.device == x0.device and x.numel() for x in xs):
            norms = torch._foreach_norm(list(xs), 2, dtype=_acc_of(x0))
            return list(torch._foreach_mul(norms, norms))
    out: list[Tensor | None] = [None] * len(xs)
    buckets: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        if not x.numel():
            out[i] = torch.zeros((), dtype=_acc_of(x), device=x.device)
        elif batched:
            buckets.setdefault((_acc_of(x), x.device), []).append(i)
        else:
            out[i] = torch.linalg.vector_norm(x, dtype=_acc_of(x)).square()
    for (acc, _), ids in buckets.items():
        norms = torch._foreach_norm([xs[i] for i in ids], 2, dtype=acc)
        for i, sq in zip(ids, torch._foreach_mul(norms, norms), strict=True):
            out[i] = sq
    return out  # type: ignore[return-value]


class _TreeSplit(NamedTuple):
    mesh: Any
    axes: tuple[str, ...]
    held_elsewhere: tuple[Tensor, ...]


_TREE_SPLIT: contextvars.ContextVar[_TreeSplit | None] = contextvars.ContextVar(
    "funcpar_tree_split", default=None)


@contextlib.contextmanager
def tree_split_over(
    mesh: Any, axes: str | Sequence[str], *, held_elsewhere: Sequence[Tensor] = ()
) -> Iterator[None]:
    """Within this context, the trees given to :func:`total_sum_of_squares` are split over the
    mesh ``axes`` *by leaf*: each rank along them holds other leaves (pipeline stages), so the
    whole tree's sum is the sum over those ranks of each rank's own.

    ``total_sum_of_squares(xs, layouts)`` then returns ``sum over ranks r of the axes of
    S_r``, where ``S_r`` is what it returns outside the context on rank ``r`` (each leaf whole
    over its own layout's axes) - one more all-reduce of the final 0-d sum (together with a
    check count, below) per axis, recorded through :mod:`funcpar.shard.comm` with the call's
    purpose + ``" (tree split over <axes>)"``. Every rank along ``axes`` must make the same
    sequence of calls (they do: the optimizer and the step run the same code on every stage).

    ``held_elsewhere``: leaves this rank holds that a rank before it along ``axes`` also holds
    with the same value (a weight tied between the first and the last pipeline stage); they
    count on that rank only. They are recognised by identity, so each must be among the
    ``xs`` of every call inside the context (a transformation that replaced the gradients
    before the norm would hide them); when one is not, every rank raises a ValueError after the
    all-reduce (which carries the count of missing leaves), rather than count it twice or
    leave the other ranks waiting.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in axes:
        if not isinstance(a, str) or a not in getattr(mesh, "axis_names", ()):
            raise ValueError(f"tree_split_over: the mesh has no axis {a!r}; its axes are "
                             f"{getattr(mesh, 'axis_names', None)}")
    if _TREE_SPLIT.get() is not None:
        raise ValueError("tree_split_over is already active: one tree split at a time")
    token = _TREE_SPLIT.set(_TreeSplit(mesh, axes, tuple(held_elsewhere)))
    try:
        yield
    finally:
        _TREE_SPLIT.reset(token)


def active_tree_split() -> Any:
    """The :func:`tree_split_over` in force (mesh, axes, leaves held elsewhere), or ``None``:
    what :func:`total_sum_of_squares` will sum over besides the leaves' own layouts. A norm
    computed under one split stands for the same tree only under the same split."""
    return _TREE_SPLIT.get()


def _split_total(split: _TreeSplit, total: Tensor, missing: int, purpose: str) -> Tensor:
    """``total`` (this rank's share) summed over the split's axes, with the missing count."""
    from funcpar.shard import comm  # late: reduce.py itself stays free of the mesh layer

    # In float64 whatever the leaves' dtype, so that ranks whose leaves differ in dtype still
    # exchange buffers of one type; the result comes back in this rank's accumulation dtype.
    both = torch.stack([total.to(torch.float64), torch.tensor(float(missing),
                                                              dtype=torch.float64,
                                                              device=total.device)])
    tag = f"{purpose} (tree split over {'x'.join(split.axes)})"
    for axis in split.axes:
        both = comm.all_reduce(both, split.mesh, axis, purpose=tag)
    if int(both[1].item()):
        raise ValueError(
            f"total_sum_of_squares ({purpose}) under tree_split_over({split.axes}): "
            f"{int(both[1].item())} leaf/leaves declared held_elsewhere on some rank were not "
            "among the tensors it was given (it finds them by identity: was the tree replaced "
            "before the norm, e.g. a transformation before clip_by_global_norm?), so a shared "
            "leaf could not be counted once")
    return both[0].to(total.dtype)


def norm(x: Tensor, *, layout: Reducible | None = None, purpose: str = "norm") -> Tensor:
    """The Frobenius (L2) norm of the whole global tensor."""
    if layout is None:
        return torch.linalg.vector_norm(x)
    return sum_of_squares(x, layout=layout, purpose=purpose).sqrt()


def rms(x: Tensor, *, layout: Reducible | None = None, purpose: str = "rms") -> Tensor:
    """Root mean square of the whole global tensor: ``norm / sqrt(numel)``."""
    n = math.prod(global_shape(x, layout))
    return norm(x, layout=layout, purpose=purpose) / math.sqrt(n)


def sum_partial(
    x: Tensor,
    dims: int | Sequence[int],
    *,
    layout: Reducible | None = None,
    purpose: str = "partial sum",
) -> Tensor:
    """Complete a contraction over ``dims`` of the leaf that ``layout`` describes.

    ``x`` is what this rank computed from its shard, a product that summed over its local part
    of ``dims`` (say ``P_local^T G_local`` for a contraction over the rows of ``G``); ``x`` need
    not have the leaf's shape. The whole contraction is the sum of these over the axes that
    split ``dims``: one all-reduce per such axis, none when ``dims`` are whole (or no layout).
    """
    d = tuple(sorted({dims} if isinstance(dims, int) else set(dims)))
    return _finish(x, d, layout, "sum", purpose)


def sum_partials(
    partials: Sequence[Tensor],
    layouts: Sequence[Reducible | None],
    dims: Sequence[int | Sequence[int] | None],
    *,
    op: str = "sum",
    purpose: str | Sequence[str] = "batched partial sums",
) -> list[Tensor]:
    """:func:`sum_partial` of many leaves at once: one all-reduce per mesh axis, not per leaf.

    ``partials[i]`` is what this rank reduced over its local part of ``dims[i]`` of the leaf
    that ``layouts[i]`` describes (any shape; ``dims[i] = None``: all of the leaf's dims).
    Returns, for each ``i``, ``partials[i]`` combined with ``op`` (``"sum"`` or ``"max"``)
    over exactly the mesh axes that split ``dims[i]`` - the value
    ``sum_partial(partials[i], dims[i], layout=layouts[i])`` has, element for element (an
    all-reduce combines each entry of a buffer independently; with more than two ranks along
    an axis the backend may add in another order, i.e. round differently in the last bit).
    A partial that needs no reduction (no layout, no dims, no axis splits them) is returned
    as it is. ``purpose``: one for all, or one per partial; a batched message is recorded with
    the distinct purposes of the partials it carries joined by ``" + "``.

    Why: the optimizers' per-leaf scalars (Lamb's norms, Adafactor's RMS) cost one tiny
    message per leaf and axis; here the partials of all leaves that need a given axis travel
    as one flat buffer (per mesh, dtype and device), in mesh axis order - the order in which
    :meth:`Layout.all_reduce` would reduce each of them. Layouts without ``axes_for`` and
    ``mesh`` fall back to their own ``all_reduce``, one leaf at a time. Every rank along an
    axis must make the same call (the optimizers do: the same code over the same layouts).
    """
    from funcpar.shard import comm  # late: as in _split_total

    purposes = [purpose] * len(partials) if isinstance(purpose, str) else list(purpose)
    if not len(partials) == len(layouts) == len(dims) == len(purposes):
        raise ValueError(f"sum_partials: {len(partials)} partials, {len(layouts)} layouts, "
                         f"{len(dims)} dims and {len(purposes)} purposes: one of each per leaf")
    if op not in ("sum", "max"):
        raise ValueError(f"sum_partials ({purposes[:1]}): op must be 'sum' or 'max', got {op!r}")
    out = list(partials)
    # (id(mesh), dtype, device) -> (mesh, [(leaf index, its axes)])
    groups: dict[tuple, tuple[Any, list[tuple[int, tuple[str, ...]]]]] = {}
    for i, (x, lay, d) in enumerate(zip(partials, layouts, dims)):
        if lay is None:
            continue
        nd = len(lay.global_shape)
        if d is None:
            d = tuple(range(nd))
        elif isinstance(d, int):
            d = (d,)
        d = tuple(sorted({k % nd for k in d})) if nd else ()
        if not d:
            continue
        mesh = getattr(lay, "mesh", None)
        if mesh is None or not hasattr(lay, "axes_for"):
            out[i] = lay.all_reduce(x, d, op, purposes[i])
            continue
        axes = tuple(lay.axes_for(d))
        if axes:
            key = (id(mesh), x.dtype, x.device)
            groups.setdefault(key, (mesh, []))[1].append((i, axes))
    for mesh, members in groups.values():
        for axis in mesh.axis_names:
            picked = [i for i, axes in members if axis in axes]
            if not picked:
                continue
            flat = torch.cat([out[i].reshape(-1) for i in picked])
            why = " + ".join(dict.fromkeys(purposes[i] for i in picked))
            flat = comm.all_reduce(flat, mesh, axis, op=op, purpose=why)
            for i, piece in zip(picked, flat.split([out[i].numel() for i in picked])):
                out[i] = piece.view(out[i].shape)
    return out


def local_sum_of_squares(x: Tensor) -> Tensor:
    """``sum(x**2)`` of this shard as :func:`sum_of_squares` forms it before its all-reduce
    (the square of torch's norm; 0 for an empty shard), to complete with :func:`sum_partials`."""
    return torch.linalg.vector_norm(x).square() if x.numel() else x.new_zeros(())


class Partial(NamedTuple):
    """One reduction a phased step asks for: :func:`sum_partials`' arguments for one leaf."""

    x: Tensor
    layout: Reducible | None
    dims: int | Sequence[int] | None  # None: all of the leaf's dims
    purpose: str


class Pass(NamedTuple):
    """One pass over a leaf's tensors a phased step asks for (a kernel launch, say).

    ``run`` is a *batched* executor: ``run(calls)`` takes a list of ``(args, kwargs)``, one per
    leaf, and returns the list of their results. :func:`run_requests` hands it every request of
    a round that names the same ``run``, so one launch serves all leaves where per-leaf calls
    would launch once per leaf. ``final``: the result feeds no reduction of the step (the
    update pass); such passes wait until no reduction is pending, so all leaves' final passes
    share one round (:func:`together`).
    """

    run: Callable[[list[tuple[tuple, Mapping[str, Any]]]], list[Any]]
    args: tuple
    kwargs: Mapping[str, Any] = MappingProxyType({})
    final: bool = False


#: A per-leaf step written as phases: a generator that yields the requests (:class:`Partial`,
#: :class:`Pass`) it needs done (a list per phase), is sent back their results in the same
#: order, and returns its result.
Phased = Generator[list[Any], list[Any], Any]

# Scheduling classes of a phase's request list (together): passes that reductions wait for,
# then reductions, then final passes.
_COMPUTE, _REDUCE, _FINAL = 0, 1, 2


def _klass(requests: list[Any]) -> int:
    # One scan (this runs for every leaf in every round).
    klass = _FINAL if requests else _COMPUTE
    for r in requests:
        if isinstance(r, Partial):
            return _REDUCE
        if klass == _FINAL and not (isinstance(r, Pass) and r.final):
            klass = _COMPUTE
    return klass


def together(*steps: Phased) -> Phased:
    """Phased steps run side by side as one phased step; returns the tuple of their results.

    Each round yields the request lists of the steps that are ready *and* of the earliest
    class among them: lists with passes only (no :class:`Partial`) first, then lists holding
    reductions, then lists of final passes (the other steps keep their lists for a later
    round). So a step's reductions wait while another step still has a pass to run before its
    own reductions, and then they all travel in one round: the reductions of a phase of the
    whole tree are still one all-reduce per mesh axis (as in plain lockstep), and each kind of
    pass runs once per round for every leaf that needs it (one launch per round, not per leaf).
    The update passes (``final``) wait for every reduction, so they all share one round.
    Within a round the requests are in the order of ``steps``. Steps may have different
    numbers of phases; nested ``together`` s schedule the same way.
    """
    n = len(steps)
    results: list[Any] = [None] * n
    # Per step: its pending request list and that list's class (None once it has returned).
    pending: list[list[Any]] = [[] for _ in steps]
    klass: list[int | None] = [None] * n

    def advance(i: int, sent: list[Any] | None) -> None:
        try:
            reqs = next(steps[i]) if sent is None else steps[i].send(sent)
        except StopIteration as stop:
            klass[i] = None
            results[i] = stop.value
            return
        reqs = reqs if type(reqs) is list else list(reqs)
        pending[i], klass[i] = reqs, _klass(reqs)

    for i in range(n - 1):
        advance(i, None)
    if n and all(k is None for k in klass):
        # Every other step is done without a phase (an optimizer's step-size phases when the
        # step size needs no reduction): the last one is the whole schedule, delegated to as
        # it is instead of being relayed round by round.
        results[n - 1] = yield from steps[n - 1]
        return tuple(results)
    if n:
        advance(n - 1, None)
    while True:
        first = min((k for k in klass if k is not None), default=None)
        if first is None:
            break
        order = [i for i, k in enumerate(klass) if k == first]
        if len(order) == 1:
            asked = pending[order[0]]
        else:
            asked = [r for i in order for r in pending[i]]
        back = yield asked
        if len(back) != len(asked):
            raise ValueError(f"together: {len(back)} results for {len(asked)} requests")
        pos = 0
        for i in order:
            k = len(pending[i])
            advance(i, back[pos:pos + k])
            pos += k
    return tuple(results)


def run_requests(requests: Sequence[Any]) -> list[Any]:
    """Do one round of requests (what :func:`together` yields); results in their order.

    The :class:`Partial` s are completed by one :func:`sum_partials` call (one all-reduce per
    mesh axis for all of them); the :class:`Pass` es are grouped by ``run``, in order of first
    appearance, and each group is one ``run`` call. Any other request is a TypeError.
    """
    out: list[Any] = [None] * len(requests)
    partials: list[int] = []
    passes: dict[Any, list[int]] = {}
    for i, r in enumerate(requests):
        if isinstance(r, Partial):
            partials.append(i)
        elif isinstance(r, Pass):
            passes.setdefault(r.run, []).append(i)
        else:
            raise TypeError(f"a phased step asked for {type(r).__name__}, not a Partial or a "
                            "Pass")
    for run, idx in passes.items():
        got = run([(requests[i].args, requests[i].kwargs) for i in idx])
        if len(got) != len(idx):
            raise ValueError(f"{getattr(run, '__name__', run)}: {len(got)} results for "
                             f"{len(idx)} calls")
        for i, res in zip(idx, got):
            out[i] = res
    if partials:
        asked = [requests[i] for i in partials]
        done = sum_partials([r.x for r in asked], [r.layout for r in asked],
                            [r.dims for r in asked], purpose=[r.purpose for r in asked])
        for i, res in zip(partials, done):
            out[i] = res
    return out


def run_phased(steps: Sequence[Phased]) -> list[Any]:
    """Run per-leaf phased steps together (:func:`together`); returns their results in order.

    Each round's requests are done by :func:`run_requests`: its :class:`Partial` s by one
    :func:`sum_partials` call (one all-reduce per mesh axis per round for the whole tree,
    where completing each leaf's reductions as it goes costs one per leaf and axis), its
    :class:`Pass` es one batched call per kind (one kernel launch for all leaves, not one per
    leaf). This is how an optimizer keeps its per-leaf code (written once for every layout)
    and still batches its reductions and its passes across leaves. Every rank along an axis
    must run the same steps (the same code over the same layouts): each then asks for the
    same reductions in the same round.
    """
    driver = together(*steps)
    try:
        asked = next(driver)
        while True:
            asked = driver.send(run_requests(asked))
    except StopIteration as stop:
        return list(stop.value)
