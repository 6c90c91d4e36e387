"""A learning-rate sweep in one process and one call per step: 8 models trained under vmap.

    python examples/sweep_vmap.py                        # 8 lrs from 1e-4 to 1e-1, 300 steps
    python examples/sweep_vmap.py --lrs 1e-3,3e-3,1e-2 --steps 100
    tensorboard --logdir runs/sweep_vmap                 # one curve per learning rate

The experiment: an MLP regresses a fixed random "teacher" MLP's outputs (noisy targets). Every
member starts from the same initial weights (one seed) and sees the same batches; only its
AdamW learning rate differs. The members' states are stacked (:func:`funcpar.train.vmap.
stack_states`: one ``lr`` tensor per member in the optimizer state) and
:func:`funcpar.train.vmap.vmap_step` trains all of them at once: each step is one forward,
backward and optimizer update over ``(members, ...)`` tensors instead of one per member
(benchmarks/bench_vmap.py measures the gain). Each member's metrics go to TensorBoard with
:class:`funcpar.train.Logger` under ``--logdir/lr_<lr>`` (``train/loss``, ``train/lr``,
``train/grad_norm``, and ``train/val_loss`` on held-out data every ``--eval-every`` steps). At
the end a table lists the last training and held-out losses per learning rate and the best one.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

import funcpar.optim as fo
from funcpar.state import functionalize, init_state
from funcpar.train import Logger, make_train_step
from funcpar.train.cli import add_debug_flag, positive_int, run_cli
from funcpar.train.vmap import stack_states, vmap_step

DEFAULT_LRS = "1e-4,3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1"


def mlp(dim_in: int, width: int, dim_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim_in, width), nn.GELU(), nn.Linear(width, width),
                         nn.GELU(), nn.Linear(width, dim_out))


def mse(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def make_data(
    args: argparse.Namespace,
) -> tuple[list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor]]:
    """Training batches and one held-out batch from a fixed random teacher MLP (+ noise)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    torch.manual_seed(args.seed + 1)
    teacher = mlp(args.dim_in, args.width, args.dim_out)
    with torch.no_grad():  # targets of unit variance: a freshly initialised MLP's are ~0.1
        scale = teacher(torch.randn(1024, args.dim_in, generator=g)).std()

    def batch(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, args.dim_in, generator=g)
        with torch.no_grad():
            y = teacher(x) / scale + 0.01 * torch.randn(n, args.dim_out, generator=g)
        return x, y

    return [batch(args.batch_size) for _ in range(args.n_batches)], batch(4 * args.batch_size)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", default=DEFAULT_LRS, help="comma-separated learning rates")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--n-batches", type=positive_int, default=32, help="batches cycled over")
    p.add_argument("--dim-in", type=positive_int, default=16)
    p.add_argument("--width", type=positive_int, default=64)
    p.add_argument("--dim-out", type=positive_int, default=4)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logdir", default="runs/sweep_vmap")
    add_debug_flag(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[float, float]:
    """Run the sweep; returns ``{lr: held-out loss}``."""
    args = parse_args(argv)
    lrs = [float(s) for s in args.lrs.split(",")]
    torch.manual_seed(args.seed)
    apply_fn, params, buffers = functionalize(mlp(args.dim_in, args.width, args.dim_out))
    optimizer = fo.adamw(lr=lrs[0], weight_decay=0.0)
    step = make_train_step(apply_fn, mse, optimizer)
    base = init_state(params, buffers, optimizer, seed=args.seed)
    state = stack_states([base._replace(opt_state=fo.set_hyperparams(base.opt_state, lr=lr))
                          for lr in lrs])
    train_step = vmap_step(step)  # no dropout: randomness="error" guards that
    evaluate = torch.func.vmap(lambda p, b, x, y: mse(apply_fn(p, b, x)[0], y),
                               in_dims=(0, 0, None, None))
    batches, (x_val, y_val) = make_data(args)
    loggers = [Logger(logdir=Path(args.logdir) / f"lr_{lr:g}", progress=False) for lr in lrs]
    val = torch.full((len(lrs),), math.nan)
    try:
        for i in range(1, args.steps + 1):
            state, metrics = train_step(state, batches[(i - 1) % len(batches)])
            if i % args.eval_every == 0 or i == args.steps:
                with torch.no_grad():
                    val = evaluate(state.params, state.buffers, x_val, y_val)
            for m, logger in enumerate(loggers):
                member = {k: v[m] for k, v in metrics.items()}
                if i % args.eval_every == 0 or i == args.steps:
                    member["val_loss"] = val[m]
                logger.log(i, member)
    finally:
        for logger in loggers:
            logger.close()
    print(f"{'lr':>10} {'train_loss':>12} {'val_loss':>12}")
    for m, lr in enumerate(lrs):
        last = loggers[m].history[-1]
        print(f"{lr:>10.3g} {last['loss']:>12.5f} {float(val[m]):>12.5f}")
    finite = [(float(v), lr) for v, lr in zip(val, lrs) if math.isfinite(float(v))]
    if not finite:
        print("best: none (every run diverged)")
        return dict(zip(lrs, val.tolist()))
    best_val, best_lr = min(finite)
    print(f"best: lr={best_lr:g} val_loss={best_val:.5f}")
    return dict(zip(lrs, val.tolist()))


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
