"""Tensor-parallel modes side by side: measured bytes, messages and activation memory per rank.

    python benchmarks/bench_tp_modes.py            # one process, 1D tp4, 2D 2x2 on 4 gloo ranks

The example Llama (funcpar.testing.reference.CFG: dim 32, 2 blocks, vocabulary 50), float64,
batch 8 x 12, SGD. For each mode, one training step on rank 0:

* **bytes / messages**: every collective of the forward and backward from ``comm_log`` (the
  gradient-norm all-reduce left out), with the comm log's byte convention;
* **activations**: the bytes autograd saves for the backward (``saved_tensors_hooks``, each
  storage counted once; parameters excluded), next to one process's;
* **params**: this rank's parameter bytes.

For 2D the measured collectives are also compared with
:func:`funcpar.transforms.tp_modes.planned_collectives` (equal, or the script fails).
"""

from __future__ import annotations

import torch

from funcpar.shard.comm import comm_log
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, batches, build
from funcpar.testing.tp_modes import build as build_2d
from funcpar.transforms.tp_modes import plan_2d, planned_collectives


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
    pbytes = sum(p.numel() * p.element_size() for p in state.params.values())
    return {"bytes": sum(r.nbytes for r in recs), "messages": len(recs),
            "activations": sum(seen.values()), "params": pbytes}, recs


def _one_process():
    step, state = build(1, 1, "sgd")
    return _measure(step, state, batches()[0])[0]


def _tp1d():
    step, state = build(4, 1, "sgd")
    return _measure(step, state, batches()[0])[0]


def _tp2d():
    step, state, data = build_2d("llama", "sgd", "2d")
    out, recs = _measure(step, state, data[0])
    plan = plan_2d(step.apply_fn.module, llama_rules(CFG.head_dim),
                   DeviceMesh.from_env(tp_row=2, tp_col=2))
    rows = 4 * data[0][0].shape[1]
    want = sorted((p.op, p.axis, p.nbytes, p.purpose)
                  for p in planned_collectives(plan, rows, torch.float64))
    got = sorted((r.op, r.axis, r.nbytes, r.purpose) for r in recs)
    out["plan_equal"] = want == got
    return out


def _on_four():
    return {"1d tp4": _tp1d(), "2d 2x2": _tp2d()}


def main() -> None:
    one = _one_process()
    res = run_ranks(_on_four, 4, timeout=600)[0]
    print(f"{'mode':<10} {'bytes':>10} {'messages':>9} {'activations':>12} {'x one':>6} "
          f"{'params':>8} {'x one':>6}")
    for name, r in {"one proc": one, **res}.items():
        print(f"{name:<10} {r['bytes']:>10,} {r['messages']:>9} {r['activations']:>12,} "
              f"{r['activations'] / one['activations']:>6.2f} {r['params']:>8,} "
              f"{r['params'] / one['params']:>6.2f}")
    if not res["2d 2x2"]["plan_equal"]:
        raise SystemExit("2D: the measured collectives differ from planned_collectives")
    print("2D: measured collectives equal planned_collectives")


if __name__ == "__main__":
    main()
