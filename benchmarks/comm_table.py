"""Extra communication each optimizer adds, per parallel layout, from the comm log.

    python benchmarks/comm_table.py                  # float32, all optimizers x all layouts
    python benchmarks/comm_table.py --dtype float64 --optim adafactor lamb

For every optimizer x layout the composed step (``shard_params`` for tp, ``data_parallel`` for
dp, ``zero_partition`` for ZeRO, in that order) runs on gloo ranks of this machine: one
warm-up step, then one measured step. Every collective of the measured step on rank 0 is taken
from :data:`funcpar.shard.comm.comm_log` and put in one class:

* **tp activations**: the model's own tensor-parallel collectives in forward and backward
  (row-split sums, vocab-parallel embedding and loss, their gradients);
* **grad reduction**: data-parallel all-reduce buckets (``dp grads``) or ZeRO's per-leaf
  reduce-scatter (``zero grad``; ``zero grad (whole)`` for leaves too small to cut);
* **ZeRO-3 param gathers**: the forward's all-gathers of partitioned parameters;
* **optimizer extra**: every collective issued inside ``optimizer.update`` (the step's
  optimizer is wrapped to capture them). Split into *reductions* (norms, row/column
  statistics, RMS, GaLore's projections, 8-bit absmax and refresh gathers, clipping's global
  norm) and ZeRO's *update gathers*
  (stages 1-2 gather the updated parts back into whole leaves);
* **metrics**: the ``grad_norm`` metric's all-reduce(s) and the ``dp loss`` mean.

Bytes follow the comm log's convention (nccl-tests'): the largest buffer of the operation on
this rank - the tensor for all-reduce, the gathered output for all-gather, the full input for
reduce-scatter. One spawn of ranks per world size runs every case of that size. Optimizers
that raise NotImplementedError under a layout are listed as skipped, not hidden.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from funcpar.models import Llama
from funcpar.optim.base import GradientTransformation
from funcpar.shard.comm import CommRecord, comm_log
from funcpar.testing import reference, run_ranks

# The optimizers, hyperparameters, layouts and model of the distributed tests
# (funcpar.testing.reference); the hyperparameters do not change which collectives run.
# adamw_small_lr is the float32 tests' AdamW: the same collectives as adamw.
OPTIMIZERS = {k: v for k, v in reference.OPTIMIZERS.items() if k != "adamw_small_lr"}
LAYOUTS = reference.LAYOUTS
CFG = reference.CFG

DETAIL = ("adafactor", "tp2xdp2+zero2")  # the case whose purposes are printed one by one


# ------------------------------------------------------------------------------ on the ranks
def _batches() -> list:
    return reference.batches()[:2]  # warm-up, measured


def _with_captured_update(step, sink: list[list[CommRecord]]):
    """``step`` whose optimizer appends the records of each ``update`` call to ``sink``."""
    inner = step.optimizer

    def update(grads, state, params=None, *, layouts=None):
        with comm_log.capture() as recs:
            out = inner.update(grads, state, params, layouts=layouts)
        sink.append(recs)
        return out

    return dataclasses.replace(step, optimizer=GradientTransformation(inner.init, update))


def _one_case(optim: str, tp: int, dp: int, zero: int, dtype: torch.dtype) -> dict:
    step, state = reference.build(tp, dp, optim, dtype, zero=zero)
    opt_recs: list[list[CommRecord]] = []
    step = _with_captured_update(step, opt_recs)
    steps = []
    for batch in _batches():
        with comm_log.capture() as recs:
            state, _ = step(state, batch)
        # Records are shared objects: the ones also captured inside update are the optimizer's.
        inside = {id(r) for r in opt_recs[-1]}
        steps.append([(tuple(r), id(r) in inside) for r in recs])
    return {"steps": steps}


def run_world(cases: list[tuple[str, str]], dtype: torch.dtype) -> dict | None:
    """Every (optim, layout) of one world size; rank 0 returns its records."""
    import torch.distributed as dist

    out = {}
    for optim, layout in cases:
        _, tp, dp, zero = LAYOUTS[layout]
        try:
            out[(optim, layout)] = _one_case(optim, tp, dp, zero, dtype)
        except NotImplementedError as err:  # raised before any collective, on every rank
            out[(optim, layout)] = {"skipped": f"{type(err).__name__}: {err}"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    return out if rank == 0 else None


# ------------------------------------------------------------------------------ classifying
def _what(purpose: str) -> str:
    """The purpose without its leaf name (``layers.0.w: factored row mean`` -> the latter)."""
    return purpose.split(": ", 1)[1] if ": " in purpose else purpose


def classify(rec: CommRecord, in_opt: bool) -> str:
    what = _what(rec.purpose)
    if in_opt:
        if what == "zero update gather":
            return "opt gather"
        # clip_by_global_norm, chained before the optimizer: the same for every optimizer
        return "opt clip" if what == "global_norm" else "opt reduce"
    if what.startswith(("dp grads", "zero grad", "sequence-parallel grads")):
        return "grad reduction"
    if what.startswith("zero3"):  # the forward's gathers and any regather for the backward
        return "zero3 param gather"
    if what in ("global_norm", "dp loss"):
        return "metrics"
    return "tp activations"


def tally(steps_rec: list) -> dict[str, list[int]]:
    """class -> [count, bytes, largest message] of one step's records."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for rec, in_opt in steps_rec:
        r = CommRecord(*rec)
        c = out[classify(r, in_opt)]
        c[0] += 1
        c[1] += r.nbytes
        c[2] = max(c[2], r.nbytes)
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def _cell(t: dict[str, list[int]], key: str) -> str:
    n, b, _ = t.get(key, (0, 0, 0))
    return "0" if n == 0 else f"{n} / {_fmt_bytes(b)}"


