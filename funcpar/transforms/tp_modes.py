"""Multi-dimensional tensor parallelism: ``shard_params(rules, mesh, mode="2d" | "2.5d")``.

2D tensor parallelism (Xu et al., "An Efficient 2D Method for Training Super-Large Deep
Learning Models", arXiv 2104.05343; Colossal-AI's ``2d`` mode) on a ``q x q`` grid of the mesh
axes :data:`~funcpar.shard.summa.ROW` (``tp_row``, a rank's grid row ``i``) and
:data:`~funcpar.shard.summa.COL` (``tp_col``, its grid column ``j``):
``DeviceMesh.from_env(dp=..., tp_row=q, tp_col=q)``.

Placement (rank ``(i, j)``):

* **activations** ``[batch, ..., hidden]`` are grid-partitioned *between* layers: batch rows
  chunk ``i``, hidden chunk ``j``. The model's tensor inputs are cut so on entry (token ids:
  rows only; float inputs: rows and last dim), the loss's targets by rows;
* **linear layers** (``nn.Linear``, ``W [out, in]``) hold the block ``in`` chunk ``i`` x
  ``out`` chunk ``j`` and compute ``Y = X Wᵀ`` by SUMMA (:func:`~funcpar.shard.summa.summa_ab`,
  exact forward and backward), leaving ``Y`` grid-partitioned like ``X``;
* **attention** runs on this rank's batch rows and heads: the q/k/v outputs are cut over
  ``tp_col`` in whole heads (the rules' ``unit``, checked), and ``o_proj``'s input over
  ``tp_row`` the same way. Heads are independent, so attention itself needs no communication;
  this is Colossal-AI's placement too (its 2D attention splits heads over the grid row);
* **embedding** ``[vocab, hidden]``: the hidden dim cut over ``tp_col`` then ``tp_row``
  (``1 / q²`` per rank); the forward all-gathers the ``tp_row`` pieces of column ``j`` and looks
  up rows chunk ``i``'s ids; the backward reduce-scatters the gradient, which sums the batch
  chunks' contributions;
* **norms** (``RMSNorm``, ``nn.LayerNorm``): weight (and bias) cut as the embedding's hidden
  dim, gathered the same way; the statistics over the hidden dim are summed over ``tp_col``,
  forward and backward (:func:`~funcpar.shard.summa.all_reduce_both`), so the gradient is the
  one process's; biases of linear layers likewise;
* **LM head and loss**: the head is a linear layer (vocabulary chunk ``j``); the loss, which
  must be token-mean cross-entropy (``token_cross_entropy``), becomes the vocab-parallel
  cross-entropy of :func:`~funcpar.shard.tp_ops.vocab_parallel_cross_entropy` over ``tp_col``
  on this rank's rows, its token sum then summed over ``tp_row`` and divided by the global
  count of targets (not ``ignore_index``): every rank gets the one process's loss.

Every parameter is split over both grid axes, so every gradient is complete where it is made
(SUMMA's reduce-scatters, the gathers' backward), no ``sync_grads`` is added, and the
optimizers reduce through each leaf's two-axis layout (:mod:`funcpar.shard.reduce`): Adafactor
and CAME row/column statistics, Lamb's trust ratios and GaLore's projections are exact without
any per-mode code.

What is refused, before any compute (ValueError naming the part): a mesh without the two grid
axes or with a non-square grid; a module holding parameters that is none of the above (MoE
experts, a convolution, ...), named; a weight tied between two modules; a dim whose pieces would
be empty; a head split that cuts a head; a batch with fewer rows than ``q``; a loss that is not
token cross-entropy; rules without a ``vocab_parallel`` (or ``colwise_gather_output``) head;
``sequence_parallel``. Uneven pieces follow ``torch.chunk``. The model's code between its
modules must be per-row and per-feature (elementwise, per head): :class:`funcpar.models.Llama`
is known to be; another model declares it with ``supports_tp_2d = True``.

**2.5D** (``mode="2.5d"``, :mod:`funcpar.shard.tesseract`): the same placement on each of
``d`` depth slices of the mesh axis ``tp_dep``, weights replicated over it; the batch rows are
cut over ``tp_dep`` then ``tp_row``, the loss's token sums run over both, and after the
backward every gradient is summed over ``tp_dep`` (``sync_grads``).
``DeviceMesh.from_env(dp=..., tp_dep=d, tp_row=q, tp_col=q)``; :func:`mode_axes` gives the axes
of each mode. **3D** is :mod:`funcpar.transforms.tp_cube`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcpar.optim.base import init_laid_out
from funcpar.shard import comm
from funcpar.shard.layout import Layout, _levels, shard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import LocalAttr, Rule
from funcpar.shard.summa import COL, ROW, Grid, all_reduce_both, summa_ab
from funcpar.shard.tesseract import DEP, Tesseract
from funcpar.shard.tp_ops import exit_region, gather_seq, vocab_parallel_cross_entropy
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep

__all__ = ["MODES", "GridPlan", "Plan2D", "Planned", "batch_rows", "comm_plan_report", "grid_apply",
           "grid_loss", "loss_collectives", "memory_per_rank", "mode_axes", "norm_forward",
           "norm_stats", "place_parts", "plan_2d", "planned_collectives", "shard_params_2d",
           "stage_lead"]

MODES = ("1d", "2d", "2.5d", "3d")
#: Models known to keep to the 2D contract (module docstring), by qualified name.
_KNOWN = frozenset({"funcpar.models.llama.Llama"})
_HEADS = ("vocab_parallel", "colwise_gather_output")
#: The ``why`` of 2.5D's gradient all-reduce over depth (its purpose names the leaves).
DEPTH_GRADS = "2.5d depth"


@dataclasses.dataclass(frozen=True)
class Part:
    """One module placed on the grid: ``kind`` is linear, embedding, rmsnorm or layernorm."""

    name: str
    module: nn.Module
    kind: str
    size: int  # norms: the whole normalized dim (the module's own weight is local in the step)


class GridPlan:
    """What every multi-dimensional mode's plan has: ``parts``, ``layouts`` (leaf name ->
    Layout) and the LM ``head`` (:class:`Plan2D` for 2D and 2.5D,
    :class:`~funcpar.transforms.tp_cube.Plan3D` for 3D)."""

    parts: tuple[Part, ...]
    layouts: dict[str, Layout]
    head: Part

    def report(self) -> str:
        """Each leaf's layout and local shape on this rank."""
        width = max(len(n) for n in self.layouts)
        return "\n".join(f"{n.ljust(width)}  {lay!r} local {lay.local_shape()}"
                         for n, lay in self.layouts.items())


