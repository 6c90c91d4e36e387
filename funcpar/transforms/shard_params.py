"""``shard_params``: tensor parallelism as a transform of the step and the state.

``step, state = shard_params(rules, mesh)(step, state)`` splits each parameter as the rules say
(:mod:`funcpar.shard.rules`) and makes the step compute the same function on the shards:

* column-split linears see their input through :func:`~funcpar.shard.tp_ops.enter_region`
  (once per run of consecutive calls on one input tensor, so q/k/v or gate/up share one
  gradient all-reduce) and
  produce their slice of the outputs; attention then runs on the local heads, since the models
  reshape by ``head_dim`` (``view(b, t, -1, head_dim)``);
* row-split linears sum their partial products with one all-reduce, then add the bias once;
* a vocab-split embedding looks up its slice of the table and sums over ranks;
* a vocab-split LM head keeps its logits split, and the loss becomes
  :func:`~funcpar.shard.tp_ops.vocab_parallel_cross_entropy` (only per-token maxima and sums
  cross the wire). This replaces the step's loss, so the step's loss must be token-mean
  cross-entropy, declared by a ``token_cross_entropy = True`` attribute (``funcpar.models.
  lm_loss`` has it), plus, if the loss declares one, an ``extra_loss(output)`` term
  (``moe_lm_loss``: the router losses); any other loss needs the ``colwise_gather_output``
  style;
* stacked MoE experts (style ``experts``) hold an ffn slice of every expert: the grouped expert
  call sees its rows through ``enter_region`` and its unscaled outputs are summed with one
  ``exit_region`` all-reduce, before the gates scale them; the router is replicated, so its
  gradient is whole on every rank (``expert_parallel`` may then cut the experts over ``ep``).

The optimizer receives the layouts, so every reduction it makes is global (DESIGN principle 2).

Sequence parallelism
--------------------
``shard_params(rules, mesh, sequence_parallel=True)`` (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198, section 4.2.2): between
the tensor-parallel regions the activations ``[batch, seq, hidden]`` - the residual stream, the
norms and whatever else runs there - are split on the sequence dim (dim 1) over the axis, so
each rank stores and computes ``1 / tp`` of them. The regions are the modules that hold a
row-split linear and the column-split linears feeding it (the attention and the MLP):

* the vocab-parallel embedding ends in a reduce-scatter over the sequence instead of an
  all-reduce (:func:`~funcpar.shard.tp_ops.vocab_parallel_embedding` with ``seq_sizes``);
* a region's module all-gathers its first argument (the hidden states) over the sequence
  (:func:`~funcpar.shard.tp_ops.gather_seq`; backward: reduce-scatter, which also does the
  work of *f*'s gradient all-reduce, so the column-split linears get no ``enter_region``) and
  runs on the whole sequence, so its own shape logic (``view(b, t, -1, head_dim)``) is
  unchanged; the column-split linears must be called on that gathered tensor itself (checked);
* the region must return its row-split linear's output itself (checked): those partial sums
  are reduce-scattered over the sequence instead of all-reduced
  (:func:`~funcpar.shard.tp_ops.reduce_scatter_seq`; backward: all-gather), and the linear's
  bias is added to this rank's chunk;
* the LM head all-gathers its input over the sequence first, so the logits (and the loss)
  cover every position, as without sequence parallelism.

Gradients: a parameter used on sequence-split activations - the norm weights, a row-split
linear's bias, any replicated leaf between the regions - gets on each rank only the gradient
of that rank's positions. Its true gradient is the sum over the axis, so the step's
``sync_grads`` (after any inner one) all-reduces the gradients of every leaf not split over
the axis, in one flat buffer per dtype (purpose ``sequence-parallel grads: <leaves>`` in the
comm log). This is exact because, with sequence parallelism on, *every* replicated leaf acts on
split activations: a region may hold no replicated parameter other than its row-split biases
(checked), and the plan must begin at a vocab-parallel embedding and end at a sharded LM head.

Sequence lengths need not divide by the axis size: rank ``r`` holds
``chunk_sizes(seq, tp)[r]`` positions (torch.chunk's cut, ``13`` over 4: ``4, 4, 4, 1``). A
sequence shorter than the axis (a rank would hold no position) is a ValueError raised by the
embedding, before any collective.

What the model must satisfy (checked where it can be, declared where it cannot): its code
between the regions must not read the sequence length from hidden states (positions, masks and
rotary tables computed from the token ids are fine; Hugging Face models derive them from the
embedding's output, which is split, so they are refused), and nothing after the LM head holds
parameters. A model declares this with a class attribute ``supports_sequence_parallel = True``;
funcpar's example :class:`~funcpar.models.Llama` is known to satisfy it. Dropout between the
regions draws its mask from the same generator state on every rank, so a model with dropout
there trains correctly but not bit-for-bit like one process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from funcpar.optim.base import init_laid_out
from funcpar.shard import comm
from funcpar.shard.layout import shard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import (
    LocalAttr,
    ModulePlan,
    Rule,
    ShardingPlan,
    is_experts,
    plan_sharding,
    scale_embedding,
)
from funcpar.shard.tp_ops import (
    enter_region,
    exit_region,
    gather_last_dim,
    gather_seq,
    reduce_scatter_seq,
    split_last_dim,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep
from funcpar.transforms.compose import require_before_partition, require_fresh

__all__ = ["logits_of", "shard_params"]


def logits_of(output: Any) -> Tensor:
    """The logits in a model's output: the tensor itself, or ``output.logits`` (Hugging Face)."""
    return output if torch.is_tensor(output) else output.logits


