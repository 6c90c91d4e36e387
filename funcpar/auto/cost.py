"""The cost model: a layout's step time, memory per rank and MFU from its analytic plan and a
device profile.

Step time (docs/AUTO_PARALLEL.md has the derivation), with ``u_r`` pipeline rank ``r``'s time
per micro-batch (``t_f + t_b + c_mb``)::

    T = m max_r u_r + (sum_r u_r - max_r u_r) / v    the slowest rank's m micro-batches, the
                                                   fill and drain through the others
                                                   (:func:`pipeline_makespan`; without a
                                                   pipeline m = 1 and T = u)
      + hidden_exposed                             gradient buckets, ZeRO-2 reduce-scatters,
                                                   ZeRO-3 gathers beyond what compute hides
      + c_step + t_opt + t_offload                 update gathers, norms, optimizer, offload

where ``c_mb`` includes, on CPU ranks, each collective call's wait for its peers
(``sync_wait``; in all no more than the rank's work: a wait is at most the compute between two
calls), and, on a CPU profile whose ``cores`` the layout's ranks outnumber, at least
``sum_ranks work / cores + comm`` (the cores do every rank's work, a pipeline's idle ranks
giving theirs to the busy ones; the busiest rank's collectives with their waits).

* ``t_f`` per micro-batch: every GEMM of the rank's blocks and head at its shape's
  throughput (``DeviceProfile.matmul_rate``; under 2D tensor parallelism SUMMA's ``q`` panel
  products of ``m/q x k/q x n/q``), causal attention at ``attention_rate``,
  elementwise traffic (4x the saved activation bytes) over ``mem_bw``, and ``op_latency`` per
  dispatched op (``OPS_FWD`` a block); ``t_b = 2 t_f`` (``+ t_f`` of the blocks under remat);
* ``c_mb``: the critical-path collectives of a micro-batch (tensor parallelism's all-reduces or
  sequence-parallel gathers and scatters, expert parallelism's all_to_all, the pipeline's
  point-to-point transfers), each ``DeviceProfile.collective_time`` on its axis; on a pipeline
  rank also its fixed cost per micro-batch (:func:`_pipeline_overhead`: ``2 v`` stage calls
  and the gradient accumulation's adds);
* hidden collectives (``CommItem.phase`` ``*_hidden``) cost ``max(T_c - overlap T_compute,
  T_c / count)``: what the compute beside them cannot hide, at least their last bucket;
* ``t_opt``: the optimizer's bytes per local parameter (AdamW reads p, g, m, v and writes p,
  m, v: 28 B; amp adds the compute copy's 6 B) over ``mem_bw``, or over ``host_mem_bw`` when
  offloaded, which also moves the gradients down and the parameters up (8 B) over ``host_bw``.

Memory per rank: the analytic plan's parameters, gradients, optimizer state on the device, amp
copy, ZeRO-3 gathered leaves, activations (micro-batches in flight) and transients, times
``1 + margin`` (default 10 %).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from funcpar.auto.analytic import (
    PRECISION_BYTES,
    AnalyticPlan,
    Choice,
    analytic_plan,
    stage_blocks,
)
from funcpar.auto.model import OPS_FWD, ModelSpec
from funcpar.auto.profile import DeviceProfile

__all__ = ["Estimate", "axis_span", "estimate", "pipeline_makespan", "pipeline_time",
           "schedule_makespan"]

OPS_HEAD = 12
# Ring attention per chunk pair (forward, backward): dispatched ops and passes over the float32
# scores, counted in funcpar.transforms.context_parallel (_Online.add, _block_grads).
RING_OPS = (14, 27)
RING_PASSES = (8, 11)
OPT_BYTES_MOVED = 28.0  # AdamW: p, g, m, v read; p, m, v written (float32)
ELEMENTWISE_PASSES = 4.0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A layout's predicted step (seconds), its parts, memory per rank (bytes, margin
    included in ``peak``) and MFU."""

    choice: Choice
    time: float
    parts: dict[str, float]
    plan: AnalyticPlan
    peak: float
    mfu: float
    tokens_per_s: float

    def line(self) -> str:
        return (f"{self.choice!s:<44} {self.time * 1e3:>10.2f} ms  "
                f"{fmt_bytes(self.peak):>10}  MFU {self.mfu * 100:5.1f} %")


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (two decimals)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} GiB"  # pragma: no cover


