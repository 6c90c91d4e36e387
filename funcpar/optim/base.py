"""The optimizer core, in optax's shape.

A :class:`GradientTransformation` is a pair of pure functions:

* ``init(params) -> state``: a pytree of tensors (checkpointable, never a Python object
  holding tensors);
* ``update(grads, state, params=None, *, layouts=None) -> (updates, new_state)``: the updates
  are *added* to the parameters by :func:`apply_updates`;
* optionally ``apply(grads, state, params, *, layouts=None) -> (new_params, new_state)``, the
  same step with the parameters updated in the same pass (a fused kernel reads and writes each
  parameter once instead of writing updates that :func:`apply_updates` then reads back).
  :func:`update_params` takes it when present and ``update`` + ``apply_updates`` otherwise.
  The two agree to round-off, not necessarily bit for bit: a fused kernel may round the new
  parameter as one expression (on CPU, AdamW's and SGD's ``apply`` run torch's own fused
  kernels, ``p (1 - lr wd) - step_size m / denom`` and ``p - lr d`` as a fused multiply-add,
  where ``apply_updates`` rounds ``u`` and then ``p + u``; a few ulps per step,
  tests/test_fused_cpu.py). What is exact: ``apply`` on the same inputs gives the same bits
  whether it writes in place (a donated step, :mod:`funcpar.kernels.inplace`) or into clones,
  and on the differentiable per-leaf reference ``apply`` is ``p + u`` itself. A caller that
  must reproduce another path's bits (offload's chunked update) makes the same choice.

``layouts`` is the pytree of per-leaf layouts parallel to ``params`` (``None``: every leaf is
whole on this process). Optimizers hand each leaf's layout to the reductions of
:mod:`funcpar.shard.reduce` and never branch on how a leaf is sharded. ``init`` takes no
layouts; a transform that initialises an optimizer on parts of leaves says what they are
parts of with :func:`init_laid_out`, for an optimizer whose state or checks depend on the
whole leaf's shape (:func:`current_init_layouts`; GaLore's rank against the whole matrix).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from funcpar.state.tree import (
    NAMESPACE,
    Tree,
    leaves_up_to,
    named_leaves,
    tree_flatten,
    tree_map,
    tree_structure_check,
    tree_unflatten,
)

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "NotTraceable",
    "apply_updates",
    "chain",
    "check_grads",
    "check_state",
    "checked_leaf_columns",
    "current_init_layouts",
    "identity",
    "init_laid_out",
    "map_leaves",
    "update_params",
]


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params, *, layouts) -> (u, state)``;
    ``apply``, when not ``None``, returns ``(new_params, state)`` directly (see the module)."""

    init: Callable[[Tree], Tree]
    update: Callable[..., tuple[Tree, Tree]]
    apply: Callable[..., tuple[Tree, Tree]] | None = None


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


_INIT_LAYOUTS: contextvars.ContextVar[Tree | None] = contextvars.ContextVar(
    "funcpar_init_layouts", default=None)


def init_laid_out(optimizer: GradientTransformation, params: Tree, layouts: Tree | None
                  ) -> Tree:
    """``optimizer.init(params)`` for parameters laid out as ``layouts`` (shards, ZeRO's
    parts): what a sharding transform calls; the ``init`` reads them with
    :func:`current_init_layouts`."""
    token = _INIT_LAYOUTS.set(layouts)
    try:
        return optimizer.init(params)
    finally:
        _INIT_LAYOUTS.reset(token)


def current_init_layouts() -> Tree | None:
    """The layouts :func:`init_laid_out` gives the ``init`` running now (None: whole leaves,
    or not known)."""
    return _INIT_LAYOUTS.get()


