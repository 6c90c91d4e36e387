"""The cost model's parts against what a real run measures (issue 35): the predicted peak memory
of each pipeline rank and of a context-parallel rank against the peak measured on it (glibc's
heap, ``funcpar.auto.heap``), and the predicted step time of a pipeline schedule against the
timeline the runtime records (``Pipeline.record``).

Time: the cost model's pipeline term ``(m + (p - 1)/v)`` micro-batch times
(:func:`funcpar.auto.cost.pipeline_time`), priced with the forward and backward times the
runtime recorded, against the makespan of the recorded schedule. On this shared 2-core machine
the ranks' compute times vary by 2x between steps, so the bound is loose (25 %), but tight
enough to tell a schedule with its bubble from one without (``m`` micro-batch times, 33 % less
at ``p = m = 2``).

Memory: 2 gloo ranks, fp32, AdamW with clipping, the ``hybrid_parallel`` preset with
``pp_size=2``; the state's bytes plus the heap's rise over a step, per rank, within the model's
stated 10 % margin of :func:`funcpar.auto.analytic_plan`'s peak for that pipeline rank.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import funcpar.optim as fo
from funcpar.auto import Choice, analytic_plan, heap, model_spec
from funcpar.auto.cost import pipeline_makespan, pipeline_time, schedule_makespan
from funcpar.auto.pipeline_memory import StageBytes, events, pipeline_peak
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim.memory import state_bytes
from funcpar.pipeline.schedules import build_schedule, simulate
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.state.tree import tree_leaves
from funcpar.testing import run_ranks
from funcpar.train import make_train_step

CFG = dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, max_seq_len=64)
B, T = 8, 64


def _measured_peak(choice: Choice) -> tuple[int, int]:
    """(pipeline rank, state bytes + the heap's largest rise over two steps) on this rank."""
    from funcpar.auto.search import preset_for

    torch.set_num_threads(1)
    cfg = LlamaConfig(**CFG)
    mesh = DeviceMesh.from_env(**choice.axes())
    apply_fn, params, buffers = functionalize(Llama(cfg, seed=0), release=True)
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3))
    step = make_train_step(apply_fn, lm_loss, opt, donate=True)
    state = init_state(params, buffers, opt)
    del params
    step, state = preset_for(choice, mesh=mesh)(step, state)
    tok = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    data = (tok[:, :-1], tok[:, 1:])
    for _ in range(2):
        state, _ = step(state, data)
    held = sum(x.numel() * x.element_size() for x in tree_leaves(state.params)
               if torch.is_tensor(x)) + state_bytes(state.opt_state)
    with heap.HeapPeak() as probe:
        for _ in range(2):
            state, _ = step(state, data)
    return mesh.rank("pp") if choice.pp > 1 else 0, held + probe.rise


@pytest.mark.skipif(not heap.available(), reason="needs glibc's mallinfo2")
@pytest.mark.parametrize("schedule,m", [pytest.param("1f1b", 4, marks=pytest.mark.slow),
                                        ("gpipe", 4)])
def test_pipeline_memory_per_rank_matches_measured_peak(schedule, m):
    """pp2, 4 micro-batches: GPipe's last rank holds every micro-batch's activations, 1F1B's
    two at most, while both accumulate the gradients (the runtime keeps ``2 G`` between a
    stage's backwards, ``3 G`` at the end of one) and keep their sent buffers: each rank's
    measured peak within the 10 % margin of its predicted one."""
    c = Choice(pp=2, microbatches=m, schedule=schedule, precision="fp32")
    spec = model_spec(LlamaConfig(**CFG))
    for rank, measured in run_ranks(_measured_peak, 2, c, timeout=300):
        predicted = analytic_plan(spec, c, B, T, rank=rank).memory.peak
        assert abs(predicted / measured - 1) <= 0.10, (rank, predicted, measured)


@pytest.mark.skipif(not heap.available(), reason="needs glibc's mallinfo2")
@pytest.mark.slow
@pytest.mark.parametrize("c", [Choice(cp=2, precision="fp32"),
                               Choice(cp=2, cp_mode="ulysses", precision="fp32"),
                               Choice(cp=2, dp=2, zero=1, precision="fp32"),
                               Choice(cp=2, dp=2, zero=2, precision="fp32")], ids=str)
