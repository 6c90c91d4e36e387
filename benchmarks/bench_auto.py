"""Validate the layout search's cost model: predicted vs measured step time and peak memory.

    python benchmarks/bench_auto.py                       # 4 gloo ranks, a small Llama
    python benchmarks/bench_auto.py --moe                 # its MoE variant (ep layouts)
    python benchmarks/bench_auto.py --device cuda --ranks 8 --profile h100 ...   # a GPU node

For each layout (``funcpar.auto.Choice``, composed with ``preset_for``: the
``hybrid_parallel``/``moe_hybrid`` preset, then remat when chosen) fresh ranks run
``--warmup`` steps, then ``--steps`` timed steps (rank 0's median wall time per step, each step
ended by a barrier; the ranks' process CPU time per step summed in ``cpu ms``), then, in the
first round, two steps under the memory probe. ``--rounds`` interleaved rounds run every
layout once each (a slow spell of a shared machine lands on a round of every layout); a
layout's time is the median over rounds, and the Spearman correlation of one round's times
with another's is printed as the measurement's own reproducibility, the ceiling of any
prediction's. Peak memory per rank
on a CPU (first round): the state's tensor bytes plus the largest rise of glibc's in-use heap
(``mallinfo2``: ``uordblks + hblkhd``, sampled every 0.2 ms in a thread, apart from the timed
steps) above its value before them; on CUDA ``max_memory_allocated``. The predictions are
``funcpar.auto.estimate`` with ``--profile`` (default the shipped ``cpu-gloo``, measured on
this machine by ``python -m funcpar.profile --ranks 4``) and no margin. Printed: the table,
the Spearman rank correlation of the times, the largest memory error (relative), and the
layout ``auto_parallel`` chooses among the same space against the best measured one.
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from funcpar.auto import Choice, auto_parallel, estimate, load_profile, model_spec
from funcpar.auto.heap import HeapPeak

DENSE_LAYOUTS = [
    Choice(dp=4, precision="fp32"), Choice(dp=4, zero=1, precision="fp32"),
    Choice(dp=4, zero=2, precision="fp32"), Choice(dp=4, zero=3, precision="fp32"),
    Choice(tp=2, dp=2, precision="fp32"), Choice(tp=2, dp=2, zero=2, precision="fp32"),
    Choice(tp=4, precision="fp32"), Choice(tp=2, dp=2, sequence_parallel=True,
                                           precision="fp32"),
    Choice(pp=2, dp=2, microbatches=2, precision="fp32"),
    Choice(pp=2, tp=2, microbatches=4, precision="fp32"),
    Choice(pp=4, microbatches=4, precision="fp32"),
    Choice(pp=2, dp=2, microbatches=4, schedule="gpipe", precision="fp32"),
    Choice(dp=4, remat=True, precision="fp32"),
    Choice(cp=2, dp=2, precision="fp32"), Choice(cp=4, cp_mode="ulysses", precision="fp32"),
    Choice(cp=2, tp=2, precision="fp32"), Choice(tp=4, tp_mode="2d", precision="fp32"),
]
MOE_LAYOUTS = [
    Choice(dp=4, precision="fp32"), Choice(dp=4, zero=2, precision="fp32"),
    Choice(ep=2, dp=2, precision="fp32"), Choice(ep=2, dp=2, zero=2, precision="fp32"),
    Choice(ep=4, precision="fp32"), Choice(dp=4, zero=3, precision="fp32"),
    Choice(pp=2, dp=2, microbatches=2, precision="fp32"),
    Choice(ep=2, pp=2, microbatches=2, precision="fp32"),
]


def _rank(cfg_kw: dict, choice: Choice, batch: int, seq: int, warmup: int, steps: int,
          device: str, mem_steps: int = 2) -> dict:
    import torch.distributed as dist

    import funcpar.optim as fo
    from funcpar.auto.search import preset_for
    from funcpar.models import Llama, LlamaConfig, lm_loss, moe_lm_loss
    from funcpar.optim.memory import state_bytes
    from funcpar.shard.mesh import DeviceMesh
    from funcpar.state import functionalize, init_state
    from funcpar.state.tree import tree_leaves
    from funcpar.train import make_train_step

    torch.set_num_threads(1)
    cfg = LlamaConfig(**cfg_kw)
    mesh = DeviceMesh.from_env(**choice.axes())
    dev = mesh.device if device == "cuda" else torch.device("cpu")
    apply_fn, params, buffers = functionalize(Llama(cfg, seed=0, device=dev), release=True)
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(1e-3))
    loss = moe_lm_loss if cfg.n_experts else lm_loss
    step = make_train_step(apply_fn, loss, opt, donate=True)
    state = init_state(params, buffers, opt)
    del params
    step, state = preset_for(choice, mesh=mesh)(step, state)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(dev)
    data = (tok[:, :-1], tok[:, 1:])
    for _ in range(warmup):
        state, _ = step(state, data)
    dist.barrier()
    held = sum(x.numel() * x.element_size() for x in tree_leaves(state.params)
               if torch.is_tensor(x)) + state_bytes(state.opt_state)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    # Timed steps first, then the memory steps: the heap sampler's thread wakes every 0.2 ms
    # and, on shared CPU cores, would take time from the ranks it measures.
    times = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = step(state, data)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t)
    cpu = (time.process_time() - cpu0) / steps
    probe = contextlib.nullcontext() if cuda else HeapPeak()
    with probe:
        for _ in range(mem_steps):
            state, metrics = step(state, data)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
    rise = torch.cuda.max_memory_allocated(dev) - base if cuda else probe.rise
    return {"time": statistics.median(times), "peak": held + rise, "cpu": cpu,
            "loss": float(metrics["loss"])}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", default="cpu-gloo")
    p.add_argument("--moe", action="store_true", help="the MoE variant (4 experts, top-2)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the layouts")
    p.add_argument("--only", type=int, default=None, help="the first N layouts")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from funcpar.testing import run_ranks

    cfg_kw = {"vocab_size": args.vocab, "dim": args.dim, "n_layers": args.layers,
              "n_heads": args.heads, "max_seq_len": args.seq}
    if args.moe:
        cfg_kw.update(n_experts=4, top_k=2, moe_every=2, capacity_factor=2.0)
    from funcpar.models import LlamaConfig

    spec = model_spec(LlamaConfig(**cfg_kw))
    prof = load_profile(args.profile)
    layouts = list(MOE_LAYOUTS if args.moe else DENSE_LAYOUTS)
    if args.ranks != 4:
        layouts = [dataclasses.replace(c, dp=c.dp * args.ranks // c.world) for c in layouts
                   if args.ranks % (c.world // c.dp) == 0]
        # ZeRO without data parallelism is the layout without it.
        layouts = list(dict.fromkeys(dataclasses.replace(c, zero=0) if c.dp == 1 else c
                                     for c in layouts))
    chosen = auto_parallel(spec, world_size=args.ranks, global_batch=args.batch,
                           seq_len=args.seq, profile=prof, memory_per_rank=1e12,
                           constraints={"precision": "fp32", "max_tp": 4}).best.choice
    if chosen not in layouts:
        layouts.append(chosen)
    if args.only:
        layouts = layouts[: args.only] + ([chosen] if chosen not in layouts[: args.only]
                                          else [])
    print(f"bench_auto: {spec.n_params / 1e6:.2f} M params ({'MoE' if args.moe else 'dense'}), "
          f"batch {args.batch} x {args.seq}, {args.ranks} ranks on {args.device}, profile "
          f"{prof.name}; {args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed "
          f"steps per layout", flush=True)
    # Interleaved rounds: each round runs every layout once in fresh ranks, so a slow spell
    # of a shared machine lands on one round of every layout rather than on a few layouts;
    # a layout's time is the median over rounds of its ranks' median step.
    runs: dict[Choice, list[dict]] = {c: [] for c in layouts}
    for r in range(args.rounds):
        for c in layouts:
            runs[c].append(run_ranks(_rank, args.ranks, cfg_kw, c, args.batch, args.seq,
                                     args.warmup, args.steps, args.device,
                                     2 if r == 0 else 0, timeout=900))  # memory: round 1
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"{'layout':<40} {'pred ms':>9} {'meas ms':>9} {'pred MiB':>9} {'meas MiB':>9} "
          f"{'mem err':>8} {'cpu ms':>8}", flush=True)
    rows = []
    for c in layouts:
        est = estimate(spec, c, prof, args.batch, args.seq, margin=0.0)
        meas_t = statistics.median(out[0]["time"] for out in runs[c])
        cpu = statistics.median(sum(r["cpu"] for r in out) for out in runs[c])
        meas_m = max(r["peak"] for r in runs[c][0])  # the first round: fresh processes
        err = est.peak / meas_m - 1
        rows.append({"layout": str(c), "pred_ms": est.time * 1e3, "meas_ms": meas_t * 1e3,
                     "meas_ms_rounds": [out[0]["time"] * 1e3 for out in runs[c]],
                     "cpu_ms": cpu * 1e3, "pred_mib": est.peak / 2**20,
                     "meas_mib": meas_m / 2**20, "mem_err": err, "chosen": c == chosen})
        mark = "  <- chosen" if c == chosen else ""
        print(f"{c!s:<40} {est.time * 1e3:>9.1f} {meas_t * 1e3:>9.1f} "
              f"{est.peak / 2**20:>9.1f} {meas_m / 2**20:>9.1f} {err * 100:>7.1f}% "
              f"{cpu * 1e3:>8.1f}{mark}", flush=True)
    rho = spearman([r["pred_ms"] for r in rows], [r["meas_ms"] for r in rows])
    pairs = [spearman([r["meas_ms_rounds"][i] for r in rows],
                      [r["meas_ms_rounds"][j] for r in rows])
             for i in range(args.rounds) for j in range(i + 1, args.rounds)]
    worst = max(rows, key=lambda r: abs(r["mem_err"]))
    best = min(rows, key=lambda r: r["meas_ms"])
    ch = next(r for r in rows if r["chosen"])
    print(f"Spearman rank correlation of step times: {rho:.3f} over {len(rows)} layouts")
    if pairs:
        print(f"one round's measured times against another's: Spearman median "
              f"{statistics.median(pairs):.3f} (range {min(pairs):.3f} .. {max(pairs):.3f})")
    print(f"largest memory error: {worst['mem_err'] * 100:+.1f} % ({worst['layout']})")
    slower = (ch["meas_ms"] / best["meas_ms"] - 1) * 100
    print(f"chosen {ch['layout']}: measured {ch['meas_ms']:.1f} ms; best measured "
          f"{best['layout']} {best['meas_ms']:.1f} ms ({slower:+.1f} %)")
    result = {"rows": rows, "spearman": rho, "round_spearman": pairs,
              "largest_mem_err": worst["mem_err"],
              "chosen": ch["layout"], "best_measured": best["layout"]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
