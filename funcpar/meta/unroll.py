"""Unrolled inner optimisation that keeps the autograd graph (Maclaurin et al. 2015,
arXiv 1502.03492; Finn et al. 2017, arXiv 1703.03400).

One inner step is ``g_t = d loss(w_t, batch_t) / d w_t`` taken with ``create_graph=True``, then
``(u_t, s_{t+1}) = opt.update(g_t, s_t, w_t)`` and ``w_{t+1} = w_t + u_t`` (by the optimizer's
``apply`` where it has one: :func:`~funcpar.optim.base.update_params`). Every operation is
out of place, so ``w_k`` is a differentiable function of ``w_0``, of the optimizer state and of
every hyperparameter given as a tensor that requires grad: a meta-loss on ``w_k`` back-propagates
through all k steps (second derivatives included). Memory grows linearly in k; truncation bounds
it by detaching the carried params and optimizer state (not the hyperparameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch as _C

from funcpar.optim.base import GradientTransformation, update_params
from funcpar.optim.hyperparams import HyperState
from funcpar.state.tree import Tree, tree_flatten, tree_map, tree_unflatten

__all__ = ["detach_state", "inner_step", "unroll", "unroll_train_step"]

LossFn = Callable[..., Tensor]


def _detach(x: Any) -> Any:
    return x.detach() if torch.is_tensor(x) else x


def detach_state(state: Tree) -> Tree:
    """``state`` with every tensor detached except the hyperparameters of each
    :class:`~funcpar.optim.hyperparams.HyperState` (so a truncated unroll still differentiates
    with respect to a learning rate given as a tensor)."""
    if isinstance(state, HyperState):
        return HyperState(state.count.detach(), state.hyperparams, detach_state(state.inner))
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(detach_state(s) for s in state))
    if isinstance(state, (tuple, list)):
        return type(state)(detach_state(s) for s in state)
    if isinstance(state, dict):
        return {k: detach_state(v) for k, v in state.items()}
    return tree_map(_detach, state)


def _check_scalar(loss: Tensor) -> Tensor:
    if loss.dim() != 0:
        raise ValueError(f"inner loss must be a scalar, got shape {tuple(loss.shape)}")
    return loss


def _autograd_grad(
    loss_fn: LossFn, spec: Any, leaves: list[Tensor], args: tuple, create_graph: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The inner gradient by ``torch.autograd.grad`` (outside any torch.func transform)."""
    # Leaves that do not require grad yet (the very first step on plain tensors) become graph
    # leaves so their gradient exists; the caller's tensors are not modified.
    leaves = [p if p.requires_grad else p.detach().requires_grad_(True) for p in leaves]
    loss = _check_scalar(loss_fn(tree_unflatten(spec, leaves), *args))
    return loss, torch.autograd.grad(loss, leaves, create_graph=create_graph)


def _func_grad(
    loss_fn: LossFn, spec: Any, leaves: list[Tensor], args: tuple,
) -> tuple[Tensor, list[Tensor]]:
    """The inner gradient by ``torch.func.grad``: inside a torch.func transform (a per-task
    ``vmap``, an outer ``torch.func.grad``) ``torch.autograd.grad`` cannot see the batched
    loss. ``torch.func.grad`` composes with the transforms around it and with ordinary autograd
    outside them, so the meta-gradient still flows through the inner gradient."""
    def flat_loss(ls: list[Tensor]) -> tuple[Tensor, Tensor]:
        loss = _check_scalar(loss_fn(tree_unflatten(spec, ls), *args))
        return loss, loss

    grads, loss = torch.func.grad(flat_loss, has_aux=True)(list(leaves))
    return loss, grads


