"""Cutting a functional model into pipeline stages at block boundaries.

A model is pipelined through a :class:`StagedModel`: where its blocks are (an ``nn.ModuleList``),
which modules run before them (the embedding: on the first stage) and after them (final norm
and LM head: on the last stage), and three functions that run the pieces -
``embed(module, *inputs) -> x``, ``block(module, i, x, *inputs) -> x`` and
``head(module, x, *inputs) -> output``. Every stage receives the micro-batch's model inputs
too (every rank has the batch), so a stage can derive positions or masks from the token ids,
never from the hidden states it was sent. Keyword arguments given to the stage's call reach
all three (context parallelism passes ``positions=``, the global positions of the token chunk
this rank holds). :func:`llama_stages` describes funcpar's :class:`~funcpar.models.Llama`.

Side losses: a stage before the last may return ``SideLoss(hidden, loss)`` instead of the
hidden states alone, where ``loss`` is a 0-d term of the training loss computed inside the
stage (an MoE block's weighted router losses). The pipeline sends ``hidden`` on, adds ``loss``
(its mean over micro-batches) to the step's loss and backpropagates it with the stage
(``d loss / d side loss = 1 / microbatches``). Between the blocks of one stage the value handed
on may be anything ``block`` and ``head`` agree on; ``hand_over(module, x)`` turns the stage's
last value into what it sends. For an MoE :class:`~funcpar.models.Llama` the blocks carry
``(hidden, stats of the stage's MoE blocks)``: a stage before the last sends ``SideLoss(hidden,
router_loss(its blocks))``, the last stage's head returns the
:class:`~funcpar.models.MoEOutput` of *its* blocks, whose ``router_loss`` ``moe_lm_loss`` adds,
so the loss is ``lm_loss + router_loss`` over every block of every stage, as in one process.
The loss function must declare that it adds the output's router loss as a plain term
(``loss_fn.extra_loss``, which ``moe_lm_loss`` has), else :func:`~funcpar.transforms.pipeline_split`
refuses the model: the other stages' router losses could not enter it as it does.

:func:`plan_stages` cuts the ``n`` blocks into ``S`` contiguous runs - at explicit cut points,
or balanced so that the largest stage's parameter count (the embedding counted on the first
stage, norm and head on the last) is as small as it can be (exact min-max partition by dynamic
programming) - and :class:`StagePlan` records, per stage, its blocks and the names of the
parameter leaves it uses. A leaf used by stages on two ranks (an embedding tied to the LM head)
is held by both; their gradients are summed between them after the backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["SideLoss", "StagePlan", "StagedModel", "llama_stages", "plan_stages",
           "staged_model_for"]


class SideLoss(NamedTuple):
    """What a stage before the last returns when its blocks add a term to the training loss
    (module docstring): the hidden states to send on, and that 0-d term."""

    hidden: Tensor
    loss: Tensor


@dataclass(frozen=True)
class StagedModel:
    """How to run a model piecewise (module docstring). ``hand_over(module, x)``: what a
    stage before the last returns from its last block's value (default: the value itself);
    ``side_losses(module)``: whether such stages return :class:`SideLoss` for this model."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    embed: Callable[..., Tensor]
    block: Callable[..., Any]
    head: Callable[..., Any]
    hand_over: Callable[[nn.Module, Any], Tensor | SideLoss] | None = None
    side_losses: Callable[[nn.Module], bool] | None = None


def _llama_rotary(module: nn.Module, x: Tensor, tokens: Tensor,
                  positions: Tensor | None) -> tuple[Tensor, Tensor]:
    from funcpar.models.llama import rotary_cos_sin

    cfg = module.cfg
    # From the token ids' sequence length (every stage has them): under sequence parallelism x
    # would hold a chunk of the sequence only. Under context parallelism the tokens are a
    # chunk too, and ``positions`` their global positions.
    return rotary_cos_sin(tokens.shape[1], cfg.head_dim, cfg.rope_theta, dtype=x.dtype,
                          device=x.device, positions=positions)


def _llama_embed(module: nn.Module, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
    if tokens.shape[1] > module.cfg.max_seq_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len "
                         f"{module.cfg.max_seq_len}")
    return module.embed_tokens(tokens)


class _MoEHidden(NamedTuple):
    """Between the blocks of a stage of an MoE Llama: the hidden states and the stats of the
    stage's MoE blocks so far (module docstring)."""

    hidden: Tensor
    stats: tuple[Any, ...]


def _llama_block(module: nn.Module, i: int, x: Tensor | _MoEHidden,
                 tokens: Tensor, positions: Tensor | None = None) -> Tensor | _MoEHidden:
    if not module.cfg.n_experts:
        cos, sin = _llama_rotary(module, x, tokens, positions)
        return module.layers[i](x, cos, sin)
    h, stats = x if isinstance(x, _MoEHidden) else (x, ())
    cos, sin = _llama_rotary(module, h, tokens, positions)
    if not module.cfg.is_moe(i):
        return _MoEHidden(module.layers[i](h, cos, sin), stats)
    h, s = module.layers[i](h, cos, sin)
    return _MoEHidden(h, (*stats, s))


