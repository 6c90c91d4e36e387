"""A MAML meta-step, or a learning-rate hypergradient, with funcpar.meta against torchopt.

    python benchmarks/bench_meta.py                     # 4 tasks, 3 inner Adam steps, 1 thread
    python benchmarks/bench_meta.py --case lr           # d(val loss)/d(lr) through 5 AdamW steps
    python benchmarks/bench_meta.py --width 128 --inner-steps 5
    python benchmarks/bench_meta.py --clock cpu --rounds 15   # on a loaded machine

A meta-step: for each of ``--tasks`` sine tasks, ``--inner-steps`` Adam steps (weight decay 0)
from the meta-parameters on the support set keeping the graph (second order), the query loss of
the adapted MLP, and the backward to the meta-parameters (the meta-gradient). funcpar:
:func:`funcpar.meta.maml_adapt` with ``funcpar.optim.adamw``; torchopt: its functional
``torchopt.adam`` unrolled by hand (``update(..., inplace=False)`` + ``apply_updates``), the
pattern of its MAML examples. Same tasks, same maths (tests/test_meta.py checks the
meta-gradients agree to 1e-10 in float64). After ``--warmup`` meta-steps of each, ``--rounds``
rounds time ``--steps`` meta-steps of each, interleaved with their order alternated; the table
gives median and fastest ms per meta-step and ``torchopt / funcpar`` (> 1: funcpar is faster).

``--case lr``: the learning rate as a 0-d tensor that requires grad; ``--inner-steps`` (5 by
default here) AdamW steps (weight decay 0.01) from fixed params on each task's support set,
the query loss, and its gradient with respect to the learning rate (hyperparameter
optimisation through training, Maclaurin et al. 2015). funcpar: :func:`funcpar.meta.unroll`
with ``fo.adamw(lr=tensor)``; torchopt: ``torchopt.adamw(lr=tensor)`` unrolled by hand as
above. The two hypergradients are checked to agree before timing.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
from _timing import add_clock_flag, interleaved
from torch import Tensor

import funcpar.optim as fo
from funcpar.meta import maml_adapt, unroll


def mlp(p: dict[str, Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(x @ p["w1"] + p["b1"])
    h = torch.tanh(h @ p["w2"] + p["b2"])
    return h @ p["w3"] + p["b3"]


def mse(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    return ((mlp(p, x) - y) ** 2).mean()


def build(args: argparse.Namespace):
    g = torch.Generator().manual_seed(0)
    w = args.width
    theta = {"w1": torch.randn(1, w, generator=g), "b1": torch.zeros(w),
             "w2": torch.randn(w, w, generator=g) / math.sqrt(w), "b2": torch.zeros(w),
             "w3": torch.randn(w, 1, generator=g) / math.sqrt(w), "b3": torch.zeros(1)}
    theta = {k: v.requires_grad_(True) for k, v in theta.items()}
    tasks = []
    for _ in range(args.tasks):
        x = torch.rand(2 * args.shots, 1, generator=g) * 10 - 5
        y = (0.1 + 4.9 * torch.rand((), generator=g)) * torch.sin(x + torch.rand((), generator=g))
        tasks.append((x[:args.shots], y[:args.shots], x[args.shots:], y[args.shots:]))
    return theta, tasks


def runners(args, theta, tasks) -> dict[str, Callable[[int], None]]:
    import torchopt

    names = list(theta)
    leaves = [theta[k] for k in names]
    inner = fo.adamw(args.inner_lr, weight_decay=0.0)

    def funcpar_step() -> None:
        loss = 0.0
        for xs, ys, xq, yq in tasks:
            adapted, _ = maml_adapt(mse, inner, theta, (xs, ys), args.inner_steps)
            loss = loss + mse(adapted, xq, yq)
        torch.autograd.grad(loss, leaves)

    def torchopt_step() -> None:
        loss = 0.0
        for xs, ys, xq, yq in tasks:
            opt = torchopt.adam(args.inner_lr)
            p = tuple(leaves)
            state = opt.init(p)
            for _ in range(args.inner_steps):
                grads = torch.autograd.grad(mse(dict(zip(names, p)), xs, ys), p,
                                            create_graph=True)
                updates, state = opt.update(grads, state, inplace=False)
                p = torchopt.apply_updates(p, updates, inplace=False)
            loss = loss + mse(dict(zip(names, p)), xq, yq)
        torch.autograd.grad(loss, leaves)

    return _repeat({"funcpar": funcpar_step, "torchopt": torchopt_step})


def lr_runners(args, theta, tasks) -> dict[str, Callable[[int], None]]:
    import torchopt

    names = list(theta)
    start = {k: v.detach() for k, v in theta.items()}
    lr = torch.tensor(args.inner_lr, requires_grad=True)

    def funcpar_grad() -> Tensor:
        loss = 0.0
        for xs, ys, xq, yq in tasks:
            opt = fo.adamw(lr, weight_decay=0.01)
            p, _, _ = unroll(mse, opt, start, opt.init(start), [(xs, ys)] * args.inner_steps)
            loss = loss + mse(p, xq, yq)
        return torch.autograd.grad(loss, lr)[0]

    def torchopt_grad() -> Tensor:
        loss = 0.0
        for xs, ys, xq, yq in tasks:
            opt = torchopt.adamw(lr, weight_decay=0.01)
            p = tuple(start[k] for k in names)
            state = opt.init(p)
            for _ in range(args.inner_steps):
                p = tuple(x if x.requires_grad else x.detach().requires_grad_(True) for x in p)
                grads = torch.autograd.grad(mse(dict(zip(names, p)), xs, ys), p,
                                            create_graph=True)
                updates, state = opt.update(grads, state, params=p, inplace=False)
                p = torchopt.apply_updates(p, updates, inplace=False)
            loss = loss + mse(dict(zip(names, p)), xq, yq)
        return torch.autograd.grad(loss, lr)[0]

    a, b = funcpar_grad(), torchopt_grad()
    if not torch.allclose(a, b, rtol=1e-4, atol=0):  # float32: the same maths to rounding
        raise SystemExit(f"the hypergradients differ: funcpar {a.item()}, torchopt {b.item()}")
    return _repeat({"funcpar": funcpar_grad, "torchopt": torchopt_grad})


def _repeat(ways: dict[str, Callable[[], object]]) -> dict[str, Callable[[int], None]]:
    def steps(one: Callable[[], object]) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                one()
        return run

    return {name: steps(one) for name, one in ways.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--shots", type=int, default=10)
    p.add_argument("--case", choices=("maml", "lr"), default="maml")
    p.add_argument("--inner-steps", type=int, default=None, help="3 (maml), 5 (lr)")
    p.add_argument("--inner-lr", type=float, default=0.01)
    p.add_argument("--width", type=int, default=40)
    p.add_argument("--steps", type=int, default=5, help="meta-steps per timed round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    add_clock_flag(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    theta, tasks = build(args)
    if args.inner_steps is None:
        args.inner_steps = 3 if args.case == "maml" else 5
    ways = (runners if args.case == "maml" else lr_runners)(args, theta, tasks)
    for fn in ways.values():
        fn(args.warmup)
    times = interleaved(ways, rounds=args.rounds, steps=args.steps, clock=args.clock)
    n_params = sum(v.numel() for v in theta.values())
    what = ("MAML meta-step" if args.case == "maml"
            else "lr hypergradient (AdamW, weight decay 0.01)")
    print(f"{what}: {args.tasks} tasks x {args.inner_steps} inner Adam steps, "
          f"{args.shots}-shot, MLP 1-{args.width}-{args.width}-1 ({n_params} params), "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds x {args.steps} steps, "
          f"{args.clock} clock")
    print(f"{'way':<10} {'median ms':>10} {'min ms':>8}")
    for name, ts in times.items():
        print(f"{name:<10} {statistics.median(ts):>10.2f} {min(ts):>8.2f}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"torchopt / funcpar: {med['torchopt'] / med['funcpar']:.2f}x (medians), "
          f"{min(times['torchopt']) / min(times['funcpar']):.2f}x (fastest rounds)")


if __name__ == "__main__":
    main()
