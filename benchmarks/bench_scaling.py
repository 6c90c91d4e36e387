"""Every parallel layout against data parallelism on the same ranks: tokens/s, collectives per
step, and the time spent blocked in collectives.

    python benchmarks/bench_scaling.py                         # 2 and 4 gloo ranks on CPU
    python benchmarks/bench_scaling.py --ranks 2 --rounds 3 --layouts dp zero1 zero2 zero3
    python benchmarks/bench_scaling.py --device cuda --ranks 8 --dim 1024 --layers 16  # GPUs

Each layout is one ``torchrun`` of ``examples/train_lm.py`` (its own summary line gives tokens/s
and the seconds its rank 0 spent blocked in collectives: a synchronous collective, or the wait
of an asynchronous one; time the compute hid is not counted), with ``--comm-report 1`` for the
collectives of one step. Rounds interleave the layouts (each round runs every layout once, in
an order rotated per round), and the table gives medians: on a shared machine a ratio measured
in one window is worth more than an absolute number. The one-process run is the baseline of
the second ratio; ``dp`` of the first.

A pipeline of ``p`` stages over ``m`` micro-batches can reach at most ``m / (m + p - 1)`` of
dp's rate (its bubble): ``vs bound`` is that ratio. Micro-batching has a cost of its own that
no schedule removes (smaller matmuls, one forward and backward pass per micro-batch: plain
PyTorch's accumulation loop pays it too), so the pipeline rows also give ``vs mb bound``: the
bound times the one-process rate with the same batch cut into ``m`` micro-batches
(``--grad-accum m``, same tokens per step) over the one-process rate of the whole batch.

Layouts (``N`` ranks): ``dp`` (dpN), ``zero1/2/3`` (dpN + ZeRO), ``zero3nr`` (ZeRO-3 without
resharding after the forward), ``tp`` (tpN), ``pp4`` /
``pp8`` (ppN, 1F1B, 4 or 8 micro-batches), ``tpdp`` (tp2 x dp N/2, 4 ranks and more).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

from funcpar.models import Llama, LlamaConfig
from funcpar.testing import free_port, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LAYOUTS = {
    "dp": lambda n: ["--dp", str(n)],
    "zero1": lambda n: ["--dp", str(n), "--zero", "1"],
    "zero2": lambda n: ["--dp", str(n), "--zero", "2"],
    "zero3": lambda n: ["--dp", str(n), "--zero", "3"],
    "zero3nr": lambda n: ["--dp", str(n), "--zero", "3", "--no-reshard-after-forward"],
    "tp": lambda n: ["--tp", str(n)],
    "pp4": lambda n: ["--pp", str(n), "--microbatches", "4", "--schedule", "1f1b"],
    "pp8": lambda n: ["--pp", str(n), "--microbatches", "8", "--schedule", "1f1b"],
    "tpdp": lambda n: ["--tp", "2", "--dp", str(n // 2)],
}

DONE = re.compile(r"done: (\d+) steps in ([\d.]+)s \(([\d,]+) tok/s\)"
                  r"(?:.*blocked in collectives ([\d.]+)s)?")
COUNT = re.compile(r"^\s+(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|send|recv)"
                   r"\s+\S+\s+(\d+)\s", re.M)


def run(args: argparse.Namespace, ranks: int, layout: str | None, accum: int = 1
        ) -> dict[str, float]:
    """One training run: tokens/s, blocked seconds per step, collectives in step 1.
    ``accum``: the batch cut into that many micro-batches (one process only)."""
    common = ["--dim", str(args.dim), "--layers", str(args.layers), "--batch-size",
              str(args.batch_size // accum), "--grad-accum", str(accum),
              "--seq-len", str(args.seq_len), "--steps", str(args.steps),
              "--warmup", "2", "--threads", "1", "--print-every", str(args.steps),
              "--device", args.device]
    script = os.path.join(ROOT, "examples", "train_lm.py")
    if layout is None:
        cmd = [sys.executable, script, *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", "", script, *common, *LAYOUTS[layout](ranks),
               "--comm-report", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for attempt in (1, 2):
        if layout is not None:  # a port free now, for each attempt
            cmd[cmd.index("--master_port") + 1] = str(free_port())
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                             env=env, cwd=ROOT)
        text = out.stdout + out.stderr
        m = DONE.search(text)
        if out.returncode == 0 and m is not None:
            break
        # Seen once on the loaded 2-core VM: a gloo rank aborting at exit ("terminate called
        # without an active exception") after the run had finished; rerun it once, say so.
        print(f"warning: {layout or 'one process'} on {ranks} ranks failed (exit "
              f"{out.returncode}, attempt {attempt}):\n{text[-1500:]}", file=sys.stderr)
    else:
        raise SystemExit(f"{layout or 'one process'} on {ranks} ranks failed twice")
    steps = int(m.group(1))
    report = text[text.find("collectives issued by rank 0"):]
    return {"tok_s": float(m.group(3).replace(",", "")),
            "blocked_ms": 1e3 * float(m.group(4) or 0.0) / steps,
            "collectives": sum(int(c) for _, c in COUNT.findall(report))}


def _collective_ms(numel: int, rounds: int, device: str) -> dict[str, float]:
    """Median milliseconds of the backend's all_reduce of ``numel`` float32 entries and of the
    reduce-scatter and all-gather that ZeRO-2 runs in its place (each rank's ``numel / n``)."""
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = torch.device("cuda", dist.get_rank()) if device == "cuda" else torch.device("cpu")
    n = dist.get_world_size()
    numel -= numel % n
    x = torch.randn(numel, device=dev)
    part = torch.empty(numel // n, device=dev)
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "reduce_scatter": lambda: dist.reduce_scatter(part, list(x.chunk(n))),
           "all_gather": lambda: dist.all_gather(list(x.chunk(n)), part)}
    got: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(rounds):
        for k, op in ops.items():  # interleaved
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            op()
            if device == "cuda":
                torch.cuda.synchronize()
            got[k].append(1e3 * (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in got.items()}


def collectives(args: argparse.Namespace, n: int, numel: int) -> str:
    """One line: the collectives of dp and ZeRO-2 at the model's gradient size (``numel``
    float32 entries) on ``n`` ranks of this backend (dp all-reduces the gradients; ZeRO-2
    reduce-scatters them and all-gathers the updated parameters: the same bytes on the wire)."""
    ms = run_ranks(_collective_ms, n, numel, 9, args.device, timeout=args.timeout,
                   backend="nccl" if args.device == "cuda" else "gloo")[0]
    rs_ag = ms["reduce_scatter"] + ms["all_gather"]
    return (f"collectives of {numel * 4 / 2**20:.1f} MiB (float32 gradients) on {n} ranks: "
            f"all_reduce {ms['all_reduce']:.1f} ms (dp); reduce_scatter "
            f"{ms['reduce_scatter']:.1f} + all_gather {ms['all_gather']:.1f} = {rs_ag:.1f} ms "
            f"(ZeRO-2): {rs_ag / ms['all_reduce']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layouts", nargs="+", default=["dp", "zero1", "zero2", "zero3", "zero3nr",
                                                    "tp", "pp4", "pp8", "tpdp"],
                   choices=list(LAYOUTS))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--timeout", type=int, default=600)
    args = p.parse_args()
    cuts = sorted({int(x[2:]) for x in args.layouts if x.startswith("pp")})
    for m in cuts:
        if args.batch_size % m:
            raise SystemExit(f"--batch-size {args.batch_size} does not split into {m} "
                             "micro-batches")
    base: dict[int, list[float]] = {m: [] for m in [1, *cuts]}
    for _ in range(args.rounds):  # interleaved, as the layouts are
        for m in base:
            base[m].append(run(args, 1, None, accum=m)["tok_s"])
    one = statistics.median(base[1])
    numel = sum(p.numel() for p in Llama(LlamaConfig(
        dim=args.dim, n_layers=args.layers, max_seq_len=args.seq_len)).parameters())
    mb = {m: statistics.median(base[m]) / one for m in cuts}
    print(f"Llama dim {args.dim}, {args.layers} layers, batch {args.batch_size} x "
          f"{args.seq_len}, {args.steps} steps, 1 thread per rank, "
          f"{args.device}; one process: {one:,.0f} tok/s (median of {args.rounds})"
          + "".join(f"; in {m} micro-batches: {mb[m]:.2f} of it" for m in cuts))
    for n in args.ranks:
        layouts = [x for x in args.layouts if not (x == "tpdp" and n < 4)]
        got: dict[str, list[dict[str, float]]] = {x: [] for x in layouts}
        for r in range(args.rounds):
            order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]
            for x in order:
                got[x].append(run(args, n, x))
        med = {x: {k: statistics.median(g[k] for g in got[x]) for k in got[x][0]}
               for x in layouts}
        dp = med["dp"]["tok_s"] if "dp" in med else float("nan")
        print(f"\n{collectives(args, n, numel)}")
        print(f"{n} ranks: {'layout':<8} {'tok/s':>9} {'vs dp':>6} {'vs 1 proc':>9} "
              f"{'colls/step':>10} {'blocked ms/step':>15} {'vs bound':>8} {'vs mb bound':>11}")
        for x in layouts:
            m = med[x]
            bounds = ""
            if x.startswith("pp"):
                k = int(x[2:])
                bound = dp * k / (k + n - 1)
                bounds = f" {m['tok_s'] / bound:>8.2f} {m['tok_s'] / (bound * mb[k]):>11.2f}"
            print(f"{'':9}{x:<8} {m['tok_s']:>9,.0f} {m['tok_s'] / dp:>6.2f} "
                  f"{m['tok_s'] / one:>9.2f} {m['collectives']:>10.0f} {m['blocked_ms']:>15.1f}"
                  f"{bounds}")


if __name__ == "__main__":
    main()
