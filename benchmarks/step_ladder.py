"""Where an eager donated funcpar step spends its time beyond a hand-written pure step.

    python benchmarks/step_ladder.py                 # tiny preset, fp32 AdamW, CPU, 1 thread
    python benchmarks/step_ladder.py --steps 500 --dim 128 --layers 4
    python benchmarks/step_ladder.py --phases         # the parts of the plain and funcpar steps

A ladder of steps on the same model and batches, from bench_train's ``pure-lean`` (a pure AdamW
step by hand on flat leaf lists) to funcpar's ``make_train_step(..., donate=True)``, each rung
swapping one more of funcpar's parts in:

1. ``lean``: forward by funcpar's ``apply_fn``, ``torch.autograd.grad``, the gradient-norm
   metric as one multi-tensor norm, ``torch._fused_adamw_`` in place, fresh tensor objects;
2. ``+ update_params``: the optimizer is ``funcpar.optim.adamw`` through ``update_params`` inside
   ``inplace_updates`` (the same fused kernel behind its tree layer: state checks, hyperparameters
   held in the state, dispatch);
3. ``+ loss_and_grads``: funcpar's forward and backward function;
4. ``+ global_norm``: funcpar's metric (layout-aware, reused by a clip, exact left fold);
5. ``+ donate_into``: the new state moved into the old storage, the old leaves marked;
6. ``funcpar-donate``: the train step itself (its donation check, rng fork, metrics);

and ``torch-eager`` (the module, ``loss.backward()``, fused ``torch.optim.AdamW``) as the peer.
All run interleaved, one step each in a rotated order, so machine noise hits them alike; the
table shows medians and first quartiles per step, the time each rung adds, and torch-eager's
time over each rung's (> 1: faster than the plain loop). Every rung computes the same maths
(their losses are checked against torch-eager's over the warm-up steps).

``--phases`` times the parts inside the steps instead, interleaved the same way: torch-eager's
forward, backward and optimizer step (``step()`` + ``zero_grad()``) against the parts of
funcpar's donated step (``loss_and_grads``, the ``global_norm`` metric, ``update_params``
inside ``inplace_updates``, ``donate_into``), each timed where it runs in a real step (after
the backward, with the caches the backward left), so the table says which of funcpar's parts
the plain loop also pays and which it does not.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence

import bench_train as bt
import torch

from funcpar.kernels.inplace import inplace_updates
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import adamw, update_params
from funcpar.optim.clip import global_norm, reuse_global_norm
from funcpar.state import functionalize
from funcpar.state.donation import donate_into
from funcpar.state.tree import tree_map
from funcpar.train.step import loss_and_grads

RUNGS = ("+ update_params", "+ loss_and_grads", "+ global_norm", "+ donate_into")


def rung(base: Llama, level: int) -> Callable[..., torch.Tensor]:
    """The lean step with funcpar's first ``level`` parts of :data:`RUNGS` (1-4) swapped in;
    the step takes an optional dict, where it writes the seconds of its parts (``--phases``)."""
    apply_fn, params, buffers = functionalize(copy.deepcopy(base))
    opt = adamw(**bt.ADAMW)
    names = list(params)
    state = {"params": {k: v.detach() for k, v in params.items()}, "buffers": buffers}
    state["opt"] = opt.init(state["params"])

    def run(batch: tuple, parts: dict[str, float] | None = None) -> torch.Tensor:
        p, b, o = state["params"], state["buffers"], state["opt"]
        t0 = time.perf_counter()
        if level >= 2:
            loss, grads, nb = loss_and_grads(apply_fn, lm_loss, p, b, batch)
        else:
            loss, flat, nb = bt.lean_grads(apply_fn, names, [p[k] for k in names], b, batch)
            grads = dict(zip(names, flat))
        t1 = time.perf_counter()
        with reuse_global_norm():
            if level >= 3:
                global_norm(grads)
            else:
                bt.lean_grad_norm(grads.values())
            t2 = time.perf_counter()
            with inplace_updates():
                new_p, new_o = update_params(opt, grads, o, p)
        t3 = time.perf_counter()
        if level >= 4:
            new_p, nb, new_o = donate_into((p, b, o), (new_p, nb, new_o))
        else:  # fresh objects on the same storage, as the lean step returns
            new_p, nb, new_o = tree_map(lambda x: x.detach() if torch.is_tensor(x) else x,
                                        (new_p, nb, new_o))
        if parts is not None:
            parts.update({"forward + loss + backward": t1 - t0, "grad-norm metric": t2 - t1,
                          "optimizer": t3 - t2, "donation": time.perf_counter() - t3})
        state.update(params=new_p, buffers=nb, opt=new_o)
        return loss.detach()

    return run


def phases(base: Llama, batches: Sequence[tuple], steps: int, warmup: int) -> None:
    """The ``--phases`` table: median milliseconds of each part (module docstring)."""
    # torch-eager's loop and the ladder's top rung (all of funcpar's parts), split in parts.
    runs = {"torch-eager": bt.plain_runner(copy.deepcopy(base), "adamw", False, "fp32",
                                           torch.device("cpu")),
            "funcpar-donate": rung(base, len(RUNGS))}
    for batch in batches[:warmup]:
        a, b = (float(run(batch, {})) for run in runs.values())
        if abs(a - b) > 1e-5 * abs(a):
            raise SystemExit(f"error: funcpar's warm-up loss {b} differs from torch-eager's {a}")
    times: dict[str, dict[str, list[float]]] = {n: {} for n in runs}
    for i in range(steps):
        batch = batches[(warmup + i) % len(batches)]
        for n in (list(runs) if i % 2 else list(runs)[::-1]):
            parts: dict[str, float] = {}
            runs[n](batch, parts)
            parts["sum of the parts"] = sum(parts.values())
            for k, v in parts.items():
                times[n].setdefault(k, []).append(v)
    print(f"parts of the step, median ms over {steps} interleaved steps each")
    for n, parts in times.items():
        for k, v in parts.items():
            print(f"{n:<16}{k:<28}{1e3 * statistics.median(v):>9.3f}")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="step_ladder.py", description=__doc__.split("\n\n")[0])
    tiny = bt.PRESETS["tiny"]
    for name in ("vocab", "dim", "layers", "heads", "ffn", "batch_size", "seq_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=tiny[name])
    p.add_argument("--steps", type=int, default=300, help="timed steps of every rung")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--phases", action="store_true",
                   help="time the parts of torch-eager's and funcpar's steps instead")
    args = p.parse_args(argv)
    if min(args.steps, args.warmup) <= 0 or args.dim % args.heads:
        p.error("--steps and --warmup must be positive and --dim divisible by --heads")
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, ffn_hidden=args.ffn, max_seq_len=args.seq_len)
    base = Llama(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (40, args.batch_size, args.seq_len + 1), generator=gen)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    if args.phases:
        phases(base, batches, args.steps, args.warmup)
        return {}
    cpu = torch.device("cpu")
    ways = {"torch-eager": bt.build("torch-eager", base, "adamw", "fp32", cpu),
            "lean": bt.lean_runner(copy.deepcopy(base))}
    ways.update({name: rung(base, i + 1) for i, name in enumerate(RUNGS)})
    ways["funcpar-donate"] = bt.build("funcpar-donate", base, "adamw", "fp32", cpu)

    warm = {n: [float(w(b)) for b in batches[:args.warmup]] for n, w in ways.items()}
    for n, losses in warm.items():
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, warm["torch-eager"]))
        if gap > 1e-5:
            raise SystemExit(f"error: {n}'s warm-up losses differ from torch-eager's ({gap:.1e})")
    names = list(ways)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.steps):
        batch = batches[(args.warmup + i) % len(batches)]
        k = i % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            ways[n](batch)
            times[n].append(time.perf_counter() - t0)
    med = {n: 1e3 * statistics.median(v) for n, v in times.items()}
    q1 = {n: 1e3 * statistics.quantiles(v, n=4)[0] for n, v in times.items()}
    print(f"{sum(x.numel() for x in base.parameters()) / 1e6:.2f} M params, batch "
          f"{args.batch_size}x{args.seq_len}, fp32 AdamW, {args.threads} thread(s), "
          f"{args.steps} interleaved steps each")
    print(f"{'step':<20}{'median ms':>11}{'q1 ms':>9}{'added':>9}{'torch/this':>12}"
          f"{'(q1)':>8}")
    prev = None
    for n in names:
        added = "" if prev is None or n == "torch-eager" else f"{med[n] - med[prev]:+.2f}"
        print(f"{n:<20}{med[n]:>11.2f}{q1[n]:>9.2f}{added:>9}"
              f"{med['torch-eager'] / med[n]:>12.3f}{q1['torch-eager'] / q1[n]:>8.3f}")
        if n != "torch-eager":
            prev = n
    return med


if __name__ == "__main__":
    main()
