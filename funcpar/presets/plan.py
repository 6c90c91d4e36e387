"""The plan of a composed step: mesh, layouts, expected communication per step, memory per rank.

:func:`describe` reads a composed ``(step, state)`` - its layouts, its ZeRO plan, its
data-parallel axis and precision - and derives, without running it:

* **layouts**: leaves grouped by how they are split (which dims over which axes), with their
  global bytes and the bytes this rank holds;
* **communication per step**: every collective the step issues, as (op, axis, count, bytes),
  in :mod:`funcpar.shard.comm`'s byte convention (the largest buffer of the operation on this
  rank: the tensor for all-reduce, the gathered output for all-gather, the full input for
  reduce-scatter, uneven pieces padded to the longest). Derived from the transforms' code paths:

  - tensor parallelism (from the sharding plan; ``tokens`` = this rank's batch x sequence, ``w``
    the feature width, ``s`` the compute dtype's size): per group of column-split siblings (one
    shared input: q/k/v, gate/up) one all-reduce of the input gradient, ``tokens*w_in*s``;
    per row-split linear one all-reduce of its output, ``tokens*w_out*s``; the vocab-parallel
    embedding one all-reduce of its output; the vocab-parallel cross-entropy three all-reduces
    of ``tokens`` entries (max, sum of exponentials, target logit, in float32 or wider); a
    gathered head one all-gather of the logits. With sequence parallelism the all-reduces
    become reduce-scatters and all-gathers of the padded sequence (``ceil(seq/tp)*tp``): the
    embedding scatters its output (and gathers its gradient), each region gathers its input
    and scatters its output (and the reverse backward), the head gathers its input, and the
    gradients of the leaves not split over tp are summed in one all-reduce per dtype;
  - 2D tensor parallelism (``grid``, a :class:`~funcpar.transforms.tp_modes.Plan2D`): the
    collectives of :func:`~funcpar.transforms.tp_modes.planned_collectives` on this rank's
    rows (its grid row's chunk of the local batch, times the sequence) in the compute dtype -
    SUMMA's panel broadcasts and partial-product reduce-scatters, the weight gathers and their
    gradients' reduce-scatters, the norm statistics, the loss's - grouped by op and axis. The
    weight panels do not scale with the tokens, so a batch shape is required;
  - data parallelism: the gradient buckets (the bucketing of
    :class:`~funcpar.transforms.data_parallel.BucketedMean` replayed on the local leaves) and
    the loss's all-reduce;
  - ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054): stage 1-2, one all-gather of the
    updates per bucket of partitioned leaves; stage 2, one reduce-scatter per bucket (leaves
    too small to cut whole in every rank's segment); stage 3, per gather group (the leaves
    outside the blocks, then each block: ``zero_partition.gather_groups``) and dtype one
    all-gather in the forward, one more in the backward when autograd saved the gathered
    value of any of its leaves (a leaf of a module other than an ``nn.Embedding``, whose
    backward needs only the indices; the group is gathered once for all uses), and one
    reduce-scatter of its gradients (in the compute dtype: they are the gathered leaves'),
    plus the buckets of the leaves too small to cut;
  - norms: the ``grad_norm`` metric and each ``clip_by_global_norm`` sum the squares with one
    all-reduce per mesh axis per distinct set of splitting axes
    (:func:`~funcpar.shard.reduce.total_sum_of_squares`), except the first clip, which takes
    the metric's norm (``TrainStep.share_grad_norm``; not under ZeRO-1, whose optimizer sees
    partitioned views of the gradients);
  - fp16: one all-reduce (max) per mesh axis for the agreed inf/nan check;
  - expert parallelism (detected from the layouts: the stacked expert leaves of every
    :class:`~funcpar.models.moe.MoE` block split on dim 0 over an axis ``ep``), per MoE block
    and step: one ``all_to_all`` of the ``ep`` token counts (int64, ``8 ep`` bytes); then, with
    ``R = max(sent, received)`` the assignment rows this rank sends or receives, the token rows
    and the expert outputs forward and the reverse of both in the backward (four of
    ``R * dim * s``) and the expert ids (``8 R``). ``R`` depends on the routing: with ``g``
    local groups (sequences; ``batch / (ep dp)``) of ``T`` tokens, ``k`` choices, ``E``
    experts and the capacity ``C`` per expert and group, the value given is that of
    *balanced* routing (every expert receives ``kT/E`` of every group's assignments:
    ``R = g min(kT, E C)``; exact when ``E`` divides ``kT``) and the bound the most any routing
    can give, ``R <= max(g min(kT, E C), ep g min(T min(k, E/ep), C E/ep))`` (what a rank sends,
    what its ``E/ep`` experts can receive from the ``ep`` ranks). :meth:`Plan.expected_comm`
    takes the routing's kept assignments per expert (``routing=``) for the exact value. Also
    the loss's all-reduce over ``ep`` and the mean over ``ep`` of the gradients of the leaves
    not split over it (in ``bucket_mb`` buckets, of the gradients as ZeRO-2/3 left them: their
    ``dp`` parts); the expert leaves are reduced over ``dp`` only (their expert-data-parallel
    group), by the data-parallel buckets or ZeRO's reduce-scatter above. Tensor parallelism
    of the experts (the ``"experts"`` rule style), with or without expert parallelism, is not
    modeled (:meth:`Plan.expected_comm` refuses).

  Not modeled: an optimizer's own reductions beyond clipping (factored statistics of Adafactor
  or CAME, Lamb's trust ratios, GaLore's projections; elementwise optimizers such as SGD and
  AdamW issue none), and any step under ``pipeline_split`` (its point-to-point transfers and
  per-stage collectives depend on the schedule: :meth:`Plan.expected_comm` refuses, and the
  printed plan says so; measure with ``comm_report``). A model whose column-split siblings do not
  share one input, or that runs a sharded module more than once per step (``remat``'s
  recompute repeats an MoE block's four forward all_to_alls), issues more.
* **memory per rank**: parameters as stored, gradients as the optimizer receives them (after the
  reductions; ZeRO-2/3 keep their part), optimizer state (:func:`funcpar.optim.memory.
  state_bytes`) on the device and in an offload store, and the transient copies: the compute
  dtype's copy of the parameters under amp, the gathered leaves of ZeRO-3 (the leaves outside
  every block plus the largest block); with a ``batch_shape`` and funcpar's Llama, the
  activations the backward keeps (:meth:`Plan.activation_bytes`, an estimate per token times
  the rank's tokens: the sequence over ``cp`` too).

``tests/test_presets.py`` checks the communication against :func:`~funcpar.shard.comm.
comm_report`'s records of a real step, count and bytes per (op, axis); ``tests/test_moe_plan.py``
does under expert parallelism (the all_to_all within its bound, exact given the routing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from funcpar.models.moe import expert_capacity
from funcpar.optim.memory import state_bytes
from funcpar.shard.buckets import bucket_indices
from funcpar.shard.comm import chunk_sizes
from funcpar.shard.layout import Layout
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import ModulePlan, ShardingPlan
from funcpar.state.train_state import TrainState
from funcpar.state.tree import named_leaves, tree_flatten
from funcpar.train.step import TrainStep
from funcpar.transforms.amp_cast import PRECISIONS
from funcpar.transforms.expert_parallel import expert_leaves
from funcpar.transforms.tp_modes import Plan2D, planned_collectives
from funcpar.transforms.zero_partition import gather_groups

__all__ = ["CommRow", "LayoutRow", "MemoryReport", "MoEBlock", "Plan", "describe"]

_COLUMN = ("colwise", "vocab_parallel", "colwise_gather_output")
# 2D tensor parallelism's collectives by (op, over the grid's row axis?): what they carry.
_TP2D_WHAT = {
    ("broadcast", False): "2d: SUMMA activation panels along grid rows (fwd + bwd)",
    ("broadcast", True): "2d: SUMMA weight panels along grid columns (fwd + bwd)",
    ("reduce_scatter", False): "2d: SUMMA input-grad partials (bwd)",
    ("reduce_scatter", True): "2d: SUMMA weight-grad partials; gathered weights' grads (bwd)",
    ("all_gather", True): "2d: embedding, norm and bias weights gathered (fwd)",
    ("all_reduce", False): "2d: norm statistics (fwd + bwd), vocab-parallel cross-entropy",
    ("all_reduce", True): "2d: loss token sum and count",
}
_HEADS = ("vocab_parallel", "colwise_gather_output")


@dataclasses.dataclass(frozen=True)
class CommRow:
    """``count`` collectives ``op`` over ``axis`` moving ``nbytes`` in all (per local token
    when ``per_token``: activation traffic with no batch shape given). ``bound``: for traffic
    that depends on the routing (expert parallelism's all_to_all), the most any routing moves;
    ``nbytes`` is then the value under balanced routing. None: ``nbytes`` is exact."""

    op: str
    axis: str
    count: int
    nbytes: int
    what: str
    per_token: bool = False
    bound: int | None = None


@dataclasses.dataclass(frozen=True)
class MoEBlock:
    """An MoE block as expert parallelism splits it: ``n_experts`` over ``axis``, tokens of
    width ``dim`` routed to ``top_k`` experts with ``capacity_factor`` (None: dropless)."""

    name: str
    axis: str
    n_experts: int
    top_k: int
    capacity_factor: float | None
    dim: int
    inner_axes: tuple[str, ...] = ()  # what else splits the experts (tensor parallelism)


@dataclasses.dataclass(frozen=True)
class LayoutRow:
    """Leaves split the same way: how, how many, their global bytes and this rank's."""

    split: str
    leaves: int
    global_bytes: int
    rank_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank (``*_max``: the most any rank holds, uneven splits included)."""

    params: int
    params_max: int
    grads: int
    grads_max: int
    opt_state: int  # on the device (this rank)
    opt_state_offloaded: int  # in the offload store (this rank)
    compute_params: int  # amp's compute-dtype copy of the parameters, during the step
    zero3_gathered: int  # ZeRO-3's gathered leaves at the peak, during the step

    @property
    def resident(self) -> int:
        """Held between steps on the device: params + optimizer state (gradients live during
        the step only, but they peak with it, so they are counted too)."""
        return self.params + self.grads + self.opt_state


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * _size(dtype)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} GiB"  # pragma: no cover


def _split_text(lay: Layout | None, mesh: DeviceMesh) -> str:
    if lay is None:
        return "whole on every rank"
    parts = []
    for d, axes in enumerate(lay.dim_axes):
        cut = [a for a in axes if mesh.size(a) > 1]
        if cut:
            parts.append(f"dim {d} over {' x '.join(cut)}")
    return "; ".join(parts) or "whole on every rank"


def _layout_rows(params: Any, layouts: Any, mesh: DeviceMesh) -> list[LayoutRow]:
    named = named_leaves(params)
    lays = [None] * len(named) if layouts is None else tree_flatten(layouts)[0]
    rows: dict[str, list[int]] = {}
    for (_, x), lay in zip(named, lays):
        if not torch.is_tensor(x):
            continue
        key = _split_text(lay, mesh)
        shape = lay.global_shape if lay is not None else tuple(x.shape)
        local = lay.local_shape() if lay is not None else tuple(x.shape)
        acc = rows.setdefault(key, [0, 0, 0])
        acc[0] += 1
        acc[1] += _nbytes(shape, x.dtype)
        acc[2] += _nbytes(local, x.dtype)
    return [LayoutRow(k, *v) for k, v in rows.items()]


def _per_rank(params: Any, layouts: Any, mesh: DeviceMesh, dtype_of: Any = None) -> list[int]:
    """Bytes of ``params`` (described by ``layouts``) on every rank of the mesh."""
    named = named_leaves(params)
    lays = [None] * len(named) if layouts is None else tree_flatten(layouts)[0]
    world = mesh.world_size
    out = [0] * world
    for (_, x), lay in zip(named, lays):
        if not torch.is_tensor(x):
            continue
        dtype = x.dtype if dtype_of is None else dtype_of
        for r in range(world):
            shape = tuple(x.shape) if lay is None else lay.local_shape(r)
            out[r] += _nbytes(shape, dtype)
    return out


class _Rows:
    """An ordered accumulator of (op, axis, what) -> count, bytes."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.rows: dict[tuple[str, str, str, bool], list[Any]] = {}

    def add(self, op: str, axis: str, nbytes: int, what: str, *, count: int = 1,
            per_token: bool = False, bound: int | None = None) -> None:
        if count == 0 or self.mesh.size(axis) == 1:  # size-1 axes issue nothing
            return
        acc = self.rows.setdefault((op, axis, what, per_token), [0, 0, None])
        acc[0] += count
        acc[1] += nbytes
        if bound is not None:
            acc[2] = (acc[2] or 0) + bound

    def out(self) -> list[CommRow]:
        return [CommRow(op, axis, c, n, what, pt, b)
                for (op, axis, what, pt), (c, n, b) in self.rows.items()]


class Plan:
    """What a composed step does per step and holds per rank; ``str(plan)`` prints it.

    Build it with :func:`describe` (the presets do: ``composed.plan``). ``expected_comm``
    and ``comm_totals`` take an optional global ``batch_shape`` ``(batch, seq)`` for the
    activation traffic of tensor parallelism.
    """

    def __init__(self, step: TrainStep, state: TrainState, mesh: DeviceMesh, *, name: str,
                 transforms: Sequence[str], sharding: ShardingPlan | None,
                 sequence_parallel: bool, bucket_mb: float, clip_norms: int,
                 batch_shape: tuple[int, int] | None, max_norm: float | None,
                 grid: Plan2D | None = None) -> None:
        self.step, self.state, self.mesh = step, state, mesh
        self.name = name
        self.transforms = tuple(transforms)
        self.sharding = sharding
        self.grid = grid
        self.sequence_parallel = sequence_parallel
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.clip_norms = clip_norms
        self.batch_shape = batch_shape
        self.max_norm = max_norm
        self.pipelined = getattr(step, "pipeline", None) is not None
        self.context_parallel = getattr(step.loss_fn, "context_parallel", None)
        self.moe_blocks = _moe_blocks(step, mesh)
        self.tp_experts = _experts_split_inside(step, mesh)
        leaves = [x for _, x in named_leaves(state.params) if torch.is_tensor(x)]
        floating = [x.dtype for x in leaves if x.is_floating_point()]
        self.param_dtype = floating[0] if floating else torch.float32
        self.compute_dtype = (PRECISIONS[step.precision] if step.precision is not None
                              else self.param_dtype)
        self.layout_rows = _layout_rows(state.params, step.layouts, mesh)
        zero = step.partition
        self.opt_layout_rows = None
        if zero is not None and zero.stage < 3:
            self.opt_layout_rows = _layout_rows(state.params, zero.part_layouts(state.params),
                                                mesh)
        self.memory = self._memory()

    # --------------------------------------------------------------------------- memory
    def _memory(self) -> MemoryReport:
        step, state, mesh = self.step, self.state, self.mesh
        params = _per_rank(state.params, step.layouts, mesh)
        zero = step.partition
        glay = step.grad_layouts if step.grad_layouts is not None else step.layouts
        grads = _per_rank(state.params, glay, mesh)
        total = state_bytes(state.opt_state)
        offloaded = sum(x.numel() * x.element_size()
                        for x in tree_flatten(state.opt_state)[0]
                        if torch.is_tensor(x) and x.is_meta)
        r = mesh.rank()
        compute = 0
        if step.precision is not None:
            compute = _per_rank(state.params, step.layouts, mesh, self.compute_dtype)[r]
        gathered = self._zero3_gathered() if zero is not None and zero.stage == 3 else 0
        return MemoryReport(params[r], max(params), grads[r], max(grads), total - offloaded,
                            offloaded, compute, gathered)

    def _whole_local(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s tensor-parallel shard shape (before the ZeRO cut)."""
        zero = self.step.partition
        shape = list(zero.layouts[i].local_shape())
        if zero.dims[i] is not None:
            shape[zero.dims[i]] = zero.lengths[i]
        return tuple(shape)

    def _zero3_gathered(self) -> int:
        """The leaves outside the blocks (whole through the forward and, gathered again, the
        backward) plus ``1 + prefetch`` adjacent blocks: the one computing and those gathered
        ahead of it; without resharding after the forward, every block."""
        zero = self.step.partition
        size = _size(self.compute_dtype)
        whole = [sum(math.prod(self._whole_local(i)) * size for i in idx)
                 for _, idx in gather_groups(self.step.apply_fn.module, zero)]
        rest, blocks = whole[0], whole[1:]
        if not zero.reshard:  # each block whole from its forward to its backward
            return rest + sum(blocks)
        k = min(1 + zero.prefetch, len(blocks))
        return rest + max((sum(blocks[j:j + k]) for j in range(len(blocks) - k + 1)),
                          default=0)

    def activation_bytes(self, batch_shape: tuple[int, int] | None = None) -> int | None:
        """The activations the backward keeps on this rank for a global ``batch_shape``
        ``(batch, seq)`` (default: the preset's): :mod:`funcpar.auto.model`'s bytes per token
        (measured on funcpar's Llama with saved-tensor hooks) times this rank's tokens - the
        batch over ``dp`` (and ``ep``), the sequence over ``cp`` - plus the rotary tables of
        each block and the head's; a block that ``remat`` checkpoints whole keeps its input,
        and one such block's activations are held again while it recomputes. An estimate (the
        ring keeps the unrepeated kv heads, less than one process's repeat under GQA). None
        without a batch shape, for a model other than funcpar's Llama, or under a pipeline."""
        from funcpar.auto.model import model_spec  # the search's model: no import cycle here
        from funcpar.models.llama import Llama

        batch_shape = batch_shape if batch_shape is not None else self.batch_shape
        module = getattr(self.step.apply_fn, "module", None)
        if batch_shape is None or not isinstance(module, Llama) or self.pipelined:
            return None
        spec = model_spec(module)
        b, t, _ = self._local_batch(batch_shape)
        if self.moe_blocks:  # expert parallelism splits the batch over its axis too
            b //= self.mesh.size(self.moe_blocks[0].axis)
        tp = self.mesh.size(self.sharding.axis) if self.sharding is not None else 1
        s = _size(self.compute_dtype)
        tokens = b * t
        rope = spec.rope_bytes(t, s)
        rematted = set(getattr(self.step.apply_fn, "remat_modules", ()) or ())
        kept, again = 0.0, 0.0
        for i in range(spec.layers):
            block = spec.block_activation_bytes(i, s, tp, self.sequence_parallel) * tokens
            if f"layers.{i}" in rematted:
                kept += tokens * s * spec.dim
                again = max(again, block + rope)
            else:
                kept += block + rope
        return int(kept + again + spec.head_activation_bytes(s, tp) * tokens)

    # ------------------------------------------------------------------- communication
    def expected_comm(self, batch_shape: tuple[int, int] | None = None, *,
                      routing: Sequence[Any] | None = None) -> list[CommRow]:
        """The collectives of one step (see the module docstring). ``batch_shape``: the global
        ``(batch, seq)`` (default: the one given to the preset); without one, the activation
        traffic of tensor parallelism and of expert parallelism's all_to_all is given per
        local token (for the latter: balanced routing, nothing dropped).

        ``routing`` (expert parallelism): the kept assignments per expert of each rank of this
        rank's ``ep`` group, in ``ep`` order - ``[moe_blocks, n_experts]`` each, the
        ``tokens_per_expert`` of :class:`~funcpar.models.llama.MoEOutput` on that rank's
        batch. With it the all_to_all bytes are exact instead of balanced (with a bound)."""
        if self.pipelined:
            raise ValueError("the expected communication is not modeled under pipeline_split "
                             "(point-to-point transfers by schedule); measure a step with "
                             "funcpar.shard.comm.comm_report")
        if self.tp_experts or (self.moe_blocks and self.sharding is not None):
            # The experts' tensor-parallel region all-reduces [kept rows, dim] per MoE block,
            # a routing-dependent size the tp rows below do not count.
            raise ValueError("the expected communication of MoE experts under tensor "
                             "parallelism (with or without expert parallelism) is not "
                             "modeled; measure a step with funcpar.shard.comm.comm_report")
        if routing is not None and not self.moe_blocks:
            raise ValueError("expected_comm: routing= is for expert parallelism, and this "
                             "step splits no MoE block's experts")
        batch_shape = batch_shape if batch_shape is not None else self.batch_shape
        rows = _Rows(self.mesh)
        if self.sharding is not None:
            self._tp_rows(rows, batch_shape)
        if self.grid is not None:
            self._tp2d_rows(rows, batch_shape)
        if self.moe_blocks:
            self._ep_rows(rows, batch_shape, routing)
        self._cp_rows(rows, batch_shape)
        self._dp_rows(rows)
        self._norm_rows(rows)
        scaler = self.step.loss_scaler
        if scaler is not None and getattr(scaler, "mesh", None) is not None:
            for axis in self.mesh.axis_names:
                rows.add("all_reduce", axis, 4, "amp fp16 inf/nan check")
        return rows.out()

    def comm_totals(self, batch_shape: tuple[int, int] | None = None, *,
                    routing: Sequence[Any] | None = None, bound: bool = False
                    ) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(op, axis): (count, bytes)}`` of :meth:`expected_comm` (a batch shape is needed
        when tensor or expert parallelism moves activations). ``bound``: the routing-dependent
        rows at their upper bound instead of their balanced value."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for row in self.expected_comm(batch_shape, routing=routing):
            if row.per_token:
                raise ValueError("comm_totals needs batch_shape=(batch, seq): the activation "
                                 "traffic of tensor or expert parallelism depends on it")
            nbytes = row.bound if bound and row.bound is not None else row.nbytes
            c, n = out.get((row.op, row.axis), (0, 0))
            out[(row.op, row.axis)] = (c + row.count, n + nbytes)
        return out

    def _local_batch(self, batch_shape: tuple[int, int] | None) -> tuple[int, int, bool]:
        """(this rank's batch, seq, per_token) for the activation traffic."""
        dp = self.mesh.size(self.step.dp_axis) if self.step.dp_axis is not None else 1
        if batch_shape is None:
            # One token per tp rank of one sequence, divided out below: per local token.
            return 1, self.mesh.size(self.sharding.axis), True
        b, t = batch_shape
        if b % dp:
            raise ValueError(f"batch_shape {batch_shape}: a batch of {b} does not split over "
                             f"dp={dp}")
        cp = self.context_parallel
        if cp is None:
            return b // dp, t, False
        n = self.mesh.size(cp.axis)
        return b // dp, -(-t // (2 * n)) * 2, False  # padded to a multiple of 2 cp

    def _tp_rows(self, rows: _Rows, batch_shape: tuple[int, int] | None) -> None:
        sp, axis = self.sharding, self.sharding.axis
        k = self.mesh.size(axis)
        b, t, per_token = self._local_batch(batch_shape)
        div = t if per_token else 1  # per_token: b = 1, t = k tokens, divided out
        act = _size(self.compute_dtype)
        # The cross-entropy works in float32 at least (half-precision logits are upcast).
        ce = max(act, 4)

        def add(op: str, nbytes: int, what: str, count: int = 1) -> None:
            rows.add(op, axis, nbytes // div, what, count=count, per_token=per_token)

        def width(mp: ModulePlan, which: str) -> int:
            shape = sp.layouts[mp.weight_name].global_shape
            if mp.kind == "embedding":
                return shape[1]
            out_dim = 1 if mp.kind == "conv1d" else 0
            return shape[out_dim] if which == "out" else shape[1 - out_dim]

        def padded(n: int) -> int:  # a dim of n cut over k, as it travels
            return chunk_sizes(n, k)[0] * k

        mods = list(sp.modules)
        parent = {mp.name: mp.name.rpartition(".")[0] for mp in mods}
        heads = [mp for mp in mods if mp.style in _HEADS]
        if not self.sequence_parallel:
            seen: set[str] = set()
            for mp in mods:
                if mp.style in _COLUMN and parent[mp.name] not in seen:
                    # Column-split siblings (q/k/v, gate/up) share one input: one all-reduce
                    # of its gradient in the backward.
                    seen.add(parent[mp.name])
                    add("all_reduce", b * t * width(mp, "in") * act,
                        "tp: input grads of column-split linears (backward)")
                if mp.style == "rowwise":
                    add("all_reduce", b * t * width(mp, "out") * act,
                        "tp: row-split linear outputs (forward)")
                if mp.style == "embedding_rowwise":
                    add("all_reduce", b * t * width(mp, "out") * act,
                        "tp: vocab-parallel embedding output (forward)")
        else:
            tpad = padded(t)
            for mp in mods:
                if mp.style == "embedding_rowwise":
                    add("reduce_scatter", b * tpad * width(mp, "out") * act,
                        "sp: embedding output scattered over the sequence")
                    add("all_gather", b * tpad * width(mp, "out") * act,
                        "sp: embedding output grad gathered (backward)")
            regions = {parent[mp.name]: mp for mp in mods if mp.style == "rowwise"}
            for region, row in regions.items():
                col = next(mp for mp in mods if mp.style == "colwise"
                           and parent[mp.name] == region)
                win, wout = width(col, "in"), width(row, "out")
                add("all_gather", b * tpad * win * act, "sp: region input gathered (forward)")
                add("reduce_scatter", b * tpad * win * act,
                    "sp: region input grad scattered (backward)")
                add("reduce_scatter", b * tpad * wout * act,
                    "sp: region output scattered (forward)")
                add("all_gather", b * tpad * wout * act, "sp: region output grad gathered "
                    "(backward)")
            for mp in heads:
                add("all_gather", b * tpad * width(mp, "in") * act, "sp: head input gathered")
                add("reduce_scatter", b * tpad * width(mp, "in") * act,
                    "sp: head input grad scattered (backward)")
        for mp in heads:
            if mp.style == "vocab_parallel":
                add("all_reduce", 3 * b * t * ce, "tp: vocab-parallel cross-entropy (max, "
                    "sum_exp, target)", count=3)
            else:
                add("all_gather", b * t * padded(width(mp, "out")) * act,
                    "tp: head logits gathered")
        if self.sequence_parallel:
            self._sp_grad_rows(rows)

    def _tp2d_rows(self, rows: _Rows, batch_shape: tuple[int, int] | None) -> None:
        """2D tensor parallelism: the collectives of :func:`funcpar.transforms.tp_modes.
        planned_collectives` on this rank's rows (its grid row's chunk of the local batch,
        times the sequence), in the compute dtype, grouped by op and axis."""
        if batch_shape is None:
            raise ValueError("the expected communication of 2D tensor parallelism needs "
                             "batch_shape=(batch, seq): its weight panels do not scale with "
                             "the tokens, so it has no per-token form")
        if getattr(self.step.apply_fn, "remat", False):
            raise ValueError("the expected communication of 2D tensor parallelism under remat "
                             "is not modeled (the recompute repeats the blocks' SUMMA panels); "
                             "measure a step with funcpar.shard.comm.comm_report")
        b, t, _ = self._local_batch(batch_shape)
        g = self.grid.grid
        local_rows = chunk_sizes(b, g.q)[g.i] * t
        for p in planned_collectives(self.grid, local_rows, self.compute_dtype):
            rows.add(p.op, p.axis, p.nbytes, _TP2D_WHAT[(p.op, p.axis == g.row)])

    def _sp_grad_rows(self, rows: _Rows) -> None:
        """One all-reduce per dtype of the gradients of the leaves not split over tp."""
        axis = self.sharding.axis
        step = self.step
        glay = step.grad_layouts if step.grad_layouts is not None else step.layouts
        by_dtype: dict[torch.dtype, int] = {}
        for (_, x), lay in zip(named_leaves(self.state.params), tree_flatten(glay)[0]):
            if not torch.is_tensor(x) or any(axis in a for a in lay.dim_axes):
                continue
            by_dtype[x.dtype] = by_dtype.get(x.dtype, 0) + _nbytes(lay.local_shape(),
                                                                   x.dtype)
        for n in by_dtype.values():
            rows.add("all_reduce", axis, n, "sp: grads of leaves not split over tp")

    def _cp_rows(self, rows: _Rows, batch_shape: tuple[int, int] | None) -> None:
        """Context parallelism: the attention's ring sends or all_to_alls (from the transform's
        own account, ContextParallel.attention_comm), the token count, the loss mean and the
        gradient buckets (of the gradients as the inner hooks left them) over its axis."""
        cp = self.context_parallel
        if cp is None:
            return
        recomputed = ()
        if getattr(self.step.apply_fn, "remat", False):
            recomputed = getattr(self.step.apply_fn, "remat_modules", None)
            if recomputed is None:
                raise ValueError("the expected communication of context_parallel under a remat "
                                 "that does not name its modules is not modeled; measure a "
                                 "step with funcpar.shard.comm.comm_report")
        n = self.mesh.size(cp.axis)
        if batch_shape is None:
            b, t, per_token = 1, 1, True
        else:
            b, t, per_token = self._local_batch(batch_shape)
        tp = self.mesh.size(self.sharding.axis) if self.sharding is not None else 1
        for op, nbytes, what, count in cp.attention_comm(n, b, t, self.compute_dtype, tp,
                                                         recomputed):
            rows.add(op, cp.axis, nbytes, what, count=count, per_token=per_token)
        rows.add("all_reduce", cp.axis, 8, "cp: counted targets")
        rows.add("all_reduce", cp.axis, self._loss_bytes(), "cp: loss mean")
        step = self.step
        glay = step.grad_layouts if step.grad_layouts is not None else step.layouts
        leaves = [x for _, x in named_leaves(self.state.params)]
        if glay is not None:
            leaves = [torch.empty(lay.local_shape(), dtype=x.dtype, device="meta")
                      for x, lay in zip(leaves, tree_flatten(glay)[0])]
        for nbytes in _buckets(leaves, cp.bucket_bytes):
            rows.add("all_reduce", cp.axis, nbytes, "cp: gradient buckets")

    def _loss_bytes(self) -> int:
        """The reported loss: float32 at least under amp, else the parameters' dtype."""
        return max(_size(self.compute_dtype), 4) if self.step.precision else _size(
            self.param_dtype)

    def _ep_rows(self, rows: _Rows, batch_shape: tuple[int, int] | None,
                 routing: Sequence[Any] | None) -> None:
        """Expert parallelism's collectives (see the module docstring)."""
        blocks = self.moe_blocks
        axis = blocks[0].axis
        ep = self.mesh.size(axis)
        dp = self.mesh.size(self.step.dp_axis) if self.step.dp_axis is not None else 1
        act = _size(self.compute_dtype)
        rows.add("all_reduce", axis, self._loss_bytes(), "ep: loss mean")
        # The leaves not split over ep: their gradients as the step hands them to the ep mean
        # (after data_parallel's and ZeRO's reductions: ZeRO-2/3's parts), in one dict.
        glay = self.step.grad_layouts if self.step.grad_layouts is not None else self.step.layouts
        experts = {f"{b.name}.experts.{leaf}" for b in blocks
                   for leaf in ("gate_proj", "up_proj", "down_proj")}
        rep = {}
        for (n, x), lay in zip(named_leaves(self.state.params), tree_flatten(glay)[0]):
            if torch.is_tensor(x) and n not in experts:
                shape = tuple(x.shape) if lay is None else lay.local_shape()
                rep[n] = torch.empty(shape, dtype=x.dtype, device="meta")
        for nbytes in _buckets(tree_flatten(rep)[0], self.bucket_bytes):
            rows.add("all_reduce", axis, nbytes, "ep: grads of leaves not split over ep (mean)")
        if routing is not None:
            routing = [torch.as_tensor(r) for r in routing]
            want = (len(blocks), blocks[0].n_experts)
            if len(routing) != ep or any(tuple(r.shape) != want for r in routing):
                raise ValueError(f"expected_comm: routing= needs {ep} (ep) tensors of shape "
                                 f"{list(want)} (moe blocks, experts), got "
                                 f"{[tuple(r.shape) for r in routing]}")
        if batch_shape is not None:
            b, t = batch_shape
            if b % (ep * dp):
                raise ValueError(f"batch_shape {batch_shape}: a batch of {b} does not split "
                                 f"over ep={ep} x dp={dp}")
            groups = b // (ep * dp)
        me = self.mesh.rank(axis)
        for i, blk in enumerate(blocks):
            rows.add("all_to_all", axis, 8 * ep, "ep: token counts")
            e, k = blk.n_experts, blk.top_k
            per_row = 4 * blk.dim * act  # tokens, outputs, and their gradients
            if batch_shape is None:  # balanced, nothing dropped: k rows per local token
                rows.add("all_to_all", axis, k * per_row, "ep: token rows, expert outputs "
                         "(forward) and their grads (backward)", count=4, per_token=True)
                rows.add("all_to_all", axis, k * 8, "ep: expert ids", per_token=True)
                continue
            cap = expert_capacity(blk.capacity_factor, k, t, e)
            local = e // ep
            balanced = groups * min(k * t, e * cap)
            most = max(balanced, ep * groups * min(t * min(k, local), local * cap))
            if routing is None:
                r, bound = balanced, most
            else:  # what this rank sends, what its experts receive from the ep group: exact
                sent = int(routing[me][i].sum())
                got = sum(int(x[i][me * local:(me + 1) * local].sum()) for x in routing)
                r, bound = max(sent, got), None
            rows.add("all_to_all", axis, r * per_row, "ep: token rows, expert outputs "
                     "(forward) and their grads (backward)", count=4,
                     bound=None if bound is None else bound * per_row)
            rows.add("all_to_all", axis, r * 8, "ep: expert ids",
                     bound=None if bound is None else bound * 8)

    def _dp_rows(self, rows: _Rows) -> None:
        step, state = self.step, self.state
        zero = step.partition
        if step.dp_axis is not None:
            rows.add("all_reduce", step.dp_axis, self._loss_bytes(), "dp: loss mean")
            if zero is None or zero.stage < 2:
                for nbytes in _buckets(tree_flatten(state.params)[0], self.bucket_bytes):
                    rows.add("all_reduce", step.dp_axis, nbytes, "dp: gradient buckets")
        if zero is None:
            return
        leaves = tree_flatten(state.params)[0]
        n = self.mesh.size(zero.axis)
        comp = _size(self.compute_dtype)
        module = getattr(step.apply_fn, "module", None)
        saved = _saved_leaves(module, zero.names)
        # Buckets (ZeroPlan.scatter_bucket / gather_bucket): one collective each, every rank's
        # segment padded to the longest. An expert shard's gradient is reduced over the zero
        # axis like any other (its own expert-data-parallel group when ep splits the mesh).
        for b in zero.buckets:
            elem = leaves[b[0]].element_size()
            cut = [i for i in b if zero.dims[i] is not None]
            if zero.stage < 3 and cut:
                rows.add("all_gather", zero.axis, max(zero.segment_sizes(cut)) * n * elem,
                         f"zero: updates gathered (bucket of {len(cut)} leaves)")
            scattered = b if zero.stage == 2 else [i for i in b if zero.dims[i] is None]
            if zero.stage >= 2 and scattered:
                uncut = any(zero.dims[i] is None for i in scattered)
                rows.add("reduce_scatter", zero.axis,
                         max(zero.segment_sizes(scattered)) * n * elem,
                         f"zero: grads reduce-scattered (bucket of {len(scattered)} leaves"
                         + (", uncut ones whole in every segment)" if uncut else ")"))
        if zero.stage < 3:
            return
        # ZeRO-3's groups (zero_partition.gather_groups): per group and dtype one all-gather in
        # the forward, one more in the backward when autograd saved any of its leaves (the
        # group is gathered once for all their uses, stacked experts' slices included), and
        # one reduce-scatter of the gradients, in the compute dtype (the gathered leaves').
        for label, idx in gather_groups(module, zero):
            for one in zero.one_dtype(idx, leaves) if idx else []:
                moved = max(zero.segment_sizes(one)) * n * comp
                rows.add("all_gather", zero.axis, moved,
                         f"zero-3: params gathered (forward, {label})")
                if zero.reshard and any(saved[i] for i in one):
                    rows.add("all_gather", zero.axis, moved,
                             f"zero-3: params gathered again (backward, {label})")
                rows.add("reduce_scatter", zero.axis, moved,
                         f"zero-3: grads reduce-scattered ({label})")

    def _norm_rows(self, rows: _Rows) -> None:
        step = self.step
        dtypes = [x.dtype for x in tree_flatten(self.state.params)[0]]
        glay = step.grad_layouts if step.grad_layouts is not None else step.layouts
        _norm(rows, dtypes, glay, self.mesh, "norm: grad_norm metric")
        opt_lay = (step.partition.part_layouts(self.state.params)
                   if step.partition is not None else step.layouts)
        # The first clip (the presets put it first in the chain) sees the step's own gradients
        # and takes the metric's norm (TrainStep.share_grad_norm), except under ZeRO-1, whose
        # optimizer sees partitioned views of them.
        shared = step.share_grad_norm and getattr(step.partition, "stage", None) != 1
        for k in range(self.clip_norms):
            if k == 0 and shared:
                continue
            _norm(rows, dtypes, opt_lay, self.mesh, "norm: clip_by_global_norm")

    # ---------------------------------------------------------------------------- text
    def __str__(self) -> str:
        mesh = self.mesh
        lines = [f"{self.name} plan (rank {mesh.rank()} of {mesh.world_size})",
                 "mesh: " + " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
                 + f" ({mesh.kind})"]
        opt = "optimizer"
        if self.max_norm is not None:
            opt = f"chain(clip_by_global_norm({self.max_norm}), optimizer)"
        lines.append("manual composition:")
        lines.append(f"  step = make_train_step(apply_fn, loss_fn, {opt})")
        if self.transforms:
            lines.append("  step, state = compose(")
            lines += [f"      {t}," for t in self.transforms]
            lines.append("  )(step, init_state(params, buffers, optimizer))")
        else:
            lines.append("  (no transform: one process, or every axis of size 1)")
        lines.append("params as stored:")
        lines += _layout_table(self.layout_rows)
        if self.opt_layout_rows is not None:
            lines.append(f"optimizer state and updates: ZeRO-{self.step.partition.stage} parts "
                         f"over {self.step.partition.axis}:")
            lines += _layout_table(self.opt_layout_rows)
        shape = self.batch_shape
        lines.append("expected communication per step"
                     + (f" (global batch {shape[0]} x {shape[1]}):" if shape else ":"))
        no_shape = self.grid is not None and shape is None
        comm = [] if self.pipelined or no_shape else self.expected_comm()
        if self.pipelined:
            lines.append("  not modeled under pipeline_split (point-to-point transfers by "
                         "schedule): measure a step with comm_report")
        elif no_shape:
            lines.append("  2D tensor parallelism's collectives need the batch shape: give "
                         "batch_shape=(batch, seq)")
        elif not comm:
            lines.append("  none")
        else:
            lines.append(f"  {'op':<15} {'axis':<5} {'count':>6} {'bytes':>14}  what")
            for r in comm:
                nb = f"{r.nbytes:,}" + (" /tok" if r.per_token else "")
                what = r.what
                if r.bound is not None:
                    what += f" [balanced routing; at most {r.bound:,}]"
                elif r.per_token and r.op == "all_to_all":
                    what += " [balanced routing, nothing dropped]"
                lines.append(f"  {r.op:<15} {r.axis:<5} {r.count:>6} {nb:>14}  {what}")
            for axis in mesh.axis_names:
                sel = [r for r in comm if r.axis == axis]
                if sel:
                    fixed = sum(r.nbytes for r in sel if not r.per_token)
                    tok = sum(r.nbytes for r in sel if r.per_token)
                    more = f" + {tok:,} per local token" if tok else ""
                    if any(r.bound is not None for r in sel):
                        most = sum(r.nbytes if r.bound is None else r.bound
                                   for r in sel if not r.per_token)
                        more += f" (at most {most:,} under any routing)"
                    lines.append(f"  total over {axis}: {sum(r.count for r in sel)} "
                                 f"collectives, {fixed:,} bytes{more}")
        lines.append("  not modeled: reductions inside the optimizer passed in (its own "
                     "clip_by_global_norm, factored statistics; none for sgd, adamw); "
                     "max_norm's clip is counted")
        m = self.memory
        lines.append("memory on this rank (max over ranks):")
        lines.append(f"  params          {_human(m.params):>12} ({_human(m.params_max)})")
        lines.append(f"  grads           {_human(m.grads):>12} ({_human(m.grads_max)})"
                     "  as the optimizer receives them")
        lines.append(f"  optimizer state {_human(m.opt_state):>12} on the device"
                     + (f", {_human(m.opt_state_offloaded)} offloaded"
                        if m.opt_state_offloaded else ""))
        if m.compute_params:
            lines.append(f"  amp copy        {_human(m.compute_params):>12} "
                         f"({self.step.precision} params during the step)")
        if m.zero3_gathered:
            lines.append(f"  zero-3 gathered {_human(m.zero3_gathered):>12} (peak during the "
                         "step: leaves outside blocks + the largest block)")
        lines.append(f"  total           {_human(m.resident):>12} (params + grads + optimizer "
                     "state)")
        act = self.activation_bytes()
        if act is not None:
            _, t, _ = self._local_batch(self.batch_shape)
            lines.append(f"  activations     {_human(act):>12} (estimate: {t} positions of the "
                         f"sequence {self.batch_shape[1]} on this rank; funcpar.auto.model)")
            lines.append(f"  with them       {_human(m.resident + act):>12}")
        else:
            lines.append("  activations not counted (no batch_shape, a pipeline, or a model "
                         "other than funcpar's Llama)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan {self.name} on {self.mesh!r}>"


def _layout_table(rows: list[LayoutRow]) -> list[str]:
    out = [f"  {'split':<32} {'leaves':>6} {'global':>12} {'this rank':>12}"]
    for r in rows:
        out.append(f"  {r.split:<32} {r.leaves:>6} {_human(r.global_bytes):>12} "
                   f"{_human(r.rank_bytes):>12}")
    return out


def _buckets(leaves: list[Any], bucket_bytes: int) -> list[int]:
    """The bytes of each gradient bucket, as BucketedMean cuts them (bucket_indices)."""
    nbytes = [g.numel() * g.element_size() for g in leaves]
    return [sum(nbytes[i] for i in b)
            for b in bucket_indices(nbytes, [g.dtype for g in leaves], bucket_bytes)]


def _saved_leaves(module: nn.Module | None, names: Sequence[str]) -> list[bool]:
    """Per leaf, whether autograd saves its gathered value (a module other than an
    ``nn.Embedding`` uses it; tied leaves count every module using them)."""
    if module is None:
        return [True] * len(names)
    users: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            users.setdefault(id(p), []).append(m)
    params = dict(module.named_parameters())
    return [any(not isinstance(m, nn.Embedding) for m in users.get(id(params[n]), [None]))
            if n in params else True for n in names]


def _moe_blocks(step: TrainStep, mesh: DeviceMesh) -> list[MoEBlock]:
    """The MoE blocks whose experts the step splits (expert parallelism: the stacked expert
    leaves' dim 0 over a mesh axis of more than one rank), read from the layouts."""
    module = getattr(step.apply_fn, "module", None)
    if module is None or step.layouts is None:
        return []
    layouts = step.layouts
    out: dict[str, MoEBlock] = {}
    for leaf, m in expert_leaves(module).items():
        lay = layouts.get(leaf) if isinstance(layouts, dict) else None
        axes = [a for a in (lay.dim_axes[0] if lay is not None else ()) if mesh.size(a) > 1]
        if not axes:
            continue
        block = leaf.rpartition(".experts.")[0]
        inner = _inner_axes(lay, step, mesh)
        if block not in out or inner:
            out[block] = MoEBlock(block, axes[0], lay.global_shape[0], m.top_k,
                                  m.capacity_factor, m.router.weight.shape[1], inner)
    return list(out.values())


def _inner_axes(lay: Any, step: TrainStep, mesh: DeviceMesh) -> tuple[str, ...]:
    """The axes of more than one rank that split a stacked expert leaf along a dim other than
    the experts' (tensor parallelism inside the experts); ZeRO-3's cut of the parts over its
    own axis is a partition, not that."""
    zero = getattr(step.partition, "axis", None)
    return tuple(a for d in lay.dim_axes[1:] for a in d if mesh.size(a) > 1 and a != zero)


def _experts_split_inside(step: TrainStep, mesh: DeviceMesh) -> bool:
    """Whether a stacked expert leaf is split by tensor parallelism (:func:`_inner_axes`),
    read from the layouts."""
    module = getattr(step.apply_fn, "module", None)
    if module is None or not isinstance(step.layouts, dict):
        return False
    for leaf in expert_leaves(module):
        lay = step.layouts.get(leaf)
        if lay is not None and _inner_axes(lay, step, mesh):
            return True
    return False


def _norm(rows: _Rows, dtypes: list[torch.dtype], layouts: Any, mesh: DeviceMesh,
          what: str) -> None:
    """The all-reduces of one total_sum_of_squares over leaves of ``layouts``."""
    if layouts is None:
        return
    groups: dict[tuple[int, tuple[str, ...]], None] = {}
    for dtype, lay in zip(dtypes, tree_flatten(layouts)[0]):
        acc = 8 if dtype == torch.float64 else 4
        nd = 0 if lay is None else len(lay.global_shape)
        axes = () if lay is None or nd == 0 else tuple(lay.axes_for(range(nd)))
        groups[(acc, axes)] = None
    for acc, axes in groups:
        for axis in axes:
            rows.add("all_reduce", axis, acc, what)


def describe(
    step: TrainStep,
    state: TrainState,
    mesh: DeviceMesh,
    *,
    name: str = "composition",
    transforms: Sequence[str] = (),
    sharding: ShardingPlan | None = None,
    sequence_parallel: bool = False,
    bucket_mb: float = 25.0,
    clip_norms: int = 0,
    batch_shape: tuple[int, int] | None = None,
    max_norm: float | None = None,
    grid: Plan2D | None = None,
) -> Plan:
    """The :class:`Plan` of a composed ``(step, state)`` over ``mesh``.

    What the step does not record is passed in: ``sharding`` (``plan_sharding(module, rules,
    mesh)``, for tensor parallelism's activation traffic), ``sequence_parallel``,
    ``bucket_mb`` (data_parallel's, and expert_parallel's for its mean over ``ep``),
    ``clip_norms`` (how many ``clip_by_global_norm`` the optimizer holds), ``transforms``
    (text of the manual calls, for printing), ``grid`` (``plan_2d(module, rules, mesh)``,
    for 2D tensor parallelism's collectives; they need ``batch_shape``). Expert parallelism is
    read from the layouts.
    """
    if grid is not None and sharding is not None:
        raise ValueError("describe: sharding= (1D) and grid= (2D) describe two tensor-parallel "
                         "modes; a step has one")
    if sequence_parallel and sharding is None:
        raise ValueError("describe: sequence_parallel needs sharding= (the sharding plan)")
    if clip_norms < 0:
        raise ValueError(f"describe: clip_norms must be >= 0, got {clip_norms}")
    return Plan(step, state, mesh, name=name, transforms=transforms, sharding=sharding,
                sequence_parallel=sequence_parallel, bucket_mb=bucket_mb,
                clip_norms=clip_norms, batch_shape=batch_shape, max_norm=max_norm, grid=grid)
