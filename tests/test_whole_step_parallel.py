"""compile=True under data_parallel, shard_params and zero_partition: the whole step stays one
compiled region, its collectives traced in as functional collectives
(funcpar/train/whole_step.py, funcpar/shard/comm.py ``traced_collectives``).

Reference: the same composed step eager, on the same ranks, from the same state and batches
(funcpar.testing.reference: the example Llama with uneven shards, AdamW after a global clip).
Checked on every rank: no graph break and one graph for the 10 steps; the losses and the
whole parameters equal eager's; ``comm_log`` records the collectives (op, bytes, purpose) of
eager at every step, plus the all-reduces of the ``grad_norm`` metric once more: inside the
region the clip computes its norm again instead of reusing the metric's
(funcpar.optim.clip.reuse_global_norm does not reuse a norm while compiling), one 0-d
all-reduce per group of splitting axes (under ZeRO-1 eager's clip computes its own norm too).

Tolerances. Default test: float64 with the ``eager`` backend (dynamo captures the traced
graph, what the break count is about, and runs it without code generation): the traced
optimizer takes the reference maths where eager takes its in-place multi-tensor fast path,
so the results differ by float64 round-off only, 1e-12 relative (measured ~1e-16). Slow tests:
float32 under inductor, whose kernels reorder float32 arithmetic, torch.testing's float32
tolerances as in tests/test_compile_step.py.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import funcpar.train.whole_step as whole_step
from funcpar.shard.comm import comm_log
from funcpar.shard.layout import unshard_tree
from funcpar.testing.multirank import run_ranks
from funcpar.testing.reference import CFG, batches, build

STEPS = 10


def _run(step, state):
    """10 steps: (losses, whole params, per step the Counter of (op, bytes, purpose))."""
    losses, records = [], []
    for i, batch in enumerate(batches()[:STEPS]):
        comm_log.begin_step(i)
        with comm_log.capture() as recs:
            state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        records.append(collections.Counter((r.op, r.nbytes, r.purpose) for r in recs))
    params = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    return losses, params, records


def compiled_vs_eager(tp, dp, zero, backend, dtype_name, layers=CFG.n_layers):
    """On this rank: (eager run, compiled run, graph breaks, unique graphs, region used)."""
    whole_step.BACKEND = backend
    dtype = getattr(torch, dtype_name)
    # float32: the reference's better-conditioned AdamW (eps 1e-5; see its OPTIMIZERS note).
    optim = "adamw" if dtype == torch.float64 else "adamw_small_lr"
    cfg = dataclasses.replace(CFG, n_layers=layers)
    eager = _run(*build(tp, dp, optim, dtype, zero=zero, cfg=cfg))
    step, state = build(tp, dp, optim, dtype, zero=zero, cfg=cfg)
    step = dataclasses.replace(step, compile=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(step, state)
    return (eager, compiled, dict(counters["graph_break"]),
            counters["stats"]["unique_graphs"], step._whole is not None)


def _check(ranks, rtol, atol):
    for rank, ((el, ep, er), (cl, cp, cr), breaks, graphs, whole) in enumerate(ranks):
        assert whole, rank  # the whole-step region ran, not the forward+backward one
        assert breaks == {}, (rank, breaks)
        assert graphs == 1, (rank, graphs)  # one region, traced once for the 10 steps
        torch.testing.assert_close(torch.tensor(cl), torch.tensor(el), rtol=rtol, atol=atol)
        for k in ep:
            torch.testing.assert_close(cp[k], ep[k], rtol=rtol, atol=atol, msg=k)
        for step, (e, c) in enumerate(zip(er, cr)):
            # The metric's norm: all-reduces over the split leaves (none when all are whole).
            # Equal counts where eager's clip misses the metric's norm too (ZeRO-1's clip sees
            # the partitioned view) and computes its own.
            norm = collections.Counter({k: n for k, n in e.items()
                                        if k[2].endswith("global_norm")})
            assert c in (e + norm, e), (rank, step, c - e, e - c)


def test_whole_step_dp2_zero2_equals_eager():
    """dp2 + ZeRO-2 (the batch split, the loss mean, per-leaf gradient reduce-scatters and
    the updates' all-gathers, all inside the graph), float64, 10 steps; one block (dynamo's
    pass over the traced graph is most of the test's time)."""
    _check(run_ranks(compiled_vs_eager, 2, 1, 2, 2, "eager", "float64", 1, timeout=600),
           rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 1-4 min each on the loaded 2-core VM
@pytest.mark.parametrize("tp,dp,zero", [(1, 2, 0), (2, 1, 0), (1, 2, 1), (1, 2, 2), (1, 2, 3),
                                        (2, 2, 2)])
def test_whole_step_parallel_float64(tp, dp, zero):
    """dp2 (bucketed all-reduce), tp2 (Megatron f/g, vocab-parallel loss), ZeRO 1-3 and
    tp2 x dp2 + ZeRO-2: as the default test, with the ``aot_eager`` backend (AOTAutograd's
    functionalization of the collectives too)."""
    _check(run_ranks(compiled_vs_eager, tp * dp, tp, dp, zero, "aot_eager", "float64",
                     timeout=1500),
           rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 1-4 min each on the loaded 2-core VM
@pytest.mark.parametrize("tp,dp,zero", [(1, 2, 0), (2, 1, 0), (1, 2, 2)])
def test_whole_step_parallel_inductor_float32(tp, dp, zero):
    """dp2, tp2 and dp2 + ZeRO-2 under inductor in float32, 10 steps: float32 round-off
    (torch.testing's float32 tolerances)."""
    _check(run_ranks(compiled_vs_eager, tp * dp, tp, dp, zero, "inductor", "float32",
                     timeout=1500),
           rtol=1.3e-6, atol=1e-5)
