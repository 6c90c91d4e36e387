"""``check_rules``: does a model compute the same thing under tensor-parallel rules?

A rule set is a claim about a model's code: that a column-split projection's output is only
ever reshaped by ``head_dim``, that nothing between two regions reads a split width, that a
module's own forward adds nothing the sharded forward would lose (Gemma's embedding scale). A
wrong claim is usually *silent*: shapes still fit, the loss goes down, the parameters drift.
:func:`check_rules` tests the claim on the user's own model before training: one forward and
backward of a random batch under ``shard_params(rules, mesh)`` against the same on the whole
model, in float64 where the model allows, comparing the loss and every parameter's gradient
(after the step's ``sync_grads``: a ``grad_sum`` leaf is compared after its sum).

The tolerance is ``tol`` or, when larger, 100 times the whole model's own round-off, measured
by a second whole run on the batch with its rows reversed (the same sums in another order): a
model that computes parts in float32 whatever its dtype (Gemma 3's norms call ``.float()``)
cannot be reproduced closer than that by any reordering, while a wrong rule is off by far
more (Gemma's lost embedding scale: a relative 0.5 in the first gradient).

Collective: call it on every rank of ``mesh`` (each rank checks the same thing; the ranks of
the other axes repeat the ``tp`` check). The model is copied (``copy.deepcopy``), cast to
``dtype`` and put in eval mode (dropout off, so the two runs draw nothing), so the caller's
model is untouched; a model too big to copy in float64 is checked on a small config of the
same family instead.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from funcpar.models.llama import lm_loss
from funcpar.optim import sgd
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import LocalAttr, Rule, plan_sharding
from funcpar.state import functionalize, init_state
from funcpar.train.step import loss_and_grads, make_train_step
from funcpar.transforms.shard_params import logits_of, shard_params

__all__ = ["RulesCheck", "check_rules", "rel_err", "token_loss"]


def token_loss(output: Any, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of a model's logits (a tensor or ``output.logits``)."""
    return lm_loss(logits_of(output), targets)


token_loss.token_cross_entropy = True  # lets shard_params compute it vocab-parallel


@dataclasses.dataclass(frozen=True)
class RulesCheck:
    """The outcome of :func:`check_rules`: relative errors against the whole model."""

    loss: float  # the whole model's loss
    loss_err: float  # |loss_tp - loss| / |loss|
    grad_errs: dict[str, float]  # per parameter: max |g_tp - g| / max |g| (0-gradients: abs)
    matched_by: dict[str, str]  # per parameter: the rule that matched it
    tol: float  # the tolerance applied: max(tol asked, 100 x noise_floor)
    noise_floor: float  # the whole model's own round-off (module docstring)

    @property
    def worst(self) -> tuple[str, float]:
        return max(self.grad_errs.items(), key=lambda kv: kv[1], default=("", 0.0))

    @property
    def ok(self) -> bool:
        return self.loss_err <= self.tol and self.worst[1] <= self.tol

    def report(self, top: int = 5) -> str:
        bad = sorted(self.grad_errs.items(), key=lambda kv: -kv[1])[:top]
        lines = [f"loss rel err {self.loss_err:.2e} (tol {self.tol:.0e}; the whole model's "
                 f"round-off {self.noise_floor:.0e})"]
        lines += [f"  {n}: grad rel err {e:.2e} (rule {self.matched_by.get(n, '?')})"
                  for n, e in bad]
        return "\n".join(lines)


