"""GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection", arXiv 2403.03507), exactly as galore-torch 1.0.

For each chosen 2-D leaf the gradient is projected on a rank-``r`` subspace taken from its own
SVD, refreshed every ``update_proj_gap`` steps (at steps 0, gap, 2 gap, ... counting from 0);
the inner optimizer (AdamW or Adafactor) runs on the projected gradient and keeps its state in
the low-rank shape; its update is projected back and multiplied by ``scale``. The inner
optimizer's moments are *not* reset at a refresh (as in the reference). Other leaves get the
inner optimizer unprojected. The projection math is :mod:`funcpar.optim.projector`'s; the
projection matrices are part of the state (a pytree of tensors), so it is checkpointable.

Which leaves, with which rank: ``galore_mask`` is ``None`` (every 2-D leaf, with the default
config), a predicate ``fn(name, param)`` or a tree with the structure of ``params``, giving per
leaf ``False``/``None`` (unprojected), ``True`` (the default config), a :class:`GaLoreConfig`
or a dict of its fields overriding the defaults (per-leaf rank, gap, scale, proj_type).
:func:`galore_param_groups` builds such a tree by parameter name.

Sharded leaves (tensor parallel, or any :class:`~funcpar.shard.layout.Layout` given to
``update``) give the single-process result with the same code: the projector is refit from the
whole gradient (gathered at refresh steps only) and each rank keeps its part of it; the
projection is completed by an all-reduce only when the projected dim is split; the inner
optimizer's state is split like the leaf on the unprojected dim, with a layout for its
reductions; 8-bit states are quantized in the whole state's blocks
(:mod:`funcpar.optim.projector`, :mod:`funcpar.optim.quant8`; costs in docs/OPTIMIZERS.md).
Every shape-dependent choice (the side of ``"std"``, the rank check, the 8-bit threshold) is
made on the whole leaf's shape. The sharding transforms initialise with the shards' layouts
(:func:`funcpar.optim.base.init_laid_out`), which ``init`` reads; an ``init`` called on bare
shards sees their shapes only, so where a shard would choose otherwise, the first update
(count 0: an all-zero state, and a refresh) rebuilds the state for the whole leaves (such an
init refuses a rank above the shard's own dims); a trained state shaped for other layouts is
a ValueError.

Communication: the per-leaf step is written as phases (:func:`funcpar.shard.reduce.run_phased`)
and all leaves' steps run together, so each kind of collective is one message per mesh axis
for the whole tree, not one per leaf: the refresh's gradient gathers
(:func:`~funcpar.optim.projector.gather_many`), the projections' partial sums, the 8-bit
absmax of all split states (a max all-reduce), and galore_adafactor's Adafactor statistics
(its phased leaf step, run inside ours). The SVD of each leaf is local (every rank has the
gathered gradient). Exceptions to one message per axis: a dim split over nested axes is
gathered level by level (one all-gather per level), and leaves of different dtypes travel in
separate buffers. Measured in docs/DISTRIBUTED_OPTIM.md (tp2 x dp2 + ZeRO-2: 2, 4 and 8
messages per step for galore_adamw, its 8-bit form and galore_adafactor).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from funcpar.kernels.factored import decoupled_decay_
from funcpar.kernels.foreach_factored import host_equals
from funcpar.kernels.inplace import fast_path_ok, inplace_allowed
from funcpar.kernels.quant8 import Adam8bitScalars, adam8bit_math
from funcpar.optim import validate
from funcpar.optim.adafactor import (
    ADAFACTOR_INJECTED,
    _leaf_step,
    _step_scalars,
    adafactor_hyperparams,
    adafactor_leaf_init,
)
from funcpar.optim.base import (
    GradientTransformation,
    NotTraceable,
    check_floating,
    check_grads,
    current_init_layouts,
    leaf_columns,
)
from funcpar.optim.factored import decoupled_decay
from funcpar.optim.hyperparams import inject_hyperparams
from funcpar.optim.masks import Mask, resolve_mask, restrict_to
from funcpar.optim.projector import (
    PROJ_TYPES,
    PROJECTION,
    REFRESH,
    Gather,
    Projector,
    gather_many,
    init_projector,
    local_projection,
    low_rank_layout,
    low_rank_shape,
    project_back,
    projector_from,
)
from funcpar.optim.quant8 import (
    MaxPartial,
    Quantized,
    adam8bit_phases,
    dynamic_map,
    quantized_zeros,
)
from funcpar.optim.schedules import ScalarOrSchedule
from funcpar.shard.reduce import Partial, global_shape, run_phased, sum_partials, together
from funcpar.state.tree import (
    Tree,
    leaves_like,
    leaves_up_to,
    named_leaves,
    tree_flatten,
    tree_map_with_path,
    tree_unflatten,
)

__all__ = [
    "DEFAULT_GALORE_TARGETS",
    "GaLoreAdafactorState",
    "GaLoreAdamWState",
    "GaLoreConfig",
    "galore_adafactor",
    "galore_adamw",
    "galore_param_groups",
]


class GaLoreConfig(NamedTuple):
    """How one leaf is projected (galore-torch's per-group ``rank``, ``update_proj_gap``,
    ``scale``, ``proj_type``)."""

    rank: int
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"


GaLoreMask = Any  # None | Callable[[str, Tensor], bool | GaLoreConfig | dict | None] | Tree


def _check_config(who: str, cfg: GaLoreConfig, name: str | None = None,
                  param: Tensor | None = None,
                  shape: tuple[int, ...] | None = None) -> GaLoreConfig:
    where = f" for leaf {name!r}" if name is not None else ""
    rank, gap = cfg.rank, cfg.update_proj_gap
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{who}: rank must be an int > 0{where}, got {rank!r}")
    if isinstance(gap, bool) or not isinstance(gap, int) or gap <= 0:
        raise ValueError(f"{who}: update_proj_gap must be an int > 0{where}, got {gap!r}")
    if isinstance(cfg.scale, bool) or not isinstance(cfg.scale, (int, float)) or not (
        math.isfinite(cfg.scale) and cfg.scale >= 0
    ):
        raise ValueError(f"{who}: scale must be a finite number >= 0{where}, got {cfg.scale!r}")
    if cfg.proj_type not in PROJ_TYPES:
        raise ValueError(f"{who}: proj_type must be one of {PROJ_TYPES}{where}, "
                         f"got {cfg.proj_type!r}")
    if param is not None:
        # The whole leaf's shape decides (a shard's is only this process's part).
        shape = tuple(param.shape) if shape is None else tuple(shape)
        if len(shape) != 2:
            raise ValueError(f"{who}: leaf {name!r} has shape {shape}; GaLore "
                             "projects 2-D leaves only (leave it out of galore_mask)")
        if rank > min(shape):
            raise ValueError(f"{who}: rank {rank} exceeds min{shape} = "
                             f"{min(shape)} for leaf {name!r}: lower its rank or leave "
                             "it out of galore_mask")
    return cfg._replace(scale=float(cfg.scale))


def resolve_galore(who: str, galore_mask: GaLoreMask, params: Tree, default: GaLoreConfig,
                   shapes: Sequence[tuple[int, ...]] | None = None) -> list[GaLoreConfig | None]:
    """Per leaf of ``params`` (flattening order): its checked config, or None (unprojected).

    ``shapes``: the whole leaves' shapes (default: the tensors' own), for sharded params.
    """
    named = named_leaves(params)
    if shapes is None:
        shapes = [None if p is None else tuple(p.shape) for _, p in named]
    if galore_mask is None:
        raw: list[Any] = [p is not None and p.dim() == 2 for _, p in named]
    elif callable(galore_mask):
        raw = [galore_mask(name, p) for name, p in named]
    else:
        raw = leaves_like(params, restrict_to(galore_mask, params), what="galore_mask",
                          against="params")
    out: list[GaLoreConfig | None] = []
    for (name, p), r, shape in zip(named, raw, shapes):
        if r is None or r is False or p is None:
            out.append(None)
            continue
        if r is True:
            cfg = default
        elif isinstance(r, GaLoreConfig):
            cfg = r
        elif isinstance(r, Mapping):
            unknown = set(r) - set(GaLoreConfig._fields)
            if unknown:
                raise ValueError(f"{who}: galore_mask for leaf {name!r} has unknown keys "
                                 f"{sorted(unknown)}; expected some of {GaLoreConfig._fields}")
            cfg = default._replace(**r)
        else:
            raise TypeError(f"{who}: galore_mask for leaf {name!r} is {type(r).__name__}; "
                            "expected a bool, None, a GaLoreConfig or a dict of its fields")
        out.append(_check_config(who, cfg, name, p, shape))
    return out


def _per_leaf(params: Tree, values: list[Any]) -> Tree:
    # Configs (NamedTuples) and layouts rebuilt under params' structure sit at its leaves,
    # which map_leaves (flatten_up_to) hands over whole.
    return tree_unflatten(tree_flatten(params)[1], values)


class _Leaf(NamedTuple):
    """What a leaf's state is made of, decided from the whole leaf (its layout) and its shard."""

    cfg: GaLoreConfig | None  # None: unprojected
    shape: tuple[int, ...]  # the whole leaf's
    state_shape: tuple[int, ...]  # this process's (low-rank if projected)
    state_layout: Any  # layout of the (low-rank) state, None when whole on this process
    state_numel: int  # the whole (low-rank) state's element count: the 8-bit choice
    layout: Any  # the leaf's layout, None when the leaf is whole on this process