@dataclasses.dataclass(frozen=True)
class Plan2D(GridPlan):
    grid: Grid
    parts: tuple[Part, ...]
    layouts: dict[str, Layout]
    head: Part


def _norm_kind(m: nn.Module) -> str | None:
    if isinstance(m, nn.LayerNorm):
        return "layernorm" if m.elementwise_affine and len(m.normalized_shape) == 1 else None
    w = getattr(m, "weight", None)
    if (type(m).__name__.endswith("RMSNorm") and isinstance(w, nn.Parameter) and w.dim() == 1
            and _eps(m) is not None and set(dict(m.named_parameters(recurse=False))) == {"weight"}):
        return "rmsnorm"
    return None


def _eps(m: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, float):
            return v
    return None


def _pieces(name: str, n: int, q: int, levels: int, what: str, mode: str = "2d") -> None:
    """Refuse a dim whose ``levels`` nested cuts over ``q`` would leave a rank no entry."""
    sizes = [n]
    for _ in range(levels):
        sizes = [s for p in sizes for s in comm.chunk_sizes(p, q)]
    if min(sizes) == 0:
        raise ValueError(f"mode={mode!r}: {name!r}: {what} of {n} cut {levels} time(s) over q={q} "
                         f"leaves a rank no entry (pieces {sizes}); use a size of at least "
                         f"{q ** levels} that cuts evenly")


