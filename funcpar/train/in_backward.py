"""The optimizer in the backward: each leaf updated as soon as its gradient is complete.

A per-leaf optimizer's update of leaf ``i`` needs only ``g_i``, its own state and the shared
scalars (the count, the hyper-parameters). So instead of holding every gradient until the
backward ends, a post-accumulate-grad hook on leaf ``i`` runs the optimizer on the one-leaf
tree ``{name_i: p_i}``, writes the new parameter and state into the donated storage, adds
``|g_i|^2`` to the running sum (float64) that gives the ``grad_norm`` metric, and drops
``g_i`` at once
(Zhao et al. 2024, "GaLore", sec. 4 "per-layer weight updates"; LOMO, Lv et al. 2023). The peak
then holds one gradient at a time instead of all of them.

It is exact only for per-leaf transformations: a chain with ``clip_by_global_norm`` needs
every gradient before the first update and is refused. Under sharding (``layouts``, data
parallel, ZeRO, pipelines) the gradient of a leaf is complete only after a collective, and
Adafactor's/CAME's factored statistics reduce across shards: refused for now (one process).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from funcpar.optim.base import GradientTransformation, update_params
from funcpar.shard.reduce import total_sum_of_squares
from funcpar.state.tree import NAMESPACE, Tree, tree_flatten

__all__ = ["check_in_backward", "loss_and_update"]


def _global_parts(opt: GradientTransformation) -> list[str]:
    """Names of the members of ``opt`` (a chain, nested) that need every gradient at once."""
    parts = getattr(opt.update, "chain_parts", None)
    if parts is not None:
        return [name for p in parts for name in _global_parts(p)]
    qual = getattr(opt.update, "__qualname__", "")
    return ["clip_by_global_norm"] if qual.startswith("clip_by_global_norm.") else []


def check_in_backward(step: Any) -> None:
    """ValueError unless ``step`` (a TrainStep) can update each leaf in the backward."""
    if not step.donate:
        raise ValueError("update_in_backward=True needs donate=True: the update overwrites each "
                         "leaf while the backward still runs, so the input state is consumed")
    glob = _global_parts(step.optimizer)
    if glob:
        raise ValueError(f"update_in_backward=True needs a per-leaf optimizer, but the chain "
                         f"holds {', '.join(glob)}, which needs every gradient before the first "
                         "update: drop the clip or use update_in_backward=False")
    parts = [name for name in ("layouts", "local_batch", "sync_grads", "overlap_grads",
                               "pipeline", "partition", "loss_scaler")
             if getattr(step, name) is not None]
    if parts or step.compile:
        parts += ["compile"] if step.compile else []
        raise ValueError(f"update_in_backward=True runs on one process, eagerly, without loss "
                         f"scaling; this step has {', '.join(parts)} (a sharded leaf's gradient "
                         "is complete only after its collective)")


def _split(node: Any, spec: Any, names: list[str], i: int, own: set[int]) -> Any:
    """Leaf ``i``'s part of an optimizer-state node: subtrees shaped like the params become
    ``{name_i: part_i}`` (the ids of their tensors go into ``own``); anything else (counts,
    hyper-parameters) is shared as it is."""
    parts = spec.flatten_up_to(node) if _shaped_like(spec, node) else None
    if parts is not None:
        own.update(id(t) for t in tree_flatten(parts[i])[0] if torch.is_tensor(t))
        return {names[i]: parts[i]}
    if isinstance(node, Tensor) or node is None:
        return node
    children, rebuild = _one_level(node)
    if rebuild is None:
        return node
    return rebuild([_split(c, spec, names, i, own) for c in children])


def _shaped_like(spec: Any, node: Any) -> bool:
    """Whether ``node`` has the params' structure as a prefix (a per-leaf state subtree).
    Asked of the structures: ``flatten_up_to``'s error on a mismatch prints every tensor."""
    if spec.num_leaves == 0:
        return False
    return spec.is_prefix(optree.tree_structure(node, namespace=NAMESPACE))