def _table(rows: list[str], cols: list[str], cell: Callable[[str, str], str], corner: str) -> str:
    lines = ["| " + " | ".join([corner, *cols]) + " |",
             "|" + "|".join(["---"] + ["--:"] * len(cols)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([r, *(cell(r, c) for c in cols)]) + " |")
    return "\n".join(lines)


def detail(steps_rec: list) -> str:
    """Per (class, op, axis, purpose without leaf): count, bytes, leaves."""
    groups: dict[tuple, list] = {}
    for rec, in_opt in steps_rec:
        r = CommRecord(*rec)
        key = (classify(r, in_opt), r.op, r.axis, _what(r.purpose))
        g = groups.setdefault(key, [0, 0, set(), set()])
        g[0] += 1
        g[1] += r.nbytes
        g[2].add(r.purpose.split(": ", 1)[0] if ": " in r.purpose else "-")
        g[3].add(r.nbytes)
    order = ["tp activations", "grad reduction", "zero3 param gather", "opt reduce",
             "opt clip", "opt gather", "metrics"]
    lines = ["| class | op | axis | purpose | count | bytes | bytes per message |",
             "|---|---|---|---|--:|--:|---|"]
    for key in sorted(groups, key=lambda k: (order.index(k[0]), k[1], k[2], k[3])):
        n, b, _, sizes = groups[key]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {n} | {_fmt_bytes(b)} | "
                     f"{', '.join(str(s) for s in sorted(sizes))} |")
    return "\n".join(lines)