def _llama_hand_over(module: nn.Module, x: Tensor | _MoEHidden) -> Tensor | SideLoss:
    from funcpar.models.llama import router_loss

    if not isinstance(x, _MoEHidden):
        return x
    return SideLoss(x.hidden, router_loss(module.cfg, x.stats)) if x.stats else x.hidden


def _llama_head(module: nn.Module, x: Tensor | _MoEHidden, tokens: Tensor,
                positions: Tensor | None = None) -> Any:
    if not module.cfg.n_experts:
        return module.lm_head(module.norm(x))
    from funcpar.models.llama import moe_output

    h, stats = x if isinstance(x, _MoEHidden) else (x, ())
    return moe_output(module.cfg, module.lm_head(module.norm(h)), stats)


def _llama_side_losses(module: nn.Module) -> bool:
    return module.cfg.n_experts > 0


def llama_stages() -> StagedModel:
    """The :class:`StagedModel` of :class:`funcpar.models.Llama` (same computation as its
    ``forward``, piecewise; with experts, the router losses as side losses: module
    docstring)."""
    return StagedModel("layers", ("embed_tokens",), ("norm", "lm_head"), _llama_embed,
                       _llama_block, _llama_head, _llama_hand_over, _llama_side_losses)


def staged_model_for(module: nn.Module, given: StagedModel | None) -> StagedModel:
    """``given``, or the known description of ``module``'s class."""
    if given is not None:
        return given
    from funcpar.models.llama import Llama

    if isinstance(module, Llama):
        return llama_stages()
    raise TypeError(f"pipeline_split does not know how to cut a {type(module).__qualname__} "
                    "into stages: pass stages=StagedModel(...) (funcpar.pipeline.stages)")


@dataclass(frozen=True)
class StagePlan:
    """Per virtual stage ``s``: its blocks ``ranges[s] = (lo, hi)`` and the dotted names of the
    parameter leaves it uses, ``names[s]``; ``p`` ranks, ``v`` stages per rank (stage ``s`` on
    rank ``s % p``)."""

    p: int
    v: int
    n_blocks: int
    ranges: tuple[tuple[int, int], ...]
    names: tuple[tuple[str, ...], ...]

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.n_stages, self.p))

    def names_of(self, rank: int) -> list[str]:
        """The leaves rank ``rank`` holds (of all its stages), in first-use order."""
        return list(dict.fromkeys(n for s in self.stages_of(rank) for n in self.names[s]))

    def shared(self) -> dict[str, list[int]]:
        """Leaves held by more than one rank -> those ranks (tied weights)."""
        holders: dict[str, list[int]] = {}
        for r in range(self.p):
            for n in self.names_of(r):
                holders.setdefault(n, []).append(r)
        return {n: rs for n, rs in holders.items() if len(rs) > 1}


