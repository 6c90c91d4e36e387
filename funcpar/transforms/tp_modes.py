"""Multi-dimensional tensor parallelism: ``shard_params(rules, mesh, mode="2d")``.

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

``mode="2.5d"`` and ``mode="3d"`` are refused (not implemented).
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

from funcpar.shard import comm
from funcpar.shard.layout import Layout, shard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import LocalAttr, Rule
from funcpar.shard.summa import COL, ROW, Grid, all_reduce_both, summa_ab
from funcpar.shard.tp_ops import exit_region, gather_seq, vocab_parallel_cross_entropy
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep

__all__ = ["MODES", "Plan2D", "Planned", "comm_plan_report", "memory_per_rank", "plan_2d",
           "planned_collectives", "shard_params_2d"]

MODES = ("1d", "2d", "2.5d", "3d")
#: Models known to keep to the 2D contract (module docstring), by qualified name.
_KNOWN = frozenset({"funcpar.models.llama.Llama"})
_HEADS = ("vocab_parallel", "colwise_gather_output")


@dataclasses.dataclass(frozen=True)
class Part:
    """One module placed on the grid: ``kind`` is linear, embedding, rmsnorm or layernorm."""

    name: str
    module: nn.Module
    kind: str
    size: int  # norms: the whole normalized dim (the module's own weight is local in the step)


@dataclasses.dataclass(frozen=True)
class Plan2D:
    grid: Grid
    parts: tuple[Part, ...]
    layouts: dict[str, Layout]
    head: Part

    def report(self) -> str:
        """Each leaf's layout and local shape on this rank."""
        width = max(len(n) for n in self.layouts)
        return "\n".join(f"{n.ljust(width)}  {lay!r} local {lay.local_shape()}"
                         for n, lay in self.layouts.items())


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


def _pieces(name: str, n: int, q: int, levels: int, what: str) -> None:
    """Refuse a dim whose ``levels`` nested cuts over ``q`` would leave a rank no entry."""
    sizes = [n]
    for _ in range(levels):
        sizes = [s for p in sizes for s in comm.chunk_sizes(p, q)]
    if min(sizes) == 0:
        raise ValueError(f"mode='2d': {name!r}: {what} of {n} cut {levels} time(s) over q={q} "
                         f"leaves a rank no entry (pieces {sizes}); use a size of at least "
                         f"{q ** levels} that cuts evenly")


def plan_2d(module: nn.Module, rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh) -> Plan2D:
    """Place every parameter of ``module`` on the grid (module docstring), or a ValueError."""
    grid = Grid(mesh)
    q = grid.q
    cls = type(module)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    if not (getattr(module, "supports_tp_2d", False) or qualname in _KNOWN):
        raise ValueError(
            f"mode='2d': {qualname} is not known to keep to the 2D contract (its code between "
            "modules must act per batch row and per feature: activations are cut on both); a "
            "model that keeps to it declares supports_tp_2d = True")
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
                raise ValueError(f"mode='2d': embedding {name!r}: max_norm, scale_grad_by_freq "
                                 "and sparse are not supported")
        else:
            kind = _norm_kind(m)
            if kind is None:
                raise ValueError(
                    f"mode='2d' cannot place {name or 'the model'!r} ({type(m).__name__}, "
                    f"parameters {sorted(own)}): under 2D only nn.Linear, nn.Embedding, "
                    "nn.LayerNorm and RMSNorm may hold parameters")
        for pn, p in own.items():
            if id(p) in owner:
                raise ValueError(f"mode='2d': {name}.{pn} is tied to {owner[id(p)]}: a tied "
                                 "weight would need two placements (untie it)")
            owner[id(p)] = f"{name}.{pn}"
        parts.append(Part(name, m, kind, int(own["weight"].shape[0])))
    by_name = {p.name: p for p in parts}
    head = None
    for rule in rules:
        if isinstance(rule, LocalAttr):
            raise ValueError(f"mode='2d': LocalAttr({rule.pattern!r}) is a 1D rule (a split "
                             "width); 2D does not support it")
        hits = [n for n in modules if n and rule.matches(n)]
        if not hits:
            raise ValueError(f"sharding rule {rule.pattern!r} ({rule.style}) matches no module")
        for n in hits:
            part = by_name.get(n)
            if rule.style in _HEADS:
                if part is None or part.kind != "linear":
                    raise ValueError(f"mode='2d': the head {n!r} must be an nn.Linear")
                head = part
            if rule.unit is not None and part is not None and part.kind == "linear":
                # colwise: the outputs are cut over tp_col; rowwise: the inputs over tp_row.
                dim = 1 if rule.style == "rowwise" else 0
                size = part.module.weight.shape[dim]
                units = size // rule.unit
                if size % rule.unit or units % q:
                    raise ValueError(
                        f"mode='2d': {n!r}: {units} heads of {rule.unit} (dim {size}) do not "
                        f"cut into whole heads over q={q} (rule {rule.pattern!r})")
    if head is None:
        raise ValueError("mode='2d' needs the LM head (the logits' linear) named by a rule of "
                         "style 'vocab_parallel' or 'colwise_gather_output': the loss is "
                         "computed on its vocabulary-split logits")
    layouts = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for part in parts:
        m = part.module
        if part.kind == "linear":
            _pieces(part.name, m.in_features, q, 1, "in_features")
            _pieces(part.name, m.out_features, q, 1, "out_features")
            specs = {"weight": (COL, ROW), "bias": ((COL, ROW),)}
            if m.bias is not None:
                _pieces(part.name, m.out_features, q, 2, "out_features (bias)")
        elif part.kind == "embedding":
            _pieces(part.name, m.embedding_dim, q, 2, "embedding_dim")
            specs = {"weight": (None, (COL, ROW))}
        else:
            _pieces(part.name, m.weight.shape[0], q, 2, "normalized dim")
            specs = {"weight": ((COL, ROW),), "bias": ((COL, ROW),)}
        for pn, p in m.named_parameters(recurse=False):
            full = names[id(p)]
            layouts[full] = Layout.from_spec(mesh, p.shape, specs[pn], name=full)
    ordered = {n: layouts[n] for n, _ in module.named_parameters()}
    return Plan2D(grid, tuple(parts), ordered, head)


