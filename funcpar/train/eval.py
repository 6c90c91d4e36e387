"""The pure evaluation step: ``metrics = eval_step(state, batch)``, no gradients, no new state.

``make_eval_step(apply_fn, loss_fn)`` evaluates in one process; ``make_eval_step(step)`` takes
a (transformed) :class:`~funcpar.train.step.TrainStep` and evaluates with the parts its
transforms rewrote - the sharded ``apply_fn`` and vocab-parallel loss of ``shard_params``, the
gathering ``apply_fn`` of ZeRO-3, amp_cast's casts, the ``local_batch`` and ``sync_loss`` of
``data_parallel`` / ``expert_parallel``, and the ``pipeline`` of ``pipeline_split`` (its
forwards alone, :meth:`funcpar.pipeline.runtime.Pipeline.loss_and_grads` with
``backward=False``) - so an evaluation under any layout is the evaluation in one process, and
a transform added later is followed by construction rather than by a second rewrite.

Metrics (0-d tensors): ``loss``, the mean cross-entropy over the target tokens that count
(``targets != loss_fn.ignore_index``, default -100); ``tokens``, their number; ``ppl``,
``exp(loss)``. The loss is token-weighted exactly, however the layout cuts the batch: every
piece of the batch a rank computes (a data-parallel slice, a pipeline micro-batch, an
accumulation micro-batch; ``P`` equal pieces of ``B / P`` rows each out of the global ``B``;
under context parallelism a piece is the cp group's sequences, its ``n`` their count)
contributes ``w = loss_piece * n_piece * (B / rows_piece) / N`` (``n``: its tokens that
count, ``N``: the global batch's), and the transforms' own means over pieces then give
``mean_P(w) = sum(loss_piece * n_piece) / N``, the mean over all tokens, even when the pieces
hold different numbers of ignored targets (the training loss is a mean of piece means).

A loss that declares an ``extra_loss(output)`` term (``moe_lm_loss``: the router losses) is
evaluated without it: ``loss_fn(out, t) - extra_loss(out)``, the language-model cross-entropy
(round-off of the subtraction aside), and a pipeline's side losses are left out likewise.

The step is pure: it runs under ``torch.no_grad()``, draws (dropout, router noise) from
``state.rng`` in a forked generator, and returns no state. The module runs in whatever mode it
is in (funcpar's Llama has no dropout; a Hugging Face model from ``from_pretrained`` is in
eval mode).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcpar.state.donation import check_not_donated
from funcpar.state.functional import ApplyFn
from funcpar.state.train_state import TrainState
from funcpar.state.tree import leaves_device, tree_flatten
from funcpar.train.step import LossFn, MicroBatches, TrainStep, _set_rng

__all__ = ["EvalStep", "evaluate", "make_eval_step"]


@dataclass(frozen=True)
class EvalStep:
    """A pure ``eval_step(state, batch) -> {"loss", "tokens", "ppl"}`` (module docstring).

    ``apply_fn``, ``loss_fn``, ``local_batch``, ``sync_loss`` and ``pipeline`` mean what they
    mean on a :class:`~funcpar.train.step.TrainStep` (:func:`make_eval_step` copies them)."""

    apply_fn: ApplyFn
    loss_fn: LossFn
    local_batch: Callable[[Any], Any] | None = None
    sync_loss: Callable[[Tensor], Tensor] | None = None
    pipeline: Any = None

    def _piece_loss(self, rows: int, count: Tensor) -> LossFn:
        """The loss each piece of the batch contributes (module docstring: ``w``)."""
        loss_fn, ignore = self.loss_fn, getattr(self.loss_fn, "ignore_index", -100)
        extra = getattr(loss_fn, "extra_loss", None)
        # Context parallelism: each rank holds part of every sequence, and its loss is already
        # weighted so that the mean over cp is the sequences' token mean; their count is then
        # the whole cp group's, not this rank's part of it.
        group_count = getattr(loss_fn, "group_count", None)

        def piece(out: Any, targets: Tensor) -> Tensor:
            ce = loss_fn(out, targets)
            if extra is not None:
                ce = ce - extra(out).to(ce.dtype)
            n = (targets != ignore).sum() if group_count is None else group_count(targets)
            # A piece with no token that counts has a 0/0 mean: it contributes nothing.
            weighted = torch.where(n > 0, ce * n, torch.zeros_like(ce))
            return weighted * (rows / targets.shape[0]) / count

        return piece

    def __call__(self, state: TrainState, batch: tuple[Any, Any]) -> dict[str, Tensor]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("a batch must be a pair (inputs, targets); inputs may be a tuple "
                            "of tensors")
        flat = tree_flatten((state.params, state.buffers))[0]
        check_not_donated(state, "EvalStep", flat)
        device = leaves_device(flat)
        targets = batch[1]
        count = (targets != getattr(self.loss_fn, "ignore_index", -100)).sum()
        piece = self._piece_loss(targets.shape[0], count.clamp_min(1).to(torch.float64))
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            _set_rng(device, state.rng)
            local = batch if self.local_batch is None else self.local_batch(batch)
            pieces = local.batches if isinstance(local, MicroBatches) else (local,)
            loss = None
            for mb in pieces:
                part = self._local_loss(piece, state, mb) / len(pieces)
                loss = part if loss is None else loss + part
            if self.sync_loss is not None:
                loss = self.sync_loss(loss)
        loss = loss.to(torch.float64)
        return {"loss": loss, "tokens": count, "ppl": loss.exp()}

    def _local_loss(self, piece: LossFn, state: TrainState, batch: tuple[Any, Any]) -> Tensor:
        if self.pipeline is not None:
            probe = EvalStep(self.apply_fn, piece)  # the pipeline reads apply_fn and loss_fn
            loss, _, _ = self.pipeline.loss_and_grads(probe, state.params, state.buffers,
                                                      batch, backward=False)
            return loss
        inputs, targets = batch
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        out, _ = self.apply_fn(state.params, state.buffers, *args)
        return piece(out, targets)


def make_eval_step(apply_fn: ApplyFn | TrainStep, loss_fn: LossFn | None = None) -> EvalStep:
    """The pure evaluation step of ``apply_fn`` and ``loss_fn`` (one process), or of a
    :class:`~funcpar.train.step.TrainStep` and the transforms applied to it (``loss_fn``
    then defaults to the step's own, which tensor parallelism may have made vocab-parallel;
    a different one is evaluated on the step's outputs as the model's one-process loss
    would be, so it must not need whole logits under a vocab-split head)."""
    if isinstance(apply_fn, TrainStep):
        step = apply_fn
        return EvalStep(step.apply_fn, step.loss_fn if loss_fn is None else loss_fn,
                        step.local_batch, step.sync_loss, step.pipeline)
    if loss_fn is None:
        raise TypeError("make_eval_step(apply_fn, loss_fn): the loss_fn is missing")
    return EvalStep(apply_fn, loss_fn)


def evaluate(eval_step: EvalStep, state: TrainState,
             batches: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """``eval_step`` over ``batches``, combined by tokens: ``{"loss", "tokens", "ppl"}`` as
    floats, the loss the mean over every batch's counted tokens (one host sync per batch)."""
    total, tokens = 0.0, 0
    for batch in batches:
        m = eval_step(state, batch)
        n = int(m["tokens"])
        total += float(m["loss"]) * n
        tokens += n
    if tokens == 0:
        raise ValueError("evaluate: no target token counts (no batch, or every target is "
                         "ignore_index)")
    loss = total / tokens
    return {"loss": loss, "tokens": tokens, "ppl": math.exp(loss)}
