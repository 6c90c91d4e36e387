"""Fine-tune a Hugging Face GPT-2 under tensor parallelism with funcpar (CPU, gloo, torchrun).

    torchrun --nproc_per_node 2 examples/finetune_hf_tp.py              # tp2, a small GPT-2
    torchrun --nproc_per_node 4 examples/finetune_hf_tp.py --tp 2       # tp2 x dp2
    python examples/finetune_hf_tp.py --tp 1                            # one process
    torchrun --nproc_per_node 2 examples/finetune_hf_tp.py --model-dir ./my-gpt2 \\
        --corpus my_texts/ --save-dir ./my-gpt2-tuned
    torchrun --nproc_per_node 2 examples/finetune_hf_tp.py --check-rules   # verify rules first

The model is ``transformers.GPT2LMHeadModel``: read from ``--model-dir`` (a local checkpoint
directory saved with ``save_pretrained``; nothing is downloaded) or, by default, built from a
small config in this file (no Hub needed) with seeded random weights. It becomes a pure function
(``functionalize``), and ``shard_params(gpt2_rules(head_dim), mesh)`` splits it over the ``tp``
axis the Megatron way: the fused ``c_attn`` projection column-split per q/k/v block (whole
heads per rank), the attention output and MLP ``c_proj`` row-split, ``c_fc`` column-split, and
the token embedding with the LM head tied to it split on the vocabulary, whose logits stay
split into funcpar's vocab-parallel cross-entropy. With more processes than ``--tp`` the rest
is data parallel (``data_parallel(mesh)``). Every rank reads the same global batches (the
transforms take their part) and computes the same loss; rank 0 prints and writes TensorBoard.

Data: local text through ``funcpar.data.text_batches`` (Hugging Face ``datasets``, offline),
Python's standard library by default, byte-level tokens unless ``--model-dir`` holds a
tokenizer (then ``AutoTokenizer.from_pretrained(model_dir)``'s ``encode``). ``--save-dir``
writes the fine-tuned whole model (gathered from the shards) with ``save_pretrained``.

``--check-rules`` runs ``funcpar.transforms.check_rules`` before training: one forward and
backward of a float64 copy of the model under the tensor-parallel rules against the whole
copy, on a random batch; rules that would be silently wrong stop the run with the worst
parameters named (docs/HF_MODELS.md).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcpar.data import (
    BYTE_VOCAB_SIZE,
    DEFAULT_STDLIB_BYTES,
    byte_tokenize,
    rank0_first,
    text_batches,
)
from funcpar.models import lm_loss
from funcpar.optim import adamw, chain, clip_by_global_norm, matrices_only, warmup_cosine
from funcpar.shard import DeviceMesh, gpt2_rules, unshard_tree
from funcpar.shard.agree import check_ranks_agree
from funcpar.state import functionalize, init_state
from funcpar.train import Logger, make_train_step
from funcpar.train.cli import add_debug_flag, positive_int, run_cli
from funcpar.transforms import check_rules, compose, data_parallel, logits_of, shard_params


def gpt2_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face output's logits."""
    return lm_loss(logits_of(output), targets)


