"""Few-shot sine regression with MAML (Finn et al. 2017, arXiv 1703.03400), Adam in the loop.

    python examples/maml_sine.py                          # 300 meta-steps, 5-shot
    python examples/maml_sine.py --meta-steps 20 --tasks 4
    tensorboard --logdir runs/maml_sine

A task is ``y = a sin(x + phi)`` with ``a ~ U[0.1, 5]``, ``phi ~ U[0, pi]``, ``x ~ U[-5, 5]``.
Each meta-step samples ``--tasks`` tasks; for each, :func:`funcpar.meta.maml_adapt` runs
``--inner-steps`` funcpar AdamW steps (no weight decay) from the meta-parameters on K support
points, keeping the graph, and the adapted model's loss on K query points is the meta-loss;
its gradient w.r.t. the meta-parameters (through the inner Adam steps, second order) drives an
outer AdamW. Every ``--eval-every`` meta-steps the same adaptation on fixed held-out tasks gives
the meta-test loss, which falls as the meta-parameters learn to adapt. TensorBoard:
``train/meta_loss``, ``train/meta_test_loss`` (:class:`funcpar.train.Logger`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch
from torch import Tensor

import funcpar.optim as fo
from funcpar.meta import maml_adapt
from funcpar.train import Logger
from funcpar.train.cli import add_debug_flag, positive_int, run_cli

Params = dict[str, Tensor]


def init_params(width: int, g: torch.Generator) -> Params:
    def lin(i: int, o: int) -> tuple[Tensor, Tensor]:
        bound = 1 / math.sqrt(i)
        return ((torch.rand(i, o, generator=g) * 2 - 1) * bound, torch.zeros(o))

    (w1, b1), (w2, b2), (w3, b3) = lin(1, width), lin(width, width), lin(width, 1)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3}


def mlp(p: Params, x: Tensor) -> Tensor:
    # tanh, not ReLU: a dead unit's gradient is exactly 0, where the derivative of Adam's
    # sqrt(v) is infinite (NaN meta-gradients; docs/FUNCTIONAL.md, limits).
    h = torch.tanh(x @ p["w1"] + p["b1"])
    h = torch.tanh(h @ p["w2"] + p["b2"])
    return h @ p["w3"] + p["b3"]


def mse(p: Params, x: Tensor, y: Tensor) -> Tensor:
    return ((mlp(p, x) - y) ** 2).mean()


def sample_task(k: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """K support and K query points of one random sine."""
    amp = 0.1 + 4.9 * torch.rand((), generator=g)
    phase = math.pi * torch.rand((), generator=g)
    x = torch.rand(2 * k, 1, generator=g) * 10 - 5
    y = amp * torch.sin(x + phase)
    return x[:k], y[:k], x[k:], y[k:]


def meta_loss(theta: Params, tasks, args: argparse.Namespace, *, first_order: bool = False):
    inner = fo.adamw(args.inner_lr, weight_decay=0.0)
    total = 0.0
    for xs, ys, xq, yq in tasks:
        adapted, _ = maml_adapt(mse, inner, theta, (xs, ys), args.inner_steps,
                                first_order=first_order)
        total = total + mse(adapted, xq, yq)
    return total / len(tasks)


def main(argv: Sequence[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meta-steps", type=positive_int, default=300)
    ap.add_argument("--tasks", type=positive_int, default=8, help="tasks per meta-step")
    ap.add_argument("--shots", type=positive_int, default=5, help="K support (and query) points")
    ap.add_argument("--inner-steps", type=positive_int, default=3)
    ap.add_argument("--inner-lr", type=float, default=0.02)
    ap.add_argument("--meta-lr", type=float, default=3e-3)
    ap.add_argument("--width", type=positive_int, default=40)
    ap.add_argument("--eval-every", type=positive_int, default=25)
    ap.add_argument("--eval-tasks", type=positive_int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logdir", default="runs/maml_sine")
    add_debug_flag(ap)
    args = ap.parse_args(argv)

    g = torch.Generator().manual_seed(args.seed)
    theta = init_params(args.width, g)
    eval_tasks = [sample_task(args.shots, torch.Generator().manual_seed(10_000 + i))
                  for i in range(args.eval_tasks)]
    outer = fo.adamw(args.meta_lr, weight_decay=0.0)
    outer_state = outer.init(theta)
    test_losses: list[float] = []

    def evaluate(step: int, log: Logger) -> None:
        # The meta-test loss needs the inner gradients but not the outer one: first order.
        loss = meta_loss({k: v.detach() for k, v in theta.items()}, eval_tasks, args,
                         first_order=True).detach()
        test_losses.append(float(loss))
        log.log(step, {"meta_test_loss": loss})
        print(f"meta-step {step:4d}  meta-test loss {float(loss):.4f}")

    with Logger(args.logdir, progress=False) as log:
        evaluate(0, log)
        for step in range(1, args.meta_steps + 1):
            leaves = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
            tasks = [sample_task(args.shots, g) for _ in range(args.tasks)]
            loss = meta_loss(leaves, tasks, args)
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
            theta, outer_state = fo.update_params(outer, grads, outer_state,
                                                  {k: v.detach() for k, v in leaves.items()})
            log.log(step, {"meta_loss": loss.detach()})
            if step % args.eval_every == 0 or step == args.meta_steps:
                evaluate(step, log)
    print(f"meta-test loss: {test_losses[0]:.4f} -> {test_losses[-1]:.4f}")
    return test_losses


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