def axis_span(choice: Choice, axis: str) -> int:
    """Consecutive ranks a group of ``axis`` spans (mesh order ``pp, ep, dp, tp``, tp
    innermost): its size times the sizes of the axes inside it."""
    axes = choice.axes()
    names = list(axes)
    inner = 1
    for a in names[names.index(axis) + 1:]:
        inner *= axes[a]
    return axes[axis] * inner


def _gemms(spec: ModelSpec, layer: int, tokens: float, tp: int, ep: int, grid: int = 0
           ) -> list[tuple[float, float, float]]:
    """(m, k, n) of each forward GEMM of block ``layer`` on one rank; under 2D tensor
    parallelism (``grid`` = q) SUMMA's ``q`` panel products of ``m/q x k/q x n/q`` each."""
    if grid:
        return [(m / grid, k / grid, n / grid) for m, k, n in _gemms(spec, layer, tokens, 1, ep)
                for _ in range(grid)]
    d, f, hd = spec.dim, spec.ffn, spec.head_dim
    out = [(tokens, d, (d + 2 * spec.kv_heads * hd) / tp), (tokens, d / tp, d)]
    if spec.is_moe(layer):
        rows = tokens * spec.top_k * ep / spec.n_experts  # per local expert, balanced
        out += [(tokens, d, spec.n_experts)]
        out += [(rows, d, 2 * f / tp), (rows, f / tp, d)] * (spec.n_experts // ep)
    else:
        out += [(tokens, d, 2 * f / tp), (tokens, f / tp, d)]
    return out


@lru_cache(maxsize=65536)
def _ring_attention(spec: ModelSpec, tokens: float, seq: int, tp: int, cp: int,
                    profile: DeviceProfile) -> tuple[float, float]:
    """(forward, backward) seconds of one block's ring attention on one rank
    (:func:`funcpar.transforms.context_parallel.ring_attention`): not a fused kernel but, per
    pair of zigzag chunks the causal mask leaves (``2 cp + 1`` a rank), the scores of
    ``c = seq / 2 cp`` queries by ``c`` keys in float32 through batched matmuls (two forward,
    five backward with the scores' recompute), ``RING_PASSES`` passes over them and
    ``RING_OPS`` dispatched ops, counted in the code."""
    c = seq / (2 * cp)
    rows = tokens / (seq / cp) * spec.heads / tp  # sequences x query heads
    group = spec.heads // spec.kv_heads
    m, k, n = group * c, spec.head_dim, c
    mm = 2 * rows * c * c * spec.head_dim / profile.matmul_rate("fp32", m, k, n)
    scores = 4.0 * rows * c * c / profile.mem_bw.value
    lat = profile.op_latency.value
    pairs = 2 * cp + 1
    fwd = pairs * (2 * mm + RING_PASSES[0] * scores + RING_OPS[0] * lat)
    bwd = pairs * (5 * mm + RING_PASSES[1] * scores + RING_OPS[1] * lat)
    return fwd, bwd


@lru_cache(maxsize=65536)
def _forward_time(spec: ModelSpec, blocks: tuple[int, ...], last: bool, tokens: float,
                  seq: int, tp: int, ep: int, precision: str, sp: bool,
                  profile: DeviceProfile, grid: int = 0, ring: int = 0
                  ) -> tuple[float, float, float, float]:
    """(whole forward, forward of the blocks alone, their attention alone, the attention's
    backward) of one micro-batch on one rank; ``tokens`` the rank's, ``seq`` the whole
    sequence each token attends over (under context parallelism more than the rank holds);
    ``ring``: the cp size of ring attention (0: the fused kernel, its backward twice its
    forward)."""
    s = PRECISION_BYTES[precision]
    t_blocks = t_attn = t_attn_b = 0.0
    kinds: dict[bool, tuple[float, float, float]] = {}
    for i in blocks:
        moe = spec.is_moe(i)
        if moe not in kinds:
            mm = sum(2 * m * k * n / profile.matmul_rate(precision, m, k, n)
                     for m, k, n in _gemms(spec, i, tokens, tp, ep, grid))
            if ring:
                attn, attn_b = _ring_attention(spec, tokens, seq, tp, ring, profile)
            else:
                attn = tokens * spec.block_flops(i, seq)[1] / tp / profile.attention_rate(
                    precision)
                attn_b = 2 * attn
            act = spec.block_activation_bytes(i, s) / tp if grid else \
                spec.block_activation_bytes(i, s, tp, sp)
            ew = ELEMENTWISE_PASSES * tokens * act / profile.mem_bw.value
            kinds[moe] = (mm + attn + ew + OPS_FWD * profile.op_latency.value, attn, attn_b)
        t_blocks += kinds[moe][0]
        t_attn += kinds[moe][1]
        t_attn_b += kinds[moe][2]
    t = t_blocks
    if last:
        m, k, n = tokens, spec.dim, spec.vocab / tp
        if grid:  # q panel products of (tokens / q) x (dim / q) x (vocab / q)
            m, k = tokens / grid, spec.dim / grid
            n = spec.vocab / grid
            t += grid * 2 * m * k * n / profile.matmul_rate(precision, m, k, n)
        else:
            t += 2 * m * k * n / profile.matmul_rate(precision, m, k, n)
        t += ELEMENTWISE_PASSES * tokens * spec.head_activation_bytes(s, tp) / \
            profile.mem_bw.value + OPS_HEAD * profile.op_latency.value
    return t, t_blocks, t_attn, t_attn_b


def _comm_time(plan: AnalyticPlan, profile: DeviceProfile, phases: tuple[str, ...]
               ) -> tuple[float, int]:
    total, count = 0.0, 0
    c = plan.choice
    sizes = c.axes()
    for item in plan.comm:
        if item.phase not in phases:
            continue
        if item.op == "recv":  # the other end of a send: one transfer, priced once
            continue
        n = sizes[item.axis]
        span = axis_span(c, item.axis)
        op = "p2p" if item.op in ("p2p", "send") else item.op
        total += item.count * profile.collective_time(op, item.nbytes / item.count, n, span)
        count += item.count
    return total, count


def _hidden(t: float, count: int, under: float, overlap: float) -> float:
    if t == 0:
        return 0.0
    return max(t - overlap * under, t / max(count, 1) if overlap > 0 else t)


def pipeline_time(m: int, p: int, v: int, per_microbatch: float) -> float:
    """A pipeline's makespan, ``(m + (p - 1) / v)`` micro-batch times: the makespan of
    :func:`funcpar.pipeline.schedules.simulate` for GPipe and 1F1B, and for the interleaved
    schedule where ``p`` divides ``m`` (tests/test_auto.py), with every stage equal."""
    return pipeline_makespan(m, v, [per_microbatch] * p)


def pipeline_makespan(m: int, v: int, per_rank: list[float]) -> float:
    """A pipeline's makespan with rank ``r`` busy ``per_rank[r]`` seconds per micro-batch
    (all its stages, forward and backward): ``m max_r u_r + (sum_r u_r - max_r u_r) / v``,
    the slowest rank's ``m`` micro-batches plus the fill and drain through the others (their
    ``1 / v`` chunks). It equals :func:`schedule_makespan` for GPipe whatever the stages'
    costs and for 1F1B when the last stage is the slowest (a language model's head); with a
    slower stage before it, 1F1B's warm-up forwards fill part of its wait and this is an upper
    bound; interleaved within 5 % (tests). The slowest rank's ``(m + p - 1)`` micro-batches
    overstate it by the others' difference."""
    slowest = max(per_rank)
    return m * slowest + (sum(per_rank) - slowest) / v


def schedule_makespan(schedule: str, p: int, m: int, v: int,
                      cost: Callable[[str, int, int], float], transfer: float = 0.0,
                      cores: float | None = None) -> float:
    """The makespan of ``schedule``'s compute order (:func:`funcpar.pipeline.schedules.
    compute_order`) with ``cost(kind, stage, mb)`` seconds per forward / backward and
    ``transfer`` seconds per point-to-point transfer between ranks, spent by the sender after
    the compute that produced it (gloo sends from the calling thread; on NCCL the launch) and
    ending when the receiver may use it: each action starts when its rank's previous one ends
    and its input is there (the previous stage's forward of the micro-batch, the next stage's
    backward, the last stage's own forward), as the runtime runs it. Unequal stages (the
    embedding on the first, the head on the last) priced as they are, where
    :func:`pipeline_time` assumes them equal.

    ``cores``: the ``p`` ranks share that many cores (CPU ranks outnumbering them): the ranks
    with an action ready run at ``min(1, cores / ready)`` of their speed (processor sharing),
    so a rank in the bubble gives its core to the busy ones."""
    from funcpar.pipeline.schedules import compute_order

    orders = [compute_order(schedule, p, v, m, r) for r in range(p)]
    last = p * v - 1

    def dep(a: Any) -> tuple[str, int, int] | None:
        if a.kind == "F":
            return ("F", a.stage - 1, a.mb) if a.stage > 0 else None
        return ("F", a.stage, a.mb) if a.stage == last else ("B", a.stage + 1, a.mb)

    def work(a: Any, r: int) -> float:
        to = a.stage + 1 if a.kind == "F" else a.stage - 1
        # The output goes to another rank: the sender's transfer.
        return cost(a.kind, a.stage, a.mb) + (transfer if 0 <= to <= last and to % p != r
                                               else 0.0)

    end: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    if cores is not None and cores < p:
        now, left = 0.0, [-1.0] * p  # left < 0: the rank's next action has not started
        while any(pos[r] < len(orders[r]) for r in range(p)):
            for r in range(p):
                if pos[r] < len(orders[r]) and left[r] < 0:
                    d = dep(orders[r][pos[r]])
                    if d is None or d in end:
                        left[r] = work(orders[r][pos[r]], r)
            busy = [r for r in range(p) if left[r] >= 0]
            if not busy:  # pragma: no cover - compute_order's lists are deadlock-free
                raise RuntimeError(f"{schedule} p={p} m={m} v={v}: no action can start")
            rate = min(1.0, cores / len(busy))
            dt = min(left[r] for r in busy) / rate
            now += dt
            for r in busy:
                left[r] -= dt * rate
                if left[r] <= 1e-12 * max(now, 1e-30):
                    a = orders[r][pos[r]]
                    end[(a.kind, a.stage, a.mb)] = now
                    pos[r] += 1
                    left[r] = -1.0
        return now
    clock = [0.0] * p
    remaining = sum(map(len, orders))
    while remaining:
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                d = dep(a)
                if d is not None and d not in end:
                    break
                clock[r] = max(clock[r], 0.0 if d is None else end[d]) + work(a, r)
                end[(a.kind, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:  # pragma: no cover - compute_order's lists are deadlock-free
            raise RuntimeError(f"{schedule} p={p} m={m} v={v}: no action can start")
    return max(clock)


def _pipeline_overhead(spec: ModelSpec, plan: AnalyticPlan, profile: DeviceProfile) -> float:
    """A pipeline rank's fixed cost per micro-batch beyond its compute and transfers: one
    forward and one backward call per local stage (``stage_call``), and the accumulation of
    the micro-batch's gradients (one add per leaf: ``op_latency`` each, reading the sum and
    the new gradient and writing the sum over ``mem_bw``; the first micro-batch's gradients
    are the sum, so ``(m - 1) / m`` of it a micro-batch)."""
    c = plan.choice
    m, v = c.microbatches, c.virtual_stages
    leaves = sum(spec.block(i).leaves for i in plan.blocks) + (1 if plan.first else 0) + (
        2 if plan.last else 0)
    grad_bytes = plan.memory.grads * (c.dp if c.zero >= 2 else 1)
    acc = leaves * profile.op_latency.value + 3 * grad_bytes / profile.mem_bw.value
    return 2 * v * profile.stage_call_time() + acc * (m - 1) / m


@dataclasses.dataclass(frozen=True)
class _RankCost:
    """One pipeline rank's costs: seconds per micro-batch (compute, critical collectives,
    pipeline overhead), after the schedule (``tail``: hidden collectives exposed, the ring's,
    the step's, optimizer, offload), its parts, the work its cores do outside collectives,
    its collectives' time with their waits for the peers."""

    per_mb: float
    tail: float
    parts: dict[str, float]
    work: float
    comm: float


def _rank_time(spec: ModelSpec, plan: AnalyticPlan, profile: DeviceProfile, global_batch: int,
               seq: int, opt_bytes: float) -> _RankCost:
    c = plan.choice
    m, p = c.microbatches, c.pp
    tokens = global_batch // (c.dp * c.ep) // m * (seq // c.cp)
    ring = c.cp if c.cp > 1 and c.cp_mode == "ring" else 0
    t_f, t_blocks, t_attn, t_attn_b = _forward_time(
        spec, plan.blocks, plan.last, float(tokens), seq, c.tp, c.ep, c.precision,
        c.sequence_parallel, profile, c.grid, ring)
    # The backward: twice the forward's products, the attention's own backward.
    t_b = 2 * (t_f - t_attn) + t_attn_b + (t_blocks if c.remat else 0.0)
    crit, cn = _comm_time(plan, profile, ("fwd", "bwd"))
    t_pipe = _pipeline_overhead(spec, plan, profile) if p > 1 else 0.0
    fh, fn = _comm_time(plan, profile, ("fwd_hidden",))
    bh, bn = _comm_time(plan, profile, ("bwd_hidden",))
    ov = profile.overlap.value
    hidden = _hidden(fh, fn, m * t_f, ov) + _hidden(bh, bn, m * t_b, ov)
    # The ring's hops, each posted before the chunk pair it overlaps: hidden under the
    # attention's compute (forward; backward twice that, the recompute's forward under remat)
    # as far as ``overlap`` allows, nothing less than zero.
    rf, rfn = _comm_time(plan, profile, ("fwd_ring",))
    rb, rbn = _comm_time(plan, profile, ("bwd_ring",))
    ring = max(0.0, rf - ov * m * t_attn) + max(
        0.0, rb - ov * m * t_attn * (3 if c.remat else 2))
    step_comm, sn = _comm_time(plan, profile, ("step",))
    mem = plan.memory
    local_params = (mem.params / 4) * (c.dp if c.zero == 3 else 1)
    opt_params = local_params / (c.dp if c.zero >= 1 else 1)
    amp = 6.0 * local_params / (c.dp if c.zero == 3 else 1) if c.precision != "fp32" else 0.0
    moved = OPT_BYTES_MOVED * opt_params * opt_bytes / 8.0
    if c.offload:
        t_opt = amp / profile.mem_bw.value + moved / profile.host_mem_bw.value
        t_off = 8.0 * opt_params / profile.host_bw.value
    else:
        t_opt = (moved + amp) / profile.mem_bw.value
        t_off = 0.0
    work = m * (t_f + t_b + t_pipe) + t_opt + t_off
    calls = cn + fn + bn + rfn + rbn + sn
    # Each call's wait for its peers (``sync_wait``, CPU ranks), at most the compute between
    # two calls: the rank's work over its calls, a call.
    wait = profile.sync_wait.value if profile.sync_wait is not None else 0.0
    sync = min(calls * wait, work)
    per_mb = t_f + t_b + (crit + sync) / m + t_pipe
    parts = {"compute": m * (t_f + t_b), "critical comm": crit, "sync waits": sync,
             "pipeline overhead": m * t_pipe, "hidden comm exposed": hidden,
             "cp ring exposed": ring, "step comm": step_comm, "optimizer": t_opt,
             "offload": t_off}
    return _RankCost(per_mb=per_mb, tail=hidden + ring + step_comm + t_opt + t_off,
                     parts=parts, work=work, comm=crit + fh + bh + rf + rb + step_comm + sync)


def estimate(spec: ModelSpec, c: Choice, profile: DeviceProfile, global_batch: int, seq: int, *,
             opt_bytes: float = 8.0, clip: bool = True, bucket_mb: float = 25.0,
             margin: float = 0.10) -> Estimate:
    """The :class:`Estimate` of layout ``c`` (module docstring)."""
    p, v = c.pp, c.virtual_stages
    stages = stage_blocks(spec, p, v)
    # Pipeline ranks that cost the same time: the same kinds of blocks and ends.
    groups: dict[tuple, list[int]] = {}
    for r in range(p):
        key = (tuple(spec.is_moe(i) for i in stages[r]), r == 0, r == p - 1)
        groups.setdefault(key, []).append(r)
    # Memory: the first rank (the most micro-batches in flight), the last (the head) and
    # the one with the most blocks.
    peaks = {0, p - 1, max(range(p), key=lambda r: len(stages[r]))}
    plans = {r: analytic_plan(spec, c, global_batch, seq, bucket_mb=bucket_mb, clip=clip,
                              opt_bytes=opt_bytes, rank=r)
             for r in sorted(peaks | {g[0] for g in groups.values()})}
    costs = [(len(g), _rank_time(spec, plans[g[0]], profile, global_batch, seq, opt_bytes))
             for g in groups.values()]
    per_rank = [rc.per_mb for n, rc in costs for _ in range(n)]
    slow = max((rc for _, rc in costs), key=lambda rc: rc.per_mb)
    last = max((rc for _, rc in costs), key=lambda rc: rc.tail)
    pipe = pipeline_makespan(c.microbatches, v, per_rank)
    time = pipe + last.tail
    parts = {**slow.parts, "bubble": pipe - c.microbatches * slow.per_mb,
             **{k: last.parts[k] for k in ("hidden comm exposed", "cp ring exposed",
                                           "step comm", "optimizer", "offload")}}
    if profile.cores is not None and c.world > profile.cores.value:
        if p > 1:  # the schedule replayed on its share of the cores, its bubbles filled
            shared_pipe = schedule_makespan(
                c.schedule, p, c.microbatches, v,
                lambda kind, s, mb: per_rank[s % p] / v * (1 if kind == "F" else 2) / 3,
                cores=profile.cores.value * p / c.world)
            parts["bubble"] += shared_pipe - pipe
            time += shared_pipe - pipe
        # More ranks than cores: the step cannot end before the cores have done every rank's
        # work (a pipeline's idle ranks give theirs to the busy ones), plus the busiest rank's
        # collectives (measured on the shared cores) and their waits for the peers.
        work = sum(n * rc.work for n, rc in costs) * (c.world // p)
        bound = work / profile.cores.value + max(rc.comm for _, rc in costs)
        parts["shared cores"] = max(0.0, bound - time)
        time = max(time, bound)
    plan = max((plans[r] for r in sorted(peaks)), key=lambda pl: pl.memory.peak)
    peak = plan.memory.peak * (1 + margin)
    tokens = global_batch * seq
    mfu = spec.model_flops_per_token(seq) * tokens / (time * c.world *
                                                      profile.peak_flops(c.precision))
    return Estimate(c, time, parts, plan, peak, mfu, tokens / time)
