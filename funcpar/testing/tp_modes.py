"""The reference runs of the multi-dimensional tensor-parallel modes (``shard_params(mode=...)``).

Two models, trained 10 steps in float64 under a mode (spawned gloo ranks) and in one process:

* ``"llama"``: :data:`funcpar.testing.reference.CFG` (vocabulary 50, MLP width 42, 8 heads, 4
  kv heads), on :func:`funcpar.testing.reference.batches`;
* ``"mlp"``: :class:`PlainMLP`, a classifier with biases and a LayerNorm whose every dim is
  odd (uneven 2D blocks: 13 -> 7/6, 18 -> 9/9 -> 5/4, 11 -> 6/5) on a batch of 9 rows (5/4).

:func:`train` returns (losses, whole params) on every rank; compare with :func:`train` of the
same model and optimizer with ``mode=None`` (one process).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from funcpar.models import Llama, lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import Rule, llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing.reference import CFG, OPTIMIZERS, STEPS, batches, run
from funcpar.train import make_train_step
from funcpar.transforms import (
    accumulate_grads,
    amp_cast,
    compose,
    data_parallel,
    pipeline_split,
    remat,
    shard_params,
    zero_partition,
)
from funcpar.transforms.tp_modes import mode_axes

__all__ = ["MLP_RULES", "PlainMLP", "build", "class_loss", "mlp_batches", "records_vs_plan",
           "train"]


class PlainMLP(nn.Module):
    """``x [batch, 13]`` to class logits ``[batch, 11]``: linear, GELU, LayerNorm, linear,
    GELU, linear (biases everywhere)."""

    supports_tp_2d = True  # per row and per feature between its modules

    def __init__(self, d_in: int = 13, hidden: int = 18, classes: int = 11) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Float[Tensor, "batch d_in"]) -> Float[Tensor, "batch classes"]:
        h = self.norm(F.gelu(self.fc1(x)))
        return self.out(F.gelu(self.fc2(h)))


def class_loss(logits: Float[Tensor, "batch classes"],
               targets: Int[Tensor, " batch"]) -> Float[Tensor, ""]:
    """Mean cross-entropy over the batch (declared token cross-entropy, so a tensor-parallel
    mode may compute it on split logits)."""
    return F.cross_entropy(logits, targets)


class_loss.token_cross_entropy = True

MLP_RULES = [Rule("out", "vocab_parallel")]


def mlp_batches(seed: int = 0, rows: int = 9) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, 13, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (2, rows), generator=g)
    return [(x[i % 2], y[i % 2]) for i in range(STEPS)]


def build(model: str, optim: str, mode: str | None, *, dp: int = 1, zero: int = 0,
          q: int = 2, depth: int = 1, rows: int = 9, pp: int = 1, microbatches: int = 1,
          schedule: str = "1f1b", rematted: bool = False, amp: str | None = None,
          donate: bool = False, compile: bool = False, accumulate: int = 1,
          dtype: torch.dtype = torch.float64, seed: int = 0):
    """``(step, state, batches)`` of ``model`` under ``mode`` (None: one process) x dp: a
    ``q x q`` grid (2D), ``depth`` of them (2.5D) or a ``q x q x q`` cube (3D), composed in the
    documented order: pipeline_split (``pp > 1``) or accumulate_grads (``accumulate > 1``),
    shard_params, data_parallel, zero_partition, remat (``rematted``), amp_cast (``amp``).
    ``rows``: the MLP's batch rows; ``seed``: the init's; ``donate``, ``compile``:
    make_train_step's."""
    torch.manual_seed(seed)
    if model == "llama":
        net, loss, rules, data = Llama(CFG).to(dtype), lm_loss, llama_rules(CFG.head_dim), \
            batches()
    else:
        net, loss, rules, data = PlainMLP().to(dtype), class_loss, MLP_RULES, \
            mlp_batches(rows=rows)
    apply_fn, params, buffers = functionalize(net)
    opt = OPTIMIZERS[optim](params)
    step = make_train_step(apply_fn, loss, opt, donate=donate, compile=compile)
    state = init_state(params, buffers, opt, seed=seed)
    transforms = [accumulate_grads(accumulate)] if accumulate > 1 else []
    mesh = None
    if mode is not None:
        per = {"2d": 2, "2.5d": 2, "3d": 3}[mode]
        mesh = DeviceMesh.from_env(**({"pp": pp} if pp > 1 else {}), dp=dp,
                                   **mode_axes(mode, q**per * depth, depth))
        if pp > 1:
            transforms.append(pipeline_split(mesh, microbatches=microbatches,
                                             schedule=schedule))
        transforms.append(shard_params(rules, mesh, mode=mode))
        if dp > 1:
            transforms.append(data_parallel(mesh))
        if zero:
            transforms.append(zero_partition(zero, mesh))
    if rematted:
        transforms.append(remat())
    if amp is not None:
        transforms.append(amp_cast(amp, mesh=mesh))
    step, state = compose(*transforms)(step, state)
    return step, state, data


def train(model: str, optim: str, mode: str | None = "2d", **kw):
    """10 steps: (losses, whole params) on this rank."""
    step, state, data = build(model, optim, mode, **kw)
    return run(step, state, data)


def records_vs_plan(mode: str, model: str, **kw) -> tuple[list, list]:
    """One SGD step of ``model`` under ``mode`` (``build``'s keywords): this rank's collectives
    from ``comm_log`` (all but the gradient norm's) and the plan's
    (:func:`~funcpar.transforms.tp_modes.planned_collectives`), each as sorted ``(op, axis,
    bytes, purpose)``."""
    from funcpar.shard.comm import comm_log
    from funcpar.transforms.tp_cube import plan_3d
    from funcpar.transforms.tp_modes import batch_rows, plan_2d, planned_collectives

    step, state, data = build(model, "sgd", mode, **kw)
    net = step.apply_fn.module
    rules = llama_rules(CFG.head_dim) if model == "llama" else MLP_RULES
    per = 3 if mode == "3d" else 2
    depth = kw.get("depth", 1)
    mesh = DeviceMesh.from_env(**mode_axes(mode, kw.get("q", 2) ** per * depth, depth))
    if mode == "3d":
        plan = plan_3d(net, rules, mesh)
        axes = plan.cube.row_axes(0)
    else:
        plan = plan_2d(net, rules, mesh, mode)
        axes = plan.grid.batch_axes
    inputs, _ = data[0]
    rows = batch_rows(inputs, mesh, axes, "the inputs", mode).shape[0]
    rows *= inputs.shape[1] if model == "llama" else 1
    planned = planned_collectives(plan, rows, torch.float64,
                                  data_fed=("fc1",) if model == "mlp" else ())
    with comm_log.capture() as recs:
        step(state, data[0])
    got = sorted((r.op, r.axis, r.nbytes, r.purpose) for r in recs
                 if "global_norm" not in r.purpose)
    return got, sorted((p.op, p.axis, p.nbytes, p.purpose) for p in planned)