def inner_step(
    loss_fn: LossFn, opt: GradientTransformation, params: Tree, opt_state: Tree, *args: Any,
    create_graph: bool = True,
) -> tuple[Tree, Tree, Tensor]:
    """One differentiable step: ``(w + u, new_state, loss(w, *args))``.

    ``loss_fn(params, *args)`` returns a 0-d tensor. With ``create_graph=False`` the gradient
    is taken as a constant (first-order MAML, FOMAML): cheaper, no second derivatives.
    """
    leaves, spec = tree_flatten(params)
    # The inner gradient needs autograd even where the caller turned it off (an evaluation
    # loop under no_grad): it is taken under enable_grad, while the update runs in the
    # caller's mode, so under no_grad nothing keeps a graph (first order by necessity).
    outer_grad = torch.is_grad_enabled()
    keep_graph = create_graph and outer_grad
    with torch.enable_grad():
        if _C.maybe_current_level() is not None:
            loss, grads = _func_grad(loss_fn, spec, leaves, args)
        else:
            loss, grads = _autograd_grad(loss_fn, spec, leaves, args, keep_graph)
    if not keep_graph:
        grads = [g.detach() for g in grads]
    if not outer_grad:
        loss = loss.detach()
    # update_params: the optimizer's apply when it has one (AdamW, SGD: ``w + u`` inside the
    # step, one multi-tensor add on the differentiable path), else update + apply_updates;
    # the same values either way (GradientTransformation's contract).
    params, opt_state = update_params(opt, tree_unflatten(spec, list(grads)), opt_state, params)
    return params, opt_state, loss


def unroll(
    loss_fn: LossFn, opt: GradientTransformation, params: Tree, opt_state: Tree,
    batches: Iterable[Any], *, truncate_every: int | None = None, keep_last: int | None = None,
    create_graph: bool = True,
) -> tuple[Tree, Tree, list[Tensor]]:
    """Run one :func:`inner_step` per batch (a batch is a tuple of extra ``loss_fn`` arguments,
    or a single one), keeping the graph: ``(w_k, s_k, losses)``.

    ``truncate_every=n`` detaches params and optimizer state after every n steps (truncated
    back-propagation, Shaban et al. 2019, arXiv 1810.10667); ``keep_last=n`` detaches them
    before the last n steps only (needs a sized ``batches``). Hyperparameters stay attached.
    """
    for name, v in (("truncate_every", truncate_every), ("keep_last", keep_last)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"unroll: {name} must be a positive int or None, got {v!r}")
    batches = list(batches)
    cut_at = len(batches) - keep_last if keep_last is not None else None
    losses = []
    for t, batch in enumerate(batches):
        if t == cut_at or (truncate_every is not None and t and t % truncate_every == 0):
            params, opt_state = tree_map(_detach, params), detach_state(opt_state)
        args = batch if isinstance(batch, tuple) else (batch,)
        params, opt_state, loss = inner_step(loss_fn, opt, params, opt_state, *args,
                                             create_graph=create_graph)
        losses.append(loss)
    return params, opt_state, losses


def unroll_train_step(
    step: Any, params: Tree, buffers: Tree, opt_state: Tree, batches: Iterable[Any],
    **kwargs: Any,
) -> tuple[Tree, Tree, list[Tensor]]:
    """:func:`unroll` with a :class:`~funcpar.train.step.TrainStep`'s model, loss and optimizer
    on ``(inputs, targets)`` batches: ``loss_fn(output, targets)`` with ``output, _ =
    apply_fn(params, buffers, *inputs)`` (the step's ``apply_fn`` contract). ``buffers`` are the
    same at every inner step: buffers the forward updates (BatchNorm's running statistics) are
    not carried from one inner step to the next.

    Only a plain single-process step: a step rewritten by a parallel transform or with a loss
    scaler, pipeline or gradient sync is refused (its hooks are not differentiable here).
    """
    for hook in ("local_batch", "sync_grads", "sync_loss", "overlap_grads", "loss_scaler",
                 "pipeline"):
        if getattr(step, hook, None) is not None:
            raise ValueError(f"unroll_train_step: the step has {hook} set; only a plain "
                             "single-process TrainStep can be unrolled differentiably")

    def loss(p: Tree, inputs: Any, targets: Any) -> Tensor:
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        out, _ = step.apply_fn(p, buffers, *inputs)
        return step.loss_fn(out, targets)

    return unroll(loss, step.optimizer, params, opt_state, batches, **kwargs)
