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

**Collectives.** Under :func:`~funcpar.transforms.data_parallel`,
:func:`~funcpar.transforms.shard_params` and :func:`~funcpar.transforms.zero_partition` the step
is traced inside :func:`funcpar.shard.comm.traced_collectives`: every collective of
:mod:`funcpar.shard.comm` (the bucketed gradient all-reduce, ZeRO's reduce-scatters and
gathers, tensor parallelism's forward/backward all-reduces, the reductions of
:mod:`funcpar.shard.reduce`, the loss mean, the fp16 finite flag) is a functional collective
(``_c10d_functional.*`` + ``wait_tensor``) inside the graph, so the step is still one region
with no graph break, on every rank. The trace runs the collectives once (``make_fx`` traces
with real tensors, so every rank must trace the same signature at the same call, as it does:
ranks build the same step); the records they would have logged are kept with the graph and
replayed into :data:`~funcpar.shard.comm.comm_log` at each run, so ``comm_report`` counts the
same collectives and bytes as the eager step. Under data parallelism the buckets are reduced
after the backward (no hooks in a traced graph; inductor may reorder them).

**remat.** The checkpoints run at trace time as eager ones do: the forward's ops are traced,
and the backward's recompute, which ``torch.utils.checkpoint`` runs from the module state it
recorded, is traced again into the backward part of the graph, so the graph recomputes the
blocks' activations instead of keeping them. ``torch.set_rng_state``, with which a checkpoint
replays the forward's random draws, is not an op ``make_fx`` traces: a region whose trace holds
a random op (dropout) under remat would draw a different mask in the recompute, so
:meth:`WholeStep._build` refuses it (:class:`NotTraceable`) and the step compiles the forward
and backward only.

**Donation.** Under ``donate=True`` the region writes the new params, buffers and optimizer
state into the input tensors before it returns them (a ``copy_`` into each input leaf, traced as
an input mutation), so the compiled update lands in the donated storage: inductor stores its
results there instead of allocating new leaf-sized buffers every step (and no copy is left
for :func:`~funcpar.state.donation.donate_into` to make). The trace then runs on copies of the
inputs, since ``make_fx`` executes what it traces.

