"""The functional training step against the plain PyTorch loop, same model, same batches.

    python benchmarks/bench_step.py                     # CPU, eager
    python benchmarks/bench_step.py --device cuda --compile --dim 512 --layers 8

functional:  state, metrics = make_train_step(apply_fn, lm_loss, chain(clip, adamw))(state, b)
plain:       loss.backward(); clip_grad_norm_; torch.optim.AdamW.step(); zero_grad()

Both start from the same weights (one seed), see the same batches, clip the global gradient
norm at 1.0 and run AdamW with the same hyperparameters (decay on every leaf, as
torch.optim.AdamW does with one parameter group), so they compute the same thing; the script
checks that their losses agree before it times anything. Timing: ``--reps`` repetitions of
``--steps`` steps each, the two implementations interleaved (and their order alternated)
within every repetition so that machine noise hits both alike; the table shows medians.
Neither side synchronises inside a step; each timed block ends with one synchronisation.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import adamw, chain, clip_by_global_norm
from funcpar.state import functionalize, init_state
from funcpar.train.step import make_train_step

LR, BETAS, WD, CLIP = 1e-3, (0.9, 0.95), 0.1, 1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def functional_runner(model: Llama, compile: bool) -> Callable[[tuple], torch.Tensor]:
    apply_fn, params, buffers = functionalize(model)
    opt = chain(clip_by_global_norm(CLIP), adamw(lr=LR, betas=BETAS, weight_decay=WD))
    step = make_train_step(apply_fn, lm_loss, opt, compile=compile)
    state = init_state(params, buffers, opt)

    def run(batch: tuple) -> torch.Tensor:
        nonlocal state
        state, metrics = step(state, batch)
        return metrics["loss"]

    return run


def plain_runner(model: Llama, compile: bool) -> Callable[[tuple], torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    forward = torch.compile(model) if compile else model

    def run(batch: tuple) -> torch.Tensor:
        inputs, targets = batch
        loss = lm_loss(forward(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def timed(run: Callable, batches: Sequence[tuple], device: torch.device) -> float:
    """Seconds per step over ``batches`` (one synchronisation, at the end)."""
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        loss = run(batch)
    _sync(device)
    loss.item()
    return (time.perf_counter() - start) / len(batches)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="bench_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (one: spin-waiting OpenMP threads make timings on "
                        "shared cores erratic, and this model is too small to gain from more)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads <= 0:
        p.error(f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, max_seq_len=args.seq_len)
    base = Llama(cfg, seed=args.seed, device=device)
    # Separate tensors for the two sides: functionalize's params are views of the module's.
    runners = {"functional": functional_runner(copy.deepcopy(base), args.compile),
               "plain": plain_runner(copy.deepcopy(base), args.compile)}
    gen = torch.Generator().manual_seed(args.seed)
    n_batches = args.warmup + args.reps * args.steps
    tokens = torch.randint(0, args.vocab, (n_batches, args.batch_size, args.seq_len + 1),
                           generator=gen).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

    warm = {name: [float(run(b)) for b in batches[: args.warmup]] for name, run in
            runners.items()}
    gap = max(abs(a - b) for a, b in zip(warm["functional"], warm["plain"]))

    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(args.reps):
        chunk = batches[args.warmup + rep * args.steps: args.warmup + (rep + 1) * args.steps]
        order = list(runners) if rep % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name].append(timed(runners[name], chunk, device))

    tokens_per_step = args.batch_size * args.seq_len
    n_params = sum(x.numel() for x in base.parameters())
    print(f"device {device} | compile {'on' if args.compile else 'off'} | "
          f"threads {torch.get_num_threads()} | model {n_params / 1e6:.2f}M params | "
          f"batch {args.batch_size}x{args.seq_len} | {args.reps} reps x {args.steps} steps, "
          f"medians | max |loss gap| over {args.warmup} warm-up steps {gap:.2e}")
    print(f"{'impl':<12}{'ms/step':>10}{'min':>9}{'max':>9}{'tokens/s':>12}")
    med = {}
    for name, ts in times.items():
        med[name] = statistics.median(ts)
        print(f"{name:<12}{1e3 * med[name]:>10.2f}{1e3 * min(ts):>9.2f}{1e3 * max(ts):>9.2f}"
              f"{tokens_per_step / med[name]:>12,.0f}")
    ratio = med["plain"] / med["functional"]
    print(f"ratio plain/functional (time per step; > 1 means functional is faster): {ratio:.3f}")
    return {"functional_ms": 1e3 * med["functional"], "plain_ms": 1e3 * med["plain"],
            "ratio": ratio, "loss_gap": gap}


if __name__ == "__main__":
    main()
