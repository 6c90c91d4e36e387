"""A Mixture-of-Experts SwiGLU feed-forward block: router, capacity, auxiliary losses.

Each token ``x`` (a row of ``dim`` features) is routed to ``k`` of ``E`` experts:

* router logits ``l = W_r x`` (``W_r``: ``[E, dim]``), computed in at least float32; with
  ``noise_std > 0`` and the module in training mode, ``l += noise_std * n``, ``n ~ N(0, 1)``
  drawn from torch's global generator (noisy top-k gating, Shazeer et al. 2017, arXiv
  1701.06538). :class:`funcpar.train.TrainStep` seeds that generator from ``state.rng``, so a
  step stays pure: the same state draws the same noise;
* ``p = softmax(l)``; the experts are the ``k`` largest ``p_e``; the gates are ``p_e`` for
  ``k = 1`` (Switch, Fedus et al. 2021, arXiv 2101.03961) and ``p_e / sum_{top-k} p`` for
  ``k >= 2`` (GShard's normalised top-2, Lepikhin et al. 2020, arXiv 2006.16668);
* capacity: routing is done per *group*, one sequence (a batch row) of ``T`` tokens, so that the
  result does not depend on how the batch is split over data-parallel ranks. Expert ``e``
  takes at most ``C = ceil(capacity_factor * k * T / E)`` assignments of a group, served in
  priority order: every token's first choice (in token order) before any second choice
  (GShard). An assignment past ``C`` is *dropped*: it contributes nothing (the block's
  residual carries the token through) and its gate is not renormalised. ``capacity_factor=None``
  is the dropless mode (MegaBlocks, Gale et al. 2022, arXiv 2211.15841): nothing is dropped;
* the output is ``y = sum_{kept (e, g)} g * down_e(silu(gate_e x) * up_e x)``.

Two router losses are returned beside ``y`` (unweighted; the model weights them):

* the load-balancing loss (Switch eq. 4, generalised to top-k): per group,
  ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the group's ``k T`` assignments (before
  capacity) that chose ``e`` and ``P_e`` the mean router probability of ``e``; averaged over
  groups. It is 1 under uniform routing;
* the router z-loss (ST-MoE, Zoph et al. 2022, arXiv 2202.08906 eq. 5): the mean over tokens of
  ``logsumexp(l)^2``.

The experts' weights are stacked, ``gate_proj``/``up_proj``: ``[E, hidden, dim]``,
``down_proj``: ``[E, dim, hidden]``, so that expert parallelism is a ``Shard(0)`` layout of these
three leaves, and tensor parallelism inside the experts (Megatron's MLP split, per expert) a
``Shard(1)`` of ``gate_proj``/``up_proj`` and a ``Shard(2)`` of ``down_proj``: the ``hidden``
(ffn) dim. :class:`Experts` runs them as one grouped call on rows sorted by expert.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

__all__ = ["Experts", "MoE", "MoEStats", "Routing", "combine", "expert_capacity",
           "expert_outputs", "route"]


class Routing(NamedTuple):
    """The routing of ``N = groups * T`` tokens, ``k`` choices each."""

    expert: Int[Tensor, "groups seq k"]  # the chosen expert of each assignment
    gate: Float[Tensor, "groups seq k"]  # its gate (0 where dropped)
    kept: Tensor  # bool [groups, seq, k]: within capacity
    aux_loss: Float[Tensor, ""]  # load balancing, unweighted
    z_loss: Float[Tensor, ""]  # router z-loss, unweighted


class MoEStats(NamedTuple):
    """What one MoE block reports beside its output."""

    aux_loss: Float[Tensor, ""]
    z_loss: Float[Tensor, ""]
    tokens_per_expert: Int[Tensor, " experts"]  # kept assignments per expert
    dropped: Int[Tensor, ""]  # assignments dropped by the capacity


def expert_capacity(capacity_factor: float | None, top_k: int, seq: int, n_experts: int) -> int:
    """``ceil(capacity_factor * top_k * seq / n_experts)`` assignments per expert and group
    (``seq`` for the dropless ``capacity_factor=None``, which no expert can exceed).

    A capacity under one token per expert is an error: such a router would drop everything."""
    if capacity_factor is None:
        return seq  # a token chooses distinct experts: no expert sees more than seq of a group
    exact = capacity_factor * top_k * seq / n_experts
    if exact < 1:
        raise ValueError(
            f"capacity_factor={capacity_factor} gives {exact:.3g} < 1 token per expert "
            f"(top_k={top_k}, {seq} tokens per sequence, {n_experts} experts): raise "
            "capacity_factor or use capacity_factor=None (dropless)")
    # The slack keeps a product that should be whole (1.25 * 2 * 8 / 4) from rounding up.
    return math.ceil(exact - 1e-9)


def route(
    logits: Float[Tensor, "groups seq experts"], top_k: int, capacity_factor: float | None
) -> Routing:
    """Top-k gating with per-group capacity (see the module docstring)."""
    groups, seq, n_experts = logits.shape
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
    probs = logits.softmax(-1)
    gate, expert = probs.topk(top_k, dim=-1)  # [G, T, k]
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    capacity = expert_capacity(capacity_factor, top_k, seq, n_experts)
    # Position of each assignment in its expert's buffer: a running count over the group in
    # priority order (choice rank first, then token), i.e. over [k, T] flattened.
    onehot = F.one_hot(expert, n_experts)  # [G, T, k, E]
    ordered = onehot.transpose(1, 2).reshape(groups, top_k * seq, n_experts)
    position = ((ordered.cumsum(1) - 1) * ordered).sum(-1)  # [G, k*T]
    position = position.reshape(groups, top_k, seq).transpose(1, 2)  # [G, T, k]
    kept = position < capacity
    gate = torch.where(kept, gate, torch.zeros((), dtype=gate.dtype, device=gate.device))
    # Load balancing: f_e counts assignments before capacity, so that dropped tokens still
    # push the router away from the overloaded expert.
    frac = onehot.sum(2).to(probs.dtype).mean(1) / top_k  # [G, E]
    aux = n_experts * (frac * probs.mean(1)).sum(-1).mean()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return Routing(expert, gate, kept, aux, z)


class Experts(nn.Module):
    """``E`` SwiGLU experts with stacked weights, run as a grouped product: ``forward(x,
    counts)`` takes rows grouped by expert (the first ``counts[0]`` rows for expert 0, the next
    ``counts[1]`` for expert 1, ...) and returns each row's output, unscaled by any gate.

    The expert count is read from the weights, not stored, so that an expert-parallel shard
    (``E / ep`` experts) runs the same code. This is the one call that sees the experts'
    weights, so tensor parallelism (``shard_params``' style ``"experts"``: each rank an ffn
    slice of every expert) wraps it whole: the input enters the tensor-parallel region once and
    the partial outputs are summed once, whatever the number of experts.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: Float[Tensor, "n dim"], counts: list[int]) -> Float[Tensor, "n dim"]:
        if len(counts) != self.gate_proj.shape[0] or sum(counts) != x.shape[0]:
            raise ValueError(f"Experts: counts {counts} must give each of the "
                             f"{self.gate_proj.shape[0]} experts its rows of the {x.shape[0]}")
        out = []
        # An expert with no row still runs (on no rows): the weights stay in the autograd
        # graph, so their gradient hooks fire on every rank alike (data_parallel's buckets are
        # launched from them, in an order that must agree across ranks).
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ self.gate_proj[e].T) * (rows @ self.up_proj[e].T)
            out.append(h @ self.down_proj[e].T)
        return torch.cat(out)


