"""The pure training step: ``step(state, batch) -> (state, metrics)``."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch._C import _functorch as _C

from funcpar.kernels.inplace import inplace_updates
from funcpar.optim.base import GradientTransformation, update_params
from funcpar.optim.clip import global_norm, reuse_global_norm
from funcpar.optim.hyperparams import get_hyperparams
from funcpar.state.donation import check_not_donated, donate_into
from funcpar.state.functional import ApplyFn
from funcpar.state.train_state import TrainState
from funcpar.state.tree import Tree, leaves_device, tree_flatten, tree_unflatten
from funcpar.train.in_backward import check_in_backward, loss_and_update
from funcpar.train.member_grads import grads_at_vmap_level
from funcpar.train.whole_step import NotTraceable, WholeStep, applies, select

__all__ = ["GradSync", "LossScaler", "MicroBatches", "TrainStep", "loss_and_grads",
           "make_train_step"]

LossFn = Callable[[Any, Any], Tensor]

#: True while :func:`loss_and_grads` takes its gradients by ``torch.func.grad`` (inside a
#: torch.func transform: vmap_step). They are first order (data, as on the autograd path), so
#: remat's torch.func checkpoint records no graph of its recompute for a higher order and
#: frees each block's recompute as the backward passes it (funcpar.transforms.remat).
FIRST_ORDER_GRADS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "funcpar_first_order_grads", default=False)


class MicroBatches(NamedTuple):
    """A batch that one step computes as ``len(batches)`` micro-batches in turn (gradient
    accumulation, :func:`funcpar.transforms.accumulate_grads`): what a ``local_batch`` hook
    returns to have :func:`loss_and_grads` sum the micro-batches' gradients inside the step.
    A pytree node (a NamedTuple), so a later ``local_batch`` (data or expert parallelism)
    splits every micro-batch alike."""

    batches: tuple[Any, ...]


def loss_and_grads(
    apply_fn: ApplyFn, loss_fn: LossFn, params: Tree, buffers: Tree,
    batch: tuple[Any, Any] | MicroBatches, on_grad: Callable[[int, Tensor], None] | None = None,
    loss_scale: Tensor | None = None,
) -> tuple[Tensor, Tree, Tree]:
    """``(loss, grads, new_buffers)`` of ``loss_fn(apply_fn(params, buffers, inputs), targets)``.

    ``on_grad(i, grad)``, when given, is called during the backward as soon as the gradient of
    flat leaf ``i`` is complete (a tensor hook), so a caller can start communicating it.
    ``loss_scale``, when given, multiplies the (float32) loss before the backward, so the
    gradients come out scaled by it (fp16 loss scaling); the returned loss is not scaled.

    Built on ``functional_call`` + ``torch.autograd.grad`` rather than ``torch.func.grad``: on a
    GPU the latter costs ~9 % more eagerly and fails under ``torch.compile`` with cuDNN
    attention (shared/PEERS.md), while this path is as fast as ``loss.backward()``.

    A :class:`MicroBatches` batch of ``K`` micro-batches ``b_1..b_K`` gives the loss
    ``sum_j loss(b_j) / K`` and its gradients (:func:`_accumulated`).
    """
    if isinstance(batch, MicroBatches):
        return _accumulated(apply_fn, loss_fn, params, buffers, batch, on_grad, loss_scale)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            "a batch must be a pair (inputs, targets); inputs may be a tuple of tensors"
        )
    inputs, targets = batch
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    leaves, spec = tree_flatten(params)
    if (not torch.compiler.is_compiling()
            and torch._C._functorch.peek_interpreter_stack() is not None):
        # Inside a torch.func transform (vmap_step): requires_grad_ is refused there, so the
        # gradients come from torch.func.grad, which nests in the transform. Not while dynamo
        # traces (compile=True): the stack it shows there is its own, and the func.grad path's
        # tree_unflatten does not replay in dynamo's optree polyfill.
        return _func_loss_and_grads(apply_fn, loss_fn, leaves, spec, buffers, args, targets,
                                    loss_scale)
    live = [p.detach().requires_grad_(p.is_floating_point() or p.is_complex()) for p in leaves]
    if on_grad is not None:
        for i, p in enumerate(live):
            if p.requires_grad:
                p.register_hook(functools.partial(_notify, on_grad, i))
    with torch.enable_grad():
        out, new_buffers = apply_fn(tree_unflatten(spec, live), buffers, *args)
        loss = _checked_loss(loss_fn(out, targets))
        wanted = [p for p in live if p.requires_grad]
        # The scaled loss is float32 whatever the loss_fn returned: a scale of 2^16 times an
        # fp16 loss would overflow where the float32 product does not.
        target = loss if loss_scale is None else loss.float() * loss_scale
        grads = iter(torch.autograd.grad(target, wanted, allow_unused=True))
    # A parameter the loss does not reach gets a zero gradient so that grads always mirror
    # params. Unlike torch.optim, which skips a parameter whose .grad is None, its weight
    # decay (and momentum) still apply.
    flat = []
    for p in live:
        g = next(grads) if p.requires_grad else None
        flat.append(torch.zeros_like(p) if g is None else g)
    return loss.detach(), tree_unflatten(spec, flat), new_buffers


def _accumulated(apply_fn, loss_fn, params, buffers, batch: MicroBatches, on_grad, loss_scale):
    """:func:`loss_and_grads` of the mean of ``K`` micro-batch losses, one backward each.

    Micro-batch ``j``'s loss enters as ``loss_j / K`` (as a pipeline's micro-batches do), so
    the running sum of the gradients is the mean's gradient and, for a loss that is a mean over
    equal micro-batches, that of the ``K``-times-larger batch (gradient accumulation). Only the
    last backward calls ``on_grad``, with the sum so far: a data-parallel or ZeRO reduction
    sees each leaf's whole gradient once per step, not once per micro-batch. Buffers pass from
    one micro-batch to the next, as over ``K`` steps.
    """
    k = len(batch.batches)
    if k == 0:
        raise ValueError("MicroBatches holds no micro-batch")

    def part(out: Any, targets: Any) -> Tensor:
        return _checked_loss(loss_fn(out, targets)) / k

    loss = acc = None
    summed: dict[int, Tensor] = {}
    for j, mb in enumerate(batch.batches):
        hook = None
        if on_grad is not None and j == k - 1:
            prior = None if acc is None else tree_flatten(acc)[0]

            def hook(i: int, g: Tensor, prior=prior) -> None:
                summed[i] = s = g if prior is None else prior[i] + g
                on_grad(i, s)

        part_loss, grads, buffers = loss_and_grads(apply_fn, part, params, buffers, mb,
                                                   on_grad=hook, loss_scale=loss_scale)
        loss = part_loss if loss is None else loss + part_loss
        if acc is None:
            acc = grads
            continue
        flat, spec = tree_flatten(grads)
        prior_flat = tree_flatten(acc)[0]
        acc = tree_unflatten(spec, [summed[i] if i in summed else p + g
                                    for i, (p, g) in enumerate(zip(prior_flat, flat))])
    return loss, acc, buffers


def _func_loss_and_grads(apply_fn, loss_fn, leaves, spec, buffers, args, targets, loss_scale):
    """:func:`loss_and_grads` by ``torch.func.grad`` (no hooks: ``on_grad`` is not called)."""
    wanted = [i for i, p in enumerate(leaves) if p.is_floating_point() or p.is_complex()]

    def scaled_loss(diff):
        flat = list(leaves)
        for i, p in zip(wanted, diff):
            flat[i] = p
        out, new_buffers = apply_fn(tree_unflatten(spec, flat), buffers, *args)
        loss = _checked_loss(loss_fn(out, targets))
        target = loss if loss_scale is None else loss.float() * loss_scale
        return target, (loss, new_buffers)

    token = FIRST_ORDER_GRADS.set(True)
    try:
        diff = [leaves[i] for i in wanted]
        # vmap_step's level alone: ordinary autograd on the stacked leaves is the same
        # gradient at ~60 % of the cost (funcpar.train.member_grads).
        found = grads_at_vmap_level(scaled_loss, diff)
        diff_grads, (loss, new_buffers) = (
            found if found is not None
            else torch.func.grad(scaled_loss, has_aux=True)(diff))
    finally:
        FIRST_ORDER_GRADS.reset(token)
    # torch.func.grad gives zeros where the loss does not reach a parameter; a leaf it does not
    # differentiate (an integer one) gets zeros here. Only those are allocated: under vmap a
    # zeros_like is a whole (N, ...) tensor per leaf.
    flat = list(leaves)
    for i, g in zip(wanted, diff_grads):
        flat[i] = g
    if len(wanted) < len(leaves):
        done = set(wanted)
        flat = [x if i in done else torch.zeros_like(x) for i, x in enumerate(flat)]
    return loss.detach(), tree_unflatten(spec, flat), new_buffers


def _checked_loss(loss: Any) -> Tensor:
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise ValueError(f"loss_fn must return a 0-d tensor, got {type(loss).__name__} "
                         f"{tuple(getattr(loss, 'shape', ()))}")
    return loss


def _notify(on_grad: Callable[[int, Tensor], None], i: int, grad: Tensor) -> None:
    on_grad(i, grad)  # returns None: the hook observes the gradient, never replaces it


class GradSync(Protocol):
    """A gradient reduction overlapped with the backward (see ``TrainStep.overlap_grads``)."""

    def ready(self, i: int, grad: Tensor) -> None: ...

    def finish(self, grads: Tree) -> Tree: ...


@runtime_checkable
class LossScaler(Protocol):
    """Loss scaling with skipped steps (see ``TrainStep.loss_scaler``; ``amp_cast("fp16")``).

    Its state lives in ``state.extras`` (which it reads and returns), so the step stays pure.
    """

    def scale(self, extras: dict[str, Tensor]) -> Tensor:
        """The 0-d float32 factor the loss is multiplied by before the backward."""
        ...

    def unscale(self, grads: Tree, extras: dict[str, Tensor]) -> tuple[Tree, Tensor]:
        """``(grads / scale, finite)``: ``finite`` a 0-d bool tensor, True when no gradient
        entry on any rank is inf or nan (the same value on every rank)."""
        ...

    def update(self, extras: dict[str, Tensor], finite: Tensor) -> dict[str, Tensor]:
        """The new extras after a step whose gradients were ``finite`` (or not)."""
        ...

    def metrics(self, extras: dict[str, Tensor], finite: Tensor) -> dict[str, Tensor]:
        """Metrics of the step (with the extras it started from)."""
        ...


@dataclass(frozen=True)
class TrainStep:
    """A pure ``step(state, batch) -> (new_state, metrics)``, kept as its parts.

    ``batch = (inputs, targets)``; the model sees ``apply_fn(params, buffers, *inputs)`` and
    the loss ``loss_fn(outputs, targets)``. Metrics are 0-d tensors (no host sync): ``loss``,
    ``grad_norm`` (global, before any clipping) and ``lr`` (when the optimizer has one).
    Random draws in the forward come from ``state.rng`` and the generator state that follows
    is stored back, so calling the step twice on one state gives the same result twice.

    The parts are what the parallel transforms (``funcpar.transforms``) rewrite: each returns a
    new ``TrainStep`` with, say, a sharded ``apply_fn`` and ``layouts`` (tensor parallel), or a
    ``local_batch`` and ``sync_grads`` (data parallel). The hooks, in the order they run:

    * ``local_batch(batch) -> batch``: the part of the global batch this process computes;
    * ``overlap_grads(leaves) -> GradSync``: per step, given the flat parameter leaves; its
      ``ready(i, grad)`` is called from the backward as each gradient completes (eager mode;
      under ``compile`` it is not), and ``finish(grads) -> grads`` right after the backward;
    * ``sync_grads(grads) -> grads``: after the backward, before clipping and the optimizer;
    * ``sync_loss(loss) -> loss``: the reported loss, made global;
    * ``loss_scaler`` (a :class:`LossScaler`, ``amp_cast("fp16")``'s): the loss is multiplied
      by ``loss_scaler.scale(state.extras)`` before the backward; after ``sync_grads`` the
      gradients are unscaled and checked (``unscale``) before the ``grad_norm`` metric,
      clipping and the optimizer. When they are not finite the step is *skipped*: params,
      buffers and optimizer state come back unchanged (the same tensors), while ``state.step``
      still advances (it counts steps taken, i.e. batches consumed, skipped ones included; the
      optimizer's own count, which drives its schedule and bias corrections, does not) and the
      generator state moves on as after any step. ``state.extras`` becomes
      ``loss_scaler.update(extras, finite)`` either way, and ``loss_scaler.metrics`` are added.
      Deciding the skip reads one bool on the host per step.

    ``precision`` records the compute precision set by ``amp_cast`` (``None``: the params'
    own), so that it is applied once and other transforms can see it; with a ZeRO-3
    ``partition`` the ``apply_fn`` must be amp_cast's own (amp_cast applied after it), else
    constructing the step is a ValueError.

    ``pipeline`` (set by ``pipeline_split``): an object whose ``loss_and_grads(step, params,
    buffers, batch, loss_scale)`` replaces the single forward/backward (it runs this rank's
    pipeline stages over micro-batches and returns the loss on every rank and the gradients
    of this rank's leaves; the ``overlap_grads`` reduction then runs after it, without
    hooks), and whose ``global_norm(grads, layouts)`` is the ``grad_norm`` metric over every
    stage's leaves.

    ``share_grad_norm`` (default True): the ``grad_norm`` metric and the optimizer run inside
    :func:`funcpar.optim.clip.reuse_global_norm`, so a ``clip_by_global_norm`` that receives
    the step's gradients unchanged clips by the metric's norm (the same tensor: bit-identical
    results) instead of all-reducing it a second time; after a transformation that changed the
    gradients it computes its own. ``False`` computes every norm anew (the results are the
    same, with the clip's all-reduces; for tests and measurements).

    ``donate`` (``make_train_step(..., donate=True)``): the step consumes its input state, as
    JAX's ``donate_argnums`` does. The new params, buffers and optimizer state are written into
    the input's storage (in place where the optimizer runs under
    :func:`funcpar.kernels.dispatch.inplace_updates`, by the compiled region itself under
    ``compile=True``, else copied in after the update) and
    returned as fresh tensor objects aliasing it; the input's tensor objects are marked donated,
    and passing that state to a step or to ``funcpar.state.save`` again raises
    :class:`funcpar.state.donation.DonatedError` naming donation. Results are bit-identical to
    ``donate=False``; a skipped fp16 step returns the params exactly as they were. It is one
    flag on the step, not a hook per transform: every transform rewrites the step with
    ``dataclasses.replace``, which carries it through, and only ``__call__`` acts on it, after
    the transformed parts have produced the new state (their leaves keep the input's shapes,
    dtypes and devices; an offloaded meta leaf is returned as computed).

    ``update_in_backward`` (needs ``donate``; :mod:`funcpar.train.in_backward`): each leaf is
    updated by the optimizer in a post-accumulate-grad hook as soon as its gradient is
    complete, and the gradient dropped, so the peak holds one gradient instead of all. Only
    for per-leaf optimizers (a ``clip_by_global_norm`` in the chain is refused) on one process.

    ``compile`` (``make_train_step(..., compile=True)``): the whole step - forward, backward,
    fp16 unscale and inf/nan check, the ``grad_norm`` metric, clipping and the optimizer - is
    one compiled region with no graph break (:mod:`funcpar.train.whole_step`: traced by
    ``make_fx``, compiled ``fullgraph=True``); an fp16 skip is a ``torch.where`` selection
    inside it, so no bool is read on the host. Under the hooks that communicate
    (``sync_grads``, ``overlap_grads``, ``sync_loss``: data/tensor parallel, ZeRO 1-3) the
    collectives are functional collectives inside the region (``overlap_grads``' buckets are
    reduced after the backward there), and with ``remat`` the recompute is traced into the
    region's backward. A ``pipeline``, ``update_in_backward`` and a remat step whose trace
    draws random numbers (its recompute could not replay them) compile the forward and
    backward alone, with the collectives and the optimizer eager after it.

    ``layouts`` describe ``state.params``; ``grad_layouts`` the gradients after the hooks when
    they differ (ZeRO-2/3 keep a part of each); ``partition`` and ``dp_axis`` record the ZeRO
    plan and the data-parallel axis, so that the transforms compose in either order.

    ``torch.func.vmap(step, in_dims=(0, None))`` over a stacked state is not the way to train
    members at once: torch's vmap refuses the state's ``None`` leaves, and one generator cannot
    serve stacked ``rng`` s; :func:`funcpar.train.vmap_step` handles both. The message torch
    gives names the step by its ``__name__``, which therefore says so.
    """

    # Not a field (no annotation): what torch.func.vmap's error calls a step instead of its
    # 800-character repr.
    __name__ = "TrainStep (to vmap over stacked states use funcpar.train.vmap_step(step))"

    apply_fn: ApplyFn
    loss_fn: LossFn
    optimizer: GradientTransformation
    layouts: Tree | None = None
    compile: bool = False
    local_batch: Callable[[Any], Any] | None = None
    sync_grads: Callable[[Tree], Tree] | None = None
    sync_loss: Callable[[Tensor], Tensor] | None = None
    overlap_grads: Callable[[list[Tensor]], GradSync] | None = None
    grad_layouts: Tree | None = None
    partition: Any = None
    dp_axis: str | None = None
    loss_scaler: LossScaler | None = None
    precision: str | None = None
    pipeline: Any = None
    share_grad_norm: bool = True
    donate: bool = False
    update_in_backward: bool = False

    def __post_init__(self) -> None:
        if self.update_in_backward:
            check_in_backward(self)
        # ZeRO-3 installs the gathered float32 leaves into the modules itself, past the params
        # tree an inner amp_cast would have cast: amp_cast must wrap it, not be wrapped.
        if (self.precision is not None and getattr(self.partition, "stage", None) == 3
                and getattr(self.apply_fn, "precision", None) != self.precision):
            raise ValueError(f"amp_cast({self.precision!r}) was applied before "
                             "zero_partition(stage=3), whose gathers would bypass its casts: "
                             "apply amp_cast after zero_partition")

    @functools.cached_property
    def _grads_of(self) -> Callable[..., tuple[Tensor, Tree, Tree]]:
        def grads_of(params, buffers, batch, loss_scale=None):
            return loss_and_grads(self.apply_fn, self.loss_fn, params, buffers, batch,
                                  loss_scale=loss_scale)

        # The forward and backward alone, for steps the whole-step region does not cover
        # (self._whole): dynamo itself cannot trace the optimizer's optree plumbing (torch 2.13).
        return torch.compile(grads_of) if self.compile else grads_of

    @functools.cached_property
    def _whole(self) -> Any:
        if not self.compile or applies(self) is not None:
            return None
        return WholeStep(functools.partial(self._core, traced=True),
                         remat=bool(getattr(self.apply_fn, "remat", False)), donate=self.donate)

    def _core(self, params, buffers, opt_state, batch, extras, traced=False):
        # traced: run inside the whole-step region (funcpar.train.whole_step): the backward is
        # traced with the rest, and an fp16 skip is selected in the graph, not read on the host.
        scaler = self.loss_scaler
        scale = None if scaler is None else scaler.scale(extras)
        if self.local_batch is not None:
            batch = self.local_batch(batch)
        if self.update_in_backward:
            params, new_buffers, opt_state, loss, gnorm = loss_and_update(
                self, params, buffers, opt_state, batch)
            return params, new_buffers, opt_state, loss, gnorm, None
        if self.pipeline is not None:
            # The reduction starts from the last micro-batch's backward (Pipeline's on_grad).
            sync = (None if self.overlap_grads is None
                    else self.overlap_grads(tree_flatten(params)[0]))
            loss, grads, new_buffers = self.pipeline.loss_and_grads(
                self, params, buffers, batch, scale,
                on_grad=None if sync is None else sync.ready)
            if sync is not None:
                grads = sync.finish(grads)
        elif self.overlap_grads is None:
            if traced:  # the region compiles it with the rest: not a compiled call of its own
                loss, grads, new_buffers = loss_and_grads(self.apply_fn, self.loss_fn, params,
                                                          buffers, batch, loss_scale=scale)
            else:
                loss, grads, new_buffers = self._grads_of(params, buffers, batch, scale)
        else:
            sync = self.overlap_grads(tree_flatten(params)[0])
            if traced:  # no hooks in a traced graph: the buckets reduce after the backward
                loss, grads, new_buffers = loss_and_grads(self.apply_fn, self.loss_fn, params,
                                                          buffers, batch, loss_scale=scale)
            elif self.compile:  # no hooks inside the compiled graph: reduce after the backward
                loss, grads, new_buffers = self._grads_of(params, buffers, batch, scale)
            else:
                loss, grads, new_buffers = loss_and_grads(
                    self.apply_fn, self.loss_fn, params, buffers, batch, on_grad=sync.ready,
                    loss_scale=scale)
            grads = sync.finish(grads)
        if self.sync_grads is not None:
            grads = self.sync_grads(grads)
        if self.sync_loss is not None:
            loss = self.sync_loss(loss)
        finite = None
        if scaler is not None:
            # Unscaled after the reductions (they are linear) and before the norm, clipping and
            # the optimizer, which must all see the true gradients.
            grads, finite = scaler.unscale(grads, extras)
        lays = self.layouts if self.grad_layouts is None else self.grad_layouts
        # One norm for the metric and the optimizer's clip: inside reuse_global_norm a
        # clip_by_global_norm given these very gradients (same layouts, same pipeline split)
        # returns the metric's norm instead of all-reducing it again. The scope ends with the
        # optimizer call, so nothing outlives the step.
        scope = reuse_global_norm() if self.share_grad_norm else contextlib.nullcontext()
        with scope:
            if self.pipeline is not None:
                gnorm = self.pipeline.global_norm(grads, lays)
            else:
                gnorm = global_norm(grads, lays)
            if finite is not None and traced:
                new_params, new_opt = update_params(self.optimizer, grads, opt_state, params,
                                                    layouts=self.layouts)
                return (select(finite, new_params, params), select(finite, new_buffers, buffers),
                        select(finite, new_opt, opt_state), loss, gnorm, finite)
            if finite is not None and not bool(finite):
                # Skipped: every rank got the same ``finite``, so they all skip, and none runs
                # the optimizer's collectives alone.
                return params, buffers, opt_state, loss, gnorm, finite
            params, opt_state = update_params(self.optimizer, grads, opt_state, params,
                                              layouts=self.layouts)
        return params, new_buffers, opt_state, loss, gnorm, finite

    def __call__(
        self, state: TrainState, batch: tuple[Any, Any]
    ) -> tuple[TrainState, dict[str, Tensor]]:
        if _C.maybe_current_level() is not None and _C.is_batchedtensor(state.rng):
            raise ValueError(
                "TrainStep under torch.func.vmap over a stacked state: one generator cannot "
                "serve the members' stacked rng; use funcpar.train.vmap_step(step) (members' "
                "None leaves, generator states and randomness handled)")
        # One flatten of what the step consumes, for the device, the donation check and
        # donate_into (the small step, rng and extras trees apart).
        owned = (state.params, state.buffers, state.opt_state)
        flat = tree_flatten(owned)
        device = leaves_device(flat[0])
        if device.type == "meta":
            from funcpar.init.lazy import check_materialized  # the lazy-init layer sits above

            check_materialized(state, "TrainStep")
        check_not_donated(state, "TrainStep",
                          [*flat[0], *tree_flatten((state.step, state.rng, state.extras))[0]])
        devices = [device] if device.type == "cuda" else []
        extras = state.extras
        whole = self._whole
        # The compiled region does not take the in-place optimizer paths (they would mutate its
        # inputs before an fp16 skip selects them); under donation it writes the selected new
        # state into the inputs itself, and donate_into finds it there.
        inplace = (inplace_updates() if self.donate and whole is None
                   else contextlib.nullcontext())
        with torch.random.fork_rng(devices=devices), inplace:
            _set_rng(device, state.rng)
            args = (state.params, state.buffers, state.opt_state, batch, extras)
            try:
                params, buffers, opt_state, loss, gnorm, finite = (
                    self._core if whole is None else whole)(*args)
            except NotTraceable:
                # Refused at trace (remat with random draws, GaLore's step-count refresh):
                # the forward and backward alone
                # are compiled from now on, this call included, from the state's generator.
                self.__dict__["_whole"] = None
                _set_rng(device, state.rng)
                with inplace_updates() if self.donate else contextlib.nullcontext():
                    params, buffers, opt_state, loss, gnorm, finite = self._core(*args)
            rng = _get_rng(device)
        params, opt_state = _cut_graph(params, opt_state)
        if self.donate:
            params, buffers, opt_state = donate_into(owned, (params, buffers, opt_state),
                                                     old_flat=flat)
        metrics = {"loss": loss, "grad_norm": gnorm}
        hp = get_hyperparams(opt_state)
        if "lr" in hp:
            metrics["lr"] = hp["lr"]
        if self.loss_scaler is not None:
            metrics.update(self.loss_scaler.metrics(extras, finite))
            extras = self.loss_scaler.update(extras, finite)
        return TrainState(params, buffers, opt_state, state.step + 1, rng, extras), metrics


def _cut_graph(params: Tree, opt_state: Tree) -> tuple[Tree, Tree]:
    """``(params, opt_state)`` detached where a leaf requires grad: a hyperparameter given as
    a tensor that requires grad (``adamw(lr=torch.tensor(1e-2, requires_grad=True))``) makes
    the new params and state functions of it, and carried into the next step each step's graph
    would keep the one before alive (memory growing with the step count). A step is the
    training path: gradients through steps are :mod:`funcpar.meta`'s (``unroll``)."""
    leaves, spec = tree_flatten((params, opt_state))
    if not any(isinstance(t, Tensor) and t.requires_grad for t in leaves):
        return params, opt_state
    return tree_unflatten(spec, [t.detach() if isinstance(t, Tensor) else t for t in leaves])


def make_train_step(
    apply_fn: ApplyFn,
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    *,
    layouts: Tree | None = None,
    compile: bool = False,
    donate: bool = False,
    update_in_backward: bool = False,
) -> TrainStep:
    """The pure training step of ``apply_fn``, ``loss_fn`` and ``optimizer`` (see
    :class:`TrainStep`). With ``compile=True`` the whole step is one compiled region, its
    collectives included (the forward and backward only under a pipeline or
    ``update_in_backward``; :class:`TrainStep`'s ``compile``). With ``donate=True`` each call
    consumes the state it is given and returns the next one in its storage
    (:class:`TrainStep`'s ``donate``): keep only the returned state.
    ``update_in_backward=True`` (with ``donate``) updates each leaf as soon as its gradient is
    complete (per-leaf optimizers, one process)."""
    return TrainStep(apply_fn, loss_fn, optimizer, layouts=layouts, compile=compile,
                     donate=donate, update_in_backward=update_in_backward)


def _set_rng(device: torch.device, state: Tensor) -> None:
    try:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
    except RuntimeError as e:
        if "size" not in str(e):  # CUDA: "wrong size"; CPU: "Expected ... of size"
            raise
        kind = "a CUDA" if device.type == "cuda" else "the CPU"
        raise ValueError(
            f"state.rng ({state.numel()} bytes) is not a state of {kind} generator, which the "
            f"parameters on {device} draw from ({_get_rng(device).numel()} bytes): build the "
            "state after moving the parameters (init_state), or give it "
            "funcpar.state.generator_state(device, seed)") from None


def _get_rng(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
