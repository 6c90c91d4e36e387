"""Train a small Llama on a local text corpus with funcpar's pure training step.

    python examples/train_lm.py                          # Python's stdlib as corpus, AdamW
    python examples/train_lm.py --optim sgd --lr 0.3 --steps 500
    python examples/train_lm.py --corpus my_texts/ --corpus-glob '**/*.md' --device cuda
    tensorboard --logdir runs/

The model becomes a pure function (``functionalize``), the optimizer a pure init/update pair
(``chain(clip_by_global_norm, <optim>)`` with a warm-up + cosine learning rate), and training
is ``state, metrics = step(state, batch)`` in a loop; the :class:`~funcpar.train.logger.Logger`
writes TensorBoard scalars, an optional JSON-lines file, and a progress bar on a terminal.
The default run (byte-level tokens, a 0.5M-parameter model, 200 steps) takes about a minute
on two CPU cores.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from funcpar.data import BYTE_VOCAB_SIZE, DEFAULT_STDLIB_BYTES, text_batches
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import chain, clip_by_global_norm, matrices_only, warmup_cosine
from funcpar.optim.base import GradientTransformation
from funcpar.state import Tree, functionalize, init_state
from funcpar.train.logger import Logger
from funcpar.train.step import make_train_step


class OptimSpec(NamedTuple):
    """Where an optimizer lives, how the script calls it, and its default peak lr here."""

    module: str  # under funcpar.optim; imported only when chosen
    name: str
    kwargs: Callable[[argparse.Namespace, Tree], dict[str, Any]]  # (flags, params) -> kwargs
    default_lr: float


def _decayed(args: argparse.Namespace, params: Tree) -> dict[str, Any]:
    # Weight decay on the matrices only: decaying norms' gains and embeddings' rows towards
    # zero is the usual mistake in small-model runs.
    return {"weight_decay": args.weight_decay, "weight_decay_mask": matrices_only}


def _galore(eight_bit: bool) -> Callable[[argparse.Namespace, Tree], dict[str, Any]]:
    def kwargs(args: argparse.Namespace, params: Tree) -> dict[str, Any]:
        from funcpar.optim.galore import galore_param_groups

        # Attention and MLP matrices are projected (GaLore's own choice of targets);
        # embeddings, the head and the norms train with plain AdamW.
        mask = galore_param_groups(params, rank=args.galore_rank,
                                   update_proj_gap=args.galore_gap)
        return {"galore_mask": mask, "eight_bit": eight_bit, **_decayed(args, params)}

    return kwargs


OPTIMIZERS: dict[str, OptimSpec] = {
    "sgd": OptimSpec("sgd", "sgd", lambda a, p: {"momentum": 0.9, **_decayed(a, p)}, 0.3),
    "adamw": OptimSpec(
        "adamw", "adamw", lambda a, p: {"betas": (0.9, 0.95), **_decayed(a, p)}, 3e-3
    ),
    # An explicit lr, not Adafactor's relative step, so that --lr and the schedule mean the
    # same thing for every optimizer.
    "adafactor": OptimSpec(
        "adafactor", "adafactor",
        lambda a, p: {"relative_step": False, "scale_parameter": False, **_decayed(a, p)}, 1e-2,
    ),
    "came": OptimSpec("came", "came", _decayed, 1e-3),
    "lamb": OptimSpec("lamb", "lamb", _decayed, 1e-2),
    "galore_adamw": OptimSpec("galore", "galore_adamw", _galore(eight_bit=False), 3e-3),
    "galore_adamw8bit": OptimSpec("galore", "galore_adamw", _galore(eight_bit=True), 3e-3),
}


def build_optimizer(args: argparse.Namespace, params: Tree) -> GradientTransformation:
    """``chain(clip_by_global_norm(clip), <optim>(lr=warmup_cosine(...)))`` from the flags."""
    spec = OPTIMIZERS[args.optim]
    try:
        factory = getattr(importlib.import_module(f"funcpar.optim.{spec.module}"), spec.name)
    except (ImportError, AttributeError) as err:
        raise SystemExit(
            f"--optim {args.optim}: funcpar.optim.{spec.module}.{spec.name} is not available "
            f"in this install ({err})"
        ) from None
    peak = spec.default_lr if args.lr is None else args.lr
    # The cosine ends at a tenth of the peak, not at zero: the last steps still learn.
    lr = warmup_cosine(peak, args.warmup, args.steps, end=0.1 * peak)
    return chain(clip_by_global_norm(args.clip), factory(lr=lr, **spec.kwargs(args, params)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train_lm.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=200)
    run.add_argument("--batch-size", type=int, default=16)
    run.add_argument("--seq-len", type=int, default=128)
    run.add_argument("--seed", type=int, default=0, help="model init, data order and RNG state")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--compile", action="store_true", help="torch.compile forward+backward")
    opt = p.add_argument_group("optimizer")
    opt.add_argument("--optim", default="adamw", choices=sorted(OPTIMIZERS))
    opt.add_argument("--lr", type=float, default=None,
                     help="peak learning rate (default: the optimizer's entry in OPTIMIZERS)")
    opt.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    opt.add_argument("--galore-rank", type=int, default=32, help="GaLore projection rank")
    opt.add_argument("--galore-gap", type=int, default=50, help="steps between GaLore SVDs")
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=128)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention")
    data = p.add_argument_group("data")
    data.add_argument("--corpus", default=None,
                      help="a text file or a directory (default: Python's standard library)")
    data.add_argument("--corpus-glob", default="**/*.txt", help="files taken from a directory")
    data.add_argument("--corpus-bytes", type=int, default=DEFAULT_STDLIB_BYTES,
                      help="size of the standard-library corpus")
    data.add_argument("--data-cache", default=None,
                      help="datasets cache directory (default: datasets' own)")
    log = p.add_argument_group("logging")
    log.add_argument("--logdir", default="runs/train_lm", help="TensorBoard directory")
    log.add_argument("--metrics-jsonl", default=None, help="also write metrics as JSON lines")
    log.add_argument("--print-every", type=int, default=50,
                     help="a plain log line every N steps when stdout is not a terminal")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "dim", "layers", "heads", "print_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps ({args.steps}))")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run training; returns ``{"first_loss", "last_loss", "history", "state"}``."""
    args = parse_args(argv)
    device = torch.device(args.device)
    loader = text_batches(
        args.corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
        cache_dir=args.data_cache, pattern=args.corpus_glob, max_bytes=args.corpus_bytes,
        device=device,
    )
    cfg = LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq_len)
    model = Llama(cfg, seed=args.seed, device=device)
    apply_fn, params, buffers = functionalize(model)
    optimizer = build_optimizer(args, params)
    state = init_state(params, buffers, optimizer, seed=args.seed)
    step = make_train_step(apply_fn, lm_loss, optimizer, compile=args.compile)
    n_params = sum(p.numel() for p in params.values())
    print(f"model {n_params / 1e6:.2f}M params | corpus {loader.tokens.numel():,} tokens, "
          f"{loader.batches_per_epoch} batches/epoch | {args.optim} on {device}", flush=True)

    start = time.perf_counter()
    with Logger(args.logdir, jsonl=args.metrics_jsonl, total_steps=args.steps,
                print_every=args.print_every, device=device) as log:
        log.reset_timer()
        for i, batch in zip(range(args.steps), loader.batches()):
            state, metrics = step(state, batch)
            log.log(i + 1, metrics, tokens=loader.tokens_per_batch)
    elapsed = time.perf_counter() - start
    history = log.history
    first, last = history[0]["loss"], history[-1]["loss"]
    tail = history[-10:]
    tail_mean = sum(r["loss"] for r in tail) / len(tail)
    print(f"done: {args.steps} steps in {elapsed:.1f}s "
          f"({args.steps * loader.tokens_per_batch / elapsed:,.0f} tok/s) | "
          f"loss first {first:.4f} last {last:.4f} (mean of last {len(tail)}: {tail_mean:.4f})",
          flush=True)
    return {"first_loss": first, "last_loss": last, "history": history, "state": state}


if __name__ == "__main__":
    try:
        main()
    except FileNotFoundError as err:  # a mistyped --corpus: the message says it all
        sys.exit(f"error: {err}")
