"""Fine-tune a local Hugging Face causal LM with funcpar and write it back in its own format.

    python examples/finetune_hf.py --model ./tiny-llama --out ./tiny-llama-tuned
    torchrun --nproc_per_node 2 examples/finetune_hf.py --model ./tiny-llama --out ./tuned --tp 2
    torchrun --nproc_per_node 4 examples/finetune_hf.py --model ./m --out ./t --tp 2 --zero 2 \\
        --eval-every 10 --sample-every 20

``--model`` is a directory as ``save_pretrained`` writes it (``config.json`` and safetensors,
one file or sharded with an index); nothing is downloaded (``local_files_only``). It holds a
tokenizer (then its ``encode``) or the vocabulary takes byte tokens (>= 256 ids). The model
becomes a pure function (``functionalize``) and trains under the layout the flags give, over
the ``dp x tp`` mesh of the torchrun world:

* ``--tp``: tensor parallelism from the model's own ``tp_plan`` (``funcpar.shard.rules.
  hf_rules``); a MoE family's experts (the plan's ``experts`` entries, which funcpar does not
  map yet) stay replicated, so their gradients are whole on every tp rank and the training is
  exact; the heads (query and key/value) must divide by ``--tp``;
* the remaining ranks are data parallel, ``--zero 1-3`` partitions over them;
* a pipeline is not offered: ``pipeline_split`` knows how to cut funcpar's Llama only.

``--eval-every`` evaluates the held-out tail of the corpus (as examples/train_lm.py), and
``--sample-every`` prints a sample through the model's own key/value cache
(``funcpar.models.generate``). At the end the whole parameters (gathered from the shards)
go back into the module and ``save_pretrained(--out)`` writes the Hugging Face directory
(``--max-shard-size`` to shard it), which ``AutoModelForCausalLM.from_pretrained`` loads with
the logits the trained state computes. ``--save-every N`` also writes funcpar checkpoints
(``--ckpt-dir/step_N``, each rank its shards); ``--export-from CKPT --out DIR`` trains nothing
and writes such a checkpoint, saved under any layout, as a Hugging Face directory (run it in
one process, or under any layout: the checkpoint is resharded on load).
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
from funcpar.models.generate import generate, logits_gatherer
from funcpar.optim import adamw, chain, clip_by_global_norm, matrices_only, warmup_cosine
from funcpar.shard import DeviceMesh, unshard_tree
from funcpar.shard.agree import check_ranks_agree
from funcpar.shard.rules import hf_rules
from funcpar.state import functionalize, generator_state, init_state, load, save
from funcpar.train import Logger, evaluate, make_eval_step, make_train_step
from funcpar.train.cli import add_debug_flag, positive_int, run_cli
from funcpar.transforms import compose, data_parallel, logits_of, shard_params, zero_partition

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def hf_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face output's logits."""
    return lm_loss(logits_of(output), targets)


# Token-mean cross-entropy: shard_params may compute it on vocab-split logits.
hf_lm_loss.token_cross_entropy = True