def identity() -> GradientTransformation:
    """Passes the gradients through unchanged."""

    def init(params: Tree) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, *, layouts=None):
        return grads, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states."""
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain argument {i} is {type(t).__name__}, not a GradientTransformation"
            )

    def init(params: Tree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def run(ts, grads, state, params, layouts):
        if len(state) != len(transforms):
            raise ValueError(
                f"chain state has {len(state)} entries for {len(transforms)} transformations"
            )
        new_states = []
        for t, s in zip(ts, state):
            grads, s = t.update(grads, s, params, layouts=layouts)
            new_states.append(s)
        return grads, new_states

    def update(grads, state, params=None, *, layouts=None):
        grads, new_states = run(transforms, grads, state, params, layouts)
        return grads, tuple(new_states)

    # The parts, for transforms that handle a chain's members separately (offload's chunking).
    update.chain_parts = transforms
    if not transforms or transforms[-1].apply is None:
        return GradientTransformation(init, update)

    def apply(grads, state, params, *, layouts=None):
        # The earlier transforms' updates, then the last one's fused step on the parameters:
        # update + apply_updates to round-off (the last transform's contract, module doc).
        grads, new_states = run(transforms[:-1], grads, state, params, layouts)
        params, s = transforms[-1].apply(grads, state[-1], params, layouts=layouts)
        return params, (*new_states, s)

    return GradientTransformation(init, update, apply)


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates`` leaf-wise, keeping each parameter's dtype."""
    check_grads(params, updates, what="updates", same_dtype=False)
    return tree_map(lambda p, u: p if u is None else (p + u.to(p.dtype)), params, updates)


class NotTraceable(RuntimeError):
    """Raised while a step is traced whole (``make_train_step(..., compile=True)``'s region,
    funcpar/train/whole_step.py) by a part that cannot run as eager would inside one graph
    (the message says what). The train step then compiles the forward and backward only and
    runs the rest eagerly."""


def update_params(
    opt: GradientTransformation, grads: Tree, state: Tree, params: Tree, *, layouts: Tree = None
) -> tuple[Tree, Tree]:
    """One optimizer step on ``params``: ``(new_params, new_state)``."""
    if opt.apply is not None:
        return opt.apply(grads, state, params, layouts=layouts)
    updates, state = opt.update(grads, state, params, layouts=layouts)
    return apply_updates(params, updates), state


def check_grads(params: Tree, grads: Tree, *, what: str = "grads",
                same_dtype: bool = True) -> None:
    """Clear errors for a grads tree that cannot belong to ``params``: another structure, a
    leaf that is not a tensor, of another shape, or (``same_dtype``) of another dtype.

    The dtype rule: a gradient has its parameter's dtype. float64 gradients of float32
    parameters (or bf16 of float32) are refused naming the leaf and both dtypes, rather than
    promoted in some optimizers and rejected deep inside others; cast them (or the params)
    first. Mixed precision keeps the rule: ``amp_cast``'s gradients are those of its float32
    masters, and offloaded masters' gradients are upcast before the optimizer. Updates
    (``apply_updates``) may differ: they are cast to the parameter's dtype."""
    if params is None:
        raise ValueError(f"params are required to check {what}: pass update(grads, state, params)")
    p_leaves, p_spec = tree_flatten(params)
    g_leaves, g_spec = tree_flatten(grads)
    if p_spec != g_spec:
        tree_structure_check(params, grads, what=what, against="params")
        raise ValueError(f"{what} tree {g_spec} does not match params tree {p_spec}")
    # Every update runs this: a plain scan first, the leaf names (a walk of the tree's
    # accessors) built only when some leaf fails, to name it.
    if all(g is None or (torch.is_tensor(g) and g.shape == p.shape
                         and (not same_dtype or not torch.is_tensor(p) or g.dtype == p.dtype))
           for p, g in zip(p_leaves, g_leaves)):
        return
    for (name, p), g in zip(named_leaves(params), g_leaves):
        if g is None:
            continue
        if not torch.is_tensor(g):
            raise TypeError(f"{what} leaf {name!r} is {type(g).__name__}, not a tensor")
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(
                f"{what} leaf {name!r} has shape {tuple(g.shape)} but the parameter has "
                f"{tuple(p.shape)}"
            )
        if same_dtype and torch.is_tensor(p) and g.dtype != p.dtype:
            raise TypeError(
                f"{what} leaf {name!r} has dtype {g.dtype} but the parameter has {p.dtype}: "
                f"gradients must have their parameter's dtype (cast them, or the params)"
            )