def test_context_parallel_memory_matches_measured_peak(c):
    """cp2 (ring, Ulysses): the state plus the end of the step (the gradients' mean over cp
    after the backward, ``3 G``) and the activations of half of each sequence, within the
    10 % margin of the measured peak on each rank; beside dp2 with ZeRO-1 (the update's
    buffers after the cp mean: data parallelism's rule) and ZeRO-2 (the mean of the part on
    top of the hooks' ``(3 + 1/n) G``)."""
    predicted = analytic_plan(model_spec(LlamaConfig(**CFG)), c, B, T).memory.peak
    for _, measured in run_ranks(_measured_peak, c.world, c, timeout=300):
        assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_pipeline_events_count_accumulated_gradients():
    """The events of one 1F1B rank (p = 2, m = 3, rank 0): the levels the module docstring
    derives, by hand."""
    # F0 F1 B0 F2 B1 B2 on rank 0 (warm-up 1): coefficients (A, Ft, Bt, G, L, O, D), the
    # dominated ones (F0, F1, B0's) dropped; D counts input gradients sent (0 bytes on a
    # first stage).
    got = set(events("1f1b", 2, 3, 1, 0))
    assert got == {
        (2, 1, 0, 1, 0, 3, 1),  # F2: mb1, mb2 in flight, mb0's gradients, 3 outputs sent
        (2, 0, 1, 1, 0, 3, 1),  # B1 starts: its transient on top
        (1, 0, 0, 2, 1, 3, 1),  # B1's grad returned: accumulator + new tuple + the sum's leaf
        (1, 0, 1, 1, 0, 3, 2),  # B2 starts: the accumulator (B1's tuple dropped, summed in)
        (0, 0, 0, 2, 0, 3, 2),  # B2's grad returned: the accumulator and B2's tuple
    }
    one = StageBytes(acts=10, fwd_transient=0, bwd_transient=0, grads=1, largest_leaf=0,
                     out=0, dx=0)
    # Activations dominate: two micro-batches in flight (1F1B's p - r) and one gradient.
    assert pipeline_peak("1f1b", 2, 3, 1, 0, [one]) == 2 * 10 + 1
    heavy = StageBytes(acts=1, fwd_transient=0, bwd_transient=0, grads=10, largest_leaf=0,
                       out=0, dx=0)
    # Gradients dominate: 2 G when B1 returns, micro-batch 2 still in flight.
    assert pipeline_peak("1f1b", 2, 3, 1, 0, [heavy]) == 2 * 10 + 1


def test_pipeline_memory_of_interleaved_ranks_counts_each_stage():
    """Interleaved stages accumulate per stage: a rank with two stages holds both stages'
    gradients once each has had a backward (events' coefficient vectors have 7 v entries)."""
    for vec in events("interleaved", 2, 4, 2, 1):
        assert len(vec) == 14
    two = [StageBytes(0, 0, 0, 1, 0, 0, 0), StageBytes(0, 0, 0, 100, 0, 0, 0)]
    # The second stage's accumulator and a new tuple: 200, plus the first's.
    assert pipeline_peak("interleaved", 2, 4, 2, 1, two) == 201


