"""Train a small Llama on a local text corpus with funcpar's pure training step.

    python examples/train_lm.py                          # Python's stdlib as corpus, AdamW
    python examples/train_lm.py --optim sgd --lr 0.3 --steps 500
    python examples/train_lm.py --corpus my_texts/ --corpus-glob '**/*.md' --device cuda
    torchrun --nproc_per_node 4 examples/train_lm.py --tp 2 --dp 2 --comm-report
    torchrun --nproc_per_node 2 examples/train_lm.py --pp 2 --microbatches 4 --layers 4
    torchrun --nproc_per_node 4 examples/train_lm.py --preset hybrid --tp 2 --zero 2 --plan
    torchrun --nproc_per_node 4 examples/train_lm.py --cp 2 --cp-mode ring --dp 2 --seq-len 512
    torchrun --nproc_per_node 4 examples/train_lm.py --auto --memory-per-rank 2GiB
    python examples/train_lm.py --auto --what-if --world 1024 --profile h100 --dim 8192
    tensorboard --logdir runs/

The model becomes a pure function (``functionalize``), the optimizer a pure init/update pair
(``chain(clip_by_global_norm, <optim>)`` with a warm-up + cosine learning rate), and training
is ``state, metrics = step(state, batch)`` in a loop; the :class:`~funcpar.train.logger.Logger`
writes TensorBoard scalars, an optional JSON-lines file, and a progress bar on a terminal.
The default run (byte-level tokens, a 0.5M-parameter model, 200 steps) takes under a minute
on two CPU cores.

Under ``torchrun`` the same script trains on a ``dp x tp`` device mesh (gloo on CPU, NCCL on
CUDA): ``shard_params`` splits heads, MLP and vocabulary over ``tp`` and ``data_parallel``
splits every global batch over ``dp``, composed as transforms of the same step and state. Each
rank reads the same global batches (the transform takes its slice), every rank computes the
same loss, and only rank 0 prints and writes logs. The losses are those of the one-process run
up to rounding. ``--comm-report`` prints the collectives rank 0 issued, step by step.

``--pp P`` adds a pipeline axis (mesh ``pp x dp x tp``): ``pipeline_split``, applied first,
cuts the blocks into ``P x --virtual-stages`` stages (balanced by parameter count) and runs
``--schedule`` (gpipe, 1f1b or interleaved) over ``--microbatches`` micro-batches of each
rank's batch; tensor and data parallelism then apply within each stage; ``--save-every`` and
``--resume`` work as without it (the checkpoint holds each leaf once under its global name, so
a pipelined run resumes in one process or another layout, and back). ``--remat K``
recomputes every K-th block's activations in the backward instead of keeping them.

``--cp N`` cuts every sequence over a ``cp`` axis of ``N`` ranks (``context_parallel``,
docs/CONTEXT_PARALLEL.md; mesh ``pp x dp x cp x tp``): ``--cp-mode ring`` passes the keys and
values around a ring, ``ulysses`` exchanges heads for positions with all_to_alls. The loss,
token count and tokens/s reported are the global batch's, as in one process. It composes with
``--pp`` (each stage's attention over ``cp``) and with dropless ``--experts``
(``--capacity-factor 0``; ``--ep`` too).

``--experts E`` gives every ``--moe-every``-th block a Mixture-of-Experts feed-forward
(docs/MOE.md); ``--ep P`` spreads the experts over an ``ep`` axis (``expert_parallel``) and
``--tp`` splits every expert's ffn as well as attention (mesh ``ep x dp x tp``); ``--pp`` cuts
an MoE model into stages like a dense one, every stage's router losses reaching the loss
(mesh ``pp x ep x dp x tp``).

``--eval-every N`` evaluates held-out batches (the tail of the corpus, never trained on) with
:func:`funcpar.train.make_eval_step` of the composed step, so under every layout;
``--keep-best`` checkpoints the best; ``--sample-every N`` prints a KV-cache sample
(:mod:`funcpar.models.generate`; ``examples/generate.py`` samples from a checkpoint).
``--grad-accum K``: K micro-batches of ``--batch-size`` per step, reduced once
(:func:`~funcpar.transforms.accumulate_grads`).

``--preset {hybrid,zero,ddp,gemini,moe}`` composes through :mod:`funcpar.presets` (Colossal-AI's
plugin names: ``hybrid_parallel``, ``low_level_zero``, ``ddp``, ``gemini``, ``moe_hybrid``:
``MoeHybridParallelPlugin``, with ``--experts`` and ``--ep``) instead of listing
the transforms here; the result is the same step (docs/PRESETS.md). ``--plan`` prints the
preset's plan: mesh, layouts, expected communication per step, memory per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from funcpar.auto.cli import add_auto_flags, resolve_auto
from funcpar.auto.search import preset_for
from funcpar.data import BYTE_VOCAB_SIZE, DEFAULT_STDLIB_BYTES, rank0_first, text_batches
from funcpar.models import Llama, LlamaConfig, lm_loss, moe_lm_loss
from funcpar.models.generate import generate, logits_gatherer
from funcpar.optim import chain, clip_by_global_norm, matrices_only, set_hyperparams, warmup_cosine
from funcpar.optim.base import GradientTransformation
from funcpar.presets import Preset, ddp, gemini, hybrid_parallel, low_level_zero, moe_hybrid
from funcpar.shard.agree import check_ranks_agree
from funcpar.shard.comm import comm_log, comm_report
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules_for
from funcpar.state import (
    Tree,
    check_one_run,
    claim_checkpoint_dir,
    functionalize,
    generator_state,
    init_state,
    latest_checkpoint,
    load,
    new_run_id,
    read_index,
)
from funcpar.state import save as save_checkpoint
from funcpar.state.tree import leaves_device, tree_flatten
from funcpar.train.cli import add_debug_flag, run_cli
from funcpar.train.eval import evaluate, make_eval_step
from funcpar.train.logger import Logger
from funcpar.train.outputs import check_writable
from funcpar.train.resume_args import ArgChange, compare_run_args
from funcpar.train.step import make_train_step
from funcpar.transforms import (
    accumulate_grads,
    amp_cast,
    compose,
    context_parallel,
    data_parallel,
    expert_parallel,
    pipeline_split,
    remat,
    shard_params,
    skip_nonfinite,
    zero_partition,
)
from funcpar.transforms.tp_modes import mode_axes

DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
    "galore": OptimSpec("galore", "galore_adamw", _galore(eight_bit=False), 3e-3),
    "galore8bit": OptimSpec("galore", "galore_adamw", _galore(eight_bit=True), 3e-3),
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


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """The model the flags describe (examples/generate.py rebuilds it from a checkpoint's)."""
    return LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, dim=args.dim, n_layers=args.layers,
                       n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq_len,
                       n_experts=args.experts, top_k=args.top_k, moe_every=args.moe_every,
                       capacity_factor=args.capacity_factor or None)