def _untraced() -> contextlib.AbstractContextManager:
    # check_state is host-side validation: inside the whole-step region's make_fx trace its
    # init on meta params runs untraced (an 8-bit init reads its code map's zero on the host).
    if torch.compiler.is_compiling():
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        return disable_proxy_modes_tracing()
    return contextlib.nullcontext()


def checked_leaf_columns(grads: Tree, params: Tree,
                         *others: Tree | None) -> tuple[Any, list[Any], list[list[Any]]]:
    """:func:`leaf_columns` of ``(grads, params, *others)`` under :func:`check_grads`' rule,
    each tree flattened once: the rule is checked on the lined-up leaves, and any failure
    (no params, another structure, a leaf of another shape or dtype, ``params`` deeper than
    ``grads``) is named by :func:`check_grads` itself, with its messages."""
    if params is None:
        check_grads(params, grads)
    try:
        spec, g_leaves, columns = leaf_columns(grads, params, *others)
    except ValueError:
        check_grads(params, grads)  # a grads tree of another structure, named as such
        raise
    for p, g in zip(columns[0], g_leaves, strict=True):
        if g is not None and not (isinstance(g, Tensor) and isinstance(p, Tensor)
                                  and g.shape == p.shape and g.dtype == p.dtype):
            check_grads(params, grads)
            break
    return spec, g_leaves, columns


def check_state(params: Tree, state: Tree, init: Callable[[Tree], Tree], seen: set[Any], *,
                who: str = "optimizer") -> None:
    """Refuse an optimizer state built for parameters of other shapes (a state for (1, 4)
    given params of (3, 4)): ValueError naming the state leaf, its shape and the shape
    ``init`` gives it for these params.

    The expected state is ``init`` run on meta copies of ``params`` (shapes and dtypes, no
    memory, no compute), so the rule is exactly the optimizer's own, factored statistics and
    8-bit blocks included. Checked once per structure: ``seen`` (the caller's cache) holds the
    keys (tree structures and shapes of params and state) already found consistent, so a
    training loop pays one flatten of each tree per update after the first.
    :func:`~funcpar.optim.inject_hyperparams` (through which every optimizer is built) calls
    it when every leaf is whole (``layouts`` None): under sharded layouts an optimizer may
    shape its state for the whole leaves, which ``init`` on local shards cannot reproduce
    (GaLore fits and checks its own state for its layouts)."""
    # The cache key, every update: one flatten of both trees with None as a node (half the
    # time of flattening them apart with None leaves: an 8-bit or amsgrad-less state holds a
    # None per leaf); torch.Size is a tuple (hashable), getattr's default covers numbers.
    leaves, spec = optree.tree_flatten((params, state), none_is_leaf=False, namespace=NAMESPACE)
    key = (spec, *[getattr(x, "shape", None) for x in leaves])
    if key in seen:
        return
    p_leaves, p_spec = tree_flatten(params)
    s_leaves, s_spec = tree_flatten(state)
    meta = tree_unflatten(p_spec, [torch.empty_like(x, device="meta") if torch.is_tensor(x)
                                   else x for x in p_leaves])
    with _untraced():
        want = init(meta)
    want_leaves, want_spec = tree_flatten(want)
    if want_spec != s_spec:
        tree_structure_check(want, state, what=f"{who} state",
                             against="the state its init builds for these params")
        raise ValueError(f"{who} state tree {s_spec} is not the one its init builds for these "
                         f"params ({want_spec}): it was built for other params or settings")
    for name, x, want in zip(_field_names(state), s_leaves, want_leaves):
        if torch.is_tensor(x) and torch.is_tensor(want) and x.shape != want.shape:
            raise ValueError(
                f"{who} state leaf {name!r} has shape {tuple(x.shape)}, but for these params "
                f"its init gives {tuple(want.shape)}: the state was built for parameters of "
                "other shapes (another model, or a checkpoint of one)")
    if len(seen) > 64:  # bounded: a long run sees few structures, chunked offload a few more
        seen.clear()
    seen.add(key)