def tp_rules(model: torch.nn.Module) -> list:
    """``hf_rules`` of the model's ``tp_plan`` without its expert entries (replicated)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    kept = {p: s for p, s in plan.items() if ".experts" not in p}
    if kept == plan:
        return hf_rules(model)
    shim = torch.nn.Module()  # what hf_rules reads: the plan and the config
    shim.tp_plan, shim.config = kept, model.config
    return hf_rules(shim)


def load_model(args: argparse.Namespace) -> tuple[torch.nn.Module, Callable[[str], list[int]]]:
    import transformers as tf

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"error: --model {args.model} has no config.json: a directory "
                         "written by save_pretrained is expected")
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                    torch_dtype=DTYPES[args.dtype])
    tokenizer: Callable[[str], list[int]] = byte_tokenize
    if any(os.path.exists(os.path.join(args.model, f))
           for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        tokenizer = tf.AutoTokenizer.from_pretrained(args.model, local_files_only=True).encode
    elif model.config.vocab_size < BYTE_VOCAB_SIZE:
        raise SystemExit(f"error: {args.model} has no tokenizer and a vocabulary of "
                         f"{model.config.vocab_size} < 256: byte tokens do not fit")
    model.config.use_cache = False  # training; sampling asks for the cache itself
    return model.eval(), tokenizer  # eval mode: no dropout, so every layout computes alike


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="finetune_hf.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="a local Hugging Face causal LM directory")
    p.add_argument("--out", required=True, help="where save_pretrained writes the result")
    p.add_argument("--max-shard-size", default="5GB",
                   help="save_pretrained's max_shard_size (e.g. 200KB: a sharded directory)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--steps", type=positive_int, default=50)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--corpus", default=None, help="file or directory (default: Python's stdlib)")
    p.add_argument("--corpus-glob", default="**/*.txt")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_STDLIB_BYTES)
    p.add_argument("--data-cache", default=None, help="datasets cache directory")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps; 0: off")
    p.add_argument("--eval-batches", type=positive_int, default=2)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--sample-every", type=int, default=0, help="print a sample every N steps")
    p.add_argument("--sample-prompt", default="def ")
    p.add_argument("--sample-tokens", type=positive_int, default=32)
    p.add_argument("--logdir", default="runs/finetune_hf")
    p.add_argument("--metrics-jsonl", default=None)
    p.add_argument("--print-every", type=positive_int, default=10)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--ckpt-dir", default="checkpoints/finetune_hf",
                   help="where --save-every writes funcpar checkpoints (step_N)")
    p.add_argument("--save-every", type=int, default=0,
                   help="save a funcpar checkpoint every N steps and at the end; 0: off")
    p.add_argument("--export-from", default=None, metavar="CKPT",
                   help="train nothing: load this funcpar checkpoint (saved under any layout) "
                        "and write it to --out")
    add_debug_flag(p)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps ({args.steps}))")
    for flag in ("eval_every", "sample_every", "save_every"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0 (0: off)")
    if args.eval_every and not 0 < args.eval_fraction < 1:
        p.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    return args


def _check_heads(model: torch.nn.Module, tp: int) -> None:
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv)):
        if n % tp:
            raise SystemExit(f"error: --tp {tp} does not divide the model's {n} {what}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Fine-tune and write ``--out``; returns ``{"losses", "evals", "params"}`` (whole
    params, on every rank)."""
    args = parse_args(argv)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(saved_threads)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.tp:
        raise SystemExit(f"error: --tp {args.tp} does not divide the {world} processes")
    mesh = DeviceMesh.from_env(dp=-1, tp=args.tp, backend="gloo")
    check_ranks_agree(mesh, vars(args))
    rank0 = mesh.rank() == 0
    say = print if rank0 else (lambda *a, **k: None)
    model, tokenizer = load_model(args)
    _check_heads(model, args.tp)
    if args.batch_size % mesh.size("dp"):
        raise SystemExit(f"error: --batch-size {args.batch_size} does not split over dp "
                         f"{mesh.size('dp')}")
    loader = rank0_first(lambda: text_batches(  # rank 0 tokenizes, the others read the cache
        args.corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
        tokenizer=tokenizer, cache_dir=args.data_cache, pattern=args.corpus_glob,
        max_bytes=args.corpus_bytes, held_out=args.eval_fraction if args.eval_every else 0.0))

    apply_fn, params, buffers = functionalize(model)
    lr = warmup_cosine(args.lr, args.warmup, args.steps, end=0.1 * args.lr)
    opt = chain(clip_by_global_norm(args.clip),
                adamw(lr=lr, weight_decay=args.weight_decay, weight_decay_mask=matrices_only))
    step = make_train_step(apply_fn, hf_lm_loss, opt)
    state = init_state(params, buffers, opt, seed=args.seed)
    transforms = []
    if mesh.size("tp") > 1:
        transforms.append(shard_params(tp_rules(model), mesh))
    if mesh.size("dp") > 1:
        transforms.append(data_parallel(mesh))
    if args.zero:
        transforms.append(zero_partition(args.zero, mesh))
    step, state = compose(*transforms)(step, state)
    eval_step = make_eval_step(step) if args.eval_every else None
    held = loader.held_out
    eval_data = [held.batch(i) for i in range(min(args.eval_batches, held.batches_per_epoch))
                 ] if args.eval_every else []
    gather = logits_gatherer(step) if args.sample_every else None

    n_params = sum(p.numel() for p in params.values())
    say(f"{type(model).__name__} {n_params / 1e6:.2f}M params | {loader.tokens.numel():,} "
        f"tokens | world {mesh.world_size}: tp {mesh.size('tp')} x dp {mesh.size('dp')}"
        + (f" + ZeRO-{args.zero}" if args.zero else ""), flush=True)
    if args.export_from is not None:
        return _export(args, model, step, state, mesh, say)
    evals = []
    with Logger(args.logdir if rank0 else None, jsonl=args.metrics_jsonl if rank0 else None,
                total_steps=args.steps, progress=False,
                print_every=args.print_every if rank0 else None) as log:
        for i, batch in zip(range(args.steps), loader.batches()):
            state, metrics = step(state, batch)
            last = i + 1 == args.steps
            if args.eval_every and ((i + 1) % args.eval_every == 0 or last):
                with log.paused():
                    ev = evaluate(eval_step, state, eval_data)
                evals.append({"step": i + 1, **ev})
                metrics = {**metrics, "eval_loss": ev["loss"], "eval_ppl": ev["ppl"]}
            log.log(i + 1, metrics, tokens=loader.tokens_per_batch)
            if args.sample_every and ((i + 1) % args.sample_every == 0 or last):
                with log.paused():
                    prompt = torch.tensor([tokenizer(args.sample_prompt)])
                    tokens, _ = generate(step.apply_fn, state.params, state.buffers, prompt,
                                         args.sample_tokens, temperature=0.8, top_k=40,
                                         rng=generator_state("cpu", args.seed + i + 1),
                                         gather_logits=gather)
                say(f"sample at step {i + 1}: {tokens[0].tolist()}", flush=True)
            if args.save_every and ((i + 1) % args.save_every == 0 or last):
                save(state, os.path.join(args.ckpt_dir, f"step_{i + 1:08d}"), step=step)
    losses = [r["loss"] for r in log.history]
    whole = _write_hf(args, model, step, state, rank0)
    say(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; wrote {args.out}", flush=True)
    return {"losses": losses, "evals": evals, "params": whole}


def _write_hf(args: argparse.Namespace, model: torch.nn.Module, step: Any, state: Any,
              rank0: bool) -> dict[str, torch.Tensor]:
    """The whole parameters (gathered from the shards: a collective) into the module (a tied
    head follows its embedding), then ``save_pretrained(--out)`` by rank 0."""
    whole = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    if rank0:
        missing, unexpected = model.load_state_dict(whole, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        if [k for k in missing if k not in tied] or unexpected:
            raise RuntimeError(f"the state does not fit the model: missing {missing}, "
                               f"unexpected {unexpected}")
        model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank leaves once rank 0 has written
    return whole


def _export(args: argparse.Namespace, model: torch.nn.Module, step: Any, state: Any,
            mesh: DeviceMesh, say: Callable[..., None]) -> dict[str, Any]:
    """``--export-from``: the checkpoint, resharded from whatever layout saved it into this
    run's (``funcpar.state.load``), written as a Hugging Face directory."""
    state = load(args.export_from, state, step=step)
    whole = _write_hf(args, model, step, state, mesh.rank() == 0)
    say(f"done: exported {args.export_from} (step {int(state.step)}) to {args.out}",
        flush=True)
    return {"losses": [], "evals": [], "params": whole}


if __name__ == "__main__":
    run_cli(main)
