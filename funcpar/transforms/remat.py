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

**Under torch.func transforms** (``vmap_step``, whose forward runs under its vmap level, the
gradients coming from autograd outside it or from ``torch.func.grad`` inside it,
funcpar.train.member_grads; a user's ``torch.func.grad``/``vjp`` of the step's ``apply_fn``).
torch.func refuses ``torch.utils.checkpoint``'s saved-tensor hooks, so there each chosen
forward runs as :class:`_FuncCheckpoint`, an ``autograd.Function`` with ``setup_context`` and
a generated vmap rule: its forward runs the block and saves only its inputs, the block's
parameters and buffers among them (explicit inputs, so they get their gradients); its backward
reinstalls the module state recorded at the forward's start with those tensors and the
forward's generator states, and takes the vector-Jacobian product of the recomputed block by
``torch.func.vjp``. Same ops on the same values: the results equal the step without remat
(tested bit for bit under ``torch.func.grad`` in a vmap, dropout included with
``randomness="same"`` and ``"different"``; to rounding, ~1e-16 relative, under vmap_step's
autograd route, which differentiates the blocks by torch.func.vjp and the rest by autograd).
``torch.func.grad`` differentiates with ``create_graph=True``, which would
keep every recompute in the graph; under :class:`~funcpar.train.step.TrainStep`'s first-order
gradients (:data:`funcpar.train.step.FIRST_ORDER_GRADS`) the backward records nothing for the
outer levels, so one block's activations are alive at a time; elsewhere the graph is kept and
higher derivatives through remat stay exact (tested: a Hessian-vector product).

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)

from funcpar.shard.rules import _matches
from funcpar.state.train_state import TrainState
from funcpar.state.tree import tree_flatten, tree_unflatten
from funcpar.train.step import FIRST_ORDER_GRADS, TrainStep

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
    parameter and buffer tensors stashed through the saved-tensor hooks (``stash=True``) or
    left in ``tensors`` for the caller to pass back to :meth:`installed` (``stash=False``:
    the torch.func path, where they are explicit inputs of :class:`_FuncCheckpoint`)."""

    def __init__(self, root: nn.Module, stash: bool = True) -> None:
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
        self.tensors = [] if stash else tensors
        self.node = None
        if stash and tensors:
            self.node = _Stash.apply(torch.zeros((), requires_grad=True), *tensors)

    @contextlib.contextmanager
    def installed(self, tensors: Sequence[Tensor] | None = None) -> Iterator[None]:
        if tensors is None:
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


class _FuncSnapshot(_Snapshot):
    """The torch.func path's record: the tensors are left for the caller (no stash node)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__(root, stash=False)


class _Reinstalling:
    """The recompute context: installs ``snapshot`` on every entry. A recompute can run more
    than once - a backward with ``create_graph=True`` (funcpar.meta's unrolled inner steps)
    keeps the checkpoint in the graph, and the second-order backward recomputes it again -
    so a single-use ``installed()`` context would fail there."""

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot
        self.entered: list[Any] = []

    def __enter__(self) -> None:
        context = self.snapshot.installed()
        context.__enter__()
        self.entered.append(context)

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


def _context_fn(module: nn.Module) -> Callable[[], tuple[Any, Any]]:
    """The checkpoint's ``context_fn`` for ``module``: made when the transform is applied, not
    while dynamo traces, which takes a function made outside the trace (not a closure made
    inside it) as the ``context_fn`` of its checkpoint graph."""

    def contexts() -> tuple[Any, Any]:
        return _contexts(module)

    return contexts