def _plan(who: str, galore_mask: GaLoreMask, params: Tree, default: GaLoreConfig,
          layouts: Tree | None) -> list[_Leaf | None]:
    """Per leaf (flattening order) its :class:`_Leaf`, None for a None parameter.

    Every shape-dependent choice (the projected side of ``"std"``/``"reverse_std"``, the rank
    check, the 8-bit threshold) is made on the whole leaf, so a shard is treated as one
    process treats the leaf.
    """
    leaves = tree_flatten(params)[0]
    lays = leaves_like(params, layouts, what="layouts", against="params")
    shapes = [None if p is None else global_shape(p, lay) for p, lay in zip(leaves, lays)]
    cfgs = resolve_galore(who, galore_mask, params, default, shapes)
    out: list[_Leaf | None] = []
    for p, lay, shape, cfg in zip(leaves, lays, shapes, cfgs):
        if p is None:
            out.append(None)
            continue
        # A leaf whole on this process needs no collective whatever its layout says.
        lay = None if shape == tuple(p.shape) else lay
        if cfg is None:
            out.append(_Leaf(None, shape, tuple(p.shape), lay, math.prod(shape), lay))
        else:
            local = low_rank_shape(p.shape, cfg.rank, cfg.proj_type, global_shape=shape)
            whole = low_rank_shape(shape, cfg.rank, cfg.proj_type)
            out.append(_Leaf(cfg, shape, local, low_rank_layout(lay, cfg.rank, cfg.proj_type),
                             math.prod(whole), lay))
    return out