def shard_params_2d(
    rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The 2D tensor-parallel transform (module docstring); what ``shard_params(rules, mesh,
    mode="2d")`` returns."""

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        from funcpar.transforms.shard_params import sharded_module

        plan = plan_2d(sharded_module(step, state), rules, mesh)
        loss_fn = _loss_2d(step.loss_fn, plan)
        layouts = {n: plan.layouts[n] for n in state.params}
        params = shard_tree(state.params, layouts)
        # Under pipeline_split the apply_fn is a stage's, ``(params, buffers, stage, x,
        # *inputs)`` (funcpar.pipeline.stages.stage_apply): ``x``, the previous stage's output,
        # is already this rank's grid block (the pipeline pairs rank (i, j) of one stage with
        # (i, j) of the next), so only the model inputs after it are cut.
        lead = 2 if step.pipeline is not None else 0
        new_step = dataclasses.replace(step, apply_fn=_apply_2d(step.apply_fn, plan, lead),
                                       loss_fn=loss_fn, layouts=layouts)
        return new_step, state._replace(params=params, opt_state=step.optimizer.init(params))

    return transform


# ------------------------------------------------------------------------------- the step
def _rows(x: Tensor, grid: Grid, what: str) -> Tensor:
    """Grid row ``i``'s chunk of the batch rows (dim 0) of ``x``."""
    if x.dim() == 0:
        raise ValueError(f"mode='2d': {what} is 0-d; its dim 0 (the batch) is cut over "
                         f"{grid.row}")
    sizes = comm.chunk_sizes(x.shape[0], grid.q)
    if min(sizes) == 0:
        raise ValueError(f"mode='2d': {what} has {x.shape[0]} batch rows, fewer than "
                         f"{grid.row}={grid.q}: each grid row needs at least one")
    start = sum(sizes[: grid.i])
    return x[start : start + sizes[grid.i]]


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
    """``apply_fn`` with its inputs cut on entry (all but the first ``lead`` positional
    arguments, which are passed as they are) and the grid forwards installed."""

    def sharded(params, buffers, *args, **kwargs):
        args = args[:lead] + tuple(_enter(a, plan.grid) for a in args[lead:])
        kwargs = {k: _enter(v, plan.grid) for k, v in kwargs.items()}
        with _installed(plan):
            return apply_fn(params, buffers, *args, **kwargs)

    sharded.module = apply_fn.module
    return sharded


@contextlib.contextmanager
def _installed(plan: Plan2D) -> Iterator[None]:
    saved = [(p.module, p.module.__dict__.get("forward")) for p in plan.parts]
    for p in plan.parts:
        p.module.forward = _FORWARDS[p.kind](p, plan.grid)
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


def _rmsnorm(part: Part, grid: Grid) -> Callable:
    m, who, size, eps = part.module, part.name, part.size, _eps(part.module)

    def fwd(x: Tensor) -> Tensor:
        w = _gather_row(m.weight, grid, size, 0, f"{who}: weight")
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(_hidden_sum(h * h, grid, f"{who}: sum of squares") / size + eps)
        return w * h.to(x.dtype)

    return fwd


def _layernorm(part: Part, grid: Grid) -> Callable:
    m, who, size = part.module, part.name, part.size

    def fwd(x: Tensor) -> Tensor:
        mean = _hidden_sum(x, grid, f"{who}: sum") / size
        c = x - mean
        var = _hidden_sum(c * c, grid, f"{who}: sum of squares") / size
        y = c * torch.rsqrt(var + m.eps) * _gather_row(m.weight, grid, size, 0, f"{who}: weight")
        if m.bias is not None:
            y = y + _gather_row(m.bias, grid, size, 0, f"{who}: bias")
        return y

    return fwd


_FORWARDS = {"linear": _linear, "embedding": _embedding, "rmsnorm": _rmsnorm,
             "layernorm": _layernorm}


def _loss_2d(loss_fn: Callable, plan: Plan2D) -> Callable:
    if not getattr(loss_fn, "token_cross_entropy", False) or getattr(loss_fn, "extra_loss",
                                                                     None) is not None:
        raise ValueError(
            "mode='2d': the logits are split over the grid (rows and vocabulary), so the loss "
            "is computed in place and must be token-mean cross-entropy without extra terms "
            "(funcpar.models.lm_loss, or a loss declaring token_cross_entropy = True)")
    grid, head = plan.grid, plan.head.module
    vocab = comm.chunk_sizes(head.out_features, grid.q)
    start = sum(vocab[: grid.j])
    ignore_index = getattr(loss_fn, "ignore_index", -100)
    from funcpar.transforms.shard_params import logits_of

    def loss(output: Any, targets: Tensor) -> Tensor:
        t = _rows(targets, grid, "the targets")
        ce = vocab_parallel_cross_entropy(logits_of(output), t, start, grid.mesh, grid.col,
                                          ignore_index=ignore_index)
        # ce is the mean over this grid row's targets: back to their sum, summed over the rows
        # (forward; each rank's own sum gets the gradient, as each computes the same loss),
        # over the global count.
        n = (t != ignore_index).sum().to(ce.dtype)
        total = exit_region(ce * n, grid.mesh, grid.row, "2d loss: token sum")
        count = comm.all_reduce(n, grid.mesh, grid.row, purpose="2d loss: token count")
        return total / count.clamp_min(1)

    # What it declares: evaluation reads the ignored index; context_parallel refuses the mode.
    loss.ignore_index, loss.tp_mode = ignore_index, "2d"
    return loss


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"tensor-parallel mode must be one of {MODES}, got {mode!r}")
    if mode in ("2.5d", "3d"):
        raise ValueError(f"tensor-parallel mode {mode!r} is not implemented (2.5D and 3D, "
                         "arXiv 2105.14500 / 2105.14450): use '1d' or '2d'")



