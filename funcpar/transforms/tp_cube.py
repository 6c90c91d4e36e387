"""3D tensor parallelism: ``shard_params(rules, mesh, mode="3d")``.

Bian et al., "Maximizing Parallelism in Distributed Training for Huge Neural Networks" (arXiv
2105.14450); Colossal-AI's ``3d`` mode. ``q³`` ranks on the mesh axes ``tp_in``, ``tp_w``,
``tp_out`` of one size ``q`` (:mod:`funcpar.shard.cube`):
``DeviceMesh.from_env(dp=..., tp_in=q, tp_w=q, tp_out=q)``.

Activations alternate between two layouts (the faces of the cube a linear layer reads and
writes): **layout 0** (the model's input, the embedding's output, the residual stream of a
transformer) has the batch rows cut over ``tp_w`` then ``tp_in`` and the hidden dim over
``tp_out``; **layout 1** (what a linear layer reading layout 0 writes: attention heads, the MLP's
inner activations) the rows over ``tp_w`` then ``tp_out`` and the hidden dim over ``tp_in``. A
linear layer reading layout ``p`` writes layout ``1 - p`` (:func:`~funcpar.shard.cube.cube_ab`),
so a Llama's q/k/v, gate and up projections read layout 0 and its o and down projections read
layout 1, as Colossal-AI swaps its input and output groups from one layer to the next.

Which layout each module reads is found once, when the transform is applied, by running the
model on a fake input (``FakeTensorMode``: shapes, no data; token ids ``[q², 1]`` for a model
whose first parameterized module is an embedding, zeros ``[q², in_features]`` for a linear
one) and following every tensor from the
input through the torch functions (a ``TorchFunctionMode``): an op combining activations of the
two layouts (their rows are different batch chunks) is refused, naming the op; so is a module
called on both. The model's dataflow must not depend on its input's values.

Placement on rank ``(i, w, o)`` (``1 / q³`` of every parameter):

* **linear** ``W [N, K]`` reading layout ``p`` (input axis ``I``, output axis ``O``: ``tp_in``,
  ``tp_out`` for ``p = 0``, swapped for ``p = 1``): ``N`` cut over ``I`` then ``tp_w``, ``K``
  over ``O``; bias: as a vector of layout ``1 - p``;
* **vectors** along a hidden dim (biases, norm weights, the embedding's columns) of layout
  ``s``: the dim cut over that layout's hidden axis, then its two row axes; gathered over the
  row axes for use (backward: reduce-scattered, which sums the rows' contributions);
* **attention** runs on this rank's rows and heads (the q/k/v outputs are cut over ``I`` in
  whole heads, checked as in 2D), with no communication;
* **norms**: statistics all-reduced over the layout's hidden axis, forward and backward;
* **LM head and loss**: the head is a linear layer; the loss (token-mean cross-entropy) is the
  vocab-parallel cross-entropy over the logits' hidden axis on this rank's rows, its token sum
  summed over the two row axes (:func:`~funcpar.transforms.tp_modes.grid_loss`).

Every gradient is complete where it is made (the cube's reduce-scatters and the gathers'
backward), so no ``sync_grads`` is added and the optimizers reduce through each leaf's
three-axis layout (:mod:`funcpar.shard.reduce`) with no per-mode code.

Refused, before any compute: a mesh without the three axes or with unequal sides; what 2D
refuses (:func:`~funcpar.transforms.tp_modes.place_parts`: parts other than Linear, Embedding,
LayerNorm and RMSNorm, tied weights, heads cut by ``q``, no head rule, a model not declaring
``supports_tp_2d``: 3D keeps the same contract); a dim whose three-level cut leaves a rank
empty; a batch whose rows do not cut into ``q²`` equal chunks (the two layouts hold different
chunks, and a model's code may read a row count from either); an input or target that is not
cut on its batch dim; a model whose trace fails or mixes the layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from funcpar.optim.base import init_laid_out
from funcpar.shard import comm
from funcpar.shard.cube import Cube, cube_ab, gather_vector
from funcpar.shard.layout import Layout, shard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import LocalAttr, Rule
from funcpar.shard.summa import all_reduce_both
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep
from funcpar.transforms.tp_modes import (
    GridPlan,
    Part,
    Planned,
    _pieces,
    batch_rows,
    grid_apply,
    grid_loss,
    loss_collectives,
    norm_forward,
    norm_stats,
    place_parts,
    stage_lead,
)

__all__ = ["Plan3D", "plan_3d", "planned_collectives_3d", "shard_params_3d"]

MODE = "3d"


@dataclasses.dataclass(frozen=True)
class Plan3D(GridPlan):
    """The cube, the parts, the layout each part reads (``parity``), the leaves' layouts and
    the LM head."""

    cube: Cube
    parts: tuple[Part, ...]
    parity: dict[str, int]
    layouts: dict[str, Layout]
    head: Part

    @property
    def logits_parity(self) -> int:
        return 1 - self.parity[self.head.name]


# ---------------------------------------------------------------------------- the trace
class _Follow(TorchFunctionMode):
    """Tags every tensor computed from a tagged one with its layout (0 or 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.tag: dict[int, int] = {}
        self.keep: list[Tensor] = []  # ids stay unique while the trace runs

    def of(self, t: Any) -> int | None:
        return self.tag.get(id(t)) if torch.is_tensor(t) else None

    def set(self, out: Any, parity: int) -> None:
        for t in tree_leaves(out):
            if torch.is_tensor(t):
                self.tag[id(t)] = parity
                self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tags = {self.tag[id(t)] for t in tree_leaves((args, kwargs))
                if torch.is_tensor(t) and id(t) in self.tag}
        if len(tags) > 1:
            raise ValueError(
                f"mode='3d': {getattr(func, '__qualname__', func)} combines activations of "
                "both layouts (their rows are different batch chunks): the model's dataflow "
                "does not fit the 3D cube")
        if tags:
            self.set(out, tags.pop())
        return out


def _example(module: nn.Module, parts: Sequence[Part], q: int) -> Tensor:
    first = parts[0]
    m = first.module
    if first.kind == "embedding":
        return torch.zeros(q * q, 1, dtype=torch.long)
    if first.kind == "linear":
        return torch.zeros(q * q, m.in_features, dtype=m.weight.dtype)
    raise ValueError(f"mode='3d' traces the model on an input made for its first module, an "
                     f"embedding or a linear layer; {first.name!r} is a {first.kind}")


def _trace(module: nn.Module, parts: Sequence[Part], head: Part, q: int) -> dict[str, int]:
    """Each part's input layout (module docstring), by a run on fake tensors."""
    follow = _Follow()
    parity: dict[str, int] = {}
    hooks = []

    def pre(part: Part) -> Callable:
        def hook(_m: nn.Module, args: tuple) -> None:
            p = follow.of(args[0]) if args else None
            if part.kind == "embedding":
                p = 0 if p is None else p
            if p is None:
                raise ValueError(f"mode='3d': the input of {part.name!r} is not computed from "
                                 "the model's input: its layout is unknown")
            if parity.setdefault(part.name, p) != p:
                raise ValueError(f"mode='3d': {part.name!r} is called on both layouts")
            if part.kind == "embedding" and p != 0:
                raise ValueError(f"mode='3d': the embedding {part.name!r} reads layout 1")

        return hook

    def post(part: Part) -> Callable:
        def hook(_m: nn.Module, _args: tuple, out: Any) -> None:
            p = parity[part.name]
            follow.set(out, 1 - p if part.kind == "linear" else p)

        return hook

    for part in parts:
        hooks.append(part.module.register_forward_pre_hook(pre(part)))
        hooks.append(part.module.register_forward_hook(post(part)))
    # Fake tensors (shapes and dtypes, no data, no compute), not meta ones: a module
    # functionalized with release=True refuses to run on meta parameters.
    fake = FakeTensorMode()
    with fake:
        x = _example(module, parts, q)
        tensors = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in
                   [*module.named_parameters(), *module.named_buffers()]}
    try:
        with fake, follow:
            follow.set(x, 0)
            out = torch.func.functional_call(module, tensors, (x,))
    except ValueError:
        raise
    except Exception as e:
        cls = type(module)
        raise ValueError(
            f"mode='3d' traces {cls.__module__}.{cls.__qualname__} once on a fake input "
            f"(shape {tuple(x.shape)}, {x.dtype}) to find the layout each module reads; the "
            f"trace failed: {type(e).__name__}: {e}") from e
    finally:
        for h in hooks:
            h.remove()
    from funcpar.transforms.shard_params import logits_of

    if head.name not in parity:
        raise ValueError(f"mode='3d': the head {head.name!r} is not called by the model")
    if follow.of(logits_of(out)) != 1 - parity[head.name]:
        raise ValueError(f"mode='3d': the model's output is not the head {head.name!r}'s "
                         "output (the loss is computed on the head's vocabulary-split logits)")
    # A part the model does not call reads layout 0 (its gradient is zero either way).
    return {p.name: parity.get(p.name, 0) for p in parts}