def default_warmup(steps: int) -> int:
    """10% of the run, at most 20 steps: a 5-step smoke run warms up for 0 steps."""
    return min(20, steps // 10)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train_lm.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=200)
    run.add_argument("--batch-size", type=int, default=16,
                     help="sequences per micro-batch (global over dp); a step takes "
                          "--grad-accum of them")
    run.add_argument("--grad-accum", type=int, default=1, metavar="K",
                     help="gradient accumulation: K micro-batches of --batch-size per optimizer "
                          "step, gradients summed inside the step and reduced once over dp "
                          "(accumulate_grads); the same step as --batch-size x K")
    run.add_argument("--seq-len", type=int, default=128)
    run.add_argument("--seed", type=int, default=0, help="model init, data order and RNG state")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--compile", action="store_true", help="torch.compile forward+backward")
    run.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: $OMP_NUM_THREADS if set, else 1)")
    run.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                     help="parameter and compute dtype (float64 for exactness checks)")
    run.add_argument("--save", default=None,
                     help="write the trained (whole, unsharded) parameters here with torch.save; "
                          "they load with Llama(...).load_state_dict")
    run.add_argument("--save-every", type=int, default=0, metavar="N",
                     help="write a sharded checkpoint of the whole state every N steps (and at "
                          "the end) under --ckpt-dir, as step_XXXXXXXX (funcpar.state.save)")
    run.add_argument("--ckpt-dir", default="checkpoints/train_lm",
                     help="where --save-every writes checkpoints")
    run.add_argument("--resume", default=None, metavar="DIR",
                     help="continue from a checkpoint directory (or the newest complete one "
                          "under DIR), under this run's layout: params, optimizer state, step, "
                          "RNG and data position; --steps counts from the start of the run. "
                          "The saved arguments are compared: model flags must match, changed "
                          "hyperparameters apply (and are reported), data-order flags (--seed, "
                          "--batch-size, --corpus...) must match unless --allow-data-change")
    run.add_argument("--allow-other-run", action="store_true",
                     help="write into a --ckpt-dir whose checkpoints belong to another run "
                          "(replacing them), or --resume from a directory that holds "
                          "checkpoints of several runs; refused without it")
    run.add_argument("--allow-data-change", action="store_true",
                     help="with --resume: continue although --seed, --batch-size, --seq-len or "
                          "the corpus flags differ from the checkpoint's (a new data order)")
    par = p.add_argument_group("parallelism (launch with torchrun; pp x dp x cp x tp = "
                               "processes)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline stages (ranks) along the pp axis; pipeline_split first")
    par.add_argument("--microbatches", type=int, default=None,
                     help="micro-batches per step under --pp (default: 2 x pp)")
    par.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"),
                     help="pipeline schedule under --pp")
    par.add_argument("--virtual-stages", type=int, default=None,
                     help="stages per rank for --schedule interleaved (default 2)")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel size: heads, MLP width and vocabulary split")
    par.add_argument("--tp-mode", default="1d", choices=("1d", "2d", "2.5d", "3d"),
                     help="tensor-parallel mode: 1d Megatron over a 'tp' axis; 2d SUMMA on a "
                          "q x q grid, --tp N = q * q ranks (axes tp_row x tp_col); 2.5d "
                          "--tp-depth d copies of it, --tp N = d * q * q (axes tp_dep x "
                          "tp_row x tp_col); 3d a q x q x q cube, --tp N = q ** 3 (axes "
                          "tp_in x tp_w x tp_out); docs/TENSOR_PARALLEL.md")
    par.add_argument("--tp-depth", type=int, default=1,
                     help="--tp-mode 2.5d: the depth d (the batch is cut over it too)")
    par.add_argument("--dp", type=int, default=None,
                     help="data-parallel size: global batch split (default: processes / tp)")
    par.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                     help="ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters")
    par.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                     action="store_false",
                     help="with --zero 3: the backward uses the forward's gathered parameters "
                          "(FSDP2's reshard_after_forward=False: ZeRO-2's traffic, no gather "
                          "after the optimizer; every block whole from forward to backward)")
    par.add_argument("--cp", type=int, default=1,
                     help="context-parallel ranks: every sequence cut over them")
    par.add_argument("--cp-mode", default="ring", choices=("ring", "ulysses"),
                     help="context-parallel attention: ring (kv passed around) or ulysses "
                          "(all_to_all of heads)")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="with --tp: split the activations between tp regions on the sequence")
    par.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                     help="compute precision (amp_cast): float32 master params and optimizer; "
                          "fp16 with dynamic loss scaling and skipped steps on inf/nan")
    par.add_argument("--nonfinite", default="skip", choices=("skip", "stop", "off"),
                     help="a step whose gradients hold inf/nan (skip_nonfinite): skip it and "
                          "count it (default), skip it and stop the run after --max-nonfinite "
                          "such steps in a row, or apply it (off: one nan ruins every weight)")
    par.add_argument("--max-nonfinite", type=int, default=3, metavar="K",
                     help="with --nonfinite stop: the K-th non-finite step in a row stops the run")
    par.add_argument("--give-up-after", type=int, default=100, metavar="K",
                     help="with --nonfinite skip: the K-th non-finite step in a row ends the run "
                          "with exit 2 (it is not training); 0: never")
    par.add_argument("--remat", type=int, default=0, metavar="K",
                     help="activation checkpointing of every K-th transformer block (1: all "
                          "blocks; 0: off): less activation memory for one more forward")
    par.add_argument("--preset", default=None,
                     choices=("hybrid", "zero", "ddp", "gemini", "moe"),
                     help="compose with funcpar.presets instead: hybrid = hybrid_parallel(tp_size"
                          "=--tp, pp_size=--pp, zero_stage=--zero), zero = low_level_zero(stage="
                          "--zero or 1), ddp = ddp(), gemini = gemini(offload='cpu', tp_size="
                          "--tp), moe = moe_hybrid(ep_size=--ep, tp_size=--tp, pp_size=--pp, "
                          "zero_stage=--zero; needs --experts); --precision and "
                          "--sequence-parallel apply")
    par.add_argument("--plan", action="store_true",
                     help="with --preset: print its plan (layouts, expected communication per "
                          "step, memory per rank) on rank 0")
    par.add_argument("--comm-report", type=int, nargs="?", const=1, default=0, metavar="N",
                     help="print the collectives of the first N steps (default 1), per step")
    opt = p.add_argument_group("optimizer")
    opt.add_argument("--optim", default="adamw", choices=sorted(OPTIMIZERS))
    opt.add_argument("--lr", type=float, default=None,
                     help="peak learning rate (default: the optimizer's entry in OPTIMIZERS)")
    opt.add_argument("--warmup", type=int, default=None,
                     help="linear warm-up steps (default: 10%% of --steps, at most 20)")
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    opt.add_argument("--galore-rank", type=int, default=32, help="GaLore projection rank")
    opt.add_argument("--galore-gap", type=int, default=50, help="steps between GaLore SVDs")
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=128)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention")
    model.add_argument("--experts", type=int, default=0,
                       help="MoE feed-forward with this many experts (docs/MOE.md); 0: dense")
    model.add_argument("--top-k", type=int, default=2, help="experts per token (MoE)")
    model.add_argument("--moe-every", type=int, default=1, help="every k-th block is MoE")
    model.add_argument("--capacity-factor", type=float, default=1.25,
                       help="MoE expert capacity factor; 0: dropless")
    par.add_argument("--ep", type=int, default=1,
                     help="expert-parallel size: experts split over ep ranks (needs --experts)")
    data = p.add_argument_group("data")
    data.add_argument("--corpus", default=None,
                      help="a text file or a directory (default: Python's standard library)")
    data.add_argument("--corpus-glob", default="**/*.txt", help="files taken from a directory")
    data.add_argument("--corpus-bytes", type=int, default=DEFAULT_STDLIB_BYTES,
                      help="size of the standard-library corpus")
    data.add_argument("--data-cache", default=None,
                      help="datasets cache directory (default: datasets' own)")
    data.add_argument("--binary-files", default="skip", choices=("skip", "error"),
                      help="a corpus file that is not UTF-8 text (binary: NUL bytes, or bytes "
                           "that do not decode): skip it, with a warning naming it (a source "
                           "tree routinely holds a stray binary; skipping it loses nothing "
                           "meant as text), or stop with an error naming it")
    log = p.add_argument_group("logging")
    log.add_argument("--logdir", default="runs/train_lm", help="TensorBoard directory")
    log.add_argument("--metrics-jsonl", default=None, help="also write metrics as JSON lines")
    log.add_argument("--print-every", type=int, default=50,
                     help="a plain log line every N steps when stdout is not a terminal")
    add_debug_flag(log)
    ev = p.add_argument_group("evaluation and samples")
    ev.add_argument("--eval-every", type=int, default=0, metavar="N",
                    help="evaluate on held-out batches every N steps (and at the end): eval/loss "
                         "and eval/ppl in TensorBoard, eval_loss and eval_ppl in the JSONL file "
                         "and the progress line; 0: off (nothing held out)")
    ev.add_argument("--eval-batches", type=int, default=4, metavar="K",
                    help="held-out batches per evaluation (the same K each time)")
    ev.add_argument("--eval-fraction", type=float, default=0.05,
                    help="with --eval-every: the tail of the token stream held out of training "
                         "(no position in both; 0 is recorded when --eval-every is 0)")
    ev.add_argument("--keep-best", action="store_true",
                    help="with --eval-every: write a checkpoint of the state with the lowest "
                         "eval loss so far to --ckpt-dir/best (resumable, and "
                         "examples/generate.py --ckpt loads it)")
    ev.add_argument("--sample-every", type=int, default=0, metavar="N",
                    help="print a short sample every N steps (and at the end): "
                         "--sample-tokens bytes after --sample-prompt, drawn with a KV cache "
                         "(funcpar.models.generate) at --temperature, top-k 40; 0: off")
    ev.add_argument("--sample-prompt", default="def ", help="the prompt of --sample-every")
    ev.add_argument("--sample-tokens", type=int, default=64, help="bytes per sample")
    ev.add_argument("--temperature", type=float, default=0.8,
                    help="sampling temperature of --sample-every (0: greedy)")
    add_auto_flags(p)
    args = p.parse_args(argv)
    # Every count flag (--seed is not a count): a negative one is a typo, never silently used.
    for name in ("steps", "batch_size", "seq_len", "dim", "layers", "heads", "print_every", "tp",
                 "pp", "ep", "top_k", "moe_every", "galore_rank", "galore_gap", "corpus_bytes",
                 "max_nonfinite", "grad_accum", "eval_batches", "sample_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("threads", "dp", "kv_heads", "microbatches", "virtual_stages"):  # None: derived
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("save_every", "experts", "remat", "comm_report", "give_up_after",
                 "eval_every", "sample_every"):  # 0: off
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (0: off), got "
                    f"{getattr(args, name)}")
    if args.sample_every:
        if args.pp > 1:
            p.error("--sample-every does not work with --pp > 1: a pipeline rank holds its "
                    "stages only (sample from a checkpoint with examples/generate.py)")
        if args.sequence_parallel:
            p.error("--sample-every does not work with --sequence-parallel (its attention "
                    "regions are swapped for the split sequence)")
        need = len(args.sample_prompt.encode()) + args.sample_tokens
        if not args.sample_prompt or need > args.seq_len:
            p.error(f"--sample-prompt ({len(args.sample_prompt.encode())} bytes, not empty) "
                    f"plus --sample-tokens {args.sample_tokens} must fit --seq-len "
                    f"{args.seq_len}, the longest sequence the model was built for")
        if args.experts and args.capacity_factor:
            p.error("--sample-every with --experts needs a dropless model (--capacity-factor "
                    "0): a capacity routes per sequence, which token-by-token decoding changes")
    if args.keep_best and not args.eval_every:
        p.error("--keep-best keeps the checkpoint with the best eval loss: it needs --eval-every")
    if args.eval_every:
        if not 0 < args.eval_fraction < 1:
            p.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    else:
        args.eval_fraction = 0.0  # nothing held out: the training stream is the whole corpus
    if args.warmup is None:
        args.warmup = default_warmup(args.steps)
    elif not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps ({args.steps}))")
    # Tensor parallelism splits attention by whole heads (query and key/value alike).
    kv = args.heads if args.kv_heads is None else args.kv_heads
    head_split = args.tp
    if args.tp_mode != "1d":
        head_split = _check_tp_mode(p, args)
    elif args.tp_depth != 1:
        p.error("--tp-depth is for --tp-mode 2.5d")
    for flag, heads in (("--heads", args.heads), ("--kv-heads", kv)):
        if heads % head_split:
            p.error(f"--tp {args.tp} does not divide the number of heads {flag} {heads}: "
                    "tensor parallelism gives every rank whole heads")
    if args.sequence_parallel and args.tp == 1:
        p.error("--sequence-parallel splits activations over tp: it needs --tp > 1")
    if args.cp < 1:
        p.error(f"--cp must be positive, got {args.cp}")
    if args.cp > 1:
        if args.sample_every:
            p.error("--sample-every with --cp: decoding cannot run context-parallel; sample "
                    "from a checkpoint with examples/generate.py --ckpt")
        if args.seq_len % (2 * args.cp) and args.experts:
            p.error(f"--cp {args.cp} cuts each sequence into 2 x {args.cp} equal chunks: with "
                    f"--experts (no padding) --seq-len {args.seq_len} must be a multiple of "
                    f"{2 * args.cp}")
        if args.compile and args.cp_mode == "ring":
            p.error("--cp --cp-mode ring does not work with --compile: the ring's sends have "
                    "no functional collective (use --cp-mode ulysses; docs/CONTEXT_PARALLEL.md)")
        if args.experts and args.capacity_factor:
            p.error("--cp with --experts needs dropless routing (--capacity-factor 0): the "
                    "capacity is per sequence, and each cp rank holds part of every sequence")
        if args.preset not in (None, "hybrid"):
            p.error(f"--preset {args.preset} has no context parallelism: use --preset hybrid "
                    "(sp_size) or compose by hand (drop --preset)")
    if args.plan and args.preset is None:
        p.error("--plan prints a preset's plan: it needs --preset")
    if args.preset is not None and args.remat:
        p.error("--remat is not part of the presets: compose it by hand (drop --preset)")
    if args.preset in ("zero", "ddp", "gemini") and args.pp > 1:
        p.error(f"--preset {args.preset} has no pipeline: use --preset hybrid with --pp")
    if args.preset in ("zero", "ddp") and (args.tp > 1 or args.sequence_parallel):
        p.error(f"--preset {args.preset} is data parallel only: drop --tp/--sequence-parallel "
                "or use --preset hybrid")
    if args.preset == "zero" and args.zero == 3:
        p.error("--preset zero is LowLevelZeroPlugin (stages 1-2): use --preset gemini or "
                "--preset hybrid --zero 3")
    if not args.reshard_after_forward and (args.zero != 3 or args.preset is not None):
        p.error("--no-reshard-after-forward is a ZeRO-3 option of the composed layout: pass "
                "--zero 3 (without --preset)")
    if args.preset == "ddp" and args.zero:
        p.error("--preset ddp has no ZeRO: use --preset zero")
    if args.preset == "gemini" and args.zero not in (0, 3):
        p.error("--preset gemini is ZeRO-3: drop --zero or pass --zero 3")
    if args.ep > 1 and (args.experts == 0 or args.experts % args.ep):
        p.error(f"--ep {args.ep} needs --experts divisible by it, got --experts {args.experts}")
    if args.experts and args.preset not in (None, "moe"):
        p.error(f"--preset {args.preset} has no expert parallelism: with --experts use "
                "--preset moe (moe_hybrid) or compose by hand (drop --preset)")
    if args.preset == "moe" and (not args.experts or args.ep < 2):
        p.error("--preset moe is moe_hybrid: it needs --experts and --ep >= 2")
    if args.experts and args.sequence_parallel:
        p.error("--sequence-parallel does not work with --experts: an MoE block routes each "
                "whole sequence (docs/MOE.md)")
    if args.dp is not None and args.batch_size % args.dp:
        p.error(f"--batch-size {args.batch_size} is not divisible by --dp {args.dp}: "
                "data parallelism gives every rank an equal slice of each batch")
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule == "interleaved" else 1
    if args.microbatches is None:
        args.microbatches = 2 * args.pp
    if args.virtual_stages > 1 and args.schedule != "interleaved":
        p.error(f"--virtual-stages {args.virtual_stages} needs --schedule interleaved")
    if args.pp > 1:
        stages = args.pp * args.virtual_stages
        if stages > args.layers:
            p.error(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} = {stages} "
                    f"stages but --layers {args.layers}: every stage needs a block")
        local = args.batch_size // ((args.dp or 1) * args.ep)
        split = "--batch-size / --dp" if args.ep == 1 else "--batch-size / (--dp x --ep)"
        if local % args.microbatches:
            p.error(f"each rank's batch ({local} = {split}) does not split into "
                    f"--microbatches {args.microbatches} equal micro-batches")
        # --save writes rank 0's whole params, and under --pp rank 0 holds only its stages';
        # --save-every/--resume work (each stage's ranks write their leaves, once each, under
        # their global names; a checkpoint loads into any layout).
        for flag, on in (("--sequence-parallel", args.sequence_parallel),
                         ("--compile", args.compile), ("--save", args.save is not None)):
            if on:
                p.error(f"{flag} does not work with --pp > 1 yet")
        rows = local // (args.microbatches * args.grad_accum)
        if args.tp_mode == "2d" and rows < head_split:  # (--pp is refused for 2.5d and 3d)
            p.error(f"--tp-mode 2d cuts each pipeline micro-batch's rows over the grid's "
                    f"{head_split} rows, but a micro-batch has {rows} ({split} / "
                    f"(--microbatches x --grad-accum)): raise --batch-size")
    return args