def place_parts(module: nn.Module, rules: Sequence[Rule | LocalAttr], q: int,
                mode: str) -> tuple[list[Part], Part]:
    """The modules of ``module`` holding parameters, each a :class:`Part`, and the LM head,
    checked against ``rules`` for a grid whose head-cutting axis has ``q`` ranks (2D, 2.5D and
    3D place the same parts), or a ValueError naming the part."""
    cls = type(module)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    if not (getattr(module, "supports_tp_2d", False) or qualname in _KNOWN):
        raise ValueError(
            f"mode={mode!r}: {qualname} is not known to keep to the 2D contract (its code "
            "between modules must act per batch row and per feature: activations are cut on "
            "both); a model that keeps to it declares supports_tp_2d = True")
    modules = dict(module.named_modules())
    parts: list[Part] = []
    owner: dict[int, str] = {}
    for name, m in modules.items():
        own = dict(m.named_parameters(recurse=False))
        if not own:
            continue
        if isinstance(m, nn.Linear):
            kind = "linear"
        elif isinstance(m, nn.Embedding):
            kind = "embedding"
            if m.max_norm or m.scale_grad_by_freq or m.sparse:
                raise ValueError(f"mode={mode!r}: embedding {name!r}: max_norm, "
                                 "scale_grad_by_freq and sparse are not supported")
        else:
            kind = _norm_kind(m)
            if kind is None:
                raise ValueError(
                    f"mode={mode!r} cannot place {name or 'the model'!r} ({type(m).__name__}, "
                    f"parameters {sorted(own)}): under {mode} only nn.Linear, nn.Embedding, "
                    "nn.LayerNorm and RMSNorm may hold parameters")
        for pn, p in own.items():
            if id(p) in owner:
                raise ValueError(f"mode={mode!r}: {name}.{pn} is tied to {owner[id(p)]}: a "
                                 "tied weight would need two placements (untie it)")
            owner[id(p)] = f"{name}.{pn}"
        parts.append(Part(name, m, kind, int(own["weight"].shape[0])))
    by_name = {p.name: p for p in parts}
    head = None
    for rule in rules:
        if isinstance(rule, LocalAttr):
            raise ValueError(f"mode={mode!r}: LocalAttr({rule.pattern!r}) is a 1D rule (a "
                             f"split width); {mode} does not support it")
        hits = [n for n in modules if n and rule.matches(n)]
        if not hits:
            raise ValueError(f"sharding rule {rule.pattern!r} ({rule.style}) matches no module")
        for n in hits:
            part = by_name.get(n)
            if rule.style in _HEADS:
                if part is None or part.kind != "linear":
                    raise ValueError(f"mode={mode!r}: the head {n!r} must be an nn.Linear")
                head = part
            if rule.unit is not None and part is not None and part.kind == "linear":
                # colwise: the outputs are cut over tp_col; rowwise: the inputs over tp_row.
                dim = 1 if rule.style == "rowwise" else 0
                size = part.module.weight.shape[dim]
                units = size // rule.unit
                if size % rule.unit or units % q:
                    raise ValueError(
                        f"mode={mode!r}: {n!r}: {units} heads of {rule.unit} (dim {size}) do "
                        f"not cut into whole heads over q={q} (rule {rule.pattern!r})")
    if head is None:
        raise ValueError(f"mode={mode!r} needs the LM head (the logits' linear) named by a rule "
                         "of style 'vocab_parallel' or 'colwise_gather_output': the loss is "
                         "computed on its vocabulary-split logits")
    return parts, head


def plan_2d(module: nn.Module, rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh,
            mode: str = "2d") -> Plan2D:
    """Place every parameter of ``module`` on the grid (module docstring), or a ValueError.
    ``mode="2.5d"``: the same placement on each depth slice of a
    :class:`~funcpar.shard.tesseract.Tesseract` (replicated over ``tp_dep``)."""
    grid = Tesseract(mesh) if mode == "2.5d" else Grid(mesh)
    q = grid.q
    parts, head = place_parts(module, rules, q, mode)
    layouts = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for part in parts:
        m = part.module
        if part.kind == "linear":
            _pieces(part.name, m.in_features, q, 1, "in_features", mode)
            _pieces(part.name, m.out_features, q, 1, "out_features", mode)
            specs = {"weight": (COL, ROW), "bias": ((COL, ROW),)}
            if m.bias is not None:
                _pieces(part.name, m.out_features, q, 2, "out_features (bias)", mode)
        elif part.kind == "embedding":
            _pieces(part.name, m.embedding_dim, q, 2, "embedding_dim", mode)
            specs = {"weight": (None, (COL, ROW))}
        else:
            _pieces(part.name, m.weight.shape[0], q, 2, "normalized dim", mode)
            specs = {"weight": ((COL, ROW),), "bias": ((COL, ROW),)}
        for pn, p in m.named_parameters(recurse=False):
            full = names[id(p)]
            layouts[full] = Layout.from_spec(mesh, p.shape, specs[pn], name=full)
    ordered = {n: layouts[n] for n, _ in module.named_parameters()}
    return Plan2D(grid, tuple(parts), ordered, head)