def _checkpointed(name: str, module: nn.Module, inner: Callable, contexts: Callable
                  ) -> Callable:
    """The forward ``inner`` under a non-reentrant checkpoint whose recompute context
    reinstalls the module state recorded when the forward ran (see :func:`_contexts`)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if _under_func_transform():
            # Inside a torch.func transform (vmap_step's torch.func.grad under vmap), which
            # refuses the checkpoint's saved-tensor hooks: the transform-composable path.
            return _func_checkpoint(module, inner, args, kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    forward.remat_of = name
    return forward


_FUNC_TRANSFORMS = frozenset({torch._C._functorch.TransformType.Grad,
                              torch._C._functorch.TransformType.Jvp,
                              torch._C._functorch.TransformType.Vmap})


def _under_func_transform() -> bool:
    """A torch.func grad/jvp/vmap is active (not dynamo's trace, not a functionalization
    alone, as make_fx's: torch.utils.checkpoint works there)."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return False
    return any(i.key() in _FUNC_TRANSFORMS for i in torch._C._functorch.get_interpreter_stack())


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Call:
    """One checkpointed call under a torch.func transform: the block's forward, its
    arguments' structure, the module state recorded at the call's start (:class:`_Snapshot`
    without its tensors, which are explicit inputs) and the random generator states then."""

    def __init__(self, module: nn.Module, inner: Callable, args: tuple, kwargs: dict) -> None:
        self.inner = inner
        leaves, self.spec = tree_flatten((args, kwargs))
        self.slots = [i for i, x in enumerate(leaves) if torch.is_tensor(x)]
        self.consts = leaves
        self.snapshot = _FuncSnapshot(module)
        self.tensors = [leaves[i] for i in self.slots] + self.snapshot.tensors
        self.n_args = len(self.slots)
        # The recompute must draw what the forward drew (dropout): the generator states at the
        # forward's start, reinstalled around the recompute (preserve_rng_state's job in
        # torch.utils.checkpoint). Under vmap(randomness="different") the draw is the batched
        # one of the generator, so the same state gives the same per-member draws.
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rngs = get_device_states(*self.tensors)
        # Read here, in the caller's thread (a CUDA backward runs in autograd's device thread).
        self.first_order = FIRST_ORDER_GRADS.get()
        self.out_spec: Any = None
        self.out_consts: list[Any] = []
        self.out_diff: list[bool] = []
        self.out_tensor: list[bool] = []

    def run(self, tensors: Sequence[Tensor], record: bool = True) -> tuple[Tensor, ...]:
        """The block's forward on ``tensors`` (arguments, then parameters and buffers): its
        tensor outputs, flat (with ``record``, the structure and non-tensor leaves are kept on
        ``self``; the recompute's are not, as they would keep its graph alive)."""
        leaves = list(self.consts)
        for i, t in zip(self.slots, tensors[:self.n_args]):
            leaves[i] = t
        args, kwargs = tree_unflatten(self.spec, leaves)
        with self.snapshot.installed(tensors[self.n_args:]):
            out = self.inner(*args, **kwargs)
        flat, spec = tree_flatten(out)
        # An output that is an input as is: a custom Function must return new tensors.
        out = tuple(x.clone() if any(x is t for t in tensors) else x
                    for x in flat if torch.is_tensor(x))
        if record:
            self.out_spec = spec
            self.out_consts = [None if torch.is_tensor(x) else x for x in flat]
            self.out_tensor = [torch.is_tensor(x) for x in flat]
            self.out_diff = [_differentiable(x) for x in out]
        return out

    def output(self, tensors: Sequence[Tensor]) -> Any:
        it = iter(tensors)
        return tree_unflatten(self.out_spec, [next(it) if tensor else x for x, tensor in
                                              zip(self.out_consts, self.out_tensor)])

    @contextlib.contextmanager
    def rng(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu_rng)
            set_device_states(self.devices, self.device_rngs)
            yield


class _FuncCheckpoint(torch.autograd.Function):
    """A checkpoint that composes with torch.func transforms (``setup_context`` and a
    generated vmap rule): the forward runs the block and saves only its inputs (arguments,
    parameters, buffers); the backward recomputes it with ``torch.func.vjp`` under the
    forward's generator states and returns the vector-Jacobian product for every input,
    parameters included (they are explicit inputs, so they get their gradients)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: Tensor) -> tuple[Tensor, ...]:
        return call.run(tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.call = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.mark_non_differentiable(*[o for o in output if not _differentiable(o)])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        tensors = list(ctx.saved_tensors)
        diff = [i for i, t in enumerate(tensors) if _differentiable(t)]

        def recompute(*xs: Tensor) -> tuple[Tensor, ...]:
            full = list(tensors)
            for i, x in zip(diff, xs):
                full[i] = x
            return tuple(o for o in call.run(full, record=False) if _differentiable(o))

        # torch.func.grad differentiates with create_graph=True, so this backward runs with
        # grad mode on and would record the recompute and its vjp in the outer graph, keeping
        # every block's activations alive until the gradients are out (no memory saved).
        # Under TrainStep's first-order gradients nothing differentiates them again: no_grad
        # for the outer levels (the vjp's own level still records). Otherwise (a user's
        # torch.func.grad of a grad) the graph is kept, for a correct higher order.
        outer = torch.no_grad() if call.first_order else contextlib.nullcontext()
        with outer, call.rng():
            _, vjp_fn = torch.func.vjp(recompute, *(tensors[i] for i in diff))
        # One cotangent per differentiable output (the others were marked non-differentiable).
        cotangents = tuple(g for g, keep in zip(grads, call.out_diff, strict=True) if keep)
        with outer:
            got = iter(vjp_fn(cotangents))
        back: list[Tensor | None] = [None] * len(tensors)
        for i in diff:
            back[i] = next(got)
        return (None, *back)


def _func_checkpoint(module: nn.Module, inner: Callable, args: tuple, kwargs: dict) -> Any:
    """``inner(*args, **kwargs)`` as a :class:`_FuncCheckpoint` (the torch.func path)."""
    call = _Call(module, inner, args, kwargs)
    return call.output(_FuncCheckpoint.apply(call, *call.tensors))


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
    * While the whole-step region is traced by ``make_fx`` (:mod:`funcpar.train.whole_step`,
      real tensors, ``torch.compiler.is_compiling()`` true): as eagerly - the recompute is
      traced in the backward's place and needs the module state back - but as dispatch modes,
      the only contexts ``torch.utils.checkpoint`` accepts while compiling.

    Disabled for dynamo: it is Python bookkeeping, and a traced copy would bake one branch in.
    """
    if torch._guards.detect_fake_mode() is not None:
        return create_selective_checkpoint_contexts(_recompute)
    if torch.compiler.is_compiling():
        return _Around(contextlib.nullcontext()), _Around(_Reinstalling(_Snapshot(module)))
    return contextlib.nullcontext(), _Reinstalling(_Snapshot(module))


class _Around(TorchDispatchMode):
    """A dispatch mode that passes every op through and holds ``context`` open while active."""

    def __init__(self, context: Any) -> None:
        super().__init__()
        self.context = context

    def __enter__(self) -> Any:
        self.context.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.context.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        return func(*args, **(kwargs or {}))


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
                wrapper = _checkpointed(name, m, own if own is not None else m.forward,
                                        context_fn)
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
    # What the recompute repeats (the plan counts the collectives inside these modules twice).
    apply.remat_modules = tuple(name for name, _ in chosen)
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
