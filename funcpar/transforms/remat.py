"""``remat``: activation checkpointing of chosen sub-modules, as a transform of the step.

``step, state = remat()(step, state)`` (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost", arXiv 1604.06174): the forward of each chosen module runs under
``torch.utils.checkpoint`` (non-reentrant), so the autograd graph keeps only the module's
inputs, not the activations inside it, and the backward runs the module's forward again to get
them back. With ``L`` blocks of activation size ``A`` each, the saved activations fall from
``L * A`` to ``L * (block input) + A`` (one block's recompute at a time), at the cost of one
more forward per block. The values are the same: the recompute runs the same ops on the same
inputs, with the random generator state of the first run (``preserve_rng_state``), so the
gradients are bit-identical to the step without remat (tested).

**Which modules.** ``policy``:

* ``"blocks"`` (default): the elements of the model's outermost ``nn.ModuleList``s (the
  transformer blocks, as :func:`~funcpar.transforms.zero_partition` and FSDP see them);
* module-name patterns (a string or a sequence of them), ``*`` matching one name component as
  in the sharding rules: ``"layers.*.mlp"``; each must match a module;
* a callable ``policy(name, module) -> bool`` over ``module.named_modules()``;

``every=k`` keeps every k-th of the chosen modules in model order (the 0th, k-th, ...), to trade
memory for compute. A chosen module inside another chosen one, an empty choice, or the model
itself is a ValueError.

**What the recompute sees.** The other transforms change a module's world only for the
duration of one forward call: ``functional_call`` swaps the parameter tensors in,
:func:`~funcpar.transforms.shard_params` swaps sharded forwards into its linears (and local
attribute values), ZeRO-3 installs gathered parameters, ``amp_cast`` installs casts and
``keep_fp32`` hooks. The backward's recompute runs after all of that has been undone, so remat
records, when a chosen module's forward starts, the state of the module and of every module
under it (parameter and buffer tensors, forward overrides, hooks, attributes) and reinstalls it
around the recompute (the checkpoint's ``context_fn``, run at the forward's start, records it
and returns the reinstalling recompute context). The parameter tensors are recorded *through
the autograd saved-tensor hooks in force* (as a saved tensor of a small autograd node), so
under ZeRO-3 they are not kept whole: ZeRO-3's hooks keep the part and gather it again for the
recompute, exactly as for any other tensor its backward needs, and peak memory keeps ZeRO-3's
one-block bound.

**Composition.** remat changes only the ``apply_fn``; it composes with
:func:`~funcpar.transforms.shard_params`, :func:`~funcpar.transforms.data_parallel`,
:func:`~funcpar.transforms.zero_partition` (every stage) and
:func:`~funcpar.transforms.amp_cast` in any order, with one exception, the order issue of
forward swapping: a module whose ``forward`` another transform replaces during the call (the
linears and embedding that ``shard_params`` shards, the attention/MLP regions under sequence
parallelism) must be rematted by a remat applied *before* that transform, so that remat wraps
the replaced forward; applied after, the other transform's forward would replace remat's, and
this is a ValueError naming the module at its first call. Whole blocks - the default - are
never replaced, so ``remat()`` goes anywhere in the chain. Under tensor or sequence
parallelism the recompute repeats the forward's activation collectives (every rank recomputes
the same blocks in the same order).

**Under compile=True.** Dynamo makes each checkpoint call its checkpoint higher-order op: the
forward is traced into the compiled graph and AOTAutograd's partitioner recomputes the region
inside the compiled backward, which reads no module state, so nothing is recorded (the
checkpoint's ``context_fn`` sees AOTAutograd tracing and returns the contexts of a plain
checkpoint under compile). A chosen module dynamo cannot trace as one checkpoint graph (a graph
break inside it; a side effect it refuses there, like ``shard_params``' per-call cache) runs as
an eager checkpoint inside the compiled step, with its state recorded and reinstalled as above,
so the results stay right. The wrong-order check is not made under compile (it needs a hook
handle, which dynamo cannot build).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from funcpar.shard.rules import _matches
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep

__all__ = ["remat", "remat_modules"]

Policy = str | Sequence[str] | Callable[[str, nn.Module], bool]


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The elements of the outermost ``nn.ModuleList``s (zero_partition's blocks)."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(b + ".") for b, _ in out):
            out += [(f"{name}.{k}" if name else k, child) for k, child in m.named_children()]
    return out


def remat_modules(module: nn.Module, policy: Policy = "blocks", every: int = 1
                  ) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs that ``remat(policy, every=every)`` checkpoints."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"remat: every must be an int >= 1, got {every!r}")
    if isinstance(policy, str) and policy == "blocks":
        chosen = _blocks(module)
        if not chosen:
            raise ValueError(f"remat('blocks'): {type(module).__name__} has no nn.ModuleList "
                             "of blocks; name the modules by pattern or a callable")
    elif callable(policy):
        chosen = [(n, m) for n, m in module.named_modules() if policy(n, m)]
        if not chosen:
            raise ValueError("remat: the policy callable chose no module")
    else:
        patterns = [policy] if isinstance(policy, str) else list(policy)
        for pat in patterns:
            if not isinstance(pat, str):
                raise TypeError(f"remat: patterns must be strings, got {pat!r}")
            if not any(n and _matches(pat, n) for n, _ in module.named_modules()):
                raise ValueError(f"remat: pattern {pat!r} matches no module (e.g. "
                                 f"{[n for n, _ in module.named_modules() if n][:4]})")
        chosen = [(n, m) for n, m in module.named_modules()
                  if n and any(_matches(p, n) for p in patterns)]
    chosen = chosen[::every]
    for name, _ in chosen:
        if not name:
            raise ValueError("remat: the policy chose the model itself; choose its blocks")
        outer = next((o for o, _ in chosen if name.startswith(o + ".")), None)
        if outer is not None:
            raise ValueError(f"remat: {name!r} is inside {outer!r}, which is checkpointed "
                             "too; choose one of them")
    return chosen


def remat(policy: Policy = "blocks", *, every: int = 1
          ) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The activation-checkpointing transform (module docstring)."""
    remat_modules(nn.ModuleList([nn.Identity()]), "blocks", every)  # validates ``every`` early

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        module = getattr(step.apply_fn, "module", None)
        if module is None:
            raise TypeError("remat needs a step built on functionalize(module)'s apply_fn")
        chosen = remat_modules(module, policy, every)
        return dataclasses.replace(step, apply_fn=_remat_apply(step.apply_fn, chosen)), state

    return transform


