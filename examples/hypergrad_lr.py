"""Learn an MLP's learning rate by hypergradient descent through unrolled AdamW steps.

    python examples/hypergrad_lr.py                       # 60 rounds of 5 unrolled steps
    python examples/hypergrad_lr.py --rounds 10 --lr0 1e-4
    tensorboard --logdir runs/hypergrad_lr

The learning rate is ``exp(log_lr)``, a tensor that requires grad, set into the optimizer state
with :func:`funcpar.optim.set_hyperparams` (a tensor keeps its graph). Each round runs
``--unroll`` AdamW steps on training batches with :func:`funcpar.meta.unroll` (graph kept), takes
the loss of the resulting weights on a held-out batch, and its gradient w.r.t. ``log_lr``
(through every step: the hypergradient, Maclaurin et al. 2015, arXiv 1502.03492; Baydin et al.
2018, arXiv 1703.04782, online) updates ``log_lr`` by a signed step; training then goes on from
the detached weights and optimizer state (truncated: one round's graph at a time). Started far
too low, the learning rate climbs by orders of magnitude and the validation loss falls.
TensorBoard: ``train/val_loss``, ``train/lr``, ``train/hypergrad``.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

import funcpar.optim as fo
from funcpar.meta import detach_state, unroll
from funcpar.train import Logger
from funcpar.train.cli import add_debug_flag, positive_int, run_cli

Params = dict[str, Tensor]


def init_params(sizes: Sequence[int], g: torch.Generator) -> Params:
    p = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        p[f"w{i}"] = torch.randn(a, b, generator=g) / math.sqrt(a)
        p[f"b{i}"] = torch.zeros(b)
    return p


def mlp(p: Params, x: Tensor) -> Tensor:
    n = len(p) // 2
    for i in range(n):
        x = x @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            x = torch.tanh(x)
    return x


def mse(p: Params, x: Tensor, y: Tensor) -> Tensor:
    return ((mlp(p, x) - y) ** 2).mean()


def main(argv: Sequence[str] | None = None) -> list[tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=positive_int, default=60)
    ap.add_argument("--unroll", type=positive_int, default=5, help="AdamW steps per hypergradient")
    ap.add_argument("--lr0", type=float, default=1e-4, help="initial learning rate")
    ap.add_argument("--hyper-lr", type=float, default=0.3, help="step of log(lr) per round")
    ap.add_argument("--width", type=positive_int, default=32)
    ap.add_argument("--batch-size", type=positive_int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logdir", default="runs/hypergrad_lr")
    add_debug_flag(ap)
    args = ap.parse_args(argv)

    g = torch.Generator().manual_seed(args.seed)
    teacher = init_params([4, 16, 2], g)

    def batch() -> tuple[Tensor, Tensor]:
        x = torch.randn(args.batch_size, 4, generator=g)
        return x, mlp(teacher, x) + 0.01 * torch.randn(args.batch_size, 2, generator=g)

    val = batch()
    params = init_params([4, args.width, args.width, 2], g)
    opt = fo.adamw(args.lr0, weight_decay=0.0)
    state = opt.init(params)
    log_lr = torch.tensor(math.log(args.lr0), requires_grad=True)
    history: list[tuple[float, float]] = []
    with Logger(args.logdir, progress=False) as log:
        for r in range(1, args.rounds + 1):
            state = fo.set_hyperparams(state, lr=log_lr.exp())
            params, state, _ = unroll(mse, opt, params, state,
                                      [batch() for _ in range(args.unroll)])
            val_loss = mse(params, *val)
            (hyper,) = torch.autograd.grad(val_loss, log_lr)
            with torch.no_grad():  # a signed step on log(lr): robust to the gradient's scale
                log_lr -= args.hyper_lr * torch.sign(hyper)
            params = {k: v.detach() for k, v in params.items()}
            state = detach_state(fo.set_hyperparams(state, lr=float(log_lr.detach().exp())))
            lr = float(log_lr.detach().exp())
            history.append((lr, float(val_loss.detach())))
            log.log(r, {"val_loss": val_loss.detach(), "lr": lr, "hypergrad": hyper})
            if r % max(1, args.rounds // 10) == 0 or r == 1:
                print(f"round {r:4d}  lr {lr:.3e}  val loss {history[-1][1]:.4f}")
    print(f"lr: {args.lr0:.1e} -> {history[-1][0]:.3e}; "
          f"val loss {history[0][1]:.4f} -> {history[-1][1]:.4f}")
    return history


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