def shard_params(
    rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh, *, axis: str = "tp",
    sequence_parallel: bool = False, mode: str = "1d",
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The tensor-parallel transform over mesh axis ``axis`` (see the module docstring).

    ``mode``: ``"1d"`` (Megatron, this module), ``"2d"`` (SUMMA on the mesh axes ``tp_row``
    x ``tp_col``, :mod:`funcpar.transforms.tp_modes`; ``axis`` is then unused) or ``"2.5d"``
    (Tesseract: 2D on each of the ``tp_dep`` depth slices, :mod:`funcpar.shard.tesseract`)
    or ``"3d"`` (the ``tp_in x tp_w x tp_out`` cube, :mod:`funcpar.transforms.tp_cube`).

    The state must be fresh from ``init_state`` (step 0) and hold whole parameters; its
    optimizer state is re-initialized on the shards (moving a trained state between layouts is
    the checkpoint's job). ``sequence_parallel``: split the activations between the regions on
    the sequence dim (module docstring, "Sequence parallelism"); uneven lengths are cut into
    ``chunk_sizes`` pieces, a sequence shorter than the axis is a ValueError.
    """

    if mode != "1d":
        from funcpar.transforms.tp_modes import check_mode, shard_params_2d

        check_mode(mode)
        if sequence_parallel:
            raise ValueError(f"sequence_parallel is a 1D mode option; mode={mode!r} already "
                             "splits the activations between layers")
        if mode == "3d":
            from funcpar.transforms.tp_cube import shard_params_3d

            return shard_params_3d(rules, mesh)
        return shard_params_2d(rules, mesh, mode)

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        module = sharded_module(step, state)
        plan = plan_sharding(module, rules, mesh, axis)
        seq = _seq_plan(module, plan) if sequence_parallel else None
        layouts = {n: plan.layouts[n] for n in state.params}
        params = shard_tree(state.params, layouts)
        loss_fn = step.loss_fn
        head = plan.vocab_parallel_head
        if head is not None:
            loss_fn = _vocab_parallel_loss(step.loss_fn, head, plan)
        sync_grads = step.sync_grads
        if seq is not None:
            split = [n for n in state.params if axis not in _split_axes(layouts[n])]
            sync_grads = _sum_over_axis(split, mesh, axis, step.sync_grads)
        elif plan.grad_sum:
            # Whole leaves that act on this rank's heads only (style grad_sum): each rank's
            # gradient is its heads' part, the sum over the axis is the gradient.
            sync_grads = _sum_over_axis([n for n in plan.grad_sum if n in state.params], mesh,
                                        axis, step.sync_grads, "grad_sum")
        new_step = dataclasses.replace(
            step, apply_fn=_sharded_apply(step.apply_fn, plan, seq), loss_fn=loss_fn,
            layouts=layouts, sync_grads=sync_grads,
        )
        opt_state = init_laid_out(step.optimizer, params, layouts)
        return new_step, state._replace(params=params, opt_state=opt_state)

    return transform


def sharded_module(step: TrainStep, state: TrainState) -> nn.Module:
    """The module under ``step`` (which every mode of ``shard_params`` rewrites), after the
    checks each mode makes: a fresh state, no ZeRO partition yet, not sharded already."""
    module = getattr(step.apply_fn, "module", None)
    if module is None:
        raise TypeError("shard_params needs a step built on functionalize(module)'s apply_fn")
    require_fresh(state, "shard_params")
    require_before_partition(step, "shard_params", "tensor-parallel shards")
    if step.layouts is not None:
        raise ValueError("the step is already sharded (it has layouts): apply shard_params "
                         "once, and before expert_parallel (which cuts the tensor-parallel "
                         "expert shards over ep)")
    return module


def _vocab_parallel_loss(loss_fn: Callable, head: ModulePlan, plan: ShardingPlan) -> Callable:
    if getattr(loss_fn, "context_parallel", None) is not None:
        raise ValueError("apply shard_params before context_parallel: the vocab-parallel loss "
                         "would replace context_parallel's token-weighted one")
    if not getattr(loss_fn, "token_cross_entropy", False):
        raise ValueError(
            f"{head.name!r} is vocab-split (rule {head.rule.pattern!r}), so the loss is computed "
            "vocab-parallel and must be token-mean cross-entropy: use funcpar.models.lm_loss "
            "(or moe_lm_loss), or the style 'colwise_gather_output' for another loss"
        )
    lay = plan.layouts[head.weight_name]
    start = lay.local_slices()[0].start
    ignore_index = getattr(loss_fn, "ignore_index", -100)
    # A loss may declare a term of the output added to the cross-entropy (moe_lm_loss: the
    # router losses, computed whole on every rank).
    extra = getattr(loss_fn, "extra_loss", None)

    def loss(output: Any, targets: Tensor) -> Tensor:
        ce = vocab_parallel_cross_entropy(
            logits_of(output), targets, start, plan.mesh, plan.axis, ignore_index=ignore_index
        )
        return ce if extra is None else ce + extra(output).to(ce.dtype)

    # What it declares, as the loss it replaces did: evaluation (funcpar.train.eval) reads the
    # ignored index, and the transforms applied after this one (context_parallel) that it is
    # still a token mean.
    loss.token_cross_entropy, loss.ignore_index = True, ignore_index
    if extra is not None:
        loss.extra_loss = extra
    return loss


def _sharded_apply(apply_fn: Callable, plan: ShardingPlan, seq: _SeqPlan | None) -> Callable:
    def sharded(params, buffers, *args, **kwargs):
        with _installed(plan) if seq is None else _installed_seq(plan, seq):
            return apply_fn(params, buffers, *args, **kwargs)

    sharded.module = apply_fn.module
    return sharded


@contextlib.contextmanager
def _swapped(plan: ShardingPlan, forwards: dict[nn.Module, Callable]) -> Iterator[None]:
    """``forwards`` in place of those modules' own, and the local attributes, for one call."""
    saved = [(m, m.__dict__.get("forward")) for m in forwards]
    whole = [(m, attr, getattr(m, attr)) for m, attr, _ in plan.local_attrs]
    for m, fwd in forwards.items():
        m.forward = fwd
    for m, attr, local in plan.local_attrs:
        setattr(m, attr, local)
    try:
        yield
    finally:
        for m, fwd in saved:
            if fwd is None:
                # Not `del m.forward`: dynamo (torch 2.13) replays set-then-del of an attribute
                # as a del of a missing one, which broke compile=True under shard_params.
                m.__dict__.pop("forward", None)
            else:
                m.forward = fwd
        for m, attr, value in whole:
            setattr(m, attr, value)


@contextlib.contextmanager
def _installed(plan: ShardingPlan) -> Iterator[None]:
    """The tensor-parallel forwards in place of the matched modules' own, for one call."""
    last: list[tuple[Tensor, Tensor]] = []  # the last input and its region entry

    def enter(x: Tensor, who: str) -> Tensor:
        # One all-reduce of the input gradient per input, shared by the consecutive linears
        # that read it (q/k/v, gate/up). Only the last input is kept: a cache of every input
        # would keep each remat recompute's inputs (and their recompute graphs) alive until
        # the call's end, i.e. through the whole backward.
        if not last or last[0][0] is not x:
            last[:] = [(x, enter_region(x, plan.mesh, plan.axis, f"{who}: input grad"))]
        return last[0][1]

    with _swapped(plan, {mp.module: _forward(mp, plan, enter) for mp in plan.modules
                         if mp.style != "grad_sum"}):  # grad_sum: the module's own forward
        yield


def _local_ops(mp: ModulePlan) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """The module's product with its local weight shard (functional_call swapped it in) and the
    addition of its local bias."""
    m = mp.module

    def matmul(x: Tensor) -> Tensor:
        return x @ m.weight if mp.kind == "conv1d" else F.linear(x, m.weight)

    def add_bias(y: Tensor) -> Tensor:
        return y if m.bias is None else y + m.bias

    return matmul, add_bias


def _forward(mp: ModulePlan, plan: ShardingPlan, enter: Callable) -> Callable:
    m, mesh, axis, who = mp.module, plan.mesh, plan.axis, mp.name
    matmul, add_bias = _local_ops(mp)

    if mp.style in ("colwise", "vocab_parallel"):
        return lambda x: add_bias(matmul(enter(x, who)))
    if mp.style == "colwise_gather_output":
        out_dim = 1 if mp.kind == "conv1d" else 0
        sizes = comm.chunk_sizes(plan.layouts[mp.weight_name].global_shape[out_dim],
                                 mesh.size(axis))
        return lambda x: gather_last_dim(add_bias(matmul(enter(x, who))), mesh, axis, sizes,
                                         f"{who}: output")
    if mp.style == "rowwise":
        return lambda x: add_bias(exit_region(matmul(x), mesh, axis, f"{who}: output"))
    if mp.style == "rowwise_split_input":
        in_dim = 0 if mp.kind == "conv1d" else 1
        sizes = comm.chunk_sizes(plan.layouts[mp.weight_name].global_shape[in_dim],
                                 mesh.size(axis))
        return lambda x: add_bias(exit_region(
            matmul(split_last_dim(x, mesh, axis, sizes, f"{who}: input")), mesh, axis,
            f"{who}: output"))
    if mp.style == "embedding_rowwise":
        start = plan.layouts[mp.weight_name].local_slices()[0].start
        return lambda ids: scale_embedding(vocab_parallel_embedding(
            ids, m.weight, start, mesh, axis, who, padding_idx=m.padding_idx), mp)
    if mp.style == "packed_experts":
        own = m.forward

        # Hugging Face's experts(hidden, top_k_index, top_k_weights) scale each expert's
        # output by its routing weight inside: every rank's output is the partial sum of its
        # ffn slice, already scaled, so one all-reduce sums it (g), and the gradients of both
        # the hidden states and the routing weights are partial on each rank (f on both).
        # The routing weights are entered in the dtype their product with the outputs has
        # (float32 weights times float64 outputs: float64), an exact cast, so their partial
        # gradients are summed before the one rounding to their own dtype, as in one process.
        def packed(x: Tensor, index: Tensor, weights: Tensor, *rest: Any, **kw: Any) -> Tensor:
            w = weights.to(torch.promote_types(x.dtype, weights.dtype))
            return exit_region(own(enter(x, who), index, enter(w, who), *rest, **kw),
                               mesh, axis, f"{who}: output")

        return packed
    if mp.style == "experts":
        own = m.forward  # the class's: the local weights hold each expert's ffn slice

        # The grouped call over every expert's rows is one Megatron MLP region: f on its
        # input, g on its (unscaled) outputs - before the gates scale them, so that the
        # gates' (and the router's) gradients see whole outputs, not this rank's partial sums.
        return lambda x, counts: exit_region(own(enter(x, who), counts), mesh, axis,
                                             f"{who}: output")
    raise AssertionError(mp.style)


# ------------------------------------------------------------------------ sequence parallelism
#: Models known to satisfy the sequence-parallel contract (module docstring): their code
#: between the regions reads no sequence length from hidden states. By qualified name, so that
#: the transforms do not import the models.
_SP_MODELS = frozenset({"funcpar.models.llama.Llama"})
_HEADS = ("vocab_parallel", "colwise_gather_output")
_NOT_SP = ("rowwise_split_input", "grad_sum", "packed_experts")


@dataclasses.dataclass(frozen=True)
class _SeqPlan:
    regions: dict[str, nn.Module]  # region name -> module whose hidden-states input is gathered
    region_of: dict[str, str]  # column/row-split module name -> its region's name
    row_of: dict[str, ModulePlan]  # region name -> its row-split linear, whose output it returns


def _split_axes(layout: Any) -> set[str]:
    return {a for axes in layout.dim_axes for a in axes}


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _seq_plan(module: nn.Module, plan: ShardingPlan) -> _SeqPlan:
    """The regions of ``plan`` for sequence parallelism, or a ValueError saying why not."""
    cls = type(module)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    if not (getattr(module, "supports_sequence_parallel", False) or qualname in _SP_MODELS):
        raise ValueError(
            f"sequence_parallel: {qualname} is not known to keep to the contract (its code "
            "between the tensor-parallel regions must not read the sequence length from hidden "
            "states, e.g. positions or masks from the embedding's output, which is split); a "
            "model that keeps to it declares supports_sequence_parallel = True"
        )
    by_style: dict[str, list[ModulePlan]] = {}
    for mp in plan.modules:
        by_style.setdefault(mp.style, []).append(mp)
    other = [f"{mp.name!r} ({mp.style})" for mp in plan.modules if mp.style in _NOT_SP]
    if other:
        raise ValueError(f"sequence_parallel does not support the styles of {other[0]}"
                         f"{f' and {len(other) - 1} more' if len(other) > 1 else ''}: only "
                         "colwise/rowwise regions between a vocab-parallel embedding and head")
    moe = next((n for n, m in module.named_modules() if is_experts(m)), None)
    if moe is not None:
        raise ValueError(
            f"sequence_parallel with MoE experts ({moe!r}) is not supported: an MoE block "
            "routes each whole sequence, which the sequence split would cut")
    if not by_style.get("embedding_rowwise"):
        raise ValueError("sequence_parallel needs a vocab-parallel embedding (style "
                         "'embedding_rowwise'): its reduce-scatter is where the split begins")
    if not any(by_style.get(h) for h in _HEADS):
        raise ValueError("sequence_parallel needs a sharded LM head (style 'vocab_parallel' or "
                         "'colwise_gather_output'): its input gather is where the split ends")
    rows = {_parent(mp.name) for mp in by_style.get("rowwise", [])}
    cols = {_parent(mp.name) for mp in by_style.get("colwise", [])}
    for mp in by_style.get("rowwise", []) + by_style.get("colwise", []):
        region = _parent(mp.name)
        other = "column" if mp.style == "rowwise" else "row"
        if region not in (cols if mp.style == "rowwise" else rows):
            raise ValueError(
                f"sequence_parallel: {mp.name!r} ({mp.style}) has no {other}-split sibling in "
                f"{region or 'the model'!r}; a region is a module holding the column-split "
                "linears and the row-split linear they feed"
            )
        if not region:
            raise ValueError(f"sequence_parallel: {mp.name!r} ({mp.style}) sits at the top of "
                             "the model; the regions must be sub-modules (attention, MLP)")
    modules = dict(module.named_modules())
    regions = {r: modules[r] for r in sorted(rows)}
    row_of: dict[str, ModulePlan] = {}
    for mp in by_style.get("rowwise", []):
        r = _parent(mp.name)
        if r in row_of:
            raise ValueError(f"sequence_parallel: region {r!r} holds two row-split linears "
                             f"({row_of[r].name!r}, {mp.name!r}); its output must be one")
        row_of[r] = mp
    for r in regions:
        for q in regions:
            if q != r and q.startswith(r + "."):
                raise ValueError(f"sequence_parallel: region {q!r} is nested in region {r!r}")
    for mp in plan.modules:
        inside = [r for r in regions if mp.name.startswith(r + ".")]
        if mp.style not in ("rowwise", "colwise") and inside:
            raise ValueError(f"sequence_parallel: {mp.name!r} ({mp.style}) sits inside the "
                             f"region {inside[0]!r}")
    # Every replicated leaf gets its gradient summed over the axis, which is right only for
    # leaves used on split activations: inside a region, only the row-split biases are.
    names = {id(p): n for n, p in module.named_parameters()}
    biases = {id(mp.module.bias) for mp in by_style.get("rowwise", [])
              if getattr(mp.module, "bias", None) is not None}
    for r, reg in regions.items():
        for pn, p in reg.named_parameters():
            if id(p) not in biases and plan.axis not in _split_axes(plan.layouts[names[id(p)]]):
                raise ValueError(
                    f"sequence_parallel: region {r!r} holds the replicated parameter "
                    f"{r}.{pn}; inside a region it would see the whole sequence and get a "
                    f"whole gradient, which the sequence-parallel gradient sum would count "
                    f"{plan.mesh.size(plan.axis)} times"
                )
    region_of = {mp.name: _parent(mp.name) for mp in plan.modules
                 if mp.style in ("rowwise", "colwise")}
    return _SeqPlan(regions, region_of, row_of)


def _sum_over_axis(names: list[str], mesh: DeviceMesh, axis: str,
                   inner: Callable | None, why: str = "sequence-parallel") -> Callable:
    """``sync_grads``: ``inner``'s, then the gradients of ``names`` summed over ``axis``."""
    purpose = f"{why} grads: " + ", ".join(names)

    def sync(grads: Any) -> Any:
        if inner is not None:
            grads = inner(grads)
        if mesh.size(axis) == 1 or not names:
            return grads
        out = copy.copy(grads)
        # One flat all-reduce per dtype: these leaves are small (norm weights) and many.
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:
            by_dtype.setdefault(grads[n].dtype, []).append(n)
        for group in by_dtype.values():
            flat = torch.cat([grads[n].reshape(-1) for n in group])
            flat = comm.all_reduce(flat, mesh, axis, purpose=purpose)
            for n, piece in zip(group, flat.split([grads[n].numel() for n in group])):
                out[n] = piece.view_as(grads[n])
        return out

    return sync


@contextlib.contextmanager
def _installed_seq(plan: ShardingPlan, seq: _SeqPlan) -> Iterator[None]:
    """The sequence-parallel forwards of the matched modules and of the regions, for one call.

    ``sizes`` (each rank's positions) is set by the embedding from the token ids; ``gathered``
    holds each region's gathered input while the region runs.
    """
    mesh, axis = plan.mesh, plan.axis
    sizes: list[list[int]] = []
    gathered: dict[str, Tensor] = {}  # region name -> its gathered input, while it runs
    partial: dict[str, Tensor] = {}  # row-split linear -> its partial sums, for its region

    def seq_sizes(who: str) -> list[int]:
        if not sizes:
            raise ValueError(f"sequence_parallel: {who!r} ran before the vocab-parallel "
                             "embedding, which splits the sequence")
        return sizes[0]

    def embed(mp: ModulePlan) -> Callable:
        m = mp.module
        start = plan.layouts[mp.weight_name].local_slices()[0].start

        def fwd(ids: Tensor) -> Tensor:
            k = mesh.size(axis)
            if ids.dim() < 2 or ids.shape[1] < k:
                raise ValueError(
                    f"sequence_parallel over {axis}={k}: {mp.name!r} got token ids of shape "
                    f"{tuple(ids.shape)}, whose dim 1 (the sequence) cannot be split into {k} "
                    "chunks; use sequences of at least as many tokens as ranks"
                )
            cut = comm.chunk_sizes(ids.shape[1], k)
            if sizes and sizes[0] != cut:
                raise ValueError(f"sequence_parallel: {mp.name!r} got a sequence of "
                                 f"{ids.shape[1]} after one of {sum(sizes[0])} in one call")
            sizes[:] = [cut]
            return scale_embedding(vocab_parallel_embedding(
                ids, m.weight, start, mesh, axis, mp.name, padding_idx=m.padding_idx,
                seq_sizes=cut), mp)

        return fwd

    def region(name: str, own: Callable) -> Callable:
        row = seq.row_of[name]

        def fwd(*args: Any, **kwargs: Any) -> Any:
            if args:
                x, rest, key = args[0], args[1:], None
            elif "hidden_states" in kwargs:
                key = "hidden_states"
                x, rest = kwargs[key], ()
            else:
                raise ValueError(f"sequence_parallel: region {name!r} was called without a "
                                 "positional or hidden_states argument to gather")
            cut = seq_sizes(name)
            full = gather_seq(x, mesh, axis, cut, f"{name}: input")
            outer = gathered.get(name), partial.get(row.name)
            gathered[name] = full
            try:
                out = own(full, *rest, **kwargs) if key is None else own(
                    *rest, **{**kwargs, key: full})
                product = partial.get(row.name)
            finally:
                for d, k, v in ((gathered, name, outer[0]), (partial, row.name, outer[1])):
                    if v is None:
                        d.pop(k, None)
                    else:
                        d[k] = v
            # The module runs on the whole sequence (its own shape logic sees whole tensors) and
            # returns the row-split linear's partial sums, which are reduce-scattered here, and
            # the bias added to this rank's chunk. Anything the module did after that linear
            # would have run on partial sums: refused.
            first = out[0] if isinstance(out, (tuple, list)) else out
            if product is None or first is not product:
                raise ValueError(
                    f"sequence_parallel: region {name!r} must return the output of its "
                    f"row-split linear {row.name!r} itself (first, if it returns a tuple)"
                )
            m = row.module
            y = reduce_scatter_seq(product, mesh, axis, cut, f"{row.name}: output")
            y = y if m.bias is None else y + m.bias
            if isinstance(out, (tuple, list)):
                return type(out)((y, *out[1:]))
            return y

        return fwd

    forwards: dict[nn.Module, Callable] = {}
    for mp in plan.modules:
        if mp.style == "embedding_rowwise":
            forwards[mp.module] = embed(mp)
        else:
            forwards[mp.module] = _seq_forward(mp, plan, seq, seq_sizes, gathered, partial)
    for name, reg in seq.regions.items():
        forwards[reg] = region(name, reg.forward)
    with _swapped(plan, forwards):
        yield


def _seq_forward(mp: ModulePlan, plan: ShardingPlan, seq: _SeqPlan,
                 seq_sizes: Callable[[str], list[int]], gathered: dict[str, Tensor],
                 partial: dict[str, Tensor]) -> Callable:
    mesh, axis, who = plan.mesh, plan.axis, mp.name
    matmul, add_bias = _local_ops(mp)

    if mp.style == "colwise":
        region = seq.region_of[who]

        def colwise(x: Tensor) -> Tensor:
            # The region's gather backward reduce-scatters the gradient of its gathered input,
            # which is right when that input's consumers are the column-split linears (each
            # rank's gradient partial); anything else could be counted tp times.
            if x is not gathered.get(region):
                raise ValueError(
                    f"sequence_parallel: {who!r} (colwise) must be called on its region "
                    f"{region!r}'s input itself, the tensor that the region gathers"
                )
            return add_bias(matmul(x))

        return colwise
    if mp.style == "rowwise":

        def rowwise(x: Tensor) -> Tensor:
            # Partial sums over the whole sequence; the region reduce-scatters them and adds
            # the bias (see _installed_seq).
            partial[who] = y = matmul(x)
            return y

        return rowwise
    if mp.style == "vocab_parallel":
        return lambda x: add_bias(matmul(gather_seq(x, mesh, axis, seq_sizes(who),
                                                    f"{who}: input")))
    if mp.style == "colwise_gather_output":
        out_dim = 1 if mp.kind == "conv1d" else 0
        vocab = comm.chunk_sizes(plan.layouts[mp.weight_name].global_shape[out_dim],
                                 mesh.size(axis))

        def head(x: Tensor) -> Tensor:
            full = gather_seq(x, mesh, axis, seq_sizes(who), f"{who}: input")
            return gather_last_dim(add_bias(matmul(full)), mesh, axis, vocab, f"{who}: output")

        return head
    raise AssertionError(mp.style)