def _check_tp_mode(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--tp-mode 2d | 2.5d | 3d``: ``--tp`` fits the mode's grid (``q * q``, ``depth * q *
    q``, ``q ** 3``); what it does not compose with yet is refused. 2D composes with --pp, --dp,
    --zero 1-3, --remat, --precision, --compile, --save-every/--resume, --eval-every and
    --preset hybrid (tests/test_tp_2d_compose.py); 2.5D and 3D with --dp, --zero 1-2 and
    --save-every/--resume (tests/test_tp_modes_nd.py), the rest refused until tested.
    --sample-every decodes one row at a time, fewer than the grid's rows. Returns ``q`` (heads
    are split over one grid axis)."""
    try:
        q = list(mode_axes(args.tp_mode, args.tp, args.tp_depth).values())[-1]  # a grid side
    except ValueError as err:
        p.error(f"--tp {args.tp} --tp-mode {args.tp_mode} --tp-depth {args.tp_depth}: {err}")
    tested = args.tp_mode == "2d"  # the compositions tests/test_tp_2d_compose.py covers
    for flag, on in (("--sequence-parallel", args.sequence_parallel),
                     ("--experts", args.experts > 0), ("--cp", args.cp > 1),
                     ("--auto", (args.auto or args.what_if) and not tested),
                     (f"--preset {args.preset}", args.preset not in (None, "hybrid")),
                     ("--preset hybrid", args.preset == "hybrid" and not tested),
                     ("--pp", args.pp > 1 and not tested),
                     ("--eval-every", args.eval_every > 0 and not tested),
                     (f"--precision {args.precision}", args.precision != "fp32" and not tested),
                     ("--remat", args.remat > 0 and not tested),
                     ("--compile", args.compile and not tested),
                     ("--zero 3", args.zero == 3 and not tested),
                     ("--sample-every", args.sample_every > 0)):
        if on:
            p.error(f"{flag} does not work with --tp-mode {args.tp_mode} yet")
    return q


def build_mesh(args: argparse.Namespace) -> DeviceMesh:
    """The ``dp x tp`` mesh of the torchrun world (a local mesh for one process).

    A size that does not fit the number of processes is reported as a usage error (SystemExit
    with DeviceMesh's message: the sizes and the world size) before anything is computed.
    """
    backend = "gloo" if torch.device(args.device).type == "cpu" else None
    axes = {"pp": args.pp} if args.pp > 1 else {}
    if args.ep > 1:  # the batch is split over ep x dp; experts over ep
        axes["ep"] = args.ep
    axes["dp"] = -1 if args.dp is None else args.dp
    if args.cp > 1:
        axes["cp"] = args.cp
    try:
        if args.tp_mode != "1d":  # the mode's grid; the 1D 'tp' axis is kept, of size 1
            axes.update(tp=1, **mode_axes(args.tp_mode, args.tp, args.tp_depth))
        else:
            axes["tp"] = args.tp
        mesh = DeviceMesh.from_env(**axes, backend=backend)
    except ValueError as err:
        world = os.environ.get("WORLD_SIZE", "1")
        raise SystemExit(
            f"error: --tp {args.tp} --dp {args.dp if args.dp is not None else 'auto'} on "
            f"{world} process(es): {err}. Launch tp x dp processes, e.g. "
            f"torchrun --nproc_per_node {args.pp * args.tp * args.cp * (args.dp or 1)} "
            "examples/train_lm.py ..."
        ) from None
    if args.ep > 1 and args.batch_size % (args.ep * mesh.size("dp")):
        raise SystemExit(f"error: --batch-size {args.batch_size} is not divisible by --ep "
                         f"{args.ep} x dp {mesh.size('dp')}")
    if args.batch_size % mesh.size("dp"):
        raise SystemExit(f"error: --batch-size {args.batch_size} is not divisible by the "
                         f"data-parallel size {mesh.size('dp')}")
    return mesh


def manual_transforms(args: argparse.Namespace, mesh: DeviceMesh, cfg: LlamaConfig) -> list:
    """The transforms the flags ask for, in the documented order."""
    transforms = []
    if args.pp > 1:  # first: the transforms below then apply within each stage
        # Gradient accumulation under a pipeline: K times as many pipeline micro-batches.
        transforms.append(pipeline_split(mesh,
                                         microbatches=args.microbatches * args.grad_accum,
                                         schedule=args.schedule,
                                         virtual_stages=args.virtual_stages))
    elif args.grad_accum > 1:
        transforms.append(accumulate_grads(args.grad_accum))
    if args.tp_mode != "1d":
        transforms.append(shard_params(llama_rules_for(cfg), mesh, mode=args.tp_mode))
    if mesh.size("tp") > 1:
        # MoE blocks: every expert's ffn split over tp (style "experts"), router replicated.
        transforms.append(shard_params(llama_rules_for(cfg), mesh,
                                       sequence_parallel=args.sequence_parallel))
    if args.cp > 1:  # after shard_params, whose vocab-parallel loss it weights
        transforms.append(context_parallel(mesh, mode=args.cp_mode))
    # After shard_params (it cuts the tp expert shards over ep) and before ZeRO (which
    # partitions the expert shards over dp).
    if "ep" in mesh.axis_names:
        transforms.append(expert_parallel(mesh))
    if mesh.size("dp") > 1:
        transforms.append(data_parallel(mesh))
    if args.zero:
        transforms.append(zero_partition(args.zero, mesh,
                                         reshard_after_forward=args.reshard_after_forward))
    if args.remat:  # whole blocks: no transform swaps their forwards, so any place works
        transforms.append(remat(every=args.remat))
    if args.precision != "fp32":  # last: ZeRO-3's parameter gathers then travel in half
        transforms.append(amp_cast(args.precision, mesh=mesh))
    return transforms


def nonfinite_guard(args: argparse.Namespace, mesh: DeviceMesh) -> list:
    """``--nonfinite``: the guard goes after every other transform (it wraps fp16's scaler)."""
    if args.nonfinite == "off":
        return []
    policy = "raise" if args.nonfinite == "stop" else "skip"
    return [skip_nonfinite(policy, max_consecutive=args.max_nonfinite,
                           give_up_after=args.give_up_after or None,
                           mesh=mesh if mesh.world_size > 1 else None)]


def build_preset(args: argparse.Namespace, mesh: DeviceMesh) -> Preset:
    """``--preset``: the Colossal-AI-named preset over this run's mesh, as a transform (the
    optimizer already clips, so no max_norm)."""
    common = {"precision": args.precision, "mesh": mesh, "plan": args.plan,
              "batch_shape": (args.batch_size * args.grad_accum, args.seq_len),
              "grad_accum": args.grad_accum}
    if args.preset == "auto":  # --auto: the searched layout's preset (+ remat when chosen)
        return preset_for(args.auto_choice, mesh=mesh, plan=args.plan,
                          batch_shape=common["batch_shape"], grad_accum=args.grad_accum)
    if args.preset == "hybrid":
        return hybrid_parallel(tp_size=mesh.size("tp") if args.tp_mode == "1d" else args.tp,
                               tp_mode=args.tp_mode, tp_depth=args.tp_depth, pp_size=args.pp,
                               zero_stage=args.zero,
                               microbatches=args.microbatches if args.pp > 1 else None,
                               pp_style=args.schedule, num_model_chunks=args.virtual_stages,
                               sequence_parallel=args.sequence_parallel,
                               sp_size=args.cp, sequence_parallelism_mode=(
                                   None if args.cp == 1 else
                                   {"ring": "ring_attn", "ulysses": "all_to_all"}[args.cp_mode]),
                               **common)
    if args.preset == "moe":
        return moe_hybrid(ep_size=args.ep, tp_size=mesh.size("tp"), pp_size=args.pp,
                          zero_stage=args.zero,
                          microbatches=args.microbatches if args.pp > 1 else None,
                          pp_style=args.schedule, num_model_chunks=args.virtual_stages,
                          **common)
    if args.preset == "zero":
        return low_level_zero(stage=args.zero or 1, **common)
    if args.preset == "ddp":
        return ddp(**common)
    return gemini(offload="cpu", tp_size=mesh.size("tp"), **common)


def load_batches(args: argparse.Namespace, device: torch.device):
    """The global batches, the same on every rank. Rank 0 tokenizes first and the others then
    read ``datasets``' cache, rather than all ranks tokenizing the same files at once."""
    def load():
        return text_batches(
            args.corpus, batch_size=args.batch_size * args.grad_accum, seq_len=args.seq_len,
            seed=args.seed,
            cache_dir=args.data_cache, pattern=args.corpus_glob, max_bytes=args.corpus_bytes,
            device=device, on_binary=args.binary_files, held_out=args.eval_fraction,
        )

    return rank0_first(load)


def sample_text(args: argparse.Namespace, step: Any, state: Any,
                gather_logits: Callable | None, *, seed: int) -> str:
    """``--sample-tokens`` bytes after ``--sample-prompt`` from the state (a collective under
    tp or ZeRO-3: every rank draws the same bytes from the same seed), decoded as UTF-8."""
    device = leaves_device(tree_flatten(state.params)[0])
    prompt = torch.tensor([list(args.sample_prompt.encode())], device=device)
    tokens, _ = generate(step.apply_fn, state.params, state.buffers, prompt, args.sample_tokens,
                         temperature=args.temperature, top_k=40,
                         rng=generator_state(device, seed), gather_logits=gather_logits)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def held_out_batches(args: argparse.Namespace, loader: Any) -> list:
    """The ``--eval-batches`` held-out batches (the first of the held-out stream's order, the
    same at every evaluation), shaped like a training step's batch so that every layout that
    takes one takes them."""
    held = loader.held_out
    if held is None or held.batches_per_epoch < args.eval_batches:
        have = 0 if held is None else held.batches_per_epoch
        raise SystemExit(f"error: --eval-fraction {args.eval_fraction} holds out "
                         f"{0 if held is None else held.tokens.numel():,} tokens: {have} "
                         f"batch(es) of {loader.batch_size} x {args.seq_len}, fewer than "
                         f"--eval-batches {args.eval_batches}; raise --eval-fraction or lower "
                         "--eval-batches")
    return [held.batch(i) for i in range(args.eval_batches)]


# How resume treats each saved argument (funcpar.train.resume_args); the others (layout,
# logging, paths) may change: a checkpoint loads into any layout.
MODEL_ARGS = ("dim", "layers", "heads", "kv_heads", "experts", "top_k", "moe_every",
              "capacity_factor", "dtype", "optim", "galore_rank")
HYPER_ARGS = ("lr", "warmup", "steps", "weight_decay", "clip", "galore_gap")
DATA_ARGS = ("seed", "batch_size", "grad_accum", "seq_len", "corpus", "corpus_glob",
             "corpus_bytes", "eval_fraction")


def apply_changes(changes: list[ArgChange], args: argparse.Namespace, state: Any,
                  say: Callable[..., None]) -> Any:
    """Report each hyperparameter that differs from the checkpoint's, and apply it: the
    learning-rate schedule and the clip are rebuilt from the flags; the weight decay lives in
    the optimizer state (inject_hyperparams), so it is set there."""
    for change in changes:
        say(f"resume: {change}; the new value applies from here", flush=True)
        if change.name == "weight_decay":
            state = state._replace(opt_state=set_hyperparams(state.opt_state,
                                                             weight_decay=args.weight_decay))
    return state


@contextlib.contextmanager
def _released(lock: Any):
    """Hold ``lock`` (None: nothing) until the block ends, however it ends."""
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run training; returns ``{"first_loss", "last_loss", "history", "state", "params"}``.

    ``state`` is this rank's (sharded under ``--tp``); ``params`` are the whole parameters,
    gathered from the shards (every rank takes part in the gather and gets them).
    """
    args = parse_args(argv)
    if args.auto or args.what_if:  # the layout from funcpar.auto's cost model, printed with why
        if resolve_auto(args, model_config(args)) is None:  # --what-if: nothing to start
            return {"first_loss": None, "last_loss": None, "history": [], "state": None,
                    "params": None}
    # One CPU thread unless asked: the default model's matmuls are too small for intra-op
    # threads to pay, and OpenMP threads that spin-wait collapse when the cores are shared
    # (measured on a busy 2-core machine: 60 steps in 8 s with one thread, 57-85 s with two).
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(saved_threads)  # main() is also called in-process (tests)


def _train(args: argparse.Namespace) -> dict[str, Any]:
    mesh = build_mesh(args)
    # Ranks launched with other flags would hang (other --steps) or diverge (other --seed).
    check_ranks_agree(mesh, vars(args))
    rank0 = mesh.rank() == 0
    say = print if rank0 else (lambda *a, **k: None)
    # Outputs first: a path found unwritable only after training would throw the training away.
    check_writable([("--save", args.save, False), ("--logdir", args.logdir, True),
                    ("--metrics-jsonl", args.metrics_jsonl, False)])
    # Under torchrun each rank's device comes from the mesh (cuda:LOCAL_RANK with NCCL).
    device = torch.device(args.device) if mesh.world_size == 1 else mesh.device
    loader = load_batches(args, device)
    cfg = model_config(args)
    # Every rank builds the same whole model from the seed; shard_params then keeps its slices.
    model = Llama(cfg, seed=args.seed, device=device, dtype=DTYPES[args.dtype])
    apply_fn, params, buffers = functionalize(model, release=True)  # the trees own the memory
    check_ranks_agree(mesh, {}, params)  # the same flags build the same model on every rank
    optimizer = build_optimizer(args, params)
    state = init_state(params, buffers, optimizer, seed=args.seed)
    n_params = sum(p.numel() for p in params.values())
    del params, buffers  # the state holds them; the transforms below replace them (shards)
    loss_fn = moe_lm_loss if args.experts else lm_loss
    # Donated: each step writes the next state into this one's storage (the loop keeps only the
    # returned state), so params and optimizer state are held once, as torch.optim holds them.
    step = make_train_step(apply_fn, loss_fn, optimizer, compile=args.compile, donate=True)
    if args.preset is not None:
        step, state = build_preset(args, mesh)(step, state)
    else:
        step, state = compose(*manual_transforms(args, mesh, cfg))(step, state)
    step, state = compose(*nonfinite_guard(args, mesh))(step, state)
    # Evaluation runs the parts the transforms rewrote (sharded, gathered, pipelined).
    eval_step = make_eval_step(step) if args.eval_every else None
    eval_data = held_out_batches(args, loader) if args.eval_every else []
    gather_logits = logits_gatherer(step) if args.sample_every else None
    # Resuming: the state is loaded into this run's layout (resharded from the saved global
    # slices); the loader is deterministic from the seed, so the data position (batches
    # consumed, kept in the checkpoint's metadata) restores the data order.
    start_step, data_pos, run_id = 0, 0, None
    if args.resume is not None:
        check_one_run(args.resume, allow_other_run=args.allow_other_run)
        found = latest_checkpoint(args.resume)
        if found is None:
            raise SystemExit(f"error: no complete checkpoint at or under {args.resume}")
        meta = read_index(found, verify_files=False)["extra_meta"]
        # Before loading: a model flag that differs is named, not reported as a shape error.
        changes = compare_run_args(meta.get("args", {}), vars(args), model=MODEL_ARGS,
                                   hyper=HYPER_ARGS, data=DATA_ARGS,
                                   allow_data_change=args.allow_data_change)
        state = apply_changes(changes, args, load(found, state, step=step), say)
        start_step = int(state.step)
        data_pos = int(meta.get("data_pos", start_step))
        run_id = meta.get("run_id")  # a resumed run keeps its identity
        say(f"resumed from {found} at step {start_step}", flush=True)
        if start_step >= args.steps:
            say(f"nothing to do: checkpoint is at step {start_step} (--steps {args.steps})",
                flush=True)
            return {"first_loss": None, "last_loss": None, "history": [], "state": state,
                    "params": None}
    pp = (f"pp {args.pp} ({args.schedule}, {args.microbatches} micro-batches) x "
          if args.pp > 1 else "")
    ep = f"ep {mesh.size('ep')} x " if "ep" in mesh.axis_names else ""
    cp = f"cp {mesh.size('cp')} ({args.cp_mode}) x " if "cp" in mesh.axis_names else ""
    where = f"{device}" if mesh.world_size == 1 else (
        f"{mesh.world_size} x {device.type} ({pp}{ep}dp {mesh.size('dp')} x {cp}tp "
        f"{mesh.size('tp')})")
    say(f"model {n_params / 1e6:.2f}M params | corpus {loader.tokens.numel():,} tokens, "
        f"{loader.batches_per_epoch} batches/epoch | {args.optim} on {where}"
        + (f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""), flush=True)

    # Only rank 0 writes TensorBoard, JSONL and the terminal; the others keep the history only.
    # start_step: a resumed run continues the metrics of the steps up to its checkpoint.
    logger = Logger(
        args.logdir if rank0 else None, jsonl=args.metrics_jsonl if rank0 else None,
        total_steps=args.steps, progress=None if rank0 else False,
        print_every=args.print_every if rank0 else None, device=device, start_step=start_step,
    )
    # This run owns --ckpt-dir while it trains (every rank agrees before the first step).
    run_id = run_id or new_run_id()
    ckpt_lock = (claim_checkpoint_dir(args.ckpt_dir, run_id, resumed=args.resume is not None,
                                      allow_other_run=args.allow_other_run)
                 if args.save_every or args.keep_best else None)
    evals: list[dict[str, float]] = []
    best = math.inf
    comm_log.clear()
    # Collectives are recorded only when a report is asked for (a long run would pile them up).
    capture = comm_log.capture() if args.comm_report else contextlib.nullcontext([])
    start = time.perf_counter()
    with logger as log, capture as comm_records, _released(ckpt_lock):
        log.reset_timer()
        for i, batch in zip(range(start_step, args.steps), loader.batches(start=data_pos)):
            comm_log.begin_step(i + 1)
            state, metrics = step(state, batch)
            if args.eval_every and ((i + 1) % args.eval_every == 0 or i + 1 == args.steps):
                with log.paused():  # not in the step's throughput
                    ev = evaluate(eval_step, state, eval_data)
                    if args.keep_best and ev["loss"] < best:
                        best = ev["loss"]
                        save_checkpoint(state, os.path.join(args.ckpt_dir, "best"), step=step,
                                        extra_meta={"data_pos": data_pos + i + 1 - start_step,
                                                    "args": vars(args), "run_id": run_id,
                                                    "eval_loss": ev["loss"]})
                evals.append({"step": i + 1, **ev})
                metrics = {**metrics, "eval_loss": ev["loss"], "eval_ppl": ev["ppl"]}
            log.log(i + 1, metrics, tokens=loader.tokens_per_batch)
            if args.sample_every and ((i + 1) % args.sample_every == 0 or i + 1 == args.steps):
                with log.paused():
                    text = sample_text(args, step, state, gather_logits, seed=args.seed + i + 1)
                say(f"sample at step {i + 1}: {text!r}", flush=True)
            if args.save_every and ((i + 1) % args.save_every == 0 or i + 1 == args.steps):
                save_checkpoint(state, os.path.join(args.ckpt_dir, f"step_{i + 1:08d}"),
                                step=step, extra_meta={"data_pos": data_pos + i + 1 - start_step,
                                                       "args": vars(args), "run_id": run_id})
    elapsed = time.perf_counter() - start
    blocked = comm_log.blocked_s  # waiting in collectives: communication the compute did not hide
    comm_log.clear()
    history = log.history
    first, last = history[0]["loss"], history[-1]["loss"]
    tail = history[-10:]
    tail_mean = sum(r["loss"] for r in tail) / len(tail)
    say(f"done: {args.steps} steps in {elapsed:.1f}s "
        f"({args.steps * loader.tokens_per_batch / elapsed:,.0f} tok/s) | "
        f"loss first {first:.4f} last {last:.4f} (mean of last {len(tail)}: {tail_mean:.4f})"
        + (f" | blocked in collectives {blocked:.2f}s ({blocked / elapsed:.0%})"
           if mesh.world_size > 1 else "")
        + (f" | {int(state.extras['skipped_steps'])} step(s) skipped on inf/nan gradients"
           if int(state.extras.get("skipped_steps", 0)) else "")
        + (f" | eval loss {evals[-1]['loss']:.4f} (ppl {evals[-1]['ppl']:.2f}), best "
           f"{min(e['loss'] for e in evals):.4f}" if evals else ""),
        flush=True)
    if args.comm_report:
        shown = [r for r in comm_records if r.step is not None and r.step <= args.comm_report]
        per_step = {}
        for r in comm_records:
            per_step[r.step] = per_step.get(r.step, 0) + r.nbytes
        say(f"collectives issued by rank 0 (of {mesh.world_size}), first {args.comm_report} "
            f"step(s):")
        if rank0:
            comm_report(shown)
        if per_step:
            say(f"all {args.steps} steps: {sum(per_step.values()):,} bytes, per step "
                f"{min(per_step.values()):,} to {max(per_step.values()):,}", flush=True)

    # The whole parameters: gathered from the tp (and zero-3) parts (a collective every rank
    # joins); under --pp, of this rank's stages only.
    whole = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    if args.save is not None and rank0:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in whole.items()}, args.save)
        say(f"saved {len(whole)} whole parameter tensors to {args.save}", flush=True)
    return {"first_loss": first, "last_loss": last, "history": history, "state": state,
            "comm_blocked_s": blocked, "params": whole, "evals": evals}


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
