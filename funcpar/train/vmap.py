"""Train N models in one call: ``torch.func.vmap`` over a whole :class:`TrainStep`.

A *stacked* state is a :class:`~funcpar.state.TrainState` whose every tensor leaf has a leading
member axis of size N (params, buffers, optimizer state including its hyperparameters, the
step count, the generator state and the extras): :func:`stack_states` builds it from N states
of one structure, :func:`unstack_states` splits it back. ``vmap_step(step)`` returns
``f(stacked_state, batch) -> (stacked_state, stacked_metrics)``, which runs ``step``'s forward,
backward, norm and optimizer update for all N members at once (each op runs once on
``(N, ...)`` tensors instead of N times: functorch's model-ensembling recipe applied to the
whole training step, optimizer included). The members' gradients come from ordinary autograd
of their summed losses on the stacked tensors, the forward at the vmap level and the backward
outside it (:mod:`funcpar.train.member_grads`: the same batched ops without torch.func.grad's
layer on each of them); with nothing else differentiated, the optimizer update runs on the
members' tensors (AdamW: torch's fused CPU kernel per member, below).

Members may differ in anything that is a tensor of the state: initial params (seeds), data
order, and the optimizer's injected hyperparameters (``lr``, ``weight_decay``, ...), which are
0-d tensors of each member's state, so a stacked state holds one ``lr`` per member
(:func:`stack_states` of states built with different ``lr``, or
``set_hyperparams`` on each member before stacking). Their structure (model, optimizer,
schedule functions) is shared.

**Batch.** ``batch=(inputs, targets)`` is shared by every member by default; with
``vmap_step(step, batch_axis=0)`` each tensor of the batch carries the member axis first
(``(N, B, ...)``: member ``i`` trains on ``batch[.., i]``).

**Randomness** (the forward's dropout and the like). Under ``vmap`` one generator serves every
member, so per-member generator states cannot be honoured inside the call. ``randomness``:

* ``"error"`` (default): a random op in the step raises (torch's vmap error). The members'
  ``rng`` leaves come back unchanged, as a separate step without draws leaves its own.
* ``"same"``: every member gets the same draws, those a separate step would make from the
  members' common generator state; all members must hold the same ``rng`` (checked: a
  ValueError otherwise) and all receive the generator state that follows. The draws, and so
  the results, are those of N separate runs from that state.
* ``"different"``: each member gets its own draws: one ``(N, ...)`` draw from the generator
  state of member 0, member ``i`` taking slice ``i``; every member then receives the state
  that follows. Repeatable (the same stacked state gives the same step), but member ``i``'s
  draws are *not* those of a separate run of member ``i``, and they depend on member 0's
  ``rng`` only.

**What equals separate runs.** Without random draws (or with ``"same"`` and one generator
state), member ``i`` of the vmapped run follows the same equations as a separate run of
``step`` on member ``i``'s state: the results agree to rounding (the batched kernels may sum
in another order: ~1e-16 relative in float64, tested to 1e-12 over 10 steps), not bit for bit.

**Transforms.** ``amp_cast("bf16")`` composes (it rewrites ``apply_fn`` only), and so does
``remat``: under a torch.func transform its blocks run as a transform-composable checkpoint
(:class:`funcpar.transforms.remat._FuncCheckpoint`: saves the block's inputs, recomputes it
with ``torch.func.vjp`` in the backward under the forward's generator state), so the
vmapped step with remat gives the results of the vmapped step without it and of separate
runs with it, with the activations of one block alive at a time in the backward.
Refused before any call, with a ValueError naming the transform: ``shard_params`` /
``expert_parallel`` (``layouts``), ``data_parallel`` (``local_batch`` / ``sync_grads`` /
``overlap_grads``),
``zero_partition`` (``partition``), ``pipeline_split`` (``pipeline``), ``offload`` (its
optimizer), ``amp_cast("fp16")`` / ``skip_nonfinite`` (``loss_scaler``: the skip decision is
one host bool per step, not per member), ``compile=True`` and ``donate=True``. The optimizers
take their plain-torch reference path under vmap
(:func:`funcpar.kernels.dispatch.use_kernels`), since a Triton kernel cannot see batched
tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch as _C

from funcpar.kernels.members import owned_level
from funcpar.optim.hyperparams import get_hyperparams
from funcpar.state.train_state import TrainState
from funcpar.state.tree import (
    device_of,
    named_leaves,
    tree_flatten,
    tree_structure_check,
    tree_unflatten,
)
from funcpar.train.step import TrainStep, _get_rng, _set_rng

__all__ = ["RANDOMNESS", "check_vmappable", "stack_states", "unstack_states", "vmap_step"]

RANDOMNESS = ("error", "same", "different")


def stack_states(states: Sequence[TrainState]) -> TrainState:
    """One state whose tensor leaves are ``torch.stack`` of the members' (member axis first).

    Every state must have the same tree structure, and each leaf the same shape and dtype in
    every member (a ValueError names the first leaf that differs). Non-tensor leaves (``None``)
    must be ``None`` in every member and stay ``None``.
    """
    states = list(states)
    if not states:
        raise ValueError("stack_states: no states given")
    first = states[0]
    for i, st in enumerate(states[1:], 1):
        tree_structure_check(first, st, what=f"state {i}", against="state 0")
    columns = zip(*(tree_flatten(st)[0] for st in states))
    names = _leaf_names(first)
    stacked = []
    for name, leaves in zip(names, columns):
        head = leaves[0]
        if not torch.is_tensor(head):
            if any(x is not head and x != head for x in leaves):
                raise ValueError(f"stack_states: non-tensor leaf {name} differs between members")
            stacked.append(head)
            continue
        for i, x in enumerate(leaves):
            if x.shape != head.shape or x.dtype != head.dtype:
                raise ValueError(f"stack_states: leaf {name} of state {i} is {x.dtype} "
                                 f"{tuple(x.shape)}, of state 0 {head.dtype} "
                                 f"{tuple(head.shape)}")
        stacked.append(torch.stack(leaves))
    return tree_unflatten(tree_flatten(first)[1], stacked)


def unstack_states(state: TrainState) -> list[TrainState]:
    """The members of a stacked state (views into its tensors, along the member axis)."""
    leaves, spec = tree_flatten(state)
    n = _members(leaves)
    return [tree_unflatten(spec, [x[i] if torch.is_tensor(x) else x for x in leaves])
            for i in range(n)]


def check_vmappable(step: TrainStep) -> None:
    """Raise a ValueError naming the transform of ``step`` that does not compose with vmap."""
    refused = [
        (step.pipeline is not None, "pipeline_split (step.pipeline)"),
        (step.partition is not None, "zero_partition (step.partition)"),
        (step.local_batch is not None or step.sync_grads is not None
         or step.overlap_grads is not None or step.sync_loss is not None,
         "data_parallel / expert_parallel (collectives in local_batch, sync_grads, "
         "overlap_grads or sync_loss)"),
        (step.layouts is not None or step.grad_layouts is not None,
         "shard_params / expert_parallel (sharded step.layouts)"),
        (getattr(step.optimizer.update, "plain_state", None) is not None,
         "offload (the optimizer state lives in a host store)"),
        (step.loss_scaler is not None,
         f"amp_cast('fp16') / skip_nonfinite (step.loss_scaler "
         f"{type(step.loss_scaler).__name__}: skipping a step is one host decision, not one "
         "per member)"),
        (step.compile, "compile=True"),
        (step.donate, "donate=True (the members' storage is one stacked tensor per leaf)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"vmap_step: {what} does not compose with vmap; amp_cast('bf16') "
                             "and remat do (see funcpar.train.vmap)")


def vmap_step(
    step: TrainStep, *, randomness: str = "error", batch_axis: int | None = None
) -> Callable[[TrainState, tuple[Any, Any]], tuple[TrainState, dict[str, Tensor]]]:
    """``f(stacked_state, batch) -> (stacked_state, metrics)``: ``step`` for every member at
    once (module docstring: what the members may differ in, ``randomness``, which transforms
    compose). ``batch_axis=None`` shares the batch; ``0`` takes member ``i``'s batch from index
    ``i`` of every batch tensor. Each metric gets the member axis: ``metrics["loss"][i]`` is
    member ``i``'s loss.
    """
    check_vmappable(step)
    if randomness not in RANDOMNESS:
        raise ValueError(f"vmap_step: randomness={randomness!r}, expected one of {RANDOMNESS}")
    if batch_axis not in (None, 0):
        raise ValueError(f"vmap_step: batch_axis={batch_axis!r}, expected None (shared) or 0")

    def run(state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, dict[str, Tensor]]:
        leaves, spec = tree_flatten((state.params, state.buffers, state.opt_state,
                                     state.extras))
        n = _members(leaves)
        if state.rng.dim() != 2 or state.rng.shape[0] != n:
            raise ValueError(f"vmap_step: state.rng has shape {tuple(state.rng.shape)}, "
                             f"expected ({n}, S): one generator state per member "
                             "(stack_states)")
        batched = [i for i, x in enumerate(leaves) if torch.is_tensor(x)]
        b_leaves, b_spec = tree_flatten(batch)
        if batch_axis is not None:
            for x in b_leaves:
                if torch.is_tensor(x) and (x.dim() == 0 or x.shape[0] != n):
                    raise ValueError(f"vmap_step(batch_axis=0): a batch tensor of shape "
                                     f"{tuple(x.shape)} has no member axis of size {n}")

        n_state = len(batched)
        metric_names: list[str] = []

        def member(tensors: list[Any]) -> list[Tensor]:
            flat = list(leaves)
            for i, t in zip(batched, tensors[:n_state]):
                flat[i] = t
            params, buffers, opt_state, extras = tree_unflatten(spec, flat)
            params, buffers, opt_state, loss, gnorm, _ = step._core(
                params, buffers, opt_state, tree_unflatten(b_spec, tensors[n_state:]), extras)
            metrics = {"loss": loss, "grad_norm": gnorm}
            hp = get_hyperparams(opt_state)
            if "lr" in hp:
                metrics["lr"] = hp["lr"]
            metric_names[:] = list(metrics)
            out = tree_flatten((params, buffers, opt_state, extras))[0]
            return [out[i] for i in batched] + list(metrics.values())

        b_dims = [0 if (batch_axis == 0 and torch.is_tensor(x)) else None for x in b_leaves]
        device = device_of(leaves)
        # Under "error" no draw can happen: the global generator is left alone (saving and
        # restoring it costs a 5 kB copy each way per step).
        scope = (contextlib.nullcontext() if randomness == "error" else
                 torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        with scope:
            if randomness != "error":
                if randomness == "same" and not bool((state.rng == state.rng[0]).all()):
                    raise ValueError("vmap_step(randomness='same'): the members hold different "
                                     "generator states; stack states built with one seed, or "
                                     "use randomness='different'")
                _set_rng(device, state.rng[0])
            outs = _flat_vmap(member, n, [leaves[i] for i in batched] + list(b_leaves),
                              [0] * n_state + b_dims, randomness)
            new_tensors = outs[:n_state]
            metrics = dict(zip(metric_names, outs[n_state:], strict=True))
            rng = state.rng if randomness == "error" else (
                _get_rng(device).unsqueeze(0).expand(n, -1).clone())
        flat = list(leaves)
        for i, t in zip(batched, new_tensors):
            flat[i] = t
        params, buffers, opt_state, extras = tree_unflatten(spec, flat)
        return TrainState(params, buffers, opt_state, state.step + 1, rng, extras), metrics

    return run


def _flat_vmap(fn: Callable[[list[Any]], list[Tensor]], n: int, args: list[Any],
               in_dims: list[int | None], randomness: str) -> list[Tensor]:
    """``torch.func.vmap(fn, in_dims=(in_dims,), out_dims=0, randomness=...)(args)`` for a
    flat list in and a flat list of tensors out, by functorch's own primitives (what
    ``torch._functorch.vmap._flat_vmap`` runs): the public API's pytree handling of the
    state's dozens of leaves (in_dims broadcast, flatten and unflatten both ways, in
    torch.utils._pytree's Python) cost about a fifth of a small vmapped step. An output
    independent of the inputs comes back expanded along the member axis, as vmap returns it.
    """
    level = _C._vmap_increment_nesting(n, randomness)
    try:
        batched = [x if d is None else _C._add_batch_dim(x, d, level)
                   for x, d in zip(args, in_dims, strict=True)]
        # Work on the members' plain tensors may step out of the level and back in: the
        # backward (funcpar.train.member_grads), AdamW's member update (kernels.members).
        with owned_level(level, n, randomness):
            outs = fn(batched)
        return [_C._remove_batch_dim(out, level, n, 0) for out in outs]
    finally:
        _C._vmap_decrement_nesting()


def _leaf_names(state: TrainState) -> list[str]:
    # By field (params.0.weight, opt_state..., step, rng): named_leaves of the NamedTuple itself
    # would number the fields.
    names = []
    for field in TrainState._fields:
        sub = [n for n, _ in named_leaves(getattr(state, field))]
        names += [f"{field}.{n}" if n else field for n in sub]
    return names


def _members(leaves: list[Any]) -> int:
    sizes = {x.shape[0] if x.dim() else None for x in leaves if torch.is_tensor(x)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"not a stacked state: its tensor leaves' leading sizes are "
                         f"{sorted(sizes, key=str)} (one member axis expected; stack_states)")
    return sizes.pop()