# ----------------------------------------------------------------------------- the plan
def plan_3d(module: nn.Module, rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh) -> Plan3D:
    """Place every parameter of ``module`` on the cube (module docstring), or a ValueError."""
    cube = Cube(mesh)
    q = cube.q
    parts, head = place_parts(module, rules, q, MODE)
    parity = _trace(module, parts, head, q)
    names = {id(p): n for n, p in module.named_parameters()}
    layouts = {}

    def vector(s: int) -> tuple[str, ...]:
        return (cube.col_axis(s), *cube.row_axes(s))

    for part in parts:
        m, p = part.module, parity[part.name]
        if part.kind == "linear":
            i_ax, o_ax = cube.io(p)
            _pieces(part.name, m.in_features, q, 1, "in_features", MODE)
            _pieces(part.name, m.out_features, q, 2, "out_features", MODE)
            specs = {"weight": ((i_ax, cube.wgt), o_ax), "bias": (vector(1 - p),)}
            if m.bias is not None:
                _pieces(part.name, m.out_features, q, 3, "out_features (bias)", MODE)
        elif part.kind == "embedding":
            _pieces(part.name, m.embedding_dim, q, 3, "embedding_dim", MODE)
            specs = {"weight": (None, vector(0))}
        else:
            _pieces(part.name, part.size, q, 3, "normalized dim", MODE)
            specs = {"weight": (vector(p),), "bias": (vector(p),)}
        for pn, t in m.named_parameters(recurse=False):
            full = names[id(t)]
            layouts[full] = Layout.from_spec(mesh, t.shape, specs[pn], name=full)
    ordered = {n: layouts[n] for n, _ in module.named_parameters()}
    return Plan3D(cube, tuple(parts), parity, ordered, head)