class _Stash(torch.autograd.Function):
    """Holds tensors as saved tensors of a node no loss reaches: they go through the
    saved-tensor hooks in force (ZeRO-3 keeps its parts) and come back on ``saved_tensors``."""

    @staticmethod
    def forward(ctx, anchor: Tensor, *tensors: Tensor) -> Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.detach()

    @staticmethod
    def backward(ctx, *grads: Tensor) -> Any:  # never reached: the output feeds no loss
        raise RuntimeError("remat's stash node was differentiated")


_TENSOR_DICTS = ("_parameters", "_buffers")


class _Snapshot:
    """The state of a module and of every module under it at a forward's start, to reinstall
    around the recompute: each ``__dict__`` (dicts copied: parameters, buffers, hooks), the
    parameter and buffer tensors stashed through the saved-tensor hooks."""

    def __init__(self, root: nn.Module) -> None:
        self.modules = list(root.modules())
        self.dicts: list[dict[str, Any]] = []
        tensors: list[Tensor] = []
        for m in self.modules:
            d: dict[str, Any] = {}
            for k, v in m.__dict__.items():
                if k in _TENSOR_DICTS:
                    slots = {}
                    for n, t in v.items():
                        slots[n] = None if t is None else len(tensors)
                        if t is not None:
                            tensors.append(t)
                    d[k] = slots
                else:
                    d[k] = copy.copy(v) if isinstance(v, dict) else v
            self.dicts.append(d)
        anchor = torch.zeros((), requires_grad=True)
        self.node = _Stash.apply(anchor, *tensors) if tensors else None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        tensors = self.node.grad_fn.saved_tensors if self.node is not None else ()
        current = [m.__dict__ for m in self.modules]
        for m, d in zip(self.modules, self.dicts):
            new = {k: ({n: None if i is None else tensors[i] for n, i in v.items()}
                       if k in _TENSOR_DICTS else copy.copy(v) if isinstance(v, dict) else v)
                   for k, v in d.items()}
            object.__setattr__(m, "__dict__", new)
        try:
            yield
        finally:
            for m, d in zip(self.modules, current):
                object.__setattr__(m, "__dict__", d)