Not covered (:func:`applies` says why; ``compile=True`` then compiles the forward and
backward only): ``pipeline`` (point-to-point transfers have no functional collective) and
``update_in_backward`` (per-leaf hooks in the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from funcpar.optim.base import NotTraceable  # re-exported: raised here and by optimizers
from funcpar.shard import comm
from funcpar.state.tree import Tree, tree_flatten, tree_map, tree_unflatten

__all__ = ["NotTraceable", "WholeStep", "applies", "peak_live_bytes", "select"]

#: The ``torch.compile`` backend of the region (tests use ``"aot_eager"``: same capture,
#: no code generation).
BACKEND = "inductor"


@contextlib.contextmanager
def _compile_session() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is True inside: torch's own context where it has one
    (2.12 on), else the module flag that context sets (2.11, the GPU machines' torch)."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def applies(step: Any) -> str | None:
    """``None`` when ``step`` compiles as one region, else why it does not."""
    if getattr(step, "pipeline", None) is not None:
        return "the step has pipeline (point-to-point transfers are not traceable)"
    if getattr(step, "update_in_backward", False):
        return "update_in_backward"
    return None


def _random_ops(graph: torch.fx.GraphModule) -> list[str]:
    """The ops of ``graph`` that draw random numbers: those torch tags as seeded, except the
    attention kernels called with ``dropout_p == 0`` (tagged for their dropout alone)."""
    def draws(node: torch.fx.Node) -> bool:
        if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
            return False
        names = [a.name for a in node.target._schema.arguments]
        if "dropout_p" not in names:
            return True
        i = names.index("dropout_p")
        p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)

    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function" and draws(n)]


def peak_live_bytes(graph: torch.fx.GraphModule) -> int:
    """The most bytes of intermediate values alive at once when ``graph``'s nodes run in their
    order, each freed after its last use (inputs not counted): ``max_i sum_{n live at i}
    bytes(n)``. The traced region's order is the eager step's, so under remat this shows the
    activations the recompute no longer keeps from the forward to the backward (the compiler
    may reorder; this is the graph as traced)."""
    nodes = list(graph.graph.nodes)
    last = {a: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    live: dict[torch.fx.Node, int] = {}
    cur = peak = 0
    for i, n in enumerate(nodes):
        val = n.meta.get("val")
        if n.op != "placeholder" and torch.is_tensor(val):
            live[n] = val.numel() * val.element_size()
            cur += live[n]
        peak = max(peak, cur)
        for a in n.all_input_nodes:
            if last[a] == i and a in live:
                cur -= live.pop(a)
    return peak


def _into(old: Tree, new: Tree) -> Tree:
    """``new`` with each tensor leaf written into ``old``'s leaf at its place (same shape,
    dtype and device; not one ``old`` already holds) and that leaf returned in its stead."""
    o_leaves, o_spec = tree_flatten(old)
    n_leaves, n_spec = tree_flatten(new)
    if o_spec != n_spec:
        return new
    out = []
    for o, n in zip(o_leaves, n_leaves):
        if (torch.is_tensor(o) and torch.is_tensor(n) and o is not n and o.shape == n.shape
                and o.dtype == n.dtype and o.device == n.device):
            o.copy_(n)
            n = o
        out.append(n)
    return tree_unflatten(n_spec, out)


def select(finite: Tensor, new: Tree, old: Tree) -> Tree:
    """``new`` where ``finite`` (a 0-d bool tensor) holds, else ``old``, leaf by leaf, without
    reading ``finite`` on the host; exact: a selected leaf is the old leaf's value."""
    def pick(n: Any, o: Any) -> Any:
        return torch.where(finite.to(n.device), n, o) if torch.is_tensor(n) else n

    return tree_map(pick, new, old)


def _copy(x: Tensor) -> Tensor:
    """A copy of ``x`` with its strides (the graph's views are traced for them)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _signature(x: Any) -> Any:
    # Strides too: the traced graph's reshapes are views where the traced strides allowed.
    if torch.is_tensor(x):  # torch.Size is a hashable tuple: no conversion (every leaf, every call)
        return ("T", x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    return ("C", type(x).__name__, repr(x))


class WholeStep:
    """The compiled region of one :class:`~funcpar.train.step.TrainStep`:
    ``(params, buffers, opt_state, batch, extras) -> (params, buffers, opt_state, loss,
    grad_norm, finite)``, as ``TrainStep._core`` computes it."""

    def __init__(self, core: Callable[..., tuple], remat: bool = False,
                 donate: bool = False) -> None:
        self._core = core  # TrainStep._core with traced=True
        self._remat = remat  # the apply_fn checkpoints blocks (random ops are refused)
        self._donate = donate  # the new state is written into the input leaves
        self._graphs: dict[Any, tuple[Callable, list[Any], list[comm.CommRecord]]] = {}

    def __call__(self, params: Tree, buffers: Tree, opt_state: Tree, batch: Any,
                 extras: Any) -> tuple:
        leaves, entry = self._entry((params, buffers, opt_state, batch, extras))
        fn, out_spec, records = entry
        out = fn([x for x in leaves if torch.is_tensor(x)])
        comm.comm_log.replay(records)  # the collectives this run issued from inside the graph
        return tree_unflatten(out_spec[0], list(out))

    def graph(self, params: Tree, buffers: Tree, opt_state: Tree, batch: Any,
              extras: Any) -> torch.fx.GraphModule:
        """The region's graph for inputs like these, as ``make_fx`` traced it (traced now if
        this signature is new: the trace runs the step's ops once on the real inputs, drawing
        from the generator and issuing its collectives, but returns nothing and compiles
        nothing until the region is called)."""
        return self._entry((params, buffers, opt_state, batch, extras))[1][0]._orig_mod

    def traced_graphs(self) -> list[torch.fx.GraphModule]:
        """The graphs traced so far (one per signature), as ``make_fx`` produced them."""
        return [fn._orig_mod for fn, _, _ in self._graphs.values()]

    def _entry(self, args: tuple) -> tuple[list[Any], tuple]:
        leaves, spec = tree_flatten(args)
        key = (spec, tuple(_signature(x) for x in leaves))
        if key not in self._graphs:
            self._graphs[key] = self._build(spec, leaves)
        return leaves, self._graphs[key]

    def _build(self, spec: Any, leaves: list[Any]
               ) -> tuple[Callable, list[Any], list[comm.CommRecord]]:
        is_t = [torch.is_tensor(x) for x in leaves]
        consts = [None if t else x for x, t in zip(leaves, is_t)]
        out_spec: list[Any] = []

        def region(tensors: list[Tensor]) -> list[Any]:
            it = iter(tensors)
            flat = [next(it) if t else c for t, c in zip(is_t, consts)]
            args = tree_unflatten(spec, flat)
            result = self._core(*args)
            if self._donate:  # params, buffers, optimizer state: into the inputs' storage
                result = (*(_into(a, r) for a, r in zip(args[:3], result[:3])), *result[3:])
            out, o_spec = tree_flatten(result)
            out_spec[:] = [o_spec]
            return out

        # Traced as torch.compile / torch.export's non-strict mode trace: is_compiling() is
        # True, so code with a host-side fast path (a float() of a 0-d tensor, an in-place
        # multi-tensor kernel) takes its traceable path, as it would under dynamo.
        # Collectives become functional ones in the graph; their records are kept to replay.
        tensors = [x for x in leaves if torch.is_tensor(x)]
        with _compile_session(), comm.traced_collectives() as records:
            # make_fx runs what it traces: a donating region writes into copies, not the state.
            graph = make_fx(region)([_copy(x) for x in tensors] if self._donate else tensors)
        if self._remat and (drawn := _random_ops(graph)):
            raise NotTraceable(f"remat with random ops in the step ({', '.join(drawn[:3])}): "
                               "the traced recompute would not replay the forward's draws")
        return torch.compile(graph, backend=BACKEND, fullgraph=True), out_spec, list(records)