def shard_params_3d(
    rules: Sequence[Rule | LocalAttr], mesh: DeviceMesh,
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The 3D tensor-parallel transform (module docstring); what ``shard_params(rules, mesh,
    mode="3d")`` returns."""

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        from funcpar.transforms.shard_params import sharded_module

        lead = stage_lead(step, MODE)  # refuses a pipeline (untested under 3D)
        plan = plan_3d(sharded_module(step, state), rules, mesh)
        cube, s = plan.cube, plan.logits_parity
        vocab = comm.chunk_sizes(plan.head.module.out_features, cube.q)
        loss_fn = grid_loss(step.loss_fn, MODE, mesh, cube.col_axis(s),
                            sum(vocab[: mesh.rank(cube.col_axis(s))]), cube.row_axes(s),
                            lambda t, what: _rows(t, cube, s, what))
        layouts = {n: plan.layouts[n] for n in state.params}
        params = shard_tree(state.params, layouts)
        apply_fn = grid_apply(step.apply_fn, lambda x: _enter(x, cube),
                              lambda: [(p.module, _forward(p, plan)) for p in plan.parts],
                              lead)
        new_step = dataclasses.replace(step, apply_fn=apply_fn, loss_fn=loss_fn,
                                       layouts=layouts)
        return new_step, state._replace(params=params,
                                        opt_state=init_laid_out(step.optimizer, params, layouts))

    return transform


# ----------------------------------------------------------------------------- the step
def _rows(x: Tensor, cube: Cube, parity: int, what: str) -> Tensor:
    """This rank's chunk of the batch rows of ``x`` in layout ``parity`` (``q²`` equal ones)."""
    if x.dim() and x.shape[0] % cube.q**2:
        raise ValueError(f"mode='3d': {what} has {x.shape[0]} batch rows; 3D cuts them into "
                         f"q² = {cube.q ** 2} equal chunks (a layer's input and output hold "
                         "different chunks)")
    return batch_rows(x, cube.mesh, cube.row_axes(parity), what, MODE)


def _enter(x: Any, cube: Cube) -> Any:
    if not torch.is_tensor(x):
        return x
    x = _rows(x, cube, 0, "a model input")
    if not x.is_floating_point():
        return x
    n = x.shape[-1]
    sizes = comm.chunk_sizes(n, cube.q)
    r = cube.mesh.rank(cube.col_axis(0))
    return x[..., sum(sizes[:r]) : sum(sizes[: r + 1])]


def _forward(part: Part, plan: Plan3D) -> Callable:
    m, who, cube, p = part.module, part.name, plan.cube, plan.parity[part.name]
    if part.kind == "linear":

        def linear(x: Tensor) -> Tensor:
            y = cube_ab(x.reshape(-1, x.shape[-1]), m.weight.t(), cube, p, m.out_features, who)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            if m.bias is None:
                return y
            return y + gather_vector(m.bias, cube, 1 - p, m.out_features, 0, f"{who}: bias")

        return linear
    if part.kind == "embedding":

        def embedding(ids: Tensor) -> Tensor:
            table = gather_vector(m.weight, cube, 0, m.embedding_dim, 1, f"{who}: table")
            return F.embedding(ids, table, padding_idx=m.padding_idx)

        return embedding
    return norm_forward(
        part, lambda w, what: gather_vector(w, cube, p, part.size, 0, f"{who}: {what}"),
        lambda x, what: all_reduce_both(x.sum(-1, keepdim=True), cube.mesh, cube.col_axis(p),
                                        f"{who}: {what}"))


# ---------------------------------------------------------------------------- plan report
def planned_collectives_3d(plan: Plan3D, rows: int, dtype: torch.dtype, *,
                           data_fed: Sequence[str] = ()) -> list[Planned]:
    """As :func:`funcpar.transforms.tp_modes.planned_collectives` for 3D: every collective of
    one forward and backward on this rank (each module called once on ``rows`` local rows),
    then the loss's; ``data_fed``: linears reading the model's input (no ``dA`` product)."""
    cube = plan.cube
    q, s = cube.q, torch.empty((), dtype=dtype).element_size()
    rank = cube.mesh.rank
    out: list[Planned] = []

    def add(who: str, op: str, axis: str, n: int, purpose: str) -> None:
        out.append(Planned(who, op, axis, n * s, purpose))

    def vector(who: str, n: int, parity: int, other: int, what: str) -> None:
        # gather_vector: over the inner row axis, then tp_w; each reduce-scattered back.
        (wgt, i_ax), o_ax = cube.row_axes(parity), cube.col_axis(parity)
        hw = comm.chunk_sizes(cube.chunk(n, o_ax), q)
        inner = comm.chunk_sizes(hw[rank(wgt)], q)
        for axis, sizes in ((i_ax, inner), (wgt, hw)):
            add(who, "all_gather", axis, max(sizes) * q * other, f"{who}: {what}")
            add(who, "reduce_scatter", axis, max(sizes) * q * other, f"{who}: {what} (grad)")

    for part in plan.parts:
        m, who, p = part.module, part.name, plan.parity[part.name]
        if part.kind == "linear":
            i_ax, o_ax = cube.io(p)
            k = cube.chunk(m.in_features, o_ax)
            n_i = cube.chunk(m.out_features, i_ax)
            cols = max(comm.chunk_sizes(n_i, q))
            add(who, "all_gather", i_ax, rows * k * q, f"{who} A gather")
            add(who, "all_gather", cube.wgt, k * cols * q, f"{who} B gather")
            add(who, "reduce_scatter", o_ax, rows * n_i * q, f"{who} C partials")
            add(who, "all_gather", o_ax, rows * n_i * q, f"{who} (grad) dC gather")
            if who not in data_fed:
                add(who, "all_gather", cube.wgt, k * cols * q, f"{who} (grad) B gather")
                add(who, "reduce_scatter", i_ax, rows * k * q, f"{who} (grad) dA partials")
            add(who, "all_gather", i_ax, rows * k * q, f"{who} (grad) A gather")
            add(who, "reduce_scatter", cube.wgt, k * cols * q, f"{who} (grad) dB partials")
            if m.bias is not None:
                vector(who, m.out_features, 1 - p, 1, "bias")
        elif part.kind == "embedding":
            vector(who, m.embedding_dim, 0, m.num_embeddings, "table")
        else:
            out += norm_stats(part, cube.col_axis(p), rows, s)
            vector(who, part.size, p, 1, "weight")
            if part.kind == "layernorm" and m.bias is not None:
                vector(who, part.size, p, 1, "bias")
    s_out = plan.logits_parity
    return out + loss_collectives(MODE, cube.col_axis(s_out), cube.row_axes(s_out), rows, s)
