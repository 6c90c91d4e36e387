"""``--auto`` and ``--what-if`` for the example scripts (``examples/train_lm.py``).

``add_auto_flags(parser)`` adds the flags; ``resolve_auto(args, cfg)`` runs the search for the
script's model and batch and either prints the plan for a cluster that is not there
(``--what-if``: returns None, nothing starts) or writes the winner into ``args`` (``tp``,
``pp``, ``dp``, ``cp``, ``cp_mode``, ``tp_mode``, ``zero``, ``precision``, ``microbatches``,
``schedule``, ``virtual_stages``, ``sequence_parallel``, ``remat``; ``args.auto_choice`` the
:class:`~funcpar.auto.Choice`'s fields) and
prints why it won. The script then composes ``preset_for(args.auto_choice, ...)``: the
``hybrid_parallel`` (or ``moe_hybrid``) preset with those arguments, then ``remat`` when chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

__all__ = ["add_auto_flags", "resolve_auto"]


def add_auto_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("automatic layout (funcpar.auto, docs/AUTO_PARALLEL.md)")
    g.add_argument("--auto", action="store_true",
                   help="choose tp (1d or 2d) x pp x dp x ep x cp x ZeRO x remat x offload by "
                        "the cost model for this run's world, model and batch (replaces --tp/"
                        "--pp/--dp/--zero/--precision/--remat; --cp N and --tp N --tp-mode 2d "
                        "pin theirs) and print why")
    g.add_argument("--what-if", action="store_true",
                   help="with --auto: print the chosen layout for --world ranks and exit "
                        "without starting anything")
    g.add_argument("--world", type=int, default=None,
                   help="with --what-if: the cluster's number of ranks (default: this run's)")
    g.add_argument("--memory-per-rank", default=None, metavar="BYTES",
                   help="with --auto: memory per rank, e.g. 2GiB (default: the profile's)")
    g.add_argument("--profile", default=None, metavar="NAME_OR_JSON",
                   help="with --auto: a device profile (python -m funcpar.profile) or a "
                        "shipped one: h100, a100, cpu-gloo (default: h100 on CUDA or with "
                        "--what-if, cpu-gloo on a CPU)")


def resolve_auto(args: argparse.Namespace, cfg: Any) -> Any:
    """The search for ``cfg`` (a LlamaConfig) and ``args``' batch; see the module docstring.
    Returns the :class:`~funcpar.auto.AutoResult` (None after ``--what-if``). Raises
    SystemExit with the search's reason when nothing fits."""
    import torch

    from funcpar.auto.search import NoFeasibleLayout, auto_parallel

    if args.what_if and not args.auto:
        raise SystemExit("error: --what-if goes with --auto")
    world = args.world or int(os.environ.get("WORLD_SIZE", "1"))
    if args.world is not None and not args.what_if:
        raise SystemExit("error: --world is for --what-if (a real run's world is torchrun's)")
    profile = args.profile
    if profile is None:
        on_gpu = torch.device(args.device).type == "cuda"
        profile = "h100" if (args.what_if or on_gpu) else "cpu-gloo"
    cons: dict[str, Any] = {}
    if not args.what_if:
        # What this script can run: amp only over float32 parameters; no pipeline with
        # --save or --compile (train_lm refuses those under --pp).
        cons["precision"] = ("bf16", "fp32") if args.dtype == "float32" else "fp32"
        if args.save is not None or args.compile:
            cons["pp"] = 1
        if args.compile or getattr(args, "sample_every", 0):
            cons["cp"] = 1  # train_lm refuses --cp with those (no compiled ring, no decoding)
        if getattr(args, "sample_every", 0) or getattr(args, "eval_every", 0):
            cons["tp_mode"] = "1d"  # train_lm refuses --tp-mode 2d with those
    if getattr(args, "cp", 1) > 1:  # --cp N given: pinned, with its mode
        cons.update(cp=args.cp, cp_mode=args.cp_mode)
    if getattr(args, "tp_mode", "1d") != "1d":  # --tp-mode 2d given: pinned, with --tp
        cons.update(tp_mode=args.tp_mode, tp=args.tp)
    try:
        result = auto_parallel(cfg, world_size=world, global_batch=args.batch_size,
                               seq_len=args.seq_len, memory_per_rank=args.memory_per_rank,
                               profile=profile, constraints=cons)
    except NoFeasibleLayout as err:
        raise SystemExit(f"error: --auto: {err}") from None
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(result.why(), flush=True)
    if args.what_if:
        if rank0:
            print(f"(--what-if: profile {result.profile.name}; nothing started)", flush=True)
        return None
    c = result.best.choice
    args.tp, args.pp, args.dp, args.ep, args.zero = c.tp, c.pp, c.dp, c.ep, c.zero
    args.precision, args.sequence_parallel = c.precision, c.sequence_parallel
    args.microbatches, args.schedule, args.virtual_stages = (c.microbatches, c.schedule,
                                                             c.virtual_stages)
    args.cp, args.cp_mode, args.tp_mode = c.cp, c.cp_mode, c.tp_mode
    args.remat = 1 if c.remat else 0
    args.preset = "auto"
    # Plain data: the arguments go into checkpoints' metadata (JSON) and are compared between
    # ranks.
    args.auto_choice = dataclasses.asdict(c)
    return result