# ---------------------------------------------------------------------------- plan report
class Planned(NamedTuple):
    """One collective the 2D step issues per call of a module (forward and backward)."""

    module: str
    op: str
    axis: str
    nbytes: int
    purpose: str


def planned_collectives(plan: Plan2D, rows: int, dtype: torch.dtype, *,
                        data_fed: Sequence[str] = ()) -> list[Planned]:
    """The collectives of one forward and backward on this rank, module by module (each
    called once on ``rows`` local rows, as in the Llama and the MLP), with ``comm_log``'s byte
    convention (:mod:`funcpar.shard.comm`), then the loss's. ``data_fed``: linears whose input
    is the model's input (no input gradient, so no ``dX`` product). The optimizer's
    collectives (gradient norm, Adafactor's statistics, ...) are not included.

    ``dtype`` is the compute dtype (amp_cast's under mixed precision): the panels, gathers and
    LayerNorm statistics travel in it; RMSNorm's statistics and the loss's in float32 at least
    (both upcast half-precision values first)."""
    g = plan.grid
    q, j, s = g.q, g.j, torch.empty((), dtype=dtype).element_size()
    wide = max(s, 4)
    out: list[Planned] = []

    def add(who: str, op: str, axis: str, n: int, purpose: str, size: int = s) -> None:
        out.append(Planned(who, op, axis, n * size, purpose))

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
            rms = part.kind == "rmsnorm"
            stats = ["sum of squares"] if rms else ["sum", "sum of squares"]
            for st in stats:
                add(who, "all_reduce", g.col, rows, f"{who}: {st}", wide if rms else s)
                add(who, "all_reduce", g.col, rows, f"{who}: {st} (grad)", wide if rms else s)
            gather(who, part.size, 1, "weight")
            if part.kind == "layernorm" and m.bias is not None:
                gather(who, part.size, 1, "bias")
    for what in ("max", "sum_exp", "target"):
        add("loss", "all_reduce", g.col, rows, f"cross_entropy {what}", wide)  # tp_ops' purposes
    add("loss", "all_reduce", g.row, 1, "2d loss: token sum", wide)
    add("loss", "all_reduce", g.row, 1, "2d loss: token count", wide)
    return out


def memory_per_rank(plan: Plan2D, dtype: torch.dtype) -> dict[str, int]:
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
