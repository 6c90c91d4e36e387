"""The cost model's pipeline parts against a real pipeline (issue 35): the predicted peak memory
of each pipeline rank against the peak measured on it (glibc's heap, ``funcpar.auto.heap``), and
the predicted step time of a schedule against the timeline the runtime records
(``Pipeline.record``).

Memory: 2 gloo ranks, fp32, AdamW with clipping, the ``hybrid_parallel`` preset with
``pp_size=2``; the state's bytes plus the heap's rise over a step, per rank, within the model's
stated 10 % margin of :func:`funcpar.auto.analytic_plan`'s peak for that pipeline rank.
"""

from __future__ import annotations

import pytest
import torch

import funcpar.optim as fo
from funcpar.auto import Choice, analytic_plan, heap, model_spec
from funcpar.auto.pipeline_memory import StageBytes, events, pipeline_peak
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim.memory import state_bytes
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.state.tree import tree_leaves
from funcpar.testing import run_ranks
from funcpar.train import make_train_step

CFG = dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, max_seq_len=64)
B, T = 8, 64


def _measured_peak(choice: Choice) -> tuple[int, int]:
    """(pipeline rank, state bytes + the heap's largest rise over one step) on this rank."""
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
    return mesh.rank("pp"), held + probe.rise


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
        (1, 0, 1, 2, 0, 3, 2),  # B2 starts: accumulator + B1's tuple, still referenced
        (0, 0, 0, 3, 0, 3, 2),  # B2's grad returned: three gradient-sized buffers
    }
    one = StageBytes(acts=10, fwd_transient=0, bwd_transient=0, grads=1, largest_leaf=0,
                     out=0, dx=0)
    # Activations dominate: two micro-batches in flight (1F1B's p - r) and one gradient.
    assert pipeline_peak("1f1b", 2, 3, 1, 0, [one]) == 2 * 10 + 1
    heavy = StageBytes(acts=1, fwd_transient=0, bwd_transient=0, grads=10, largest_leaf=0,
                       out=0, dx=0)
    # Gradients dominate: 3 G at the end of the third backward.
    assert pipeline_peak("1f1b", 2, 3, 1, 0, [heavy]) == 3 * 10


def test_pipeline_memory_of_interleaved_ranks_counts_each_stage():
    """Interleaved stages accumulate per stage: a rank with two stages holds both stages'
    gradients once each has had a backward (events' coefficient vectors have 7 v entries)."""
    for vec in events("interleaved", 2, 4, 2, 1):
        assert len(vec) == 14
    two = [StageBytes(0, 0, 0, 1, 0, 0, 0), StageBytes(0, 0, 0, 100, 0, 0, 0)]
    # The second stage's accumulator, its stale tuple and a new one: 300, plus the first's.
    assert pipeline_peak("interleaved", 2, 4, 2, 1, two) == 301
