"""Dense vs MoE of equal active parameters: tokens/s, all_to_all bytes, load balance (CPU).

The example Llama (dim 64, 2 layers, vocab 256, batch 8 x 64) with a SwiGLU feed-forward of
width ``H`` (dense) against the same model whose feed-forwards are MoE blocks of ``E`` experts of
width ``H`` each, top-1: every token runs one expert, so both models have the same *active*
parameters per token (the MoE adds a router of ``E x dim`` and holds ``E`` times the FFN
weights). Measured, on one torch thread:

* tokens/s of the full AdamW train step on one process, dense and MoE interleaved round by
  round, the median of ``--rounds`` rounds of ``--steps`` steps each, and the ratio;
* under ``expert_parallel`` over 2 ranks (gloo): the all_to_all bytes of the first step on
  each rank as ``comm_log`` records them (counts, token rows, expert ids, outputs, and their
  backward), beside the plan's prediction (:mod:`funcpar.presets.plan`): exact given the
  routing (each rank's kept assignments per expert, from a one-process forward of its
  sequences), the value under balanced routing, and the bound for any routing;
* load balance on the MoE's first step: kept tokens per expert and the dropped fraction, per
  MoE block, at capacity factor ``--capacity-factor``.

    python benchmarks/bench_moe.py [--experts 4] [--capacity-factor 1.25]

A loaded machine makes the absolute tokens/s noisy; the ratio of interleaved medians less so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss, moe_lm_loss
from funcpar.shard import comm
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.train.cli import positive_int


def _config(experts: int, capacity_factor: float) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=176,
                       max_seq_len=64, n_experts=experts, top_k=1,
                       capacity_factor=capacity_factor or None)


def _setup(cfg: LlamaConfig):
    model = Llama(cfg, seed=0)
    apply_fn, params, buffers = functionalize(model)
    opt = fo.adamw(lr=1e-3)
    loss = moe_lm_loss if cfg.n_experts else lm_loss
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    return make_train_step(apply_fn, loss, opt), init_state(params, buffers, opt), batch, model


def _tokens_per_s(step, state, batch, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    float(metrics["loss"])
    return steps * batch[0].numel() / (time.perf_counter() - start)


def _a2a_bytes(experts: int, capacity_factor: float) -> dict[str, int]:
    """This rank's all_to_all bytes of the first step under ep2, measured and planned."""
    from funcpar.presets import describe
    from funcpar.shard.mesh import DeviceMesh
    from funcpar.transforms import expert_parallel

    torch.set_num_threads(1)
    step, state, batch, model = _setup(_config(experts, capacity_factor))
    mesh = DeviceMesh.from_env(ep=2)
    step, state = expert_parallel(mesh)(step, state)
    # The routing of this rank's sequences (the module still holds the initial weights, and
    # routing is per sequence), then the ep group's: what the plan needs for the exact bytes.
    with torch.no_grad():
        mine = model(step.local_batch(batch)[0]).tokens_per_expert
    group = list(comm.all_gather(mine[None], mesh, "ep"))
    with comm.comm_log.capture() as recs:
        step(state, batch)
    plan = describe(step, state, mesh, batch_shape=tuple(batch[0].shape))
    key = ("all_to_all", "ep")
    return {"measured": sum(r.nbytes for r in recs if r.op == "all_to_all"),
            "routed": plan.comm_totals(routing=group)[key][1],
            "balanced": plan.comm_totals()[key][1],
            "bound": plan.comm_totals(bound=True)[key][1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=positive_int, default=4, help="an even count (ep2)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="0: dropless")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--steps", type=positive_int, default=5)
    args = p.parse_args()
    if args.experts % 2:
        p.error(f"--experts {args.experts}: the ep2 run splits the experts over 2 ranks")
    if args.capacity_factor < 0:
        p.error(f"--capacity-factor must be >= 0 (0: dropless), got {args.capacity_factor}")
    torch.set_num_threads(1)
    dense, moe = (_setup(_config(e, args.capacity_factor)) for e in (0, args.experts))
    active = {}
    for name, (_, state, _, _) in (("dense", dense), ("moe", moe)):
        total = sum(v.numel() for v in state.params.values())
        inactive = sum(v.numel() * (args.experts - 1) // args.experts
                       for k, v in state.params.items() if ".experts." in k)
        active[name] = (total, total - inactive)
    rates: dict[str, list[float]] = {"dense": [], "moe": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (step, state, batch, _) in (("dense", dense), ("moe", moe)):
            rate = _tokens_per_s(step, state, batch, args.steps)
            if r:
                rates[name].append(rate)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{'model':<6} {'params':>9} {'active':>9} {'tokens/s':>10}")
    for name in ("dense", "moe"):
        print(f"{name:<6} {active[name][0]:>9,} {active[name][1]:>9,} {med[name]:>10,.0f}")
    print(f"moe / dense tokens/s: {med['moe'] / med['dense']:.2f}")
    out = moe[3](moe[2][0])
    for i, (counts, dropped) in enumerate(zip(out.tokens_per_expert, out.dropped)):
        n = int(counts.sum() + dropped)
        print(f"MoE block {i}: tokens per expert {counts.tolist()}, dropped "
              f"{int(dropped)}/{n} = {int(dropped) / n:.1%}")
    per_rank = run_ranks(_a2a_bytes, 2, args.experts, args.capacity_factor, timeout=300)
    print("ep2 all_to_all bytes of the first step (plan: funcpar.presets.plan):")
    print(f"{'rank':<5} {'measured':>10} {'plan, routing':>14} {'plan, balanced':>15} "
          f"{'plan bound':>11}")
    for rank, b in enumerate(per_rank):
        print(f"{rank:<5} {b['measured']:>10,} {b['routed']:>14,} {b['balanced']:>15,} "
              f"{b['bound']:>11,}")


if __name__ == "__main__":
    main()
