"""Tensor-parallel modes side by side: measured bytes, messages and activation memory per rank.

    python benchmarks/bench_tp_modes.py   # one process; 1D tp4 and 2D 2x2 on 4 gloo ranks;
                                          # 2.5D 2x2x(depth 2) and 3D 2x2x2 on 8

The example Llama (funcpar.testing.reference.CFG: dim 32, 2 blocks, vocabulary 50, 8 heads, 4
kv heads, so 1D stops at 4 ranks), float64, batch 8 x 12, SGD. For each mode, one training step
on rank 0:

* **bytes / messages**: every collective of the forward and backward from ``comm_log`` (the
  gradient-norm all-reduce left out), with the comm log's byte convention; the linear layers'
  bytes split into the transfers of *activation* blocks (panels of ``X``, ``dY``, the ``dX``
  partials) and of *weight* blocks (panels of ``W``, the ``dW`` partials), the seed formulas'
  two kinds of terms, and the rest (norms, embedding, loss, 2.5D's gradient sum over depth);
* **formula**: the seed table's bandwidth term at these ``P``, ``q``, ``d``;
* **activations**: the bytes autograd saves for the backward (``saved_tensors_hooks``, each
  storage counted once; parameters excluded), next to one process's;
* **params**: this rank's parameter bytes.

For 2D, 2.5D and 3D the measured collectives are also compared with
:func:`funcpar.transforms.tp_modes.planned_collectives` (equal, or the script fails).
"""

from __future__ import annotations

import torch
from torch import nn

from funcpar.shard.comm import comm_log
from funcpar.testing import run_ranks
from funcpar.testing.reference import batches, build
from funcpar.testing.tp_modes import build as build_nd
from funcpar.testing.tp_modes import records_vs_plan

#: Purpose endings of a linear layer's weight-block transfers (summa.py, cube.py); the 2D
#: ``(grad) partials`` over tp_row are ``dW``'s, over tp_col ``dX``'s.
_WEIGHT = ("B panel", "B gather", "dB partials")


def _kind(rec, linears: set[str]) -> str:
    who = rec.purpose.split(" ")[0]
    if who not in linears:  # a linear's bias gather ("name: bias") is not a block transfer
        return "other"
    if rec.purpose.endswith(_WEIGHT) or (rec.purpose.endswith("(grad) partials")
                                         and rec.axis == "tp_row"):
        return "weight"
    return "act"


def _measure(step, state, batch):
    params = {p.untyped_storage().data_ptr() for p in state.params.values()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with comm_log.capture() as recs, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(state, batch)
    recs = [r for r in recs if "global_norm" not in r.purpose]
    linears = {n for n, m in step.apply_fn.module.named_modules() if isinstance(m, nn.Linear)}
    split = {"act": 0, "weight": 0, "other": 0, "regather": 0}
    for r in recs:
        split[_kind(r, linears)] += r.nbytes
        # 3D's backward gathers A and B again (cube.py saves its own blocks only).
        split["regather"] += r.nbytes * r.purpose.endswith(("(grad) A gather",
                                                             "(grad) B gather"))
    pbytes = sum(p.numel() * p.element_size() for p in state.params.values())
    return {"bytes": sum(r.nbytes for r in recs), "messages": len(recs), **split,
            "activations": sum(seen.values()), "params": pbytes}, recs


def _one_process():
    step, state = build(1, 1, "sgd")
    return _measure(step, state, batches()[0])[0]


def _tp1d():
    step, state = build(4, 1, "sgd")
    return _measure(step, state, batches()[0])[0]


def _grid_mode(mode: str, depth: int = 1):
    step, state, data = build_nd("llama", "sgd", mode, depth=depth)
    out = _measure(step, state, data[0])[0]
    got, want = records_vs_plan(mode, "llama", depth=depth)  # one more step, on a fresh build
    out["plan_equal"] = got == want
    return out


def _on_four():
    return {"1d tp4": _tp1d(), "2d 2x2": _grid_mode("2d")}


def _on_eight():
    return {"2.5d 2x2x2": _grid_mode("2.5d", depth=2), "3d 2x2x2": _grid_mode("3d")}


#: The seed table's bandwidth term per linear layer, at the benchmark's sizes.
FORMULAS = {"1d tp4": ("2(P-1)/P", 2 * 3 / 4), "2d 2x2": ("6(q-1)/q", 6 * 1 / 2),
            "2.5d 2x2x2": ("3(q-1)(d+1)/dq", 3 * 1 * 3 / 4), "3d 2x2x2": ("6(q-1)/q^3", 6 / 8)}


def main() -> None:
    one = _one_process()
    res = {**run_ranks(_on_four, 4, timeout=600)[0], **run_ranks(_on_eight, 8, timeout=600)[0]}
    print(f"{'mode':<11} {'bytes':>9} {'msgs':>5} {'linear act':>10} {'linear W':>9} "
          f"{'other':>8} {'formula':>20} {'activations':>11} {'x one':>6} {'params':>8} "
          f"{'x one':>6}")
    for name, r in {"one proc": one, **res}.items():
        f, v = FORMULAS.get(name, ("", 0.0))
        form = f"{f} = {v:.2f}" if f else ""
        grid = name not in ("one proc", "1d tp4")  # 1D's collectives are not per linear
        act, w = (f"{r['act']:,}", f"{r['weight']:,}") if grid else ("-", "-")
        print(f"{name:<11} {r['bytes']:>9,} {r['messages']:>5} {act:>10} "
              f"{w:>9} {r['other']:>8,} {form:>20} {r['activations']:>11,} "
              f"{r['activations'] / one['activations']:>6.2f} {r['params']:>8,} "
              f"{r['params'] / one['params']:>6.2f}")
    r3 = res["3d 2x2x2"]
    print(f"3d: of its linear bytes, {r3['regather']:,} are the backward's second gathers of A "
          f"and B; the other {r3['act'] + r3['weight'] - r3['regather']:,} are the six "
          "collectives per linear that the seed's 6(q-1)/q^3 counts")
    for name, r in res.items():
        if "plan_equal" in r and not r["plan_equal"]:
            raise SystemExit(f"{name}: the measured collectives differ from planned_collectives")
    print("2D, 2.5D, 3D: measured collectives equal planned_collectives")


if __name__ == "__main__":
    main()