# Declares token-mean cross-entropy, so shard_params may compute it on vocab-split logits.
gpt2_loss.token_cross_entropy = True


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, Callable[[str], list[int]]]:
    """``(model, tokenizer)``: from ``--model-dir`` or from the small in-code config."""
    import transformers as tf

    if args.model_dir is not None:
        model = tf.GPT2LMHeadModel.from_pretrained(args.model_dir, local_files_only=True)
        tokenizer: Callable[[str], list[int]] = byte_tokenize
        has_tok = any(os.path.exists(os.path.join(args.model_dir, f))
                      for f in ("tokenizer.json", "vocab.json"))
        if has_tok:
            tokenizer = tf.AutoTokenizer.from_pretrained(args.model_dir,
                                                         local_files_only=True).encode
        elif model.config.vocab_size < BYTE_VOCAB_SIZE:
            raise SystemExit(f"error: {args.model_dir} has no tokenizer and a vocabulary of "
                             f"{model.config.vocab_size} < 256: byte tokens do not fit")
        if model.config.n_positions < args.seq_len:
            raise SystemExit(f"error: --seq-len {args.seq_len} exceeds the model's n_positions "
                             f"{model.config.n_positions}")
    else:
        cfg = tf.GPT2Config(
            vocab_size=BYTE_VOCAB_SIZE, n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
            n_positions=args.seq_len, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
            attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0, use_cache=False,
        )
        torch.manual_seed(args.seed)  # HF initialises from the global generator
        model = tf.GPT2LMHeadModel(cfg)
        tokenizer = byte_tokenize
    model.config.use_cache = False  # no key/value cache in training
    return model.train(), tokenizer


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="finetune_hf_tp.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", type=positive_int, default=2,
                   help="tensor-parallel size (processes / tp: dp)")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None,
                   help="a local GPT-2 checkpoint directory (default: the small in-code config)")
    p.add_argument("--dim", type=positive_int, default=128, help="in-code config: n_embd")
    p.add_argument("--layers", type=positive_int, default=2, help="in-code config: n_layer")
    p.add_argument("--heads", type=positive_int, default=4, help="in-code config: n_head")
    p.add_argument("--dropout", type=float, default=0.0, help="in-code config: all dropouts")
    p.add_argument("--corpus", default=None, help="file or directory (default: Python's stdlib)")
    p.add_argument("--corpus-glob", default="**/*.txt")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_STDLIB_BYTES)
    p.add_argument("--data-cache", default=None, help="datasets cache directory")
    p.add_argument("--logdir", default="runs/finetune_hf_tp")
    p.add_argument("--metrics-jsonl", default=None, help="also write metrics as JSON lines")
    p.add_argument("--print-every", type=positive_int, default=10)
    p.add_argument("--save-dir", default=None, help="save_pretrained the tuned model here")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per process")
    p.add_argument("--check-rules", action="store_true",
                   help="before training, check the tp rules against the whole model (float64)")
    add_debug_flag(p)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps ({args.steps}))")
    if args.model_dir is None and args.heads % args.tp:
        p.error(f"--tp {args.tp} does not divide --heads {args.heads}: every rank takes whole "
                "heads")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Fine-tune; returns ``{"losses": [...], "params": whole params}`` (on every rank)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.tp:
        raise SystemExit(f"error: --tp {args.tp} does not divide the {world} processes; launch "
                         f"torchrun --nproc_per_node {args.tp} (or a multiple)")
    # gloo: CPU tensors. On GPUs leave backend to DeviceMesh (NCCL) and move the model.
    mesh = DeviceMesh.from_env(dp=-1, tp=args.tp, backend="gloo")
    check_ranks_agree(mesh, vars(args))  # other flags per rank would hang or diverge
    rank0 = mesh.rank() == 0
    model, tokenizer = build_model(args)
    cfg = model.config
    if cfg.n_head % args.tp:
        raise SystemExit(f"error: --tp {args.tp} does not divide the model's {cfg.n_head} heads")
    if args.batch_size % mesh.size("dp"):
        raise SystemExit(f"error: --batch-size {args.batch_size} does not split over dp "
                         f"{mesh.size('dp')}")

    loader = rank0_first(lambda: text_batches(  # rank 0 tokenizes, the others read the cache
        args.corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
        tokenizer=tokenizer, cache_dir=args.data_cache, pattern=args.corpus_glob,
        max_bytes=args.corpus_bytes))

    apply_fn, params, buffers = functionalize(model)
    lr = warmup_cosine(args.lr, args.warmup, args.steps, end=0.1 * args.lr)
    opt = chain(clip_by_global_norm(args.clip),
                adamw(lr=lr, weight_decay=args.weight_decay, weight_decay_mask=matrices_only))
    step = make_train_step(apply_fn, gpt2_loss, opt)
    state = init_state(params, buffers, opt, seed=args.seed)
    rules = gpt2_rules(cfg.n_embd // cfg.n_head)
    if args.check_rules and mesh.size("tp") > 1:
        # Raises (one line via run_cli) when the rules are not exact for this model.
        res = check_rules(model, rules, mesh, loss_fn=gpt2_loss, seq_len=min(16, args.seq_len))
        if rank0:
            print(f"check_rules: exact under tp {mesh.size('tp')}: {res.report(top=1)}",
                  flush=True)
    transforms = []
    if mesh.size("tp") > 1:
        transforms.append(shard_params(rules, mesh))
    if mesh.size("dp") > 1:
        transforms.append(data_parallel(mesh))
    step, state = compose(*transforms)(step, state)

    n_params = sum(p.numel() for p in params.values())
    if rank0:
        print(f"GPT-2 {n_params / 1e6:.2f} M params ({cfg.n_layer} layers, {cfg.n_head} heads, "
              f"vocab {cfg.vocab_size}) | {loader.tokens.numel():,} tokens | world "
              f"{mesh.world_size}: tp {mesh.size('tp')} x dp {mesh.size('dp')} (gloo)",
              flush=True)
    with Logger(args.logdir if rank0 else None, jsonl=args.metrics_jsonl if rank0 else None,
                total_steps=args.steps, progress=False,
                print_every=args.print_every if rank0 else None) as log:
        for i, batch in zip(range(args.steps), loader.batches()):
            state, metrics = step(state, batch)
            log.log(i + 1, metrics, tokens=loader.tokens_per_batch)
    losses = [r["loss"] for r in log.history]
    whole = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    if rank0:
        print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of last "
              f"{min(10, len(losses))}: {sum(losses[-10:]) / len(losses[-10:]):.4f})",
              flush=True)
        if args.save_dir is not None:
            # The gathered whole tensors into the module (tied lm_head follows wte), then the
            # Hugging Face format: the tuned model loads with from_pretrained.
            missing, unexpected = model.load_state_dict(whole, strict=False)
            untied = [k for k in missing if k != "lm_head.weight"]
            if untied or unexpected:
                raise RuntimeError(f"state does not fit the model: missing {untied}, "
                                   f"unexpected {unexpected}")
            model.save_pretrained(args.save_dir)
            print(f"saved the fine-tuned model to {args.save_dir}", flush=True)
    if torch.distributed.is_initialized():
        # Every rank leaves together: a rank tearing down gloo while rank 0 still writes the
        # model aborts the job ("terminate called without an active exception").
        torch.distributed.barrier()
    return {"losses": losses, "params": whole}


if __name__ == "__main__":
    run_cli(main)  # a user's error as one line on stderr, exit 2; --debug: the traceback