def _one_level(node: Any) -> tuple[list[Any], Any]:
    """``(children, rebuild)`` of a pytree node; ``rebuild`` None for a leaf."""
    try:
        children, meta, _, unflatten = optree.tree_flatten_one_level(
            node, namespace=NAMESPACE, none_is_leaf=True)
    except ValueError:  # a leaf
        return [], None
    return list(children), lambda kids: unflatten(meta, kids)


def _merge(template: Any, spec: Any, names: list[str], news: list[Any]) -> Any:
    """The inverse of :func:`_split` over every leaf's new state ``news``."""
    if _shaped_like(spec, template):
        return optree.tree_unflatten(spec, [n[names[i]] for i, n in enumerate(news)])
    if isinstance(template, Tensor) or template is None:
        return news[0]  # shared: every leaf computed it from the same input (count + 1)
    children, rebuild = _one_level(template)
    if rebuild is None:
        return news[0]
    kids = [_one_level(n)[0] for n in news]
    return rebuild([_merge(c, spec, names, [k[j] for k in kids])
                    for j, c in enumerate(children)])


def loss_and_update(step: Any, params: Tree, buffers: Tree, opt_state: Tree,
                    batch: tuple[Any, Any]) -> tuple[Tree, Tree, Tree, Tensor, Tensor]:
    """``(params, new_buffers, opt_state, loss, grad_norm)``, each leaf updated in its hook.

    ``params`` and ``opt_state`` are donated: each leaf's new values are written into their
    storage as soon as they are computed. ``grad_norm = sqrt(sum_i |g_i|^2)`` is accumulated in
    the hooks (float64), as the normal step's metric is computed from the whole gradient.
    """
    leaves, spec = tree_flatten(params)
    names = [str(k) for k in range(len(leaves))]
    shared_spec = optree.tree_structure(params, namespace=NAMESPACE)
    owns: list[set[int]] = [set() for _ in leaves]
    pieces = [_split(opt_state, shared_spec, names, i, owns[i]) for i in range(len(leaves))]
    new_states: list[Any] = [None] * len(leaves)
    sq = torch.zeros((), dtype=torch.float64)
    live = [p.detach().requires_grad_(p.is_floating_point() or p.is_complex()) for p in leaves]

    def update_leaf(i: int, grad: Tensor) -> None:
        nonlocal sq
        with torch.no_grad():
            # The normal step's per-leaf sum (no leaf-sized temporary): a float64 copy of the
            # largest gradient would cost more than the gradients this path saves.
            sq = sq + total_sum_of_squares([grad], [None], purpose="grad_norm").double()
            new_p, new_s = update_params(step.optimizer, {names[i]: grad}, pieces[i],
                                         {names[i]: leaves[i]})
            leaves[i].copy_(new_p[names[i]])  # donated: the new value in the old storage
            # This leaf's own state tensors likewise; the shared ones (the count) are read by
            # the other leaves' updates and stay as they were until the step returns.
            old, _ = tree_flatten(pieces[i])
            new, nspec = tree_flatten(new_s)
            out = [o.copy_(n) if (len(old) == len(new) and id(o) in owns[i]
                                  and o.shape == n.shape and o.dtype == n.dtype) else n
                   for o, n in zip(old if len(old) == len(new) else new, new)]
            new_states[i] = optree.tree_unflatten(nspec, out)

    def hook(i: int, p: Tensor) -> None:
        update_leaf(i, p.grad)
        p.grad = None  # dropped at once: the point of updating in the backward

    for i, p in enumerate(live):
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda t, i=i: hook(i, t))
    inputs, targets = batch
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    with torch.enable_grad():
        out, new_buffers = step.apply_fn(optree.tree_unflatten(spec, live), buffers, *args)
        loss = step.loss_fn(out, targets)
        del out
        loss.backward(inputs=[p for p in live if p.requires_grad])
    for i, p in enumerate(leaves):  # leaves the loss does not reach: a zero gradient, as the
        if new_states[i] is None:   # normal step gives them (weight decay still applies)
            update_leaf(i, torch.zeros_like(p))
    opt_state = _merge(opt_state, shared_spec, names, new_states)
    # The donating TrainStep then aliases these (same storage: nothing is copied again).
    return params, new_buffers, opt_state, loss.detach(), sq.sqrt().to(loss.dtype)
