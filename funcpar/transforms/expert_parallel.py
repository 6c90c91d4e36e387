"""``expert_parallel``: the experts of every MoE block spread over a mesh axis.

``step, state = expert_parallel(mesh, axis="ep")(step, state)`` (GShard, Lepikhin et al. 2020,
arXiv 2006.16668; DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv 2201.05596): each of the ``ep``
ranks holds ``E / ep`` consecutive experts of every :class:`~funcpar.models.moe.MoE` block -
the stacked leaves ``experts.{gate,up,down}_proj`` get the layout ``{ep: Shard(0)}`` - and its
own slice of the batch, as a data-parallel rank does. In each MoE block a rank routes its own
tokens (the router is replicated), then

1. sends each kept assignment's token row to the rank holding its expert, and the expert index
   with it: :func:`funcpar.shard.comm.all_to_all` with uneven splits (the counts travel first,
   one small all_to_all);
2. runs its local experts on the rows it received;
3. sends the outputs back with the reverse splits, where each is scaled by its gate and added
   to its token.

The all_to_all is differentiable (its backward is the reverse all_to_all), so after the backward
an expert's gradient on its owner is the sum over the ep group of every rank's contribution.

**Gradients.** With ``L = mean_r L_r`` over the ``ep`` ranks (and over ``dp`` by
``data_parallel``): a replicated leaf's gradient is averaged over ``ep`` (an all-reduce); an
expert leaf's gradient already holds ``sum_r dL_r/dw`` and is divided by ``ep``. The expert
leaves are then reduced over the *expert-data-parallel* group, the ``dp`` axis, by
``data_parallel`` like every other leaf, so the replicated leaves are averaged over ``ep x dp``
and the experts over ``dp``: Colossal-AI's "moe data parallel" group. The loss reported is the
mean over ``ep``.

Routing is per sequence (:mod:`funcpar.models.moe`), so the router's choices, the capacity and
the router losses do not depend on how the batch is split: the step equals the one-process
step on the global batch, up to the order of floating-point sums. Every optimizer's reductions
consult the layouts (``Shard(0)`` over ``ep`` on the experts), so they stay exact as well.

**Composition.** Apply ``expert_parallel`` before ``zero_partition`` (stages 1-3, which then
partition the expert shards over ``dp``, their own data-parallel group), in any order with
``data_parallel`` and ``remat`` (all tested exact); ``amp_cast`` after it (tested: bf16 ep2
against one-process bf16, tests/test_moe_compose.py), lazy init (``materialize`` after it:
only this rank's experts are allocated; tested bit for bit).
``shard_params`` goes *before* it: with the rule style ``"experts"`` each tp rank holds an ffn
slice of every expert, and ``expert_parallel`` cuts that shard's expert dim over ``ep``, so an
expert leaf's layout is ``{ep: Shard(0), tp: Shard(1)}`` (``Shard(2)`` for ``down_proj``). The
all_to_all then runs over ``ep`` within each tp index (the tp ranks of an ep group route the
same tokens, so they send the same counts), and the experts' tensor-parallel region (one
all-reduce of their outputs, ``shard_params``) runs on the rows each rank received.
``pipeline_split`` goes *before* it: each rank keeps its stages' leaves, and
``expert_parallel`` splits the experts of those stages' MoE blocks over ``ep`` (the ep ranks
of a pp coordinate run the same schedule, so their all_to_alls, forward and backward, pair up;
tested exact, pp2 x ep2). Checkpoints reshard expert
states like any ``Shard(0)`` layout (tested: saved under ep2 x dp2 + ZeRO-2, loaded under one
process and under ep4).

**Hugging Face experts.** transformers 5 stores a family's experts as one module holding
``gate_up_proj [E, 2 ffn, dim]`` (gate and up concatenated) and ``down_proj [E, dim, ffn]``,
called as ``experts(hidden [n, dim], top_k_index [n, k], top_k_weights [n, k])`` and scaling
each output by its routing weight inside (Mixtral, OLMoE, Qwen2/3-MoE, DeepSeek-V3, ...;
:func:`funcpar.shard.rules.is_packed_experts`). Their two leaves get ``{ep: Shard(0)}`` too,
and for the call the module's forward is replaced by the same dispatch: the assignments
``(token, expert, weight)`` flattened from the routing, rows sent to the experts' owners, the
module's own forward run on them with this rank's experts (its ``num_experts`` made local for
the call) and unit weights, outputs sent back, scaled by their weights and added to their
tokens. Under ``shard_params`` (style ``packed_experts``: each expert's ffn split over ``tp``)
the tensor-parallel region wraps this dispatch: the hidden states and routing weights enter it
once, the partial outputs that come back are summed over ``tp`` once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from funcpar.models.moe import Experts, MoE, expert_outputs
from funcpar.optim.base import init_laid_out
from funcpar.shard import comm
from funcpar.shard.layout import Layout, Shard, shard_tensor
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import is_packed_experts
from funcpar.shard.tp_ops import all_to_all_grad
from funcpar.state.train_state import TrainState
from funcpar.train.step import TrainStep
from funcpar.transforms.compose import require_before_partition, require_fresh
from funcpar.transforms.data_parallel import bucketed_mean, split_batch

__all__ = ["expert_leaves", "expert_parallel"]

_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")
_HF_EXPERT_LEAVES = ("gate_up_proj", "down_proj")


def expert_leaves(module: torch.nn.Module, *, hf: bool = False) -> dict[str, torch.nn.Module]:
    """``{leaf name: its block}`` for the stacked expert leaves of every MoE block
    (:class:`~funcpar.models.moe.MoE`), and with ``hf`` of every Hugging Face experts module
    (the leaf's value is then the experts module itself)."""
    out: dict[str, torch.nn.Module] = {}
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            for leaf in _EXPERT_LEAVES:
                out[f"{name}.experts.{leaf}" if name else f"experts.{leaf}"] = m
        elif hf and is_packed_experts(m):
            for leaf in _HF_EXPERT_LEAVES:
                out[f"{name}.{leaf}" if name else leaf] = m
    return out


def _blocks(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The MoE blocks and Hugging Face experts modules, by name."""
    return {name: m for name, m in module.named_modules()
            if isinstance(m, MoE) or is_packed_experts(m)}


def _n_experts(m: torch.nn.Module) -> int:
    return m.n_experts if isinstance(m, MoE) else m.gate_up_proj.shape[0]


def _exchange(x: Tensor, token: Tensor, expert: Tensor, gate: Tensor, local: int,
              mesh: DeviceMesh, axis: str, who: str,
              run: Callable[[Tensor, Tensor], Tensor], *, promote: bool = False) -> Tensor:
    """Assignments ``(token, expert, gate)`` of rows of ``x`` to experts held ``local`` per
    rank: each row sent to its expert's owner with the expert's index, ``run(rows, experts)``
    there (unscaled outputs), sent back, scaled by its gate and added to its token, as the
    one-process code does it: funcpar's ``combine`` casts the gate to ``x``'s dtype first;
    transformers (``promote``) multiplies in the promoted dtype (float32 gates times bf16
    outputs in float32), then casts."""
    ep = mesh.size(axis)
    # Assignments in expert order, so each destination's rows are contiguous (and each
    # token's contributions are added in the one-process order: by expert).
    order = torch.argsort(expert, stable=True)
    token, expert, gate = token[order], expert[order], gate[order]
    send = torch.bincount(torch.div(expert, local, rounding_mode="floor"), minlength=ep)
    recv = comm.all_to_all(send[:, None], mesh, axis, [1] * ep, [1] * ep,
                           purpose=f"{who}: token counts")[:, 0]
    send_l, recv_l = send.tolist(), recv.tolist()
    rows = all_to_all_grad(x[token], mesh, axis, send_l, recv_l, f"{who}: tokens")
    got = comm.all_to_all(expert, mesh, axis, send_l, recv_l, purpose=f"{who}: expert ids")
    back = all_to_all_grad(run(rows, got), mesh, axis, recv_l, send_l,
                           f"{who}: expert outputs")
    scaled = (back * gate[:, None]).to(x.dtype) if promote else back * gate[:, None].to(x.dtype)
    return torch.zeros_like(x).index_add(0, token, scaled)


def _dispatch(mesh: DeviceMesh, axis: str, who: str) -> Callable[..., Tensor]:
    """The expert-parallel replacement of :func:`~funcpar.models.moe.combine`."""
    rank = mesh.rank(axis)

    def dispatch(
        experts: Experts,
        x: Float[Tensor, "n dim"],
        token: Int[Tensor, " a"],
        expert: Int[Tensor, " a"],
        gate: Float[Tensor, " a"],
    ) -> Float[Tensor, "n dim"]:
        local = experts.gate_proj.shape[0]
        return _exchange(x, token, expert, gate, local, mesh, axis, who,
                         lambda rows, got: expert_outputs(experts, rows, got, first=rank * local))

    return dispatch


def _hf_dispatch(m: torch.nn.Module, mesh: DeviceMesh, axis: str, who: str
                 ) -> Callable[..., Tensor]:
    """The expert-parallel forward of a Hugging Face experts module (module docstring)."""
    rank = mesh.rank(axis)
    own = type(m).forward

    def forward(
        x: Float[Tensor, "n dim"], top_k_index: Int[Tensor, "n k"], top_k_weights: Tensor,
    ) -> Float[Tensor, "n dim"]:
        local = m.gate_up_proj.shape[0]  # this rank's experts (functional_call's shard)
        k = top_k_index.shape[-1]
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)

        def run(rows: Tensor, got: Tensor) -> Tensor:
            whole = m.num_experts
            m.num_experts = local  # the module's own routing masks count its local experts
            try:
                ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype,
                                  device=rows.device)
                return own(m, rows, (got - rank * local)[:, None], ones)
            finally:
                m.num_experts = whole

        return _exchange(x, token, top_k_index.reshape(-1), top_k_weights.reshape(-1), local,
                         mesh, axis, who, run, promote=True)

    return forward


@contextlib.contextmanager
def _installed(blocks: dict[str, torch.nn.Module], mesh: DeviceMesh, axis: str
               ) -> Iterator[None]:
    for name, m in blocks.items():
        if isinstance(m, MoE):
            m.dispatch = _dispatch(mesh, axis, name or "moe")
        else:  # shard_params' packed_experts forward (inside this call) wraps this one
            m.forward = _hf_dispatch(m, mesh, axis, name or "experts")
    try:
        yield
    finally:
        for m in blocks.values():
            m.__dict__.pop("dispatch" if isinstance(m, MoE) else "forward", None)


def expert_parallel(
    mesh: DeviceMesh, *, axis: str = "ep", bucket_mb: float = 25.0
) -> Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]:
    """The expert-parallel transform over ``axis`` (see the module docstring)."""
    if axis not in mesh.axis_names:
        raise ValueError(f"expert_parallel: the mesh has no axis {axis!r}: its axes are "
                         f"{mesh.axis_names}")
    _check_world(mesh)
    ep = mesh.size(axis)
    bucket_bytes = int(bucket_mb * 2**20)

    def transform(step: TrainStep, state: TrainState) -> tuple[TrainStep, TrainState]:
        module = getattr(step.apply_fn, "module", None)
        if module is None:
            raise TypeError("expert_parallel needs a step built on functionalize(module)'s "
                            "apply_fn")
        leaves = expert_leaves(module, hf=True)
        if not leaves:
            raise ValueError("expert_parallel: the model has no MoE block (funcpar.models.moe"
                             ".MoE) nor Hugging Face experts (gate_up_proj [E, 2 ffn, dim], "
                             f"down_proj [E, dim, ffn]), so no expert leaf to split over "
                             f"{axis!r}; set LlamaConfig.n_experts > 0")
        _refuse(step, state)
        blocks = _blocks(module)
        for name, m in blocks.items():
            if _n_experts(m) % ep:
                raise ValueError(f"expert_parallel: {name!r} has {_n_experts(m)} experts, not "
                                 f"divisible by {axis}={ep}")
        if step.pipeline is not None:
            # pipeline_split (applied first) left this rank its stages' leaves only: the other
            # stages' experts are split on their own ranks, over the same axis.
            leaves = {n: m for n, m in leaves.items() if n in state.params}
        missing = [n for n in leaves if n not in state.params]
        if missing:
            raise ValueError(f"expert_parallel: expert leaves {missing} are not in the params")
        layouts = dict(step.layouts) if step.layouts is not None else {
            n: None for n in state.params}
        params = dict(state.params)
        for n in leaves:
            layouts[n], params[n] = _split_experts(n, params[n], layouts[n], mesh, axis)
        inner_batch, inner_grads, inner_loss = step.local_batch, step.sync_grads, step.sync_loss
        replicated = [n for n in state.params if n not in leaves]

        def local_batch(batch: Any) -> Any:
            batch = inner_batch(batch) if inner_batch is not None else batch
            return split_batch(batch, mesh, axis)

        def sync_grads(grads: dict[str, Tensor]) -> dict[str, Tensor]:
            grads = inner_grads(grads) if inner_grads is not None else grads
            out = dict(grads)
            out.update(bucketed_mean({n: grads[n] for n in replicated}, mesh, axis,
                                     bucket_bytes))
            for n in leaves:
                out[n] = grads[n] / ep  # the all_to_all's backward summed the ep group
            return out

        def sync_loss(loss: Tensor) -> Tensor:
            loss = inner_loss(loss) if inner_loss is not None else loss
            return comm.all_reduce(loss, mesh, axis, purpose="ep loss") / ep

        def apply_fn(params: Any, buffers: Any, *args: Any, **kwargs: Any) -> Any:
            with _installed(blocks, mesh, axis):
                return step.apply_fn(params, buffers, *args, **kwargs)

        apply_fn.module = module
        new_step = dataclasses.replace(step, apply_fn=apply_fn, layouts=layouts,
                                       local_batch=local_batch, sync_grads=sync_grads,
                                       sync_loss=sync_loss)
        return new_step, state._replace(params=params,
                                        opt_state=init_laid_out(step.optimizer, params, layouts))

    return transform


def _split_experts(name: str, local: Tensor, layout: Layout | None, mesh: DeviceMesh,
                   axis: str) -> tuple[Layout, Tensor]:
    """An expert leaf's layout with dim 0 (the experts) cut over ``axis``, and this rank's
    shard. ``layout``: the leaf's layout so far, None (whole) or tensor parallelism's (the ffn
    dim over ``tp``, from ``shard_params``), which keeps its splits: ``{ep: Shard(0), tp:
    Shard(1 or 2)}``; ``local`` is already that layout's shard, so only dim 0 is cut here."""
    if layout is None:
        lay = Layout(mesh, local.shape, {axis: Shard(0)}, name=name)
        return lay, shard_tensor(local, lay)
    if layout.mesh is not mesh:
        raise ValueError(f"expert_parallel: {name!r} was sharded by shard_params on another "
                         "mesh; give expert_parallel and shard_params the same DeviceMesh")
    if axis in {a for axes in layout.dim_axes for a in axes}:
        raise ValueError(f"expert_parallel: {name!r} is already split over {axis!r}: apply "
                         "expert_parallel once")
    if layout.dim_axes[0]:
        raise ValueError(f"expert_parallel: {name!r} has its expert dim (0) split over "
                         f"{layout.dim_axes[0]} already; tensor parallelism inside the experts "
                         "splits their ffn dim (rule style 'experts')")
    cut = Layout(mesh, local.shape, {axis: Shard(0)}, name=name)
    return layout.split(0, axis), shard_tensor(local, cut)


def _check_world(mesh: DeviceMesh) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != mesh.world_size:
        raise ValueError(f"expert_parallel: the mesh {mesh.shape} covers {mesh.world_size} ranks "
                         f"but the world has {dist.get_world_size()}: ep x the other axes must "
                         "equal the world size")


def _refuse(step: TrainStep, state: TrainState) -> None:
    require_fresh(state, "expert_parallel")
    require_before_partition(step, "expert_parallel",
                             "expert shards over their data-parallel group")