def _context_fn(module: nn.Module) -> Callable[[], tuple[Any, Any]]:
    """The checkpoint's ``context_fn`` for ``module``: made when the transform is applied, not
    while dynamo traces, which takes a function made outside the trace (not a closure made
    inside it) as the ``context_fn`` of its checkpoint graph."""

    def contexts() -> tuple[Any, Any]:
        return _contexts(module)

    return contexts


def _checkpointed(name: str, inner: Callable, contexts: Callable) -> Callable:
    """The forward ``inner`` under a non-reentrant checkpoint whose recompute context
    reinstalls the module state recorded when the forward ran (see :func:`_contexts`)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    forward.remat_of = name
    return forward


@torch.compiler.disable
def _contexts(module: nn.Module) -> tuple[Any, Any]:
    """The checkpoint's ``(forward, recompute)`` contexts. Called at the forward's start.

    * Eagerly (``compile=False``, or a compiled step whose forward dynamo could not trace as
      one checkpoint graph and ran eagerly): record the module state now and reinstall it
      around the recompute, which runs in the backward after the transforms' per-call state
      is gone.
    * While AOTAutograd traces dynamo's checkpoint graph (``compile=True``): the recompute is
      part of the compiled backward, a graph over saved tensors that reads no module state,
      so there is nothing to record; the contexts are those of a plain checkpoint under
      compile (selective checkpointing's, every op recomputed), which tag the region's ops
      for the partitioner to recompute.

    Disabled for dynamo: it is Python bookkeeping, and a traced copy would bake one branch in.
    """
    if torch._guards.detect_fake_mode() is not None:
        return create_selective_checkpoint_contexts(_recompute)
    return contextlib.nullcontext(), _Snapshot(module).installed()


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _remat_apply(apply_fn: Callable, chosen: list[tuple[str, nn.Module]]) -> Callable:
    contexts = [_context_fn(m) for _, m in chosen]

    def apply(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> Any:
        saved, handles = [], []
        try:
            for (name, m), context_fn in zip(chosen, contexts):
                own = m.__dict__.get("forward")
                if getattr(own, "remat_of", None) is not None:
                    raise ValueError(f"remat: {name!r} is checkpointed twice (remat applied "
                                     "twice to it)")
                wrapper = _checkpointed(name, own if own is not None else m.forward, context_fn)
                saved.append((m, own))
                m.forward = wrapper
                # Not while dynamo traces: it cannot build a hook's handle (nor set an item of
                # the hook dict), and would split the compiled forward here. No transform that
                # replaces forwards (shard_params) runs under compile today (torch 2.13).
                if not torch.compiler.is_compiling():
                    handles.append(m.register_forward_pre_hook(_guard(name, wrapper)))
            return apply_fn(params, buffers, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            for m, own in saved:
                if own is None:
                    # Not ``del m.forward``: dynamo replays a set-then-delete of an instance
                    # attribute as a delete of one that does not exist (torch 2.13).
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = own

    apply.module = getattr(apply_fn, "module", None)
    apply.remat = True  # TrainStep's whole-step compile steps aside (funcpar.train.whole_step)
    if hasattr(apply_fn, "precision"):  # amp_cast's mark (TrainStep's ZeRO-3 order check)
        apply.precision = apply_fn.precision
    return apply


def _guard(name: str, wrapper: Callable) -> Callable:
    def hook(m: nn.Module, args: Any) -> None:
        if m.__dict__.get("forward") is not wrapper:
            raise ValueError(
                f"remat: the forward of {name!r} was replaced by a transform applied before "
                "remat (shard_params replaces its sharded linears' forwards, and its regions' "
                "under sequence parallelism), so it would not be checkpointed: apply remat "
                "before that transform, or checkpoint the blocks that hold these modules"
            )

    return hook