def _traced_steps(schedule: str, m: int, steps: int) -> list[tuple[list, float]]:
    """Per step after the first: this rank's recorded compute spans ``(kind, stage, mb,
    start, end)`` (``Pipeline.record``; ``perf_counter`` is one clock for the host's
    processes) and, measured right after the step under the same load, one transfer of a
    micro-batch's activation: half a ping-pong through the runtime's path (``batch_p2p``)."""
    from funcpar.shard import comm
    from funcpar.transforms import pipeline_split

    torch.set_num_threads(1)
    cfg = LlamaConfig(**CFG)
    mesh = DeviceMesh.from_env(pp=2)
    apply_fn, params, buffers = functionalize(Llama(cfg, seed=0))
    opt = fo.adamw(1e-3)
    step, state = pipeline_split(mesh, microbatches=m, schedule=schedule)(
        make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt))
    step.pipeline.record = True
    tok = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    r, x = mesh.rank("pp"), torch.zeros(B // m, T, cfg.dim)
    out = []
    for _ in range(steps):
        state, _ = step(state, (tok[:, :-1], tok[:, 1:]))
        spans = [(a.kind, a.stage, a.mb, s, e) for a, s, e in step.pipeline.trace]
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for kind in (("send", "recv") if r == 0 else ("recv", "send")):
                buf = x if kind == "send" else torch.empty_like(x)
                comm.batch_p2p([comm.P2POp(kind, buf, 1 - r, 7, "probe")], mesh, "pp")[0].wait()
            times.append((time.perf_counter() - t) / 2)
        out.append((spans, statistics.median(times)))
    return out[1:]


def test_schedule_makespan_equals_simulated_schedule():
    """The cost model's schedule replay with the simulator's unit costs (backward = 2
    forwards, free transfers) gives :func:`funcpar.pipeline.schedules.simulate`'s makespan
    on the real action lists, and with equal stages the closed form ``pipeline_time``."""
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for p in (2, 3, 4):
            for m in (1, 2, 4, 8):
                if schedule == "interleaved" and m % p:
                    continue
                sim = simulate(build_schedule(schedule, p, m, v), p, m, v)
                rep = schedule_makespan(schedule, p, m, v,
                                        lambda kind, s, mb: 1.0 if kind == "F" else 2.0)
                assert rep == sim.makespan == pipeline_time(m, p, v, 3.0 * v)


def test_pipeline_makespan_of_unequal_stages_equals_the_replay():
    """Stages of unequal cost (the embedding on the first rank, the head on the last): the
    closed form ``m max u + (sum u - max u)`` is the replay's makespan for GPipe, and for
    1F1B where the last stage is the slowest (a language model's head), where the slowest
    stage's ``(m + p - 1)`` overstates it; with a slower stage before the last, 1F1B's
    warm-up forwards fill some of that stage's wait and the form is an upper bound (within
    25 % here); interleaved (v = 2, the embedding's stage and the head's) within 5 %."""
    def unit(u):
        return lambda k, s, mb: u[s] / 3 * (1 if k == "F" else 2)

    for costs in ([1.5, 1.0, 1.0, 3.6], [2.2, 3.1], [1.0, 4.0, 1.0], [3.0, 1.0, 1.0, 1.0]):
        p = len(costs)
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 4, 8):
                rep = schedule_makespan(schedule, p, m, 1, unit(costs))
                form = pipeline_makespan(m, 1, costs)
                assert form <= (m + p - 1) * max(costs)
                if schedule == "gpipe" or costs[-1] == max(costs):
                    assert form == pytest.approx(rep)
                else:
                    assert rep - 1e-9 <= form <= 1.25 * rep
    for p in (2, 4):  # interleaved, a language model's stages: the embedding, the head
        for head in (1.0, 1.5, 4.0):
            stage = [1.1] + [1.0] * (2 * p - 2) + [head]
            ranks = [stage[r] + stage[r + p] for r in range(p)]  # stages r and r + p
            for m in (p, 2 * p, 4 * p):
                rep = schedule_makespan("interleaved", p, m, 2, unit(stage))
                assert pipeline_makespan(m, 2, ranks) == pytest.approx(rep, rel=0.05)


@pytest.mark.parametrize("schedule,m", [pytest.param("1f1b", 4, marks=pytest.mark.slow),
                                        ("gpipe", 2)])
def test_pipeline_time_matches_schedule_trace(schedule, m):
    """The schedule replayed with the recorded forward and backward times and the transfer
    time measured beside them (``schedule_makespan``) against the recorded makespan: the
    median over steps within [0.7, 1.1] of it (what is left is the runtime's bookkeeping per
    action and the ranks' time-slicing on shared cores), and nearer to it than the busiest
    rank's compute alone (a model without the bubble)."""
    ranks = run_ranks(_traced_steps, 2, schedule, m, 4, timeout=300)
    ratios, errors = [], []
    for k in range(len(ranks[0])):
        spans = [x for r in ranks for x in r[k][0]]
        cost = {(kind, st, mb): e - s for kind, st, mb, s, e in spans}
        makespan = max(x[4] for x in spans) - min(x[3] for x in spans)
        replay = schedule_makespan(schedule, 2, m, 1, lambda *a, c=cost: c[a],
                                   transfer=ranks[0][k][1])
        busiest = max(sum(e - s for *_, s, e in r[k][0]) for r in ranks)
        ratios.append(replay / makespan)
        errors.append((abs(replay - makespan), abs(busiest - makespan)))
    assert 0.7 <= statistics.median(ratios) <= 1.1, ratios
    assert sum(a < b for a, b in errors) > len(errors) / 2, errors