def shard_params_2d(
    rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh, mode: str = "2d",
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The 2D tensor-parallel transform (module docstring); what ``shard_params(rules, mesh,
    mode="2d")`` returns, and with ``mode="2.5d"`` what ``mode="2.5d"`` returns (each depth
    slice runs 2D on its batch rows; the gradients are summed over ``tp_dep``)."""

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        from funcpar.transforms.shard_params import sharded_module

        lead = stage_lead(step, mode)  # refuses a pipeline under 2.5D (untested)
        plan = plan_2d(sharded_module(step, state), rules, mesh, mode)
        loss_fn = _loss_2d(step.loss_fn, plan)
        layouts = {n: plan.layouts[n] for n in state.params}
        params = shard_tree(state.params, layouts)
        new_step = dataclasses.replace(step, apply_fn=_apply_2d(step.apply_fn, plan, lead),
                                       loss_fn=loss_fn, layouts=layouts)
        if isinstance(plan.grid, Tesseract):
            new_step = dataclasses.replace(new_step, sync_grads=_depth_sum(plan, step.sync_grads))
        return new_step, state._replace(params=params,
                                        opt_state=init_laid_out(step.optimizer, params, layouts))

    return transform


# ------------------------------------------------------------------------------- the step
def stage_lead(step: TrainStep, mode: str) -> int:
    """How many leading positional arguments of ``step.apply_fn`` :func:`grid_apply` passes
    uncut: under pipeline_split the apply_fn is a stage's, ``(params, buffers, stage, x,
    *inputs)`` (funcpar.pipeline.stages.stage_apply), and ``x``, the previous stage's output,
    is already this rank's block (the pipeline pairs each rank of one stage with the rank at
    the same grid coordinates in the next), so only the model inputs after it are cut. Only 2D
    is tested under a pipeline (tests/test_tp_2d_compose.py); 2.5D and 3D are refused there."""
    if step.pipeline is None:
        return 0
    if mode != "2d":
        raise ValueError(f"shard_params(mode={mode!r}) under pipeline_split is not tested yet "
                         "(mode='2d' is): drop pipeline_split or use mode='2d'")
    return 2


def batch_rows(x: Tensor, mesh: DeviceMesh, axes: Sequence[str], what: str,
               mode: str) -> Tensor:
    """This rank's chunk of the batch rows (dim 0) of ``x`` cut over ``axes`` nested, outermost
    first (as a :class:`~funcpar.shard.layout.Layout` cuts a dim over several axes)."""
    over = " x ".join(f"{a}={mesh.size(a)}" for a in axes)
    if x.dim() == 0:
        raise ValueError(f"mode={mode!r}: {what} is 0-d; its dim 0 (the batch) is cut over "
                         f"{over}")
    pieces = [x.shape[0]]
    for a in axes:
        pieces = [s for p in pieces for s in comm.chunk_sizes(p, mesh.size(a))]
    if min(pieces) == 0:
        raise ValueError(f"mode={mode!r}: {what} has {x.shape[0]} batch rows, fewer than "
                         f"{over}: each rank needs at least one (pieces {pieces})")
    coords = mesh.coords()
    start, size = _levels(x.shape[0], [mesh.size(a) for a in axes], [coords[a] for a in axes])[-1]
    return x[start : start + size]


def _rows(x: Tensor, grid: Grid, what: str) -> Tensor:
    """This rank's chunk of the batch rows (dim 0) of ``x``: grid row ``i``'s (2.5D: of depth
    chunk ``k``)."""
    return batch_rows(x, grid.mesh, grid.batch_axes, what, grid.mode)


def _cols(x: Tensor, grid: Grid) -> Tensor:
    """Grid column ``j``'s chunk of the last dim of ``x``."""
    sizes = comm.chunk_sizes(x.shape[-1], grid.q)
    start = sum(sizes[: grid.j])
    return x[..., start : start + sizes[grid.j]]