def _init_projectors(params: Tree, plan: list[_Leaf | None], meta: bool = False) -> Tree:
    leaves, spec = tree_flatten(params)
    return tree_unflatten(spec, [
        None if lf is None or lf.cfg is None else init_projector(
            p.shape, lf.cfg.rank, lf.cfg.proj_type, dtype=p.dtype,
            device="meta" if meta else p.device, global_shape=lf.shape)
        for p, lf in zip(leaves, plan)
    ])


def _project_phases(g: Tensor, proj: Projector, cfg: GaLoreConfig, count: int, svd_dtype,
                    layout):
    """galore-torch's ``project`` as phases: at a refresh (counts 0, gap, 2 gap, ...) the
    gradient's gather (a :class:`~funcpar.optim.projector.Gather` the driver completes for all
    leaves with one all-gather per mesh axis) and the SVD; then the projection's partial sum (a
    Partial: one all-reduce per mesh axis for all leaves). The scheduler runs every gather
    before any reduction (:func:`funcpar.shard.reduce.together`), so the leaves that refresh
    and those that do not still reduce in one round."""
    if count % cfg.update_proj_gap == 0:
        (whole,) = yield [Gather(g, layout, REFRESH)]
        proj = projector_from(whole, g, cfg.rank, cfg.proj_type, svd_dtype=svd_dtype,
                              layout=layout)
    partial, dims = local_projection(g, proj)
    (low,) = yield [Partial(partial, layout, dims, PROJECTION)]
    return low, proj


def _unprojected_phases():
    """The phases of :func:`_project_phases` for an unprojected leaf: nothing to gather, a
    reduction that needs no message (no layout). It keeps every leaf's later phases (its 8-bit
    absmax, its Adafactor statistics) in the round of the projected leaves' ones, so that each
    is one all-reduce per mesh axis for the whole tree: a reduction (not an empty phase)
    because run_phased's scheduler lets phases without reductions run ahead of those with
    one."""
    yield [Partial(_NOTHING, None, None, PROJECTION)]


# The unprojected leaves' reduction: returned as it is (no layout), never read.
_NOTHING = torch.zeros(())


def _with_galore_collectives(step):
    """A phased step that completes GaLore's own requests of ``step`` itself and passes the
    rest (Partials, kernel passes) on to its driver (:func:`funcpar.shard.reduce.run_phased`).

    Per round: all :class:`~funcpar.optim.projector.Gather` s by one
    :func:`~funcpar.optim.projector.gather_many` (one all-gather per mesh axis), all
    :class:`~funcpar.optim.quant8.MaxPartial` s by one ``sum_partials(op="max")`` (one
    all-reduce per mesh axis). (run_phased completes sums only; with a max op in
    :class:`~funcpar.shard.reduce.Partial` this wrapper would shrink to the gathers.)
    """
    try:
        asked = next(step)
        while True:
            asked = list(asked)
            if not any(isinstance(r, (Gather, MaxPartial)) for r in asked):
                asked = step.send((yield asked))  # nothing of GaLore's own (most rounds)
                continue
            results: list = [None] * len(asked)
            gathers = [i for i, r in enumerate(asked) if isinstance(r, Gather)]
            maxes = [i for i, r in enumerate(asked) if isinstance(r, MaxPartial)]
            rest = [i for i, r in enumerate(asked) if not isinstance(r, (Gather, MaxPartial))]
            if gathers:
                why = " + ".join(dict.fromkeys(asked[i].purpose for i in gathers))
                got = gather_many([asked[i].x for i in gathers], [asked[i].layout for i in gathers],
                                  purpose=why)
                for i, t in zip(gathers, got):
                    results[i] = t
            if maxes:
                got = sum_partials([asked[i].x for i in maxes], [asked[i].layout for i in maxes],
                                   [asked[i].dims for i in maxes], op="max",
                                   purpose=[asked[i].purpose for i in maxes])
                for i, t in zip(maxes, got):
                    results[i] = t
            if rest:
                got = yield [asked[i] for i in rest]
                for i, t in zip(rest, got):
                    results[i] = t
            asked = step.send(results)
    except StopIteration as stop:
        return stop.value


def _map_phased(fn: Callable[..., Any], grads: Tree, *others: Tree | None, n_out: int) -> Any:
    """:func:`funcpar.optim.base.map_leaves` for a phased per-leaf ``fn``: all leaves' steps
    run together (run_phased), so each round's reductions of the whole tree are one all-reduce
    per mesh axis (and GaLore's gathers and maxima one collective per axis)."""
    spec, g_leaves, columns = leaf_columns(grads, *others)
    steps = [fn(g, *row) for g, *row in zip(g_leaves, *columns)]
    (outs,) = run_phased([_with_galore_collectives(together(*steps))])
    return tuple(tree_unflatten(spec, [o[i] for o in outs]) for i in range(n_out))


def _shapes_of(tree: Tree) -> tuple[Any, list[Any]]:
    leaves, spec = tree_flatten(tree)
    return spec, [None if x is None else (x.shape, x.dtype) for x in leaves]


class _Planned(NamedTuple):
    """What :func:`_update_plan` derives from the leaves' shapes, configs and layouts alone."""

    plan: list[_Leaf | None]
    cfgs: Tree
    state_layouts: Tree
    leaf_layouts: Tree
    shapes: tuple[Any, list[Any]]  # _shapes_of the meta-device state build makes for plan