def by_purpose(steps_rec: list) -> str:
    """The optimizer reductions of a step as ``purpose [axis] count / bytes; ...``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rec, in_opt in steps_rec:
        r = CommRecord(*rec)
        if classify(r, in_opt) == "opt reduce":
            g = groups.setdefault((_what(r.purpose), r.axis), [0, 0])
            g[0] += 1
            g[1] += r.nbytes
    return "; ".join(f"{what} [{axis}] {n} / {_fmt_bytes(b)}"
                     for (what, axis), (n, b) in sorted(groups.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--optim", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    results: dict = {}
    for world in sorted({LAYOUTS[lay][0] for lay in args.layouts}):
        cases = [(o, lay) for lay in args.layouts if LAYOUTS[lay][0] == world
                 for o in args.optim]
        results.update(run_ranks(run_world, world, cases, dtype, backend=None, timeout=1200)[0])
    elapsed = time.perf_counter() - t0

    ok = {k: v for k, v in results.items() if "skipped" not in v}
    measured = {k: tally(v["steps"][1]) for k, v in ok.items()}
    warm = {k: tally(v["steps"][0]) for k, v in ok.items()}
    lays, opts = args.layouts, args.optim
    largest_leaf = max(p.numel() * p.element_size()
                       for p in Llama(CFG).to(dtype).parameters())

    def by_case(key: str, warmup: bool = False, field: int | None = None):
        def cell(o: str, lay: str) -> str:
            if (o, lay) not in ok:
                return "skipped" if (o, lay) in results else "-"
            t = (warm if warmup else measured)[(o, lay)]
            if field is not None:
                return _fmt_bytes(t.get(key, (0, 0, 0))[field])
            return _cell(t, key)
        return cell

    print(f"# Extra optimizer communication ({args.dtype}, gloo, rank 0 of the measured step; "
          f"{elapsed:.0f} s)\n")
    print(f"Model: {CFG}\n")
    print("## Optimizer reductions inside optimizer.update (clipping and ZeRO gathers "
          "excluded): count / bytes\n")
    print(_table(opts, lays, by_case("opt reduce"), "optimizer"))
    print(f"\n## Largest single optimizer reduction, bytes (largest parameter, whole: "
          f"{_fmt_bytes(largest_leaf)})\n")
    print(_table(opts, lays, by_case("opt reduce", field=2), "optimizer"))

    def per_layout(key: str) -> Callable[[str, str], str]:
        def cell(row: str, lay: str) -> str:
            vals = {_cell(measured[(o, lay)], key) for o in opts if (o, lay) in measured}
            return " or ".join(sorted(vals)) if vals else "-"
        return cell

    rows = {"clip_by_global_norm (in update)": "opt clip",
            "ZeRO update gathers (in update)": "opt gather",
            "grad reduction": "grad reduction",
            "ZeRO-3 param gathers": "zero3 param gather",
            "tp activations (fwd + bwd)": "tp activations",
            "metrics (grad_norm, dp loss)": "metrics"}
    print("\n## Per layout, the same for every optimizer: count / bytes\n")
    print(_table(list(rows), lays, lambda r, lay: per_layout(rows[r])(r, lay), "class"))

    differ = [o for o in opts if any(
        (o, lay) in ok and warm[(o, lay)].get("opt reduce", [0, 0, 0])[:2]
        != measured[(o, lay)].get("opt reduce", [0, 0, 0])[:2] for lay in lays)]
    if differ:
        print("\n## Warm-up step (step 0) where it differs from the measured step: optimizer "
              "reductions, count / bytes\n")
        print(_table(differ, lays, by_case("opt reduce", warmup=True), "optimizer"))

    skipped = {k: v["skipped"] for k, v in results.items() if "skipped" in v}
    if skipped:
        print("\n## Skipped\n")
        for (o, lay), why in skipped.items():
            print(f"- {o} under {lay}: {why}")

    if any((o, DETAIL[1]) in ok for o in opts):
        print(f"\n## Optimizer reductions by purpose under {DETAIL[1]} (measured step): "
              "purpose [axis] count / bytes\n")
        print("| optimizer | purposes |\n|---|---|")
        for o in opts:
            if (o, DETAIL[1]) in ok:
                print(f"| {o} | {by_purpose(ok[(o, DETAIL[1])]['steps'][1]) or 'none'} |")
    if DETAIL in ok:
        print(f"\n## {DETAIL[0]} under {DETAIL[1]}: every collective of the measured step "
              "(rank 0), by purpose\n")
        print(detail(ok[DETAIL]["steps"][1]))
    print("\nLegend: count / bytes per step on rank 0; bytes as the comm log counts them "
          "(all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the full "
          "input). Optimizer reductions: collectives issued inside optimizer.update other than "
          "clip_by_global_norm's global_norm (every optimizer but adafactor_relative is chained "
          "after clipping at 0.5) and ZeRO's update gathers, which the per-layout table shows.")

if __name__ == "__main__":
    main()