def _enter(x: Any, grid: Grid) -> Any:
    if not torch.is_tensor(x):
        return x
    x = _rows(x, grid, "a model input")
    return _cols(x, grid) if x.is_floating_point() else x


def _apply_2d(apply_fn: Callable, plan: Plan2D, lead: int = 0) -> Callable:
    return grid_apply(apply_fn, lambda x: _enter(x, plan.grid),
                      lambda: [(p.module, _FORWARDS[p.kind](p, plan.grid)) for p in plan.parts],
                      lead)


def grid_apply(apply_fn: Callable, enter: Callable[[Any], Any],
               forwards: Callable[[], list[tuple[nn.Module, Callable]]],
               lead: int = 0) -> Callable:
    """``apply_fn`` on this rank's piece of each input (``enter``; the first ``lead``
    positional arguments are passed as they are), with the modules' forwards replaced by
    ``forwards()``'s for the call."""

    def sharded(params, buffers, *args, **kwargs):
        args = args[:lead] + tuple(enter(a) for a in args[lead:])
        kwargs = {k: enter(v) for k, v in kwargs.items()}
        with _installed(forwards()):
            return apply_fn(params, buffers, *args, **kwargs)

    sharded.module = apply_fn.module
    return sharded


@contextlib.contextmanager
def _installed(forwards: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    saved = [(m, m.__dict__.get("forward")) for m, _ in forwards]
    for m, fwd in forwards:
        m.forward = fwd
    try:
        yield
    finally:
        for m, fwd in saved:
            if fwd is None:
                m.__dict__.pop("forward", None)  # not `del`: see shard_params._swapped
            else:
                m.forward = fwd


def _gather_row(w: Tensor, grid: Grid, n: int, dim: int, purpose: str) -> Tensor:
    """Grid column ``j``'s piece of a dim cut over (tp_col, tp_row) (``n`` long in all), from
    the tp_row pieces; backward, the gradient is reduce-scattered (summed over the batch
    chunks of the column's ranks)."""
    mine = comm.chunk_sizes(n, grid.q)[grid.j]
    return gather_seq(w, grid.mesh, grid.row, comm.chunk_sizes(mine, grid.q), purpose, dim=dim)


def _linear(part: Part, grid: Grid) -> Callable:
    m, who = part.module, part.name

    def fwd(x: Tensor) -> Tensor:
        y = summa_ab(x.reshape(-1, x.shape[-1]), m.weight.t(), grid, m.in_features, who)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if m.bias is None:
            return y
        return y + _gather_row(m.bias, grid, m.out_features, 0, f"{who}: bias")

    return fwd


def _embedding(part: Part, grid: Grid) -> Callable:
    m, who = part.module, part.name

    def fwd(ids: Tensor) -> Tensor:
        table = _gather_row(m.weight, grid, m.embedding_dim, 1, f"{who}: table")
        return F.embedding(ids, table, padding_idx=m.padding_idx)

    return fwd


def _hidden_sum(x: Tensor, grid: Grid, purpose: str) -> Tensor:
    return all_reduce_both(x.sum(-1, keepdim=True), grid.mesh, grid.col, purpose)


def norm_forward(part: Part, gather: Callable[[Tensor, str], Tensor],
                 hidden_sum: Callable[[Tensor, str], Tensor]) -> Callable:
    """RMSNorm or LayerNorm ``part`` on activations whose hidden dim is split over ranks:
    ``gather(w, what)`` is this rank's hidden chunk of the weight (bias) ``w``,
    ``hidden_sum(x, what)`` the sum over the whole hidden dim (forward and backward, as
    :func:`~funcpar.shard.summa.all_reduce_both`). ``y = w x / sqrt(mean(x²) + eps)``, or
    ``y = w (x - mean) / sqrt(var + eps) + b``, with the means over ``part.size``."""
    m, size = part.module, part.size
    if part.kind == "rmsnorm":
        eps = _eps(m)

        def rms(x: Tensor) -> Tensor:
            w = gather(m.weight, "weight")
            h = x.to(torch.promote_types(x.dtype, torch.float32))
            h = h * torch.rsqrt(hidden_sum(h * h, "sum of squares") / size + eps)
            return w * h.to(x.dtype)

        return rms

    def layernorm(x: Tensor) -> Tensor:
        c = x - hidden_sum(x, "sum") / size
        var = hidden_sum(c * c, "sum of squares") / size
        y = c * torch.rsqrt(var + m.eps) * gather(m.weight, "weight")
        return y if m.bias is None else y + gather(m.bias, "bias")

    return layernorm


def _norm(part: Part, grid: Grid) -> Callable:
    who = part.name
    return norm_forward(
        part, lambda w, what: _gather_row(w, grid, part.size, 0, f"{who}: {what}"),
        lambda x, what: _hidden_sum(x, grid, f"{who}: {what}"))


_FORWARDS = {"linear": _linear, "embedding": _embedding, "rmsnorm": _norm, "layernorm": _norm}


def _loss_2d(loss_fn: Callable, plan: Plan2D) -> Callable:
    grid = plan.grid
    vocab = comm.chunk_sizes(plan.head.module.out_features, grid.q)
    return grid_loss(loss_fn, grid.mode, grid.mesh, grid.col, sum(vocab[: grid.j]),
                     grid.batch_axes, lambda t, what: _rows(t, grid, what))


def grid_loss(loss_fn: Callable, mode: str, mesh: DeviceMesh, vocab_axis: str, start: int,
              row_axes: Sequence[str], rows: Callable[[Tensor, str], Tensor]) -> Callable:
    """The loss on logits split over ``vocab_axis`` (this rank's vocabulary from ``start``) and
    over the batch rows (``rows`` cuts the targets alike; ``row_axes`` are the axes cutting
    them): the vocab-parallel cross-entropy on this rank's rows, its token sum summed over
    ``row_axes`` and divided by the global count of targets that are not ``ignore_index``, so
    every rank gets the one process's token mean."""
    if not getattr(loss_fn, "token_cross_entropy", False) or getattr(loss_fn, "extra_loss",
                                                                     None) is not None:
        raise ValueError(
            f"mode={mode!r}: the logits are split over the grid (rows and vocabulary), so the "
            "loss is computed in place and must be token-mean cross-entropy without extra "
            "terms (funcpar.models.lm_loss, or a loss declaring token_cross_entropy = True)")
    ignore_index = getattr(loss_fn, "ignore_index", -100)
    from funcpar.transforms.shard_params import logits_of

    def loss(output: Any, targets: Tensor) -> Tensor:
        t = rows(targets, "the targets")
        ce = vocab_parallel_cross_entropy(logits_of(output), t, start, mesh, vocab_axis,
                                          ignore_index=ignore_index)
        # ce is the mean over this rank's rows' targets: back to their sum, summed over the
        # rows' axes (forward; each rank's own sum gets the gradient, as each computes the same
        # loss), over the global count.
        n = (t != ignore_index).sum().to(ce.dtype)
        total, count = ce * n, n
        for axis in row_axes:
            total = exit_region(total, mesh, axis, f"{mode} loss: token sum")
            count = comm.all_reduce(count, mesh, axis, purpose=f"{mode} loss: token count")
        return total / count.clamp_min(1)

    # What it declares: evaluation reads the ignored index; context_parallel refuses the mode.
    loss.ignore_index, loss.tp_mode = ignore_index, mode
    return loss


def _depth_sum(plan: Plan2D, inner: Callable | None) -> Callable:
    """2.5D's ``sync_grads``: ``inner``'s, then every gradient summed over ``tp_dep`` (each
    depth slice's covers its own batch rows; the weights are replicated over depth)."""
    from funcpar.transforms.shard_params import _sum_over_axis

    return _sum_over_axis(list(plan.layouts), plan.grid.mesh, plan.grid.dep, inner,
                          DEPTH_GRADS)


def mode_axes(mode: str, tp_size: int, depth: int = 1) -> dict[str, int]:
    """The mesh axes (outermost first) and sizes of ``tp_size`` tensor-parallel ranks under
    ``mode``: 2D ``tp_row = tp_col = q`` (``tp_size = q²``), 2.5D ``tp_dep = depth`` then the
    grid (``tp_size = depth q²``), 3D ``tp_in = tp_w = tp_out = q`` (``tp_size = q³``); a
    ValueError naming the sizes when they do not fit."""
    check_mode(mode)
    if mode == "1d":
        return {"tp": tp_size}
    if mode != "2.5d" and depth != 1:
        raise ValueError(f"a depth ({depth}) is for tp_mode='2.5d', not {mode!r}")
    if depth < 1 or tp_size % depth:
        raise ValueError(f"tp_mode={mode!r}: {tp_size} ranks do not split into depth {depth}")
    per = 3 if mode == "3d" else 2
    q = round((tp_size // depth) ** (1 / per))
    if q < 2 or q**per * depth != tp_size:
        shape = {"2d": "a square q * q >= 4", "2.5d": f"depth ({depth}) * q * q with q >= 2",
                 "3d": "a cube q * q * q >= 8"}[mode]
        raise ValueError(f"tp_mode={mode!r} needs tp_size {shape}, got {tp_size}")
    if mode == "3d":
        from funcpar.shard.cube import IN, OUT, WGT

        return {IN: q, WGT: q, OUT: q}
    grid = {ROW: q, COL: q}
    return {DEP: depth, **grid} if mode == "2.5d" else grid


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"tensor-parallel mode must be one of {MODES}, got {mode!r}")




# ---------------------------------------------------------------------------- plan report
class Planned(NamedTuple):
    """One collective the 2D step issues per call of a module (forward and backward)."""

    module: str
    op: str
    axis: str
    nbytes: int
    purpose: str


def planned_collectives(plan: GridPlan, rows: int, dtype: torch.dtype, *,
                        data_fed: Sequence[str] = ()) -> list[Planned]:
    """The collectives of one forward and backward on this rank, module by module (each
    called once on ``rows`` local rows, as in the Llama and the MLP), with ``comm_log``'s byte
    convention (:mod:`funcpar.shard.comm`), then the loss's. ``data_fed``: linears whose input
    is the model's input (no input gradient, so no ``dX`` product). The optimizer's
    collectives (gradient norm, Adafactor's statistics, ...) are not included; 2.5D's
    gradient all-reduce over depth is (module ``"grads"``).

    ``dtype`` is the compute dtype (amp_cast's under mixed precision): the panels, gathers and
    LayerNorm statistics travel in it; RMSNorm's statistics and the loss's in float32 at least
    (both upcast half-precision values first: :func:`norm_stats`, :func:`loss_collectives`)."""
    if not isinstance(plan, Plan2D):  # a 3D plan
        from funcpar.transforms.tp_cube import planned_collectives_3d

        return planned_collectives_3d(plan, rows, dtype, data_fed=data_fed)
    g = plan.grid
    q, j, s = g.q, g.j, torch.empty((), dtype=dtype).element_size()
    out: list[Planned] = []

    def add(who: str, op: str, axis: str, n: int, purpose: str) -> None:
        out.append(Planned(who, op, axis, n * s, purpose))

    def gather(who: str, n_whole: int, other: int, what: str) -> None:
        # A dim cut over (tp_col, tp_row), gathered over tp_row forward, reduce-scattered back.
        piece = max(comm.chunk_sizes(comm.chunk_sizes(n_whole, q)[j], q)) * q * other
        add(who, "all_gather", g.row, piece, f"{who}: {what}")
        add(who, "reduce_scatter", g.row, piece, f"{who}: {what} (grad)")

    for part in plan.parts:
        m, who = part.module, part.name
        if part.kind == "linear":
            kc, nc = comm.chunk_sizes(m.in_features, q), comm.chunk_sizes(m.out_features, q)
            # Forward Y = X W^T (SUMMA AB); backward dX = dY W (ABt), dW^T = X^T dY (AtB).
            for kk in kc:
                add(who, "broadcast", g.col, rows * kk, f"{who} A panel")
                add(who, "broadcast", g.row, kk * nc[j], f"{who} B panel")
            if who not in data_fed:
                for kk in kc:
                    add(who, "broadcast", g.row, kk * nc[j], f"{who} (grad) B panel")
                add(who, "reduce_scatter", g.col, max(kc) * q * rows, f"{who} (grad) partials")
            for kk in kc:
                add(who, "broadcast", g.col, rows * kk, f"{who} (grad) A panel")
            add(who, "reduce_scatter", g.row, max(kc) * q * nc[j], f"{who} (grad) partials")
            if m.bias is not None:
                gather(who, m.out_features, 1, "bias")
        elif part.kind == "embedding":
            gather(who, m.embedding_dim, m.num_embeddings, "table")
        else:
            out += norm_stats(part, g.col, rows, s)
            gather(who, part.size, 1, "weight")
            if part.kind == "layernorm" and m.bias is not None:
                gather(who, part.size, 1, "bias")
    out += loss_collectives(g.mode, g.col, g.batch_axes, rows, s)
    if isinstance(g, Tesseract) and g.d > 1:
        # After the backward: every gradient (this rank's parameter bytes) summed over depth.
        n = sum(math.prod(lay.local_shape()) for lay in plan.layouts.values())
        add("grads", "all_reduce", g.dep, n,
            f"{DEPTH_GRADS} grads: " + ", ".join(plan.layouts))
    return out


def norm_stats(part: Part, axis: str, rows: int, size: int) -> list[Planned]:
    """The all-reduces over ``axis`` of :func:`norm_forward`'s statistics (forward, then its
    backward) on ``rows`` rows of ``size``-byte values: RMSNorm's travel in float32 at least
    (it upcasts half-precision activations), LayerNorm's in the compute dtype."""
    rms = part.kind == "rmsnorm"
    width = max(size, 4) if rms else size
    return [Planned(part.name, "all_reduce", axis, rows * width, f"{part.name}: {st}{grad}")
            for st in (["sum of squares"] if rms else ["sum", "sum of squares"])
            for grad in ("", " (grad)")]


def loss_collectives(mode: str, vocab_axis: str, row_axes: Sequence[str], rows: int,
                     size: int) -> list[Planned]:
    """:func:`grid_loss`'s all-reduces: the vocab-parallel cross-entropy's over
    ``vocab_axis`` on ``rows`` rows, then the token sum and count over each of ``row_axes``;
    all in float32 at least (the cross-entropy upcasts half-precision logits)."""
    width = max(size, 4)
    out = [Planned("loss", "all_reduce", vocab_axis, rows * width, f"cross_entropy {what}")
           for what in ("max", "sum_exp", "target")]  # tp_ops' purposes
    for axis in row_axes:
        out += [Planned("loss", "all_reduce", axis, width, f"{mode} loss: token {what}")
                for what in ("sum", "count")]
    return out


def memory_per_rank(plan: GridPlan, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of this rank's parameters under the plan, next to one process's."""
    s = torch.empty((), dtype=dtype).element_size()
    lays = plan.layouts.values()
    return {"params_local": sum(math.prod(lay.local_shape()) for lay in lays) * s,
            "params_whole": sum(math.prod(lay.global_shape) for lay in lays) * s}


def comm_plan_report(planned: Sequence[Planned]) -> str:
    """Per module: the count and bytes of each (op, axis)."""
    rows: dict[tuple[str, str, str], list[int]] = {}
    for p in planned:
        acc = rows.setdefault((p.module, p.op, p.axis), [0, 0])
        acc[0] += 1
        acc[1] += p.nbytes
    lines = [f"{'module':<32} {'op':<15} {'axis':<7} {'count':>5} {'bytes':>10}"]
    lines += [f"{m:<32} {op:<15} {ax:<7} {c:>5} {n:>10,}" for (m, op, ax), (c, n) in rows.items()]
    lines.append(f"{'total':<32} {'':<15} {'':<7} {len(planned):>5} "
                 f"{sum(p.nbytes for p in planned):>10,}")
    return "\n".join(lines)