def _moe_step_comm(c: Choice) -> tuple[dict, int]:
    """One step's collectives (``comm_log``, totals per (op, axis)) of the MoE model under
    ``c``'s preset, and this rank's parameter bytes."""
    from funcpar.auto.search import preset_for
    from funcpar.models import moe_lm_loss
    from funcpar.shard.comm import comm_log

    torch.set_num_threads(1)
    cfg = LlamaConfig(**MOE_TP)
    mesh = DeviceMesh.from_env(**c.axes())
    apply_fn, params, buffers = functionalize(Llama(cfg, seed=0))
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3))
    step, state = preset_for(c, mesh=mesh)(make_train_step(apply_fn, moe_lm_loss, opt),
                                           init_state(params, buffers, opt))
    tok = torch.randint(0, cfg.vocab_size, (B, 17), generator=torch.Generator().manual_seed(0))
    data = (tok[:, :-1], tok[:, 1:])
    state, _ = step(state, data)
    with comm_log.capture() as recs:
        step(state, data)
    totals: dict = {}
    for r in recs:
        n, b = totals.get((r.op, r.axis), (0, 0))
        totals[(r.op, r.axis)] = (n + 1, b + r.nbytes)
    return totals, sum(x.numel() * x.element_size() for x in tree_leaves(state.params))


# Every assignment kept (no capacity): the experts' rows, and so their tensor-parallel
# all-reduces, do not depend on the routing without ep.
MOE_TP = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=192, n_experts=4,
              top_k=2, moe_every=2, capacity_factor=None)


@pytest.mark.parametrize("c", [Choice(tp=2, precision="fp32"),
                               pytest.param(Choice(tp=2, dp=2, zero=2),
                                            marks=pytest.mark.slow)], ids=str)
def test_moe_tensor_parallel_collectives_equal_the_comm_log(c):
    """MoE with each expert's ffn split over tp (no ``describe`` plan: it refuses experts
    under tp): the analytic collectives equal one real step's comm log op by op and axis by
    axis - the attention's and the experts' all-reduces of an MoE block, the dense blocks',
    the loss's, data parallelism's and ZeRO's, the norms' - and the parameters per rank."""
    spec = model_spec(LlamaConfig(**MOE_TP))
    ana = analytic_plan(spec, c, B, 16)
    for totals, param_bytes in run_ranks(_moe_step_comm, c.world, c, timeout=300):
        assert ana.totals() == {k: (n, float(b)) for k, (n, b) in totals.items()}
        assert ana.memory.params == param_bytes


@pytest.mark.slow
def test_moe_expert_and_tensor_parallel_collectives_match_the_comm_log_but_routing():
    """ep2 x tp2: the rows a rank receives depend on the routing, which the model takes as
    balanced, so only what does not depend on it is exact: every (op, axis)'s count, the ep
    all-reduces' bytes (loss, gradients, norm) and the parameters; the all_to_alls and the
    experts' tp all-reduces are within 25 % (one step of this model's routers)."""
    c = Choice(tp=2, ep=2, precision="fp32")
    ana = analytic_plan(model_spec(LlamaConfig(**MOE_TP)), c, B, 16)
    for totals, param_bytes in run_ranks(_moe_step_comm, c.world, c, timeout=300):
        want = ana.totals()
        assert {k: n for k, (n, _) in want.items()} == {k: n for k, (n, _) in totals.items()}
        assert want[("all_reduce", "ep")][1] == totals[("all_reduce", "ep")][1]
        for key in (("all_to_all", "ep"), ("all_reduce", "tp")):
            assert abs(want[key][1] / totals[key][1] - 1) <= 0.25, (key, want, totals)
        assert ana.memory.params == param_bytes