def _balanced(costs: Sequence[float], extra_first: float, extra_last: float,
              k: int) -> list[int]:
    """Cut points (block index where each stage after the first begins) of the contiguous
    partition of ``costs`` into ``k`` non-empty runs minimizing the largest run's cost (the
    first run also pays ``extra_first``, the last ``extra_last``); ties go to earlier cuts."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, first: bool, last: bool) -> float:
        return prefix[j] - prefix[i] + (extra_first if first else 0) + (
            extra_last if last else 0)

    inf = float("inf")
    # best[j][s]: min over partitions of blocks[:j] into s runs of the largest run's cost
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    arg = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                c = max(best[i][s - 1], cost(i, j, s == 1, s == k))
                if c < best[j][s]:
                    best[j][s], arg[j][s] = c, i
    cuts, j = [], n
    for s in range(k, 1, -1):
        j = arg[j][s]
        cuts.append(j)
    return sorted(cuts)


def plan_stages(module: nn.Module, staged: StagedModel, p: int, v: int = 1,
                cuts: Sequence[int] | None = None) -> StagePlan:
    """Cut ``module``'s blocks into ``p * v`` stages: at ``cuts`` (the block index where each
    stage after the first begins, ``p * v - 1`` increasing indices) or balanced by parameter
    count (module docstring). ValueError when the stages cannot each get a block."""
    blocks = module.get_submodule(staged.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{staged.blocks!r} is a {type(blocks).__name__}, not an nn.ModuleList")
    n, k = len(blocks), p * v
    if k > n:
        what = f"pp={p} x {v} virtual stages per rank" if v > 1 else f"pp={p}"
        raise ValueError(f"pipeline of {k} stages ({what}) but the model has only {n} blocks "
                         f"in {staged.blocks!r}: every stage needs at least one block")
    if cuts is not None:
        cuts = [int(c) for c in cuts]
        if len(cuts) != k - 1:
            raise ValueError(f"cuts {cuts} give {len(cuts) + 1} stages but the mesh's pp size "
                             f"({p}) x virtual stages ({v}) is {k}: pass {k - 1} cut points")
        bounds = [0, *cuts, n]
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"cuts {cuts} must increase strictly within 1..{n - 1} (block "
                             f"indices where stages begin, {n} blocks)")
    else:
        def numel(m: nn.Module) -> int:
            return sum(x.numel() for x in m.parameters())

        first = sum(numel(module.get_submodule(x)) for x in staged.first)
        last = sum(numel(module.get_submodule(x)) for x in staged.last)
        cuts = _balanced([float(numel(b)) for b in blocks], first, last, k)
    bounds = [0, *cuts, n]
    ranges = tuple((bounds[s], bounds[s + 1]) for s in range(k))
    # Leaves by identity, so that a tied weight gets its one name (named_parameters'), found
    # wherever it is used.
    name_of = {id(x): name for name, x in module.named_parameters()}

    def leaves(mods: list[nn.Module]) -> list[str]:
        return list(dict.fromkeys(name_of[id(x)] for m in mods for x in m.parameters()))

    names = []
    for s, (lo, hi) in enumerate(ranges):
        mods = ([module.get_submodule(x) for x in staged.first] if s == 0 else [])
        mods += [blocks[i] for i in range(lo, hi)]
        mods += [module.get_submodule(x) for x in staged.last] if s == k - 1 else []
        names.append(tuple(leaves(mods)))
    covered = {x for ns in names for x in ns}
    missing = [x for x in name_of.values() if x not in covered]
    if missing:
        raise ValueError(f"pipeline stages use no module holding {missing[:5]}: every "
                         f"parameter must sit in a block, in {staged.first} or in "
                         f"{staged.last}")
    for ns in names:
        for x in ns:
            leaf = module.get_parameter(x)
            if leaf.dim() == 0 and leaf.is_floating_point():
                # The pipeline's global gradient norm sums per-stage totals; reduce's
                # grouping never sums a 0-d leaf across ranks.
                raise ValueError(f"pipeline_split: parameter {x!r} is 0-d; give it shape (1,)")
    return StagePlan(p, v, n, ranges, tuple(names))


class StageRunner(nn.Module):
    """Runs stage pieces of ``model`` under ``torch.func.functional_call`` (which needs a
    module whose ``forward`` is the computation): holds the model as its one child."""

    def __init__(self, model: nn.Module, staged: StagedModel) -> None:
        super().__init__()
        self.model = model
        self._staged = staged

    def forward(self, lo: int, hi: int, first: bool, last: bool, x: Tensor | None,
                *inputs: Any, **kwargs: Any) -> Any:
        st, m = self._staged, self.model
        if first:
            x = st.embed(m, *inputs, **kwargs)
        for i in range(lo, hi):
            x = st.block(m, i, x, *inputs, **kwargs)
        if last:
            return st.head(m, x, *inputs, **kwargs)
        return x if st.hand_over is None else st.hand_over(m, x)


def stage_apply(module: nn.Module, staged: StagedModel, plan: StagePlan) -> Callable:
    """``apply(params, buffers, stage, x, *inputs, **kwargs) -> (output, new_buffers)``:
    virtual stage ``stage`` of the model on ``x`` (None on the first stage, which embeds
    ``inputs``; ``kwargs`` go to the :class:`StagedModel`'s functions with them); the
    last stage returns the model's output, the others hidden states (or a :class:`SideLoss`).
    ``params`` holds (at least) the stage's leaves, by their dotted names; the module's own
    tensors are untouched.
    ``apply.module`` is the model, for the transforms that look at its structure."""
    runner = StageRunner(module, staged)
    k = plan.n_stages
    training = module.training  # fixed now, as functionalize fixes it

    def apply(params: dict[str, Tensor], buffers: dict[str, Tensor], stage: int,
              x: Tensor | None, *inputs: Any, **kwargs: Any) -> tuple[Any, dict[str, Tensor]]:
        lo, hi = plan.ranges[stage]
        missing = [n for n in plan.names[stage] if n not in params]
        if missing:
            raise KeyError(f"pipeline stage {stage} uses leaves {missing[:5]} that params "
                           "lacks")
        new_buffers = {n: b.clone() for n, b in buffers.items()}
        tensors = {f"model.{n}": t for n, t in params.items()}
        tensors.update({f"model.{n}": t for n, t in new_buffers.items()})
        was_training = module.training
        module.train(training)
        try:
            out = torch.func.functional_call(
                runner, tensors, (lo, hi, stage == 0, stage == k - 1, x, *inputs), kwargs,
                tie_weights=True, strict=False)
        finally:
            module.train(was_training)
        return out, new_buffers

    apply.module = module
    return apply
