"""Optimizer comparison: the example Llama trained once per optimizer, same data, same init.

    python examples/compare_optimizers.py                          # all optimizers, 200 steps
    python examples/compare_optimizers.py --optims adamw,adafactor,came --steps 500
    tensorboard --logdir runs/compare_optimizers                   # one curve per optimizer

The experiment: byte-level tokens of a local corpus (Python's standard library by default,
``funcpar.data``) split into a training part (the first ``1 - --val-fraction`` of the token
stream) and a held-out part (the rest). For every optimizer the same model
(:class:`funcpar.models.Llama`, the same seed, so the same initial weights) is trained for
``--steps`` steps on the same batches in the same order, with the example's recipe
(``examples/train_lm.py``: ``chain(clip_by_global_norm, <optim>)``, linear warm-up then cosine
to a tenth of the peak, weight decay on matrices only, each optimizer's default peak learning
rate from ``train_lm.OPTIMIZERS`` unless ``--lr`` overrides it for all). Each run writes its
TensorBoard scalars with :class:`funcpar.train.Logger` under ``--logdir/<optimizer>``, so
TensorBoard overlays the curves (``train/loss``, ``train/lr``, ``train/grad_norm``, and the
held-out ``train/val_loss`` every ``--eval-every`` steps). At the end a table compares them:
the mean training loss of the last 10 steps, the held-out loss, the optimizer state's size and
the wall time.

A comparison at one learning rate per optimizer is a comparison of those settings, not of the
algorithms at their best: sweep ``--lr`` per optimizer before drawing conclusions.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from funcpar.data import (
    BYTE_VOCAB_SIZE,
    DEFAULT_STDLIB_BYTES,
    PackedBatches,
    corpus_files,
    load_tokens,
    stdlib_files,
)
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import state_bytes
from funcpar.state import functionalize, init_state
from funcpar.train import Logger, make_train_step
from funcpar.train.cli import add_debug_flag, positive_int, run_cli


def _train_lm() -> ModuleType:
    """examples/train_lm.py as a module: its optimizer table and recipe are reused, so this
    experiment trains each optimizer exactly as the example does."""
    path = Path(__file__).resolve().with_name("train_lm.py")
    spec = importlib.util.spec_from_file_location("funcpar_example_train_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: Sequence[str] | None, choices: Sequence[str],
               default_warmup: Callable[[int], int]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="compare_optimizers.py",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--optims", default=",".join(choices),
                   help=f"comma-separated, from {', '.join(choices)}")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps (default: 10%% of --steps, at most 20)")
    p.add_argument("--lr", type=float, default=None,
                   help="one peak lr for every optimizer (default: each one's own)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--galore-rank", type=int, default=32)
    p.add_argument("--galore-gap", type=int, default=50)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--dim", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--corpus", default=None, help="file or directory (default: Python's stdlib)")
    p.add_argument("--corpus-glob", default="**/*.txt")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_STDLIB_BYTES)
    p.add_argument("--data-cache", default=None, help="datasets cache directory")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the tail of the token stream held out for the validation loss")
    p.add_argument("--val-batches", type=positive_int, default=4)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--logdir", default="runs/compare_optimizers")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: $OMP_NUM_THREADS if set, else 1)")
    add_debug_flag(p)
    args = p.parse_args(argv)
    args.optims = [o.strip() for o in args.optims.split(",") if o.strip()]
    bad = [o for o in args.optims if o not in choices]
    if bad or not args.optims:
        p.error(f"--optims: unknown {bad or 'empty list'}; choose from {', '.join(choices)}")
    if args.warmup is None:  # follows the run, as in train_lm.py
        args.warmup = default_warmup(args.steps)
    elif not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps ({args.steps}))")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if args.threads is not None and args.threads <= 0:
        p.error(f"--threads must be positive, got {args.threads}")
    return args


def split_corpus(args: argparse.Namespace) -> tuple[PackedBatches, PackedBatches]:
    """Training and held-out batches from one token stream, cut at ``1 - val_fraction``."""
    files = (stdlib_files(args.corpus_bytes) if args.corpus is None
             else corpus_files(args.corpus, args.corpus_glob))
    tokens = load_tokens(files, cache_dir=args.data_cache)
    cut = int(tokens.numel() * (1 - args.val_fraction))
    need = args.val_batches * args.batch_size * (args.seq_len + 1)
    if tokens.numel() - cut < need:
        raise SystemExit(f"error: the held-out part has {tokens.numel() - cut:,} tokens, fewer "
                         f"than --val-batches x --batch-size x (--seq-len + 1) = {need:,}: "
                         "raise --corpus-bytes or --val-fraction")
    train = PackedBatches(tokens[:cut], batch_size=args.batch_size, seq_len=args.seq_len,
                          seed=args.seed)
    val = PackedBatches(tokens[cut:], batch_size=args.batch_size, seq_len=args.seq_len,
                        seed=args.seed)
    return train, val


@torch.no_grad()
def held_out_loss(apply_fn: Any, state: Any, val: PackedBatches, n: int) -> float:
    """Mean loss over the first ``n`` held-out batches (the same ones for every optimizer)."""
    losses = []
    for _, (inputs, targets) in zip(range(n), val.batches()):
        logits, _ = apply_fn(state.params, state.buffers, inputs)
        losses.append(float(lm_loss(logits, targets)))
    return sum(losses) / len(losses)


def run_one(name: str, args: argparse.Namespace, lm: ModuleType, train: PackedBatches,
            val: PackedBatches) -> dict[str, Any]:
    """Train one optimizer from the shared initial weights; log to ``logdir/<name>``."""
    cfg = LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, max_seq_len=args.seq_len)
    model = Llama(cfg, seed=args.seed)  # the same weights for every optimizer
    apply_fn, params, buffers = functionalize(model)
    opt_args = argparse.Namespace(**{**vars(args), "optim": name})
    optimizer = lm.build_optimizer(opt_args, params)
    step = make_train_step(apply_fn, lm_loss, optimizer)
    state = init_state(params, buffers, optimizer, seed=args.seed)
    start = time.perf_counter()
    with Logger(os.path.join(args.logdir, name), total_steps=args.steps, progress=False) as log:
        for i, batch in zip(range(args.steps), train.batches()):
            state, metrics = step(state, batch)
            if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
                val_loss = held_out_loss(apply_fn, state, val, args.val_batches)
                # Logged with the step's metrics: TensorBoard's train/val_loss beside train/loss.
                metrics = {**metrics, "val_loss": val_loss}
            log.log(i + 1, metrics, tokens=train.tokens_per_batch)
        history = log.history
    elapsed = time.perf_counter() - start
    tail = [r["loss"] for r in history[-10:]]
    return {"optim": name, "first_loss": history[0]["loss"], "last10": sum(tail) / len(tail),
            "val_loss": val_loss, "state_mb": state_bytes(state.opt_state) / 1e6,
            "seconds": elapsed, "lr": history[0].get("lr")}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the comparison; returns one row per optimizer (the printed table's)."""
    lm = _train_lm()
    args = parse_args(argv, sorted(lm.OPTIMIZERS), lm.default_warmup)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train, val = split_corpus(args)
        print(f"corpus: {train.tokens.numel():,} training tokens, {val.tokens.numel():,} held out"
              f" | {len(args.optims)} optimizers x {args.steps} steps of {args.batch_size}x"
              f"{args.seq_len} | TensorBoard: {args.logdir}/<optimizer>", flush=True)
        rows = []
        for name in args.optims:
            rows.append(run_one(name, args, lm, train, val))
            r = rows[-1]
            print(f"  {name}: loss {r['first_loss']:.3f} -> {r['last10']:.3f}, held-out "
                  f"{r['val_loss']:.3f} ({r['seconds']:.1f} s)", flush=True)
    finally:
        torch.set_num_threads(saved)
    print(f"\n{'optimizer':<12}{'train loss (last 10)':>22}{'held-out loss':>15}"
          f"{'state MB':>10}{'seconds':>9}")
    for r in sorted(rows, key=lambda r: r["val_loss"]):
        print(f"{r['optim']:<12}{r['last10']:>22.4f}{r['val_loss']:>15.4f}"
              f"{r['state_mb']:>10.2f}{r['seconds']:>9.1f}")
    return rows


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