# The last few _planned results. Not per optimizer: inject_hyperparams builds the optimizer
# anew every step.
_PLANNED: dict = {}


def _planned(who: str, galore_mask: GaLoreMask, params: Tree, default: GaLoreConfig,
             layouts: Tree | None, build: Callable[..., Any], build_key: tuple) -> _Planned:
    """The plan of ``params`` under ``layouts`` (:func:`_plan`), its per-leaf trees, and the
    shapes of the state ``build`` makes for it, remembered by the leaves' structure, shapes
    and dtypes, the layouts (by identity), ``galore_mask`` (None or a predicate, by identity:
    a predicate is asked once per structure) and ``build_key`` (the optimizer and the static
    options ``build`` depends on): making them (the meta-device state above all) took longer
    than a small leaf's whole step, every step. A tree mask, or a layout that cannot be
    hashed, plans every step."""
    leaves, spec = tree_flatten(params)
    lays = leaves_up_to(spec, layouts, what="layouts", against="params")
    key = None
    if galore_mask is None or callable(galore_mask):
        key = (who, build_key, default, galore_mask, spec, tuple(lays),
               tuple(None if p is None else (p.shape, p.dtype) for p in leaves))
        try:
            hit = _PLANNED.get(key)
        except TypeError:
            key = hit = None
        if hit is not None:
            return hit
    plan = _plan(who, galore_mask, params, default, layouts)
    out = _Planned(
        plan,
        _per_leaf(params, [None if lf is None else lf.cfg for lf in plan]),
        _per_leaf(params, [None if lf is None else lf.state_layout for lf in plan]),
        _per_leaf(params, [None if lf is None else lf.layout for lf in plan]),
        _shapes_of(build(params, plan, meta=True)),
    )
    if key is not None:
        if len(_PLANNED) >= 8:
            _PLANNED.pop(next(iter(_PLANNED)))
        _PLANNED[key] = out
    return out


def _fit_state(who: str, state: Any, count: int, shapes: tuple[Any, list[Any]],
               fresh: Callable[[], Any]) -> Any:
    """The state to update: ``state`` itself when it is shaped as ``shapes`` (those of a
    meta-device init for the whole leaves' shapes, :func:`_planned`); ``fresh()`` when
    ``state`` is an untouched init (count 0: all zeros by construction, and every first update
    refits the projectors) made from shards without their layouts (``init`` sees only local
    shapes, so a side, an 8-bit choice or an absmax length may differ from the whole leaf's);
    otherwise a ValueError.
    """
    if _shapes_of(state) == shapes:
        return state
    if count == 0:
        return fresh()
    raise ValueError(f"{who}: the optimizer state (count {count}) is shaped for other layouts "
                     "than the ones given to update; reshard a trained state through a "
                     "checkpoint")


class _UpdatePlan(NamedTuple):
    state: Any
    cfgs: Tree
    state_layouts: Tree
    leaf_layouts: Tree
    decay: Tree


def _update_plan(who: str, galore_mask: GaLoreMask, weight_decay_mask: Mask, params: Tree,
                 grads: Tree, default: GaLoreConfig, layouts: Tree | None, state: Any,
                 build: Callable[..., Any], build_key: tuple) -> _UpdatePlan:
    """What both GaLore updates need per leaf: the plan under ``layouts``, the state fitted to
    it, and per leaf the config, the low-rank state's layout, the leaf's layout, the decay.
    ``build_key``: see :func:`_planned`."""
    check_grads(params, grads)
    if torch.compiler.is_compiling():
        raise NotTraceable(f"{who}: the projection's refresh every update_proj_gap steps is "
                           "host control flow on the step count")
    planned = _planned(who, galore_mask, params, default, layouts, build, build_key)
    # Host int: the refresh is data-independent control flow on the step count.
    state = _fit_state(who, state, int(state.count), planned.shapes,
                       lambda: build(params, planned.plan))
    return _UpdatePlan(state, planned.cfgs, planned.state_layouts, planned.leaf_layouts,
                       resolve_mask(weight_decay_mask, params))


# --------------------------------------------------------------------------------------------
# GaLore-AdamW (+ 8-bit states)
# --------------------------------------------------------------------------------------------


class GaLoreAdamWState(NamedTuple):
    count: Tensor  # 0-d int64: updates done
    projector: Tree  # per leaf: Projector, or None for an unprojected leaf
    exp_avg: Tree  # per leaf: low-rank shaped for a projected leaf; Quantized when 8-bit
    exp_avg_sq: Tree


