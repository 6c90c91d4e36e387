"""The analytic counterpart of :mod:`funcpar.presets.plan`: a layout's collectives per step and
memory per rank, from the model's config and the layout's sizes alone (no tensor, no mesh).

:func:`funcpar.presets.describe` reads a composed ``(step, state)``: exact, but it needs the
model built (on the meta device it costs ~10 ms for a 2-layer Llama and grows with the leaf
count) and a layout per call. The search prices thousands of layouts of 70B-405B configs, so it
uses this module, which follows the same rules (the plan module's docstring: tensor
parallelism's per-region all-reduces or sequence-parallel gathers and scatters, data
parallelism's buckets, ZeRO's per-bucket or per-leaf gathers and reduce-scatters, expert
parallelism's all_to_all under balanced routing, context parallelism's ring transfers or
all_to_alls and its means, the norms' all-reduces) on per-block element counts
(:class:`~funcpar.auto.model.ModelSpec`). ``tests/test_auto.py`` holds it to the plan on
small configs: bytes per (op, axis) and memory equal where every split is even; counts of
bucketed collectives within one (buckets are cut on leaf boundaries, here on totals). 2D
tensor parallelism's SUMMA collectives, which the plan does not list, follow the transform's
own account (:func:`funcpar.transforms.tp_modes.planned_collectives`) and are held to it.

Beyond the plan it models what the plan does not (stated as assumptions, docs/AUTO_PARALLEL.md):

* **pipelines** (``pp > 1``): each rank's stages are the balanced cut of
  :func:`funcpar.pipeline.stages.plan_stages` (by parameter count; an even cut of the blocks
  for configs too large for its exact search), the tensor-parallel collectives run once per
  micro-batch at the micro-batch's size, ZeRO-3 gathers once per micro-batch, and each
  micro-batch crosses every stage boundary forward (activation) and backward (its gradient):
  ``2 v`` point-to-point transfers per micro-batch on a rank;
* **activations** (:meth:`~funcpar.auto.model.ModelSpec.block_activation_bytes`) times the
  micro-batches in flight on the rank (:func:`in_flight`); a pipeline rank's peak walks its
  schedule (:mod:`funcpar.auto.pipeline_memory`);
* **remat** of every block (the recompute repeats the forward's tensor-parallel all-reduces).
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Any

from funcpar.auto.model import ModelSpec
from funcpar.auto.pipeline_memory import StageBytes, pipeline_peak

__all__ = ["AnalyticPlan", "Choice", "CommItem", "Memory", "analytic_plan", "in_flight",
           "stage_blocks", "step_buffers"]

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PARAM_BYTES = 4  # float32 parameters, gradients and master copy (amp_cast keeps them)
CP_PRESET_MODES = {"ring": "ring_attn", "ulysses": "all_to_all"}  # the presets' names


@dataclasses.dataclass(frozen=True)
class Choice:
    """One layout: the mesh ``pp x ep x dp x cp x tp`` (outermost first, as the presets build
    it) and what runs on it. ``microbatches``: pipeline micro-batches per step (1 without a
    pipeline). ``remat``: every block recomputed in the backward. ``offload``: the optimizer
    state in host memory ("cpu"). ``cp``: context parallelism (each sequence cut over ``cp``
    ranks, :func:`funcpar.transforms.context_parallel`) in ``cp_mode`` ``"ring"`` or
    ``"ulysses"``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    remat: bool = False
    offload: str | None = None
    precision: str = "bf16"
    sequence_parallel: bool = False
    cp: int = 1
    cp_mode: str = "ring"
    tp_mode: str = "1d"

    @property
    def grid(self) -> int:
        """``q`` of 2D tensor parallelism's ``q x q`` grid (``tp = q^2``), 0 under 1D."""
        return math.isqrt(self.tp) if self.tp_mode == "2d" else 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.ep * self.cp

    def axes(self) -> dict[str, int]:
        """Mesh axes, outermost first (``hybrid_parallel``/``moe_hybrid``'s order)."""
        out = {"pp": self.pp} if self.pp > 1 else {}
        if self.ep > 1:
            out["ep"] = self.ep
        out["dp"] = self.dp
        if self.cp > 1:
            out["cp"] = self.cp
        if self.grid:  # the presets keep the 1D axis, of size 1, beside the grid
            out.update(tp=1, tp_row=self.grid, tp_col=self.grid)
        else:
            out["tp"] = self.tp
        return out

    def preset_kwargs(self) -> dict:
        """The arguments of the equivalent preset (``hybrid_parallel``, or ``moe_hybrid`` with
        ``ep > 1``); remat is composed after it (the presets have none)."""
        kw: dict = {"tp_size": self.tp, "pp_size": self.pp, "dp_size": self.dp,
                    "zero_stage": self.zero, "precision": self.precision}
        if self.pp > 1:
            kw.update(microbatches=self.microbatches, pp_style=self.schedule,
                      num_model_chunks=self.virtual_stages)
        if self.cp > 1:
            kw.update(sp_size=self.cp, sequence_parallelism_mode=CP_PRESET_MODES[self.cp_mode])
        if self.grid:
            kw["tp_mode"] = "2d"
        if self.ep > 1:
            kw["ep_size"] = self.ep
        else:
            kw.update(sequence_parallel=self.sequence_parallel, offload=self.offload)
        return kw

    def __str__(self) -> str:
        parts = [f"tp{self.tp}" + ("(2d)" if self.grid else ""), f"pp{self.pp}",
                 f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"zero{self.zero}")
        if self.pp > 1:
            sched = self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1
                                     else "")
            parts.append(f"{sched} m{self.microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.remat:
            parts.append("remat")
        if self.offload:
            parts.append(f"offload-{self.offload}")
        parts.append(self.precision)
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class CommItem:
    """``count`` collectives ``op`` over ``axis`` moving ``nbytes`` in all per step on the
    rank, in :mod:`funcpar.shard.comm`'s byte convention. ``phase``: when it runs, for the
    overlap model - ``"fwd"``/``"bwd"`` on the critical path of each micro-batch,
    ``"fwd_hidden"``/``"bwd_hidden"`` issued asynchronously beside that compute (ZeRO-3's
    prefetched gathers, the gradient buckets and reduce-scatters), ``"step"`` once per step
    outside the compute (ZeRO's update gathers, norms, the loss)."""

    op: str
    axis: str
    count: int
    nbytes: float
    what: str
    phase: str


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on the rank holding the most (the first or the last pipeline stage). The first
    six fields are :class:`funcpar.presets.MemoryReport`'s; ``activations``: what the
    backward keeps at the peak (micro-batches in flight); ``transient``: the largest
    short-lived buffers of the forward and backward (one rematted block's activations, the
    logits' gradient); ``step_buffers``: what the end of the step holds beside parameters and
    optimizer state (the gradients, the flat buffers of their reduction, the clipped copy,
    ZeRO's gathered updates; :func:`step_buffers`).

    The peak (:attr:`peak`) is parameters, optimizer state and amp copy plus the larger of
    the two phases: forward/backward (activations, transients, ZeRO-3's gathered leaves) and
    the end of the step (``step_buffers``). Under a pipeline the forward/backward phase is
    ``pipeline_phase`` instead (:mod:`funcpar.auto.pipeline_memory`: activations in flight,
    the gradients accumulated and the point-to-point buffers at the schedule's worst point,
    the half-precision copy of the parameters included per micro-batch)."""

    params: float
    grads: float
    opt_state: float
    opt_state_offloaded: float
    compute_params: float
    zero3_gathered: float
    activations: float
    transient: float
    step_buffers: float = 0.0
    pipeline_phase: float | None = None

    @property
    def resident(self) -> float:
        """The plan's total: params + grads + optimizer state on the device."""
        return self.params + self.grads + self.opt_state

    @property
    def peak(self) -> float:
        if self.pipeline_phase is not None:
            return self.params + self.opt_state + max(
                self.pipeline_phase, self.step_buffers + self.compute_params, self.grads)
        return self.params + self.opt_state + self.compute_params + max(
            self.zero3_gathered + self.activations + self.transient,
            max(self.step_buffers, self.grads))


def step_buffers(grad_bytes: float, dp: int, zero: int, clip: bool, cp: int = 1) -> float:
    """Bytes at the end of a step beside parameters and optimizer state, for ``grad_bytes``
    of local (tensor-parallel) gradients before ZeRO: measured on gloo ranks with the
    presets' composition (benchmarks/bench_auto.py's memory sampler; docs/AUTO_PARALLEL.md),
    in units of ``G = grad_bytes`` over ``n = dp`` ranks: one process ``G`` (+ ``G`` for the
    clipped copy); data parallelism ``3 G`` (autograd's gradients, the bucket's flat buffer,
    the mean) ``+ G`` clipped; ZeRO-1 that ``+ (1 + 1/n) G`` (the gathered updates and the
    part); ZeRO-2 ``(3 + 1/n) G + G/n`` clipped; ZeRO-3 ``2 G/n + G/n`` clipped.

    Under a pipeline the same rules: the reduction starts from the hooks of each stage's last
    micro-batch backward, as without one (measured: pp2 x dp2, 1F1B m2 and GPipe m4, within
    0.1 %; until 2026-11-28 evening it ran after the schedule and the rule was
    ``(3 + 1/n) G``). Context parallelism means its gradients after the
    backward (``sync_grads``, flat buckets): alone (``dp = 1``)
    ``max(3, 1 + 1) G`` (measured ``3.0 G`` at cp4); beside data parallelism its
    flat copy and mean ``2 G`` (of the ZeRO-2/3 part: ``2 G / n``) come on top of what data
    parallelism's hooks hold then (``3 G``; ZeRO-2 ``(3 + 1/n) G``, ZeRO-3 ``G/n``), before the
    clip and ZeRO's update buffers, so the end of the step is the larger of the two (measured at
    dp2 x cp2: ``5.0 G``, ``5.5 G``, ``4.5 G``, ``1.5 G`` for ZeRO 0-3, each within 1 %)."""
    n = dp
    c = 1.0 if clip else 0.0
    if cp > 1 and n > 1:
        held = (3.0, 3.0, 3.0 + 1 / n, 1 / n)[zero]
        return max(step_buffers(grad_bytes, dp, zero, clip),
                   (held + 2 / (n if zero >= 2 else 1)) * grad_bytes)
    if n == 1:
        units = max(3, 1 + c) if cp > 1 else 1 + c
    elif zero == 0:
        units = 3 + c
    elif zero == 1:
        units = 3 + c + 1 + 1 / n
    elif zero == 2:
        units = 3 + 1 / n + c / n
    else:
        units = 2 / n + c / n
    return units * grad_bytes


@lru_cache(maxsize=256)
def _balanced_cut(costs: tuple[float, ...], first: float, last: float, k: int) -> list[int]:
    from funcpar.pipeline.stages import _balanced

    return _balanced(list(costs), first, last, k)


@lru_cache(maxsize=4096)
def stage_cut(spec: ModelSpec, pp: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The blocks of each of the ``pp v`` stages, cut as
    :func:`~funcpar.pipeline.stages.plan_stages` balances them (by parameter count, embedding
    on the first stage, final norm and head on the last); configs whose exact search would
    take long (``k L^2 > 2e5``) are cut evenly."""
    k, n = pp * v, spec.layers
    costs = tuple(float(b.tp_split + b.replicated + b.experts)
                  for b in map(spec.block, range(n)))
    if k == 1:
        bounds = [0, n]
    elif k * n * n <= 200_000:
        bounds = [0, *_balanced_cut(costs, float(spec.embed), float(spec.head + spec.dim), k),
                  n]
    else:
        bounds = [round(i * n / k) for i in range(k + 1)]
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(k))


@lru_cache(maxsize=4096)
def stage_blocks(spec: ModelSpec, pp: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Per pipeline rank, the blocks of its stages (rank ``r`` holds stages ``r, r + p, ...``
    of :func:`stage_cut`)."""
    stages, k = stage_cut(spec, pp, v), pp * v
    return tuple(tuple(b for s in range(r, k, pp) for b in stages[s]) for r in range(pp))


@lru_cache(maxsize=4096)
def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak, in units of the
    rank's whole share of blocks (an interleaved chunk is ``1/v`` of it): GPipe ``m``, 1F1B
    ``min(p - r, m)``, interleaved ``min(v m, 2 (p - r - 1) + (v - 1) p + 1) / v`` (its
    warm-up forwards plus the one in the steady state; tests check these against
    :func:`funcpar.pipeline.schedules.simulate`)."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - rank, m))
    return min(v * m, 2 * (p - rank - 1) + (v - 1) * p + 1) / v


@dataclasses.dataclass(frozen=True)
class AnalyticPlan:
    """The collectives of one step on the busiest rank and its memory (module docstring)."""

    choice: Choice
    comm: tuple[CommItem, ...]
    memory: Memory
    blocks: tuple[int, ...]  # blocks on the rank costed for time (the slowest stage's)
    first: bool
    last: bool

    def totals(self) -> dict[tuple[str, str], tuple[int, float]]:
        """``{(op, axis): (count, bytes)}``, as :meth:`funcpar.presets.Plan.comm_totals`."""
        out: dict[tuple[str, str], tuple[int, float]] = {}
        for c in self.comm:
            n, b = out.get((c.op, c.axis), (0, 0.0))
            out[(c.op, c.axis)] = (n + c.count, b + c.nbytes)
        return out


def _buckets(nbytes: float, cap: int) -> int:
    return max(1, math.ceil(nbytes / cap)) if nbytes > 0 else 0


def analytic_plan(spec: ModelSpec, c: Choice, global_batch: int, seq: int, *,
                  bucket_mb: float = 25.0, clip: bool = True, opt_bytes: float = 8.0,
                  rank: int | None = None) -> AnalyticPlan:
    """The :class:`AnalyticPlan` of layout ``c`` for a global batch of ``global_batch``
    sequences of ``seq`` tokens. ``opt_bytes``: optimizer state per parameter (AdamW's two
    float32 moments: 8). ``rank``: the pipeline rank to describe (default: whichever holds
    the most memory)."""
    if rank is None and c.pp > 1:
        plans = [analytic_plan(spec, c, global_batch, seq, bucket_mb=bucket_mb, clip=clip,
                               opt_bytes=opt_bytes, rank=r) for r in (0, c.pp - 1)]
        return max(plans, key=lambda p: p.memory.peak)
    r = rank or 0
    s = PRECISION_BYTES[c.precision]
    amp = c.precision != "fp32"
    cap = int(bucket_mb * 2**20)
    tp, dp, ep, pp, m, v = c.tp, c.dp, c.ep, c.pp, c.microbatches, c.virtual_stages
    blocks = stage_blocks(spec, pp, v)[r]
    first, last = r == 0, r == pp - 1
    d = spec.dim
    b_local = global_batch // (dp * ep)
    cp = c.cp
    lseq = seq // cp  # this rank's positions of each sequence (context parallelism's cut)
    tokens = b_local * lseq  # this rank's tokens per step, all micro-batches together
    items: list[CommItem] = []

    def add(op: str, axis: str, count: int, nbytes: float, what: str, phase: str) -> None:
        size = {"tp": tp, "dp": dp, "ep": ep, "pp": pp, "cp": cp, "tp_row": c.grid,
                "tp_col": c.grid}[axis]
        if count and size > 1:
            items.append(CommItem(op, axis, count, nbytes, what, phase))

    # ----------------------------------------------------------------- elements on the rank
    bc = [spec.block(i) for i in blocks]
    split = sum(b.tp_split for b in bc) + (spec.embed if first else 0) + (
        spec.head if last else 0)
    repl = sum(b.replicated for b in bc) + (d if last else 0)
    experts = sum(b.experts for b in bc)
    # 2D tensor parallelism splits every leaf over the grid, norms and embedding included.
    local = (split + repl) / tp if c.grid else split / tp + repl + experts / (ep * tp)
    # --------------------------------------------------------------- tensor parallelism
    dense = [i for i in blocks if not spec.is_moe(i)]
    moe = [i for i in blocks if spec.is_moe(i)]
    act = tokens * d * s
    # The expert rows a rank computes per step: its sequences' kept assignments (balanced
    # routing under ep: as many received as sent), at most the experts' capacity.
    if moe and spec.capacity_factor is not None:
        cap_e = math.ceil(spec.capacity_factor * spec.top_k * seq / spec.n_experts - 1e-9)
    else:
        cap_e = seq
    rows = b_local * min(spec.top_k * seq, spec.n_experts * cap_e)
    if c.grid:
        _tp2d_rows(add, spec, c.grid, blocks, first, last, b_local // c.grid * lseq, s)
    elif tp > 1 and not c.sequence_parallel:
        n = len(dense)
        add("all_reduce", "tp", 2 * n * m, 2 * n * act, "tp: row-split linear outputs", "fwd")
        add("all_reduce", "tp", 2 * n * m, 2 * n * act, "tp: input grads of column-split "
            "linears", "bwd")
        if c.remat:
            add("all_reduce", "tp", 2 * n * m, 2 * n * act, "tp: recompute's row-split "
                "outputs (remat)", "bwd")
        if moe:
            # An MoE block: the attention's region (one all-reduce each way) and the experts'
            # (their rows' partial sums forward, the rows' input gradient backward;
            # docs/MOE.md, "Tensor parallelism inside the experts").
            k, reps = len(moe), 2 if c.remat else 1
            xr = rows * d * s
            add("all_reduce", "tp", k * m * reps, k * act * reps, "tp: MoE attention output",
                "fwd")
            add("all_reduce", "tp", k * m, k * act, "tp: MoE attention input grads", "bwd")
            add("all_reduce", "tp", k * m * reps, k * xr * reps, "tp: experts' output rows",
                "fwd")
            add("all_reduce", "tp", k * m, k * xr, "tp: experts' input grads", "bwd")
        if first:
            add("all_reduce", "tp", m, act, "tp: vocab-parallel embedding output", "fwd")
        if last:
            add("all_reduce", "tp", m, act, "tp: head input grads", "bwd")
    elif tp > 1:
        pad = b_local * math.ceil(lseq / tp) * tp * d * s
        n = len(dense)
        reps = 2 if c.remat else 1  # the recompute repeats the forward's gathers/scatters
        add("all_gather", "tp", 2 * n * m * reps, 2 * n * pad * reps, "sp: region inputs "
            "gathered", "fwd")
        add("reduce_scatter", "tp", 2 * n * m * reps, 2 * n * pad * reps, "sp: region outputs "
            "scattered", "fwd")
        add("reduce_scatter", "tp", 2 * n * m, 2 * n * pad, "sp: region input grads "
            "scattered", "bwd")
        add("all_gather", "tp", 2 * n * m, 2 * n * pad, "sp: region output grads gathered",
            "bwd")
        if first:
            add("reduce_scatter", "tp", m, pad, "sp: embedding output scattered", "fwd")
            add("all_gather", "tp", m, pad, "sp: embedding output grad gathered", "bwd")
        if last:
            add("all_gather", "tp", m, pad, "sp: head input gathered", "fwd")
            add("reduce_scatter", "tp", m, pad, "sp: head input grad scattered", "bwd")
        # The gradients of the leaves tp does not split (norms), one all-reduce per dtype.
        add("all_reduce", "tp", 1, repl * PARAM_BYTES, "sp: grads of leaves not split over tp",
            "step")
    if tp > 1 and last and not c.grid:
        add("all_reduce", "tp", 3 * m, 3 * tokens * max(s, 4), "tp: vocab-parallel "
            "cross-entropy (max, sum_exp, target)", "fwd")
    # ---------------------------------------------------------------- expert parallelism
    loss_bytes = max(s, 4) if amp else PARAM_BYTES
    if ep > 1:
        add("all_reduce", "ep", 1, loss_bytes, "ep: loss mean", "step")
        nonexp = (split / tp + repl) * PARAM_BYTES / (dp if c.zero >= 2 else 1)
        add("all_reduce", "ep", _buckets(nonexp, cap), nonexp, "ep: grads of leaves not split "
            "over ep (mean)", "step")
        k = len(moe)
        add("all_to_all", "ep", k * m, k * 8 * ep, "ep: token counts", "fwd")
        add("all_to_all", "ep", 2 * k * m, 2 * k * rows * d * s, "ep: token rows and expert "
            "outputs", "fwd")
        add("all_to_all", "ep", 2 * k * m, 2 * k * rows * d * s, "ep: their grads", "bwd")
        add("all_to_all", "ep", k * m, k * rows * 8, "ep: expert ids", "fwd")
    # ----------------------------------------------------------------- data parallelism
    grad_bytes = local * PARAM_BYTES
    if dp > 1:
        add("all_reduce", "dp", 1, loss_bytes, "dp: loss mean", "step")
        if c.zero < 2:
            add("all_reduce", "dp", _buckets(grad_bytes, cap), grad_bytes,
                "dp: gradient buckets", "bwd_hidden")
        if c.zero in (1, 2):
            add("all_gather", "dp", _buckets(grad_bytes, cap), grad_bytes,
                "zero: updates gathered", "step")
        if c.zero == 2:
            add("reduce_scatter", "dp", _buckets(grad_bytes, cap), grad_bytes,
                "zero: grads reduce-scattered", "bwd_hidden")
        if c.zero == 3:
            # Per gather group (zero_partition.gather_groups: each block, and the leaves
            # outside the blocks on the first and last stages) one all-gather forward, one
            # backward when autograd saved any of its leaves, one reduce-scatter. The
            # embedding alone (a first pipeline stage) is not regathered: its backward needs
            # only the indices.
            whole = local * s
            groups = len(blocks) + (1 if first or last else 0)
            regather = whole - (spec.embed / tp * s if first and not last else 0)
            n_re = len(blocks) + (1 if last else 0)
            add("all_gather", "dp", groups * m, whole * m, "zero-3: params gathered "
                "(forward)", "fwd_hidden")
            add("all_gather", "dp", n_re * m, regather * m, "zero-3: params gathered again "
                "(backward)", "bwd_hidden")
            add("reduce_scatter", "dp", groups * m, whole * m,
                "zero-3: grads reduce-scattered", "bwd_hidden")
    # -------------------------------------------------------------------------- norms
    groups = _norm_groups(c, tp > 1 and split > 0, experts > 0)
    for axes in groups:
        for axis in axes:
            add("all_reduce", axis, 1, 4, "norm: grad_norm metric", "step")
    if clip and (c.zero == 1):  # the clip shares the metric's norm except under ZeRO-1
        for axes in _norm_groups(c, tp > 1 and split > 0, experts > 0, optimizer=True):
            for axis in axes:
                add("all_reduce", axis, 1, 4, "norm: clip_by_global_norm", "step")
    # ------------------------------------------------------------- context parallelism
    if cp > 1:
        _cp_rows(add, spec, c, len(blocks), b_local, lseq, s, loss_bytes,
                 grad_bytes / (dp if c.zero >= 2 else 1), cap)
    # ---------------------------------------------------------------------- pipeline
    if pp > 1:
        mb_act = b_local // m * lseq * d * s
        add("p2p", "pp", 2 * v * m, 2 * v * m * mb_act, "pp: activations forward and their "
            "grads backward", "fwd")
    # ------------------------------------------------------------------------ memory
    params = local * PARAM_BYTES / (dp if c.zero == 3 else 1)
    grads = local * PARAM_BYTES / (dp if c.zero >= 2 else 1)
    opt = local * opt_bytes / (dp if c.zero >= 1 else 1)
    compute = params / PARAM_BYTES * s if amp else 0.0
    gathered = 0.0
    if c.zero == 3:
        outside = ((spec.embed / tp if first else 0) + (spec.head / tp + d if last else 0))
        # The block computing and the one prefetched (zero_partition's prefetch=1).
        sizes = [b.tp_split / tp + b.replicated + b.experts / (ep * tp) for b in bc]
        k = min(2, len(sizes))
        largest = max((sum(sizes[j:j + k]) for j in range(len(sizes) - k + 1)), default=0)
        gathered = (outside + largest) * s
    mb_tokens = b_local // m * lseq
    held = in_flight(c.schedule, pp, m, v, r)
    kept, transient = _kept(spec, c, blocks, mb_tokens, lseq, s)
    activations = kept * held + (spec.head_activation_bytes(s, tp) * mb_tokens if last else 0)
    if last:  # the logits' gradient and the softmax (float32) while the head's backward runs
        transient = max(transient, 2 * mb_tokens * spec.vocab / tp * 4)
    phase = None
    if pp > 1:
        stages = [_stage_bytes(spec, c, st, st == 0, st == pp * v - 1, mb_tokens, lseq, s)
                  for st in range(r, pp * v, pp)]
        phase = pipeline_peak(c.schedule, pp, m, v, r, stages)
    mem = Memory(params, grads, 0.0 if c.offload else opt, opt if c.offload else 0.0,
                 compute, gathered, activations, transient,
                 step_buffers(grad_bytes, dp, c.zero, clip, cp), phase)
    return AnalyticPlan(c, tuple(items), mem, blocks, first, last)


def _kept(spec: ModelSpec, c: Choice, blocks: tuple[int, ...], mb_tokens: int, lseq: int,
          s: int) -> tuple[float, float]:
    """(what ``blocks`` keep for the backward of one micro-batch of ``mb_tokens`` tokens, the
    transient of recomputing one of them under remat): the saved activations and rotary
    tables, or under remat each block's input and one block's activations while it
    recomputes. Under 2D tensor parallelism the activations are grid-partitioned (rows over
    ``tp_row``, features or heads over ``tp_col``): one process's over ``tp``."""
    tp = c.tp
    if c.grid:
        per_block = [spec.block_activation_bytes(i, s) / tp for i in blocks]
    else:
        per_block = [spec.block_activation_bytes(i, s, tp, c.sequence_parallel) for i in blocks]
    rope = spec.rope_bytes(lseq, s)
    if c.remat:
        return (len(blocks) * (mb_tokens * s * spec.dim + rope),
                max(per_block, default=0) * mb_tokens + rope)
    return sum(per_block) * mb_tokens + rope * len(blocks), 0.0


def _stage_bytes(spec: ModelSpec, c: Choice, stage: int, first: bool, last: bool,
                 mb_tokens: int, seq: int, s: int) -> StageBytes:
    """One pipeline stage's quantities for :func:`funcpar.auto.pipeline_memory.pipeline_peak`
    (that module's docstring)."""
    tp, ep, d = c.tp, c.ep, spec.dim
    blocks = stage_cut(spec, c.pp, c.virtual_stages)[stage]
    bc = [spec.block(i) for i in blocks]
    local = (sum(b.tp_split for b in bc) + (spec.embed if first else 0)
             + (spec.head if last else 0)) / tp + sum(b.replicated for b in bc) + (
        d if last else 0) + sum(b.experts for b in bc) / (ep * tp)
    leaves = [spec.embed / tp if first else 0, spec.head / tp if last else 0]
    for i in blocks:
        leaves.append(spec.n_experts // ep * spec.ffn * d / tp if spec.is_moe(i)
                      else max(spec.ffn * d, d * d) / tp)
    acts, recompute = _kept(spec, c, blocks, mb_tokens, seq, s)
    fwd_t = bwd_t = recompute
    if c.precision != "fp32":  # amp_cast's half-precision copy, made per call, saved
        acts += local * s
    vocab = spec.vocab / tp
    if last:
        # Kept: the final norm's tensors and the float32 log-softmax; the logits (and their
        # float32 copy in half precision) live only while the loss is computed.
        head = spec.head_activation_bytes(s, tp)
        acts += (head - (s + (4 if s < 4 else 0)) * vocab) * mb_tokens
        fwd_t += (s + (4 if s < 4 else 0)) * vocab * mb_tokens
        bwd_t = max(bwd_t, 8 * vocab * mb_tokens)
    # A block's backward: the MLP's input gradients (about two F-wide tensors a token).
    bwd_t = max(bwd_t, 2 * spec.ffn / tp * s * mb_tokens)
    mb_act = mb_tokens * d * s
    return StageBytes(acts, fwd_t, bwd_t, local * PARAM_BYTES, max(leaves) * PARAM_BYTES,
                      0.0 if last else mb_act, 0.0 if first else mb_act)


def _tp2d_rows(add: Any, spec: ModelSpec, q: int, blocks: tuple[int, ...], first: bool,
               last: bool, rows: int, s: int) -> None:
    """2D tensor parallelism's collectives (:func:`funcpar.transforms.tp_modes.
    planned_collectives`, held to the comm log by tests/test_tp_modes.py) on ``rows`` local
    token rows: per linear ``[out, in]`` SUMMA broadcasts ``q`` panels of the activation
    (``rows x in/q``, over ``tp_col``) and of the weight (``in/q x out/q``, over ``tp_row``)
    forward, the weight's again and the activation's again backward, and reduce-scatters the
    input gradient's partials (``tp_col``) and the weight gradient's (``tp_row``); per RMSNorm
    the sum of squares all-reduced over ``tp_col`` forward and backward and its weight
    gathered over ``tp_row`` (reduce-scattered back); the embedding's table likewise; the
    vocab-parallel cross-entropy's three all-reduces over ``tp_col`` and the token sum and
    count over ``tp_row``; the norms' statistics and the loss's travel in float32 at least
    (upcast before they are reduced). Dims are taken to divide (the search offers 2D only
    there)."""
    wide = max(s, 4)
    d, f, hd = spec.dim, spec.ffn, spec.head_dim
    linears = [(d, spec.heads * hd), (d, spec.kv_heads * hd), (d, spec.kv_heads * hd),
               (spec.heads * hd, d), (d, f), (d, f), (f, d)]
    pairs: dict[tuple[int, int], int] = {}  # (in, out) -> linears of that shape on the rank
    for _ in blocks:
        for io in linears:
            pairs[io] = pairs.get(io, 0) + 1
    if last:
        pairs[(d, spec.vocab)] = pairs.get((d, spec.vocab), 0) + 1
    norms = 2 * len(blocks) + (1 if last else 0)
    for (n_in, n_out), k in pairs.items():
        a, w = rows * n_in // q * s, n_in // q * (n_out // q) * s  # one panel of each
        add("broadcast", "tp_col", q * k, q * k * a, "2d: activation panels (forward)", "fwd")
        add("broadcast", "tp_row", q * k, q * k * w, "2d: weight panels (forward)", "fwd")
        add("broadcast", "tp_row", q * k, q * k * w, "2d: weight panels (backward)", "bwd")
        add("broadcast", "tp_col", q * k, q * k * a, "2d: activation panels (backward)", "bwd")
        add("reduce_scatter", "tp_col", k, k * q * a, "2d: input-gradient partials", "bwd")
        add("reduce_scatter", "tp_row", k, k * q * w, "2d: weight-gradient partials", "bwd")
    add("all_reduce", "tp_col", 2 * norms, 2 * norms * rows * wide, "2d: norms' sums of squares "
        "(forward and backward)", "fwd")
    add("all_gather", "tp_row", norms, norms * d // q * s, "2d: norm weights gathered", "fwd")
    add("reduce_scatter", "tp_row", norms, norms * d // q * s, "2d: norm weight grads", "bwd")
    if first:
        table = spec.vocab * d // q * s
        add("all_gather", "tp_row", 1, table, "2d: embedding table gathered", "fwd")
        add("reduce_scatter", "tp_row", 1, table, "2d: embedding table grad", "bwd")
    if last:
        add("all_reduce", "tp_col", 3, 3 * rows * wide, "2d: cross-entropy (max, sum_exp, "
            "target)", "fwd")
        add("all_reduce", "tp_row", 2, 2 * wide, "2d: loss token sum and count", "fwd")


def _cp_rows(add: Any, spec: ModelSpec, c: Choice, n_blocks: int, b_local: int, lseq: int,
             s: int, loss_bytes: float, grad_bytes: float, cap: int) -> None:
    """Context parallelism's collectives (:meth:`funcpar.transforms.context_parallel.
    ContextParallel.attention_comm` and the plan's ``_cp_rows``): per attention, ring - the
    key/value block (``2 x kv_heads / tp`` heads of the rank's positions) sent and received
    ``n - 1`` times forward and again backward, with the float32 ``(dK, dV)`` accumulators
    ``n`` times; Ulysses - two all_to_alls forward (q, k, v to head-split; the output back)
    and two backward. Then the token count, the loss mean and the gradients' mean in buckets.
    The ring's transfers are posted before the block they overlap (``overlap=True``, the
    transform's default): phases ``fwd_ring``/``bwd_ring``, hidden under the attention's
    compute as far as the profile's ``overlap`` allows; the all_to_alls wait."""
    n, tp, hd = c.cp, c.tp, spec.head_dim
    h, k = spec.heads // tp, spec.kv_heads // tp
    per_head = b_local * lseq * hd
    L = n_blocks
    if c.cp_mode == "ring":
        kv = 2 * k * per_head
        work = 4  # the accumulators: float32 for float32 and half-precision inputs
        for op in ("send", "recv"):
            add(op, "cp", L * (n - 1), L * (n - 1) * kv * s, "cp ring: kv blocks (forward)",
                "fwd_ring")
            add(op, "cp", L * (n - 1), L * (n - 1) * kv * s, "cp ring: kv blocks (backward)",
                "bwd_ring")
            add(op, "cp", L * n, L * n * kv * work, "cp ring: dkv accumulators (backward)",
                "bwd_ring")
        if c.remat:  # the recompute repeats the forward's ring (not in the plan: it refuses)
            for op in ("send", "recv"):
                add(op, "cp", L * (n - 1), L * (n - 1) * kv * s, "cp ring: kv blocks "
                    "(recompute)", "bwd_ring")
    else:
        # ulysses_kv_heads: the kv heads split over the ranks when they divide by n, else
        # (they divide n) each rank receives the one its query heads share.
        sent = h + 2 * (k if k % n == 0 else n)
        reps = 3 if c.remat else 2  # forward, backward (and the recompute's forward)
        add("all_to_all", "cp", reps * L, reps * L * sent * per_head * s, "cp ulysses: qkv",
            "fwd")
        add("all_to_all", "cp", reps * L, reps * L * h * per_head * s, "cp ulysses: out",
            "bwd")
    add("all_reduce", "cp", 1, 8, "cp: counted targets", "step")
    add("all_reduce", "cp", 1, loss_bytes, "cp: loss mean", "step")
    add("all_reduce", "cp", _buckets(grad_bytes, cap), grad_bytes, "cp: gradient buckets",
        "step")


def _norm_groups(c: Choice, tp_split: bool, experts: bool, *,
                 optimizer: bool = False) -> list[tuple[str, ...]]:
    """The distinct sets of axes splitting the gradients (or, ``optimizer``, the optimizer's
    parts): :func:`funcpar.shard.reduce.total_sum_of_squares` all-reduces each once per axis."""
    zero_axes = ("dp",) if (c.zero >= 2 or (optimizer and c.zero >= 1)) and c.dp > 1 else ()
    tp_axes = ("tp",) if c.tp > 1 and tp_split else ()
    if c.grid:  # every leaf is split over both grid axes
        return [("tp_row", "tp_col") + zero_axes]
    groups = {zero_axes, tp_axes + zero_axes}
    if experts and c.ep > 1:  # the experts: split over ep, and over tp with their ffn
        groups.add(("ep",) + (("tp",) if c.tp > 1 else ()) + zero_axes)
    return [g for g in groups if g]
