"""``compile=True``: the whole training step as one compiled region.

The forward, the backward, the loss-scale unscale and inf/nan check, the ``grad_norm`` metric,
clipping and the optimizer update are traced together into one FX graph of aten ops by
``make_fx`` (the step's own Python, pytrees included, runs once per traced signature, so
optree never meets dynamo: dynamo's optree polyfill cannot unflatten funcpar's trees in torch
2.13), and that graph is compiled by ``torch.compile(..., fullgraph=True)``: zero graph breaks
by construction (a construct that cannot be captured is an error, not a silent break).

The region's boundary is flat: params, buffers, optimizer state, batch and extras enter as
lists of tensor leaves; the tree structures, non-tensor leaves, shapes and dtypes key a cache
of traced graphs (a new key traces and compiles anew, as ``torch.compile``'s guards would).
An fp16 skipped step is a ``torch.where`` selection of the old leaves inside the graph (no host
read). Random draws inside the region come from the compiled graph's generator, as under
``torch.compile`` of a module.

Used by :class:`~funcpar.train.step.TrainStep` on one process without hooks that communicate
(no ``sync_grads`` / ``overlap_grads`` / ``sync_loss`` / ``pipeline`` / ``update_in_backward``)
and without :func:`~funcpar.transforms.remat`;
otherwise ``compile=True`` compiles the forward and backward only (:func:`applies` says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from funcpar.state.tree import Tree, tree_flatten, tree_map, tree_unflatten

__all__ = ["WholeStep", "applies", "select"]

#: The ``torch.compile`` backend of the region (tests use ``"aot_eager"``: same capture,
#: no code generation).
BACKEND = "inductor"


def applies(step: Any) -> str | None:
    """``None`` when ``step`` compiles as one region, else why it does not."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "more than one process (collectives stay eager)"
    for hook in ("sync_grads", "overlap_grads", "sync_loss", "pipeline"):
        if getattr(step, hook, None) is not None:
            return f"the step has {hook}"
    if getattr(step, "update_in_backward", False):
        return "update_in_backward"
    if getattr(step.apply_fn, "remat", False):
        # remat's checkpoints recompute from module state that only dynamo's checkpoint
        # operator captures; make_fx would replay them eagerly (docs/REMAT.md).
        return "remat (its checkpoints compile with the forward and backward)"
    return None


def select(finite: Tensor, new: Tree, old: Tree) -> Tree:
    """``new`` where ``finite`` (a 0-d bool tensor) holds, else ``old``, leaf by leaf, without
    reading ``finite`` on the host; exact: a selected leaf is the old leaf's value."""
    def pick(n: Any, o: Any) -> Any:
        return torch.where(finite.to(n.device), n, o) if torch.is_tensor(n) else n

    return tree_map(pick, new, old)


def _signature(x: Any) -> Any:
    if torch.is_tensor(x):
        return ("T", tuple(x.shape), x.dtype, x.device, x.requires_grad)
    return ("C", type(x).__name__, repr(x))


class WholeStep:
    """The compiled region of one :class:`~funcpar.train.step.TrainStep`:
    ``(params, buffers, opt_state, batch, extras) -> (params, buffers, opt_state, loss,
    grad_norm, finite)``, as ``TrainStep._core`` computes it."""

    def __init__(self, core: Callable[..., tuple]) -> None:
        self._core = core  # TrainStep._core with traced=True
        self._graphs: dict[Any, tuple[Callable, list[Any]]] = {}

    def __call__(self, params: Tree, buffers: Tree, opt_state: Tree, batch: Any,
                 extras: Any) -> tuple:
        leaves, spec = tree_flatten((params, buffers, opt_state, batch, extras))
        key = (spec, tuple(_signature(x) for x in leaves))
        if key not in self._graphs:
            self._graphs[key] = self._build(spec, leaves)
        fn, out_spec = self._graphs[key]
        tensors = [x for x in leaves if torch.is_tensor(x)]
        out = fn(tensors)
        return tree_unflatten(out_spec[0], list(out))

    def _build(self, spec: Any, leaves: list[Any]) -> tuple[Callable, list[Any]]:
        is_t = [torch.is_tensor(x) for x in leaves]
        consts = [None if t else x for x, t in zip(leaves, is_t)]
        out_spec: list[Any] = []

        def region(tensors: list[Tensor]) -> list[Any]:
            it = iter(tensors)
            flat = [next(it) if t else c for t, c in zip(is_t, consts)]
            result = self._core(*tree_unflatten(spec, flat))
            out, o_spec = tree_flatten(result)
            out_spec[:] = [o_spec]
            return out

        # Traced as torch.compile / torch.export's non-strict mode trace: is_compiling() is
        # True, so code with a host-side fast path (a float() of a 0-d tensor, an in-place
        # multi-tensor kernel) takes its traceable path, as it would under dynamo.
        with torch.compiler._compile_session_context():
            graph = make_fx(region)([x for x in leaves if torch.is_tensor(x)])
        return torch.compile(graph, backend=BACKEND, fullgraph=True), out_spec