def _galore_adamw(lr, weight_decay, eps, *, betas, default, galore_mask, adam_variant,
                  eight_bit, block_size, min_8bit_size, svd_dtype, weight_decay_mask):
    who = "galore_adamw"
    beta1, beta2 = betas
    code_m, code_v = dynamic_map(signed=True), dynamic_map(signed=False)
    maps_on = {code_m.device: (code_m, code_v)}  # the maps copied once to each states' device
    build_key = (who, eight_bit, block_size, min_8bit_size)

    def moment_zeros(lf, p, code, device):
        if eight_bit and lf.state_numel >= min_8bit_size:
            return quantized_zeros(lf.state_shape, code, block_size, device=device,
                                   layout=lf.state_layout)
        return torch.zeros(lf.state_shape, dtype=p.dtype, device=device)

    def build(params: Tree, plan: list[_Leaf | None], meta: bool = False) -> GaLoreAdamWState:
        leaves, spec = tree_flatten(params)

        def moments(code):
            return tree_unflatten(spec, [
                None if lf is None else moment_zeros(lf, p, code, "meta" if meta else p.device)
                for lf, p in zip(plan, leaves)])

        return GaLoreAdamWState(torch.zeros((), dtype=torch.int64),
                                _init_projectors(params, plan, meta), moments(code_m),
                                moments(code_v))

    def init(params: Tree) -> GaLoreAdamWState:
        check_floating(params, who=who)
        return build(params, _plan(who, galore_mask, params, default, current_init_layouts()))

    def step(grads, state: GaLoreAdamWState, params, layouts, out):
        state, cfgs, state_layouts, leaf_layouts, decay = _update_plan(
            who, galore_mask, weight_decay_mask, params, grads, default, layouts, state, build,
            build_key)
        c = int(state.count)
        count = state.count + 1
        t = count.to(torch.float64)
        bc1 = 1 - beta1**t
        bc2_sqrt = (1 - beta2**t).sqrt()
        # "hf": eps added to sqrt(v), both corrections in the step size (galore-torch's AdamW);
        # "bnb": eps added to sqrt(v / bc2), 1 / bc1 in the step size (bitsandbytes' Adam).
        step_size = lr * bc2_sqrt / bc1 if adam_variant == "hf" else lr / bc1

        scalars = Adam8bitScalars(beta1=beta1, beta2=beta2, eps=eps, bc2_sqrt=bc2_sqrt,
                                  variant=adam_variant)
        decays = not host_equals(weight_decay, 0.0)
        # addcmul takes tensors; a 0-d CPU one only as its second factor on CUDA (the products
        # commute, so the order changes no bit).
        lr_wd = torch.as_tensor(lr * weight_decay, dtype=torch.float64)

        def leaf(g, p, proj, m, v, cfg, use_decay, layout, low_layout):
            # Phases: the refresh's gather, the projection's partial sum, the 8-bit absmax of a
            # sharded state (the same rounds for every leaf: _unprojected_phases).
            # One check for both eager paths (a check costs as much as a small leaf's pass):
            # the fitted state has p's dtype, as g has, and the direction has p's shape.
            eager = _eager_ok(p, g, m, v, *(proj or ()), lr, weight_decay, eps)
            low = g
            if cfg is not None:
                low, proj = yield from _project_phases(g, proj, cfg, c, svd_dtype, layout)
            else:
                yield from _unprojected_phases()
            quantized = isinstance(m, Quantized), isinstance(v, Quantized)
            if all(quantized):
                # Whole 8-bit states: one fused pass (a Triton kernel on CUDA); sharded ones
                # in the whole state's blocks: two passes around the absmax all-reduce.
                if low.device not in maps_on:
                    maps_on[low.device] = code_m.to(low.device), code_v.to(low.device)
                direction, m_st, v_st = yield from adam8bit_phases(
                    low, m, v, *maps_on[low.device], block_size, scalars, layout=low_layout)
            elif any(quantized):
                raise ValueError(f"{who}: one moment of a leaf is 8-bit and the other is not; "
                                 "the state was not built by this optimizer")
            elif eager:
                # In place inside inplace_updates (else into new moments); the direction
                # into the projected gradient, which only the moments read.
                m_st, v_st, direction = adam8bit_math(
                    m, v, low, scalars, own=True, keep_moments=not inplace_allowed(),
                    scratch=low if cfg is not None else None)
            else:
                m_st, v_st, direction = adam8bit_math(m, v, low, scalars)
            if cfg is not None:
                direction = project_back(direction, proj, cfg.scale, layout=layout)
            if out == "param" and eager:
                return (_apply_in_place(p, direction, step_size, lr_wd, use_decay and decays,
                                        cfg is None),
                        proj, m_st, v_st)
            # w - s N rounded once, as galore-torch's p.add_(N, alpha=-s) (one fused pass).
            if use_decay and adam_variant == "bnb" and cfg is None:
                # bitsandbytes' own AdamW shrinks the weight before its step ...
                new_p = torch.addcmul(p * (1 - lr * weight_decay), direction, step_size,
                                      value=-1)
            else:
                new_p = torch.addcmul(p, direction, step_size, value=-1)
            if use_decay and not (adam_variant == "bnb" and cfg is None):
                # ... galore-torch shrinks the already updated weight (both AdamWs), also
                # rounded once: p.add_(p, alpha=-lr wd).
                new_p = torch.addcmul(new_p, new_p, lr_wd, value=-1)
            # new - old is exact while the step is under half the weight, so apply_updates
            # rebuilds new_p with the rounding computed here (apply: new_p itself).
            return (new_p - p if out == "update" else new_p.to(p.dtype)), proj, m_st, v_st

        u, proj, m, v = _map_phased(
            leaf, grads, params, state.projector, state.exp_avg, state.exp_avg_sq, cfgs, decay,
            leaf_layouts, state_layouts, n_out=4,
        )
        return u, GaLoreAdamWState(count, proj, m, v)

    def _apply_in_place(p, direction, step_size, lr_wd, decays, unprojected):
        # The operations of the out-of-place code above, written into the step's own fresh
        # direction (or a fresh shrunk weight) and, inside inplace_updates (a donated step),
        # into p itself: the same bits, donated or not. A decay of exactly 0 is skipped
        # (w - 0 w is w, but for the sign of a zero), as galore-torch and bitsandbytes skip it.
        donated = inplace_allowed()
        if decays and adam_variant == "bnb" and unprojected:
            shrunk = p.mul_(1 - lr * weight_decay) if donated else torch.mul(
                p, 1 - lr * weight_decay)
            return shrunk.addcmul_(direction, step_size, value=-1)
        if donated:
            new_p = p.addcmul_(direction, step_size, value=-1)
        else:
            new_p = torch.addcmul(p, direction, step_size, value=-1, out=direction)
        if decays:
            new_p.addcmul_(new_p, lr_wd, value=-1)
        return new_p

    def update(grads, state: GaLoreAdamWState, params=None, *, layouts=None):
        return step(grads, state, params, layouts, "update")

    def apply(grads, state: GaLoreAdamWState, params, *, layouts=None):
        return step(grads, state, params, layouts, "param")

    return GradientTransformation(init, update, apply)


