"""Sample text from a checkpoint of examples/train_lm.py, with a KV cache.

    python examples/train_lm.py --steps 500 --save-every 500 --ckpt-dir checkpoints/lm
    python examples/generate.py --ckpt checkpoints/lm --prompt "def "
    python examples/generate.py --ckpt checkpoints/lm/best --temperature 0 --max-new-tokens 200

The checkpoint (the newest complete one under ``--ckpt``, or ``--ckpt`` itself; a ``--keep-best``
run's ``best`` too) records the flags it was trained with, which rebuild the model; its state
loads whatever layout it was saved from (tp, dp, ZeRO, pipeline: funcpar.state.load reshards
it into this one process). The prompt is the example's byte-level tokens (UTF-8 bytes), and
the sample is :func:`funcpar.models.generate.generate`: greedy at ``--temperature 0``, else
top-k / top-p sampling from ``--seed``; the text printed is the prompt and the new bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from funcpar.models import Llama
from funcpar.models.generate import generate
from funcpar.state import (
    functionalize,
    generator_state,
    init_state,
    latest_checkpoint,
    load,
    read_index,
)
from funcpar.train.cli import add_debug_flag, run_cli


def _train_lm() -> ModuleType:
    """examples/train_lm.py, whose flags and optimizer rebuild the checkpoint's state."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_lm.py")
    spec = importlib.util.spec_from_file_location("funcpar_example_train_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True,
                   help="a checkpoint of examples/train_lm.py, or a directory of them (the "
                        "newest complete one is taken)")
    p.add_argument("--prompt", default="def ", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100,
                   help="bytes to sample (the prompt and these must fit the model's --seq-len)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: no top-k filter")
    p.add_argument("--top-p", type=float, default=0.95, help="1: no nucleus filter")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_debug_flag(p)
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.prompt:
        p.error("--prompt must not be empty")
    return args


def load_model(ckpt: str, device: torch.device) -> tuple[Any, Any, Any, argparse.Namespace]:
    """``(apply_fn, params, buffers, the run's flags)`` of the checkpoint at or under ``ckpt``."""
    found = latest_checkpoint(ckpt)
    if found is None:
        raise SystemExit(f"error: no complete checkpoint at or under {ckpt}")
    index = read_index(found, verify_files=False)
    saved = index["extra_meta"].get("args")
    if not saved:
        raise SystemExit(f"error: {found} records no run flags: not a checkpoint of "
                         "examples/train_lm.py")
    train_lm = _train_lm()
    run = argparse.Namespace(**saved)
    dtype = train_lm.DTYPES[run.dtype]
    model = Llama(train_lm.model_config(run), seed=run.seed, device=device, dtype=dtype)
    apply_fn, params, buffers = functionalize(model, release=True)
    # The run's optimizer, so that the state has the checkpoint's leaves; only params are used.
    optimizer = train_lm.build_optimizer(run, params)
    like = init_state(params, buffers, optimizer, seed=run.seed)
    # The transforms' counters (skipped steps, a loss scale) as the checkpoint holds them.
    extras = {n.split(".", 1)[1]: torch.zeros(rec["global_shape"], dtype=getattr(torch,
                                                                               rec["dtype"]))
              for n, rec in index["leaves"].items() if n.startswith("extras.")}
    state = load(found, like._replace(extras=extras))
    return apply_fn, state.params, state.buffers, run


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print and return ``{"text", "tokens", "ckpt_args"}``."""
    args = parse_args(argv)
    device = torch.device(args.device)
    apply_fn, params, buffers, run = load_model(args.ckpt, device)
    prompt = torch.tensor([list(args.prompt.encode("utf-8"))], device=device)
    if prompt.shape[1] + args.max_new_tokens > run.seq_len:
        raise SystemExit(f"error: the prompt ({prompt.shape[1]} bytes) and --max-new-tokens "
                         f"{args.max_new_tokens} exceed the model's --seq-len {run.seq_len}")
    tokens, _ = generate(apply_fn, params, buffers, prompt, args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k or None,
                         top_p=args.top_p if args.top_p < 1 else None,
                         rng=generator_state(device, args.seed))
    text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    print(text, flush=True)
    return {"text": text, "tokens": tokens, "ckpt_args": vars(run)}


if __name__ == "__main__":
    run_cli(main)