def expert_outputs(
    experts: Experts,
    rows: Float[Tensor, "n dim"],
    expert: Int[Tensor, " n"],
    first: int = 0,
) -> Float[Tensor, "n dim"]:
    """``y[i] = expert_{expert[i]}(rows[i])``, unscaled, in the rows' order (``first``: the
    global index of the first local expert, for an expert-parallel shard)."""
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert - first, minlength=experts.gate_proj.shape[0]).tolist()
    y = experts(rows[order], counts)
    return y[torch.argsort(order)]  # back to the rows' order


def combine(
    experts: Experts,
    x: Float[Tensor, "n dim"],
    token: Int[Tensor, " a"],
    expert: Int[Tensor, " a"],
    gate: Float[Tensor, " a"],
) -> Float[Tensor, "n dim"]:
    """``y[t] = sum_a gate_a * experts_{expert_a}(x[t_a])`` over the assignments ``a``."""
    # Assignments in expert order, so that each token's contributions are added by expert
    # (the order expert parallelism also keeps).
    order = torch.argsort(expert, stable=True)
    token, expert, gate = token[order], expert[order], gate[order]
    y = expert_outputs(experts, x[token], expert)
    return torch.zeros_like(x).index_add(0, token, y * gate[:, None].to(x.dtype))


class MoE(nn.Module):
    """The MoE feed-forward block; ``forward(x) -> (y, MoEStats)``."""

    def __init__(self, dim: int, hidden: int, n_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = 1.25, noise_std: float = 0.0) -> None:
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"MoE needs n_experts >= 1, got {n_experts}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE top_k={top_k} must be in [1, n_experts={n_experts}]")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE capacity_factor must be > 0 or None, got {capacity_factor}")
        if noise_std < 0:
            raise ValueError(f"MoE noise_std must be >= 0, got {noise_std}")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.noise_std = capacity_factor, noise_std
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)

    def router_logits(self, x: Float[Tensor, "batch seq dim"]) -> Float[Tensor, "batch seq e"]:
        work = torch.promote_types(x.dtype, torch.float32)
        logits = x.to(work) @ self.router.weight.to(work).T
        if self.noise_std > 0 and self.training:
            logits = logits + self.noise_std * torch.randn_like(logits)
        return logits

    def forward(
        self, x: Float[Tensor, "batch seq dim"]
    ) -> tuple[Float[Tensor, "batch seq dim"], MoEStats]:
        b, t, d = x.shape
        # ``self.route`` is :func:`route` on one process; context parallelism installs one whose
        # router losses are the whole sequences' for the duration of a call
        # (funcpar.transforms.context_parallel).
        r = self.__dict__.get("route", route)(self.router_logits(x), self.top_k,
                                              self.capacity_factor)
        flat = r.kept.reshape(-1)
        a = flat.nonzero().squeeze(-1)
        token = torch.div(a, self.top_k, rounding_mode="floor")
        # ``self.dispatch`` is :func:`combine` on one process; expert parallelism installs an
        # all_to_all version for the duration of a call (funcpar.transforms.expert_parallel).
        dispatch = self.__dict__.get("dispatch", combine)
        y = dispatch(self.experts, x.reshape(-1, d), token, r.expert.reshape(-1)[a],
                     r.gate.reshape(-1)[a])
        counts = torch.bincount(r.expert.reshape(-1)[a], minlength=self.n_experts)
        stats = MoEStats(r.aux_loss, r.z_loss, counts, (~flat).sum())
        return y.reshape(b, t, d), stats