def check_rules(
    model: nn.Module,
    rules: Sequence[Rule | LocalAttr],
    mesh: DeviceMesh,
    *,
    axis: str = "tp",
    batch: tuple[Any, Any] | None = None,
    loss_fn: Callable[[Any, Tensor], Tensor] = token_loss,
    dtype: torch.dtype | None = torch.float64,
    batch_size: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    tol: float | None = None,
    raise_on_error: bool = True,
) -> RulesCheck:
    """One ``shard_params(rules, mesh)`` forward and backward of ``model`` against the whole
    model (module docstring). ``batch`` defaults to random token ids (``seed``) of the model's
    ``config.vocab_size``, ``batch_size x seq_len``, predicting the next token; ``loss_fn`` to
    :func:`token_loss` (token cross-entropy of ``output.logits``). ``dtype``: the copy's dtype
    (None: as it is). ``tol``: the largest relative error accepted, by default ``1e-9`` in
    float64 and ``1e-3`` otherwise (the sharded sums only reorder additions). A failed check is
    a ValueError naming the worst parameters and their rules (``raise_on_error``); the
    returned :class:`RulesCheck` holds every error either way.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"check_rules: the mesh has no axis {axis!r}: its axes are "
                         f"{mesh.axis_names}")
    work = copy.deepcopy(model)
    if dtype is not None:
        work = work.to(dtype)
    work.eval()
    if tol is None:
        first = next(work.parameters(), None)
        tol = 1e-9 if first is None or first.dtype == torch.float64 else 1e-3
    if batch is None:
        batch = _random_batch(work, batch_size, seq_len, seed)
    plan = plan_sharding(work, rules, mesh, axis)  # its errors first, with their own words
    apply_fn, params, buffers = functionalize(work)
    loss, grads, _ = loss_and_grads(apply_fn, loss_fn, params, buffers, batch)
    step = make_train_step(apply_fn, loss_fn, sgd(0.0))
    step, state = shard_params(rules, mesh, axis=axis)(step, init_state(params, buffers,
                                                                        sgd(0.0)))
    tp_loss, tp_grads, _ = loss_and_grads(step.apply_fn, step.loss_fn, state.params,
                                          state.buffers, batch)
    if step.sync_grads is not None:
        tp_grads = step.sync_grads(tp_grads)
    whole = unshard_tree(tp_grads, step.layouts)
    top = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    errs = {n: rel_err(whole[n], g, top) for n, g in grads.items()}
    floor = _noise_floor(apply_fn, loss_fn, params, buffers, batch, grads, top)
    res = RulesCheck(float(loss), abs(float(tp_loss) - float(loss)) / max(abs(float(loss)),
                                                                          1e-300),
                     errs, dict(plan.matched_by), max(tol, _FLOOR_FACTOR * floor), floor)
    if raise_on_error and not res.ok:
        raise ValueError(f"check_rules: {type(model).__name__} under these rules over "
                         f"{axis}={mesh.size(axis)} does not compute what the whole model "
                         f"does (silently wrong rules):\n{res.report()}")
    return res


def rel_err(a: Tensor, b: Tensor, top: float, floor: float = 1e-6) -> float:
    """``max |a - b| / max |b|``, where ``max |b|`` is at least ``floor * top`` (``top``: the
    largest entry of the whole tree): a leaf that is ~0 everywhere (a key bias, whose gradient
    softmax cancels) is measured against the tree's scale, not against its own round-off."""
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    scale = max(float(b.abs().max()), floor * top, 1e-300)
    return float((a - b).abs().max()) / scale


#: The tolerance is at least this many times the whole model's own round-off.
_FLOOR_FACTOR = 100.0


def _noise_floor(apply_fn: Callable, loss_fn: Callable, params: Any, buffers: Any,
                 batch: tuple[Any, Any], grads: dict[str, Tensor], top: float) -> float:
    """The whole model's own round-off: its gradients on the batch with its rows reversed
    (the same sums in another order) against ``grads``. ~1e-16 for a model computing in
    float64; ~1e-7 for one that computes parts in float32 whatever its dtype (Gemma 3's norms
    upcast with ``.float()``), where a sharded run cannot be closer than that either."""
    x, y = batch
    rows = [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if torch.is_tensor(t)]
    if not rows or any(t.dim() == 0 or t.shape[0] < 2 for t in rows) or not torch.is_tensor(y):
        return 0.0
    flip = tuple(t.flip(0) for t in x) if isinstance(x, (tuple, list)) else x.flip(0)
    _, again, _ = loss_and_grads(apply_fn, loss_fn, params, buffers, (flip, y.flip(0)))
    return max((rel_err(again[n], g, top) for n, g in grads.items()), default=0.0)


def _random_batch(model: nn.Module, batch_size: int, seq_len: int, seed: int
                  ) -> tuple[Tensor, Tensor]:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    vocab = getattr(cfg, "vocab_size", None) or getattr(model, "vocab_size", None) or getattr(
        getattr(model, "cfg", None), "vocab_size", None)
    if not vocab:
        raise ValueError(f"check_rules: {type(model).__name__} has no config.vocab_size to draw "
                         "token ids from; pass batch=(inputs, targets)")
    g = torch.Generator().manual_seed(seed)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(device)
    return ids[:, :-1], ids[:, 1:]
