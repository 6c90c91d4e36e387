"""N small MLPs trained in one vmapped step against N separate steps (funcpar.train.vmap).

    python benchmarks/bench_vmap.py                    # N=8, AdamW, 1 torch thread, CPU
    python benchmarks/bench_vmap.py --members 4 --width 128 --profile

The members (one MLP each, own seed and learning rate; AdamW with global-norm clipping) are
trained two ways on the same batches: ``vmap_step(step)`` on their stacked state (one call per
step: each op runs once on ``(N, ...)`` tensors) and ``step`` called on each member in turn.
After ``--warmup`` steps of each, ``--rounds`` rounds time ``--steps`` steps of each way,
the two interleaved and their order alternated every round, so the machine's noise hits both
alike; the table gives the median ms per training step of all N members (and the fastest round)
and ``sequential / vmapped`` (> 1: vmap is faster). ``--profile`` prints torch.profiler's top
ops of a few steps of each way, to see where the time goes.

Both ways do the same arithmetic; the gain is the per-op overhead (Python, dispatch, autograd
bookkeeping, the optimizer's per-leaf loops) paid once instead of N times, so it is largest
for small models and shrinks as the matmuls grow.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from _timing import add_clock_flag, interleaved
from torch import nn

import funcpar.optim as fo
from funcpar.state import functionalize, init_state
from funcpar.train import make_train_step
from funcpar.train.vmap import stack_states, vmap_step


def build(args: argparse.Namespace):
    states = []
    for i in range(args.members):
        torch.manual_seed(i)
        model = nn.Sequential(nn.Linear(args.dim, args.width), nn.GELU(),
                              nn.Linear(args.width, args.width), nn.GELU(),
                              nn.Linear(args.width, args.dim))
        apply_fn, params, buffers = functionalize(model)
        opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=1e-3, weight_decay=0.01))
        st = init_state(params, buffers, opt)
        lr = 1e-3 * 2.0 ** (i - args.members // 2)
        states.append(st._replace(opt_state=fo.set_hyperparams(st.opt_state, lr=lr)))
    step = make_train_step(apply_fn, lambda out, y: ((out - y) ** 2).mean(), opt)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch, args.dim, generator=g),
                torch.randn(args.batch, args.dim, generator=g)) for _ in range(4)]
    return step, states, batches


def runners(step, states, batches) -> dict[str, Callable[[int], None]]:
    run_v = vmap_step(step)
    box = {"vmapped": stack_states(states), "sequential": list(states)}

    def vmapped(n: int) -> None:
        st = box["vmapped"]
        for i in range(n):
            st, _ = run_v(st, batches[i % len(batches)])
        box["vmapped"] = st

    def sequential(n: int) -> None:
        sts = box["sequential"]
        for i in range(n):
            sts = [step(st, batches[i % len(batches)])[0] for st in sts]
        box["sequential"] = sts

    return {"vmapped": vmapped, "sequential": sequential}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    add_clock_flag(p)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    step, states, batches = build(args)
    ways = runners(step, states, batches)
    for fn in ways.values():
        fn(args.warmup)
    times = interleaved(ways, rounds=args.rounds, steps=args.steps, clock=args.clock)
    n_params = sum(p.numel() for p in states[0].params.values())
    print(f"{args.members} members x {n_params} params (MLP {args.dim}-{args.width}-"
          f"{args.width}-{args.dim}), batch {args.batch}, AdamW + clip, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds x {args.steps} steps, "
          f"{args.clock} clock")
    print(f"{'way':<12} {'median ms':>10} {'min ms':>8}")
    for name, ts in times.items():
        print(f"{name:<12} {statistics.median(ts):>10.2f} {min(ts):>8.2f}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"sequential / vmapped: {med['sequential'] / med['vmapped']:.2f}x (medians), "
          f"{min(times['sequential']) / min(times['vmapped']):.2f}x (fastest rounds)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in ways.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn(3)
            print(f"--- {name}: 3 steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