def _field_names(tree: Tree) -> list[str]:
    """Dotted leaf names with named-tuple fields spelled out (``exp_avg.w``, where
    :func:`named_leaves` says ``1.w``): for error messages."""
    out = []
    for acc in optree.tree_accessors(tree, none_is_leaf=True, namespace=NAMESPACE):
        parts = []
        for e in acc:
            attr = next(a for a in ("field", "key", "entry") if hasattr(e, a))
            parts.append(str(getattr(e, attr)))
        out.append(".".join(parts))
    return out


def check_floating(params: Tree, *, who: str) -> None:
    """Optimizers update floating-point leaves only: name the first one that is not."""
    for name, p in named_leaves(params):
        if p is None:
            continue
        if not torch.is_tensor(p):
            raise TypeError(f"{who}: leaf {name!r} is {type(p).__name__}, not a tensor")
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(
                f"{who}: leaf {name!r} has dtype {p.dtype}; optimizers update floating-point "
                "tensors only (keep integer tensors in buffers)"
            )


def map_leaves(
    fn: Callable[..., Any],
    grads: Tree,
    *others: Tree | None,
    n_out: int = 1,
) -> Any:
    """Run ``fn(g, *other_leaves)`` for each leaf of ``grads`` and rebuild the trees.

    Each of ``others`` is lined up with ``grads``' leaves as
    :func:`~funcpar.state.tree.leaves_like` does (``None`` gives ``None`` per leaf), so
    per-leaf optimizer states may be whole sub-trees (a dict of factored statistics, say).
    ``fn`` returns ``n_out`` values; ``map_leaves`` returns ``n_out`` trees of ``grads``'
    structure (a single tree when ``n_out == 1``).
    """
    spec, g_leaves, columns = leaf_columns(grads, *others)
    outs = [fn(g, *row) for g, *row in zip(g_leaves, *columns)] if columns else [
        fn(g) for g in g_leaves
    ]
    if n_out == 1:
        return tree_unflatten(spec, outs)
    return tuple(tree_unflatten(spec, [o[i] for o in outs]) for i in range(n_out))


def leaf_columns(grads: Tree, *others: Tree | None) -> tuple[Any, list[Any], list[list[Any]]]:
    """``(spec, grad leaves, [leaves of each of others])`` lined up as :func:`map_leaves` lines
    them up: for optimizers that hand whole lists of leaves to a multi-tensor kernel."""
    g_leaves, spec = tree_flatten(grads)
    columns = [leaves_up_to(spec, o, what=f"argument {i + 1}", against="grads")
               for i, o in enumerate(others)]
    return spec, g_leaves, columns


def as_tuple(x: float | Sequence[float], n: int, name: str) -> tuple[float, ...]:
    if isinstance(x, (int, float)):
        return (float(x),) * n
    x = tuple(x)
    if len(x) != n:
        raise ValueError(f"{name} must have {n} entries, got {len(x)}")
    return x


def zeros_like_tree(tree: Tree) -> Tree:
    return tree_map(lambda x: None if x is None else torch.zeros_like(x), tree)


def scalar(x: float | Tensor, like: Tensor | None = None) -> Tensor:
    """A 0-d float64 tensor (hyperparameters live in states as these)."""
    t = torch.as_tensor(x, dtype=torch.float64)
    return t if like is None else t.to(like.device)