def _eager_ok(p: Tensor, direction: Tensor, *hyper: Any) -> bool:
    """Whether GaLore's eager in-place paths may run for a leaf ``p`` (its parameter write;
    in :func:`_galore_adamw` also its full-precision inner Adam, given the gradient as
    ``direction`` and the state's tensors among ``hyper``): not when the step must be
    differentiable (any of the tensors given, hyperparameters included) or runs under a
    torch.func transform or torch.compile's tracing; a leaf of >= 1 dim whose direction has
    its shape and dtype (0-d arithmetic promotes with the 0-d float64 step size)."""
    return (p.dim() > 0 and direction.shape == p.shape and direction.dtype == p.dtype
            and p.is_contiguous() and not torch.compiler.is_compiling()
            and fast_path_ok(p, direction, *hyper))


def _check_common(who: str, rank, update_proj_gap, scale, proj_type, svd_dtype) -> GaLoreConfig:
    if svd_dtype is not None and svd_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{who}: svd_dtype must be torch.float32, torch.float64 or None, "
                         f"got {svd_dtype!r}")
    return _check_config(who, GaLoreConfig(rank, update_proj_gap, scale, proj_type))


def galore_adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: ScalarOrSchedule = 1e-6,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    galore_mask: GaLoreMask = None,
    eight_bit: bool = False,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    adam_variant: str = "hf",
    svd_dtype: torch.dtype | None = torch.float32,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """GaLore with an AdamW inner optimizer: galore-torch's ``GaLoreAdamW`` (and, 8-bit,
    ``GaLoreAdamW8bit``).

    Zhao et al. 2024, arXiv 2403.03507; 8-bit states: Dettmers et al. 2022, arXiv 2110.02861.
    Defaults: ``lr=1e-3``, ``betas=(0.9, 0.999)``, ``eps=1e-6``, ``weight_decay=0.0``,
    ``rank=128``, ``update_proj_gap=200``, ``scale=0.25``, ``proj_type="std"``, every 2-D leaf
    projected, fp32 states, ``block_size=256``, ``min_8bit_size=4096``. Tested step by step
    against galore-torch 1.0 (tests/test_galore.py: measured 1.7e-19 in float64, 1.1e-7 in
    float32, all five ``proj_type``; 8-bit: against GaLoreAdamW8bit and against this fp32 run).

    Per leaf, with ``G~`` the projected gradient of a projected leaf (else ``G~ = G``) and
    ``t`` the step (from 1), ``bc1 = 1 - b1^t``, ``bc2 = 1 - b2^t``::

        m <- b1 m + (1 - b1) G~;   v <- b2 v + (1 - b2) G~^2
        "hf":  N = m / (sqrt(v) + eps),          s = lr sqrt(bc2) / bc1
        "bnb": N = m / (sqrt(v) / sqrt(bc2) + eps), s = lr / bc1
        N <- scale * project_back(N)             (projected leaves)
        W' = W - s N;  W <- W' - lr wd W'         (decay after the step)
        "bnb", unprojected leaf:  W <- W (1 - lr wd) - s N   (decay before)

    ``adam_variant="hf"`` (the default) is galore-torch's ``GaLoreAdamW`` exactly (Hugging
    Face's AdamW: eps outside the uncorrected sqrt, the bias corrections folded into the step
    size, decay after the update); galore-torch's defaults are ``eps=1e-6``,
    ``weight_decay=0.0``. ``adam_variant="bnb"`` is the Adam of bitsandbytes that
    ``GaLoreAdamW8bit`` runs (its defaults: ``eps=1e-8``, ``weight_decay=1e-2``), with the
    decay placement above.

    ``eight_bit=True`` keeps ``m`` and ``v`` of every leaf whose (low-rank) state has at least
    ``min_8bit_size`` elements blockwise-quantized (:mod:`funcpar.optim.quant8`: ``m`` with the
    signed dynamic map, ``v`` with the unsigned one, ``block_size`` elements per absmax); each
    step dequantizes, updates in the leaf's dtype and requantizes, as bitsandbytes does (the
    size test is on the state, as in ``GaLoreAdamW8bit``, where a projected leaf's parameter is
    swapped for its low-rank stand-in before the test). Smaller states stay full precision.

    ``rank``, ``update_proj_gap``, ``scale``, ``proj_type`` are the default
    :class:`GaLoreConfig`; ``galore_mask`` picks the leaves and may override them per leaf (see
    the module docstring; default: every 2-D leaf). ``svd_dtype``: see
    :mod:`funcpar.optim.projector`. ``lr``, ``weight_decay`` and ``eps`` may be schedules; the
    decay applies where ``weight_decay_mask`` allows (galore-torch: every leaf of the group).
    """
    who = "galore_adamw"
    validate.nonnegative(who, "lr", lr)
    validate.positive(who, "eps", eps)
    validate.nonnegative(who, "weight_decay", weight_decay)
    betas = validate.betas_in_range(who, betas)
    default = _check_common(who, rank, update_proj_gap, scale, proj_type, svd_dtype)
    if adam_variant not in ("hf", "bnb"):
        raise ValueError(f"{who}: adam_variant must be 'hf' or 'bnb', got {adam_variant!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{who}: block_size must be an int > 0, got {block_size!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"{who}: min_8bit_size must be an int >= 0, got {min_8bit_size!r}")
    return inject_hyperparams(
        _galore_adamw,
        ("lr", "weight_decay", "eps"),
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        betas=betas,
        default=default,
        galore_mask=galore_mask,
        adam_variant=adam_variant,
        eight_bit=bool(eight_bit),
        block_size=block_size,
        min_8bit_size=min_8bit_size,
        svd_dtype=svd_dtype,
        weight_decay_mask=weight_decay_mask,
    )


# --------------------------------------------------------------------------------------------
# Choosing the leaves by name
# --------------------------------------------------------------------------------------------

#: Name patterns (``re.search``) of the attention and MLP weights of common transformers
#: (Llama/Mistral ``self_attn``/``mlp``, GPT-2 ``attn``/``mlp``, BERT ``attention``/
#: ``intermediate``/``layer.N.output``, T5 ``SelfAttention``/``DenseReluDense``, ...).
DEFAULT_GALORE_TARGETS: tuple[str, ...] = (
    r"attn", r"[Aa]ttention", r"mlp", r"ffn", r"feed_forward", r"intermediate",
    r"layers?\.\d+\.output\.", r"DenseReluDense",
)


def galore_param_groups(
    params: Tree | nn.Module,
    *,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    targets: Sequence[str] = DEFAULT_GALORE_TARGETS,
    overrides: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> Tree:
    """A ``galore_mask`` tree: a :class:`GaLoreConfig` for each 2-D leaf whose dotted name
    matches one of ``targets`` (regular expressions, ``re.search``), None elsewhere.

    ``overrides`` maps a name pattern to config fields for the targeted leaves it matches (the
    first matching pattern wins), e.g. ``{"mlp": {"rank": 64}, r"attn": {"rank": 32,
    "update_proj_gap": 100}}``; a pattern mapped to None leaves its leaves unprojected. An
    ``nn.Module`` stands for its ``named_parameters()`` dict (:func:`funcpar.state.functionalize`'s
    params). Ranks are checked against the shapes here (and again by the optimizer's init).
    """
    who = "galore_param_groups"
    if isinstance(params, nn.Module):
        params = {k: v.detach() for k, v in params.named_parameters()}
    default = _check_config(who, GaLoreConfig(rank, update_proj_gap, scale, proj_type))
    compiled = [re.compile(t) for t in targets]
    rules = [(re.compile(k), v) for k, v in (overrides or {}).items()]

    def pick(name: str, p: Tensor) -> GaLoreConfig | None:
        if p is None or p.dim() != 2 or not any(t.search(name) for t in compiled):
            return None
        cfg = default
        for pattern, fields in rules:
            if pattern.search(name):
                if fields is None:
                    return None
                cfg = default._replace(**fields)
                break
        return _check_config(who, cfg, name, p)

    return tree_map_with_path(pick, params)


# --------------------------------------------------------------------------------------------
# GaLore-Adafactor
# --------------------------------------------------------------------------------------------


class GaLoreAdafactorState(NamedTuple):
    count: Tensor  # 0-d int64: updates done
    projector: Tree  # per leaf: Projector, or None for an unprojected leaf
    stats: Tree  # per leaf: Adafactor's statistics dict (of the low-rank shape if projected)


def _galore_adafactor(lr=None, weight_decay=0.0, clip_threshold=1.0, *, eps, decay_rate, beta1,
                      scale_parameter, relative_step, warmup_init, min_dim_size_to_factor,
                      default, galore_mask, svd_dtype, weight_decay_mask):
    who = "galore_adafactor"
    build_key = (who, beta1, min_dim_size_to_factor)

    def build(params: Tree, plan: list[_Leaf | None], meta: bool = False
              ) -> GaLoreAdafactorState:
        leaves, spec = tree_flatten(params)
        stats = [
            None if lf is None else adafactor_leaf_init(
                lf.state_shape, dtype=p.dtype, device="meta" if meta else p.device, beta1=beta1,
                min_dim_size_to_factor=min_dim_size_to_factor)
            for lf, p in zip(plan, leaves)
        ]
        return GaLoreAdafactorState(torch.zeros((), dtype=torch.int64),
                                    _init_projectors(params, plan, meta),
                                    tree_unflatten(spec, stats))

    def init(params: Tree) -> GaLoreAdafactorState:
        check_floating(params, who=who)
        return build(params, _plan(who, galore_mask, params, default, current_init_layouts()))

    def step(grads, state: GaLoreAdafactorState, params, layouts, out):
        state, cfgs, state_layouts, leaf_layouts, decay = _update_plan(
            who, galore_mask, weight_decay_mask, params, grads, default, layouts, state, build,
            build_key)
        c = int(state.count)
        count = state.count + 1
        shared = _step_scalars(count, lr=lr, decay_rate=decay_rate,
                               relative_step=relative_step, warmup_init=warmup_init)
        decays_any = not host_equals(weight_decay, 0.0)

        def leaf(g, p, proj, st, cfg, use_decay, param_layout, layout, low_layout):
            # Phases: the refresh's gather and the projection's partial sum (as every leaf's:
            # _unprojected_phases), then Adafactor's (its phased leaf step).
            low = g
            if cfg is not None:
                # The low-rank gradient is split like the leaf on its unprojected dim and whole
                # on the projected one: low_layout says so to Adafactor's row/column statistics
                # and update RMS; RMS(W) in alpha_t is of the whole leaf (param_layout).
                low, proj = yield from _project_phases(g, proj, cfg, c, svd_dtype, layout)
            else:
                yield from _unprojected_phases()
            u, new_st, step_size = yield from _leaf_step(
                low, p, st, count, lr=lr, eps=eps, clip_threshold=clip_threshold,
                decay_rate=decay_rate, beta1=beta1, scale_parameter=scale_parameter,
                relative_step=relative_step, warmup_init=warmup_init, layout=low_layout,
                param_layout=param_layout, shared=shared,
            )
            if cfg is not None:
                u = project_back(u, proj, cfg.scale, layout=layout)
            if out == "param" and _eager_ok(p, u, lr, weight_decay):
                # In place under donation; else into u where it is the step's own (projected
                # back; unprojected with beta1 it is the new momentum itself). A decay of
                # exactly 0 skipped.
                decays = use_decay and decays_any
                if inplace_allowed():
                    new_p = decoupled_decay_(p, weight_decay * step_size) if decays else p
                    return new_p.sub_(u), proj, new_st
                new_p = decoupled_decay(p, weight_decay * step_size) if decays else p
                return torch.sub(new_p, u, out=u if cfg is not None else None), proj, new_st
            p_in = p
            p = p.to(u.dtype)
            # galore-torch's order: decay with alpha_t on the pre-update weight, then the step.
            new_p = decoupled_decay(p, weight_decay * step_size) if use_decay else p
            if out == "param":
                return (new_p - u).to(p_in.dtype), proj, new_st
            return (new_p - u) - p, proj, new_st

        u, proj, stats = _map_phased(leaf, grads, params, state.projector, state.stats, cfgs,
                                     decay, layouts, leaf_layouts, state_layouts, n_out=3)
        return u, GaLoreAdafactorState(count, proj, stats)

    def update(grads, state: GaLoreAdafactorState, params=None, *, layouts=None):
        return step(grads, state, params, layouts, "update")

    def apply(grads, state: GaLoreAdafactorState, params, *, layouts=None):
        return step(grads, state, params, layouts, "param")

    return GradientTransformation(init, update, apply)



def galore_adafactor(
    lr: Any = None,
    eps: Sequence[float] = (1e-30, 1e-3),
    clip_threshold: Any = 1.0,
    decay_rate: float = -0.8,
    beta1: float | None = None,
    weight_decay: Any = 0.0,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
    *,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    galore_mask: GaLoreMask = None,
    svd_dtype: torch.dtype | None = torch.float32,
    min_dim_size_to_factor: int = 0,
    weight_decay_mask: Mask = None,
) -> GradientTransformation:
    """GaLore with a Hugging Face Adafactor inner optimizer: galore-torch's ``GaLoreAdafactor``.

    Zhao et al. 2024 (arXiv 2403.03507) around Shazeer & Stern 2018 (arXiv 1804.04235).
    Defaults: :func:`~funcpar.optim.adafactor`'s and :func:`galore_adamw`'s GaLore ones. Tested
    step by step against galore-torch 1.0 (tests/test_galore.py: measured 0 in float64, 8.8e-9
    in float32).

    For a projected leaf ``W`` the Adafactor step (:func:`funcpar.optim.adafactor`'s, via
    :func:`~funcpar.optim.adafactor.adafactor_leaf_update`) runs on the projected gradient
    ``G~`` with statistics of ``G~``'s shape (factored: it is 2-D): ``beta2_t`` from the step;
    ``u = G~ V^-1/2`` clipped by ``RMS(u)`` (of the *low-rank* ``u``) over ``clip_threshold``;
    ``u <- alpha_t u`` with ``alpha_t = max(eps2, RMS(W)) rho_t`` from the *full* ``W``; with
    ``beta1`` the low-rank momentum ``M <- beta1 M + (1 - beta1) u``, ``u = M``. Then
    ``W <- W - weight_decay alpha_t W - scale * project_back(u)``. Unprojected leaves are plain
    :func:`~funcpar.optim.adafactor`. Arguments as there; ``rank``, ``update_proj_gap``,
    ``scale``, ``proj_type``, ``galore_mask``, ``svd_dtype`` as in :func:`galore_adamw`.
    """
    who = "galore_adafactor"
    # The Adafactor arguments are checked exactly as adafactor() checks them (first).
    hyper = adafactor_hyperparams(lr, eps, clip_threshold, decay_rate, beta1, weight_decay,
                                  scale_parameter, relative_step, warmup_init,
                                  min_dim_size_to_factor)
    default = _check_common(who, rank, update_proj_gap, scale, proj_type, svd_dtype)
    return inject_hyperparams(
        _galore_adafactor,
        ADAFACTOR_INJECTED,
        **hyper,
        default=default,
        galore_mask=galore_mask,
        svd_dtype=svd_dtype,
        weight_decay_mask=weight_decay_mask,
    )
