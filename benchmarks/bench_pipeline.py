"""Pipeline bubble and in-flight activations: measured per-stage timelines against the theory.

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank), pipeline size
``p`` and micro-batch count ``m``, the ranks train a Llama (8 blocks) for a few steps with
``pipeline_split`` and record every forward / backward's start and end
(``Pipeline.record``; ``time.perf_counter`` is CLOCK_MONOTONIC, one clock for all processes of
the host). Per step, rank ``r``'s bubble fraction is ``1 - busy_r / (end - start)``, with
``start`` / ``end`` the first compute start and last compute end over all ranks; the table gives
the mean over ranks and steps (after a warm-up step), next to

* the textbook bubble ``(p - 1) / (m + p - 1)`` (GPipe, 1F1B) or ``(p - 1) / (v m + p - 1)``
  (interleaved), which assumes backward = 2 forwards and free transfers;
* the bubble of the same action lists simulated with unit costs (``schedules.simulate``);
* the peak number of micro-batches whose activations a rank holds (max over ranks; 1F1B must
  hold at most ``p``, GPipe ``m``), measured by the runtime and simulated.

Run: ``python benchmarks/bench_pipeline.py [--quick]`` (CPU, gloo; one thread per rank).
On a machine with fewer cores than ranks the timelines include time-slicing between ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.pipeline.schedules import build_schedule, simulate, theory_bubble
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.transforms import pipeline_split

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=8, n_heads=8, n_kv_heads=4,
                  max_seq_len=64)


def _rank(schedule: str, v: int, m: int, batch: int, seq: int, steps: int):
    mesh = DeviceMesh.from_env(pp=int(os.environ["WORLD_SIZE"]))
    apply_fn, params, buffers = functionalize(Llama(CFG))
    opt = fo.adamw(lr=1e-3)
    step, state = pipeline_split(mesh, microbatches=m, schedule=schedule, virtual_stages=v)(
        make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt))
    step.pipeline.record = True
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (batch, seq + 1), generator=g)
    out = []
    for _ in range(steps):
        state, _ = step(state, (ids[:, :-1], ids[:, 1:]))
        busy = sum(e - s for _, s, e in step.pipeline.trace)
        first = min(s for _, s, _ in step.pipeline.trace)
        last = max(e for _, _, e in step.pipeline.trace)
        out.append((busy, first, last, step.pipeline.peak_in_flight))
    return out


def measure(p: int, schedule: str, v: int, m: int, *, batch: int, seq: int, steps: int):
    per_rank = run_ranks(_rank, p, schedule, v, m, batch, seq, steps, backend=None,
                         timeout=900)
    bubbles = []
    for k in range(1, steps):  # step 0 warms up
        start = min(r[k][1] for r in per_rank)
        end = max(r[k][2] for r in per_rank)
        bubbles += [1 - r[k][0] / (end - start) for r in per_rank]
    peak = max(r[-1][3] for r in per_rank)
    sim = simulate(build_schedule(schedule, p, m, v), p, m, v)
    return (sum(bubbles) / len(bubbles), theory_bubble(schedule, p, m, v),
            sum(sim.bubble) / p, peak, max(sim.peak_in_flight))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="p=2 only, fewer steps")
    args = ap.parse_args(argv)
    steps = 3 if args.quick else 4
    sizes = [2] if args.quick else [2, 4]
    print(f"model: Llama dim {CFG.dim}, {CFG.n_layers} blocks, batch 16 x seq 64, float32, "
          f"{torch.get_num_threads()} threads here, {os.cpu_count()} cores; mean over ranks "
          f"and {steps - 1} steps")
    print(f"{'schedule':<14} {'p':>2} {'m':>3} {'bubble':>8} {'theory':>8} {'sim':>8} "
          f"{'peak':>5} {'sim peak':>8}")
    for p in sizes:
        for m in (p, 2 * p, 4 * p):
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
                b, th, sim, peak, speak = measure(p, schedule, v, m, batch=16, seq=64,
                                                  steps=steps)
                name = schedule if v == 1 else f"{schedule} v{v}"
                print(f"{name:<14} {p:>2} {m:>3} {b:>8.3f} {th:>8.3f} {sim:>8.3f} "
                      f"{peak:>5} {speak:>8}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
