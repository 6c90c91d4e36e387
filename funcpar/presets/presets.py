"""The presets: Colossal-AI's Booster plugins as thin compositions of funcpar's transforms.

Each preset is a :class:`Preset` (a frozen set of choices) that composes, in the one valid
order documented by the transforms,

``[clip] -> pipeline_split -> shard_params -> context_parallel -> data_parallel ->
zero_partition -> offload -> amp_cast``

* ``pipeline_split(mesh, microbatches=..., schedule=pp_style, virtual_stages=
  num_model_chunks)`` when ``pp_size > 1`` (first: it cuts the whole model into stages, and
  the transforms after it apply per stage);
* ``shard_params(rules, mesh)`` when ``tp_size > 1``; the rules are the model's
  (:func:`pick_rules`) unless given;
* ``context_parallel(mesh, mode=...)`` when ``sp_size > 1`` with Colossal-AI's
  ``sequence_parallelism_mode`` ``"ring_attn"`` (ring) or ``"all_to_all"`` (Ulysses), over a
  ``cp`` axis of ``sp_size`` ranks (``"split_gather"`` is ``shard_params``' sequence
  parallelism over ``tp``);
* ``data_parallel(mesh, bucket_mb=...)`` when the ``dp`` axis has more than one rank;
* ``zero_partition(stage, mesh)`` when ``zero_stage > 0`` (after ``shard_params``: the
  partition cuts the tensor-parallel shards);
* ``offload(target)`` for the optimizer state (with ZeRO in either order; here after it, so
  the store holds this rank's parts);
* ``amp_cast(precision, mesh=mesh)`` last (required after ZeRO-3, whose gathers would bypass
  its casts otherwise).

``max_norm`` prepends ``clip_by_global_norm(max_norm)`` to the optimizer, as the plugins'
``max_norm`` does. Under the transforms the clip sees the global norm of the sharded or
partitioned gradients (:mod:`funcpar.shard.reduce`), so it clips exactly as one process would.

A preset is used in one of two ways:

* ``hybrid_parallel(model, loss_fn, optimizer, tp_size=2, zero_stage=2)``: functionalize the
  model, build ``make_train_step`` and ``init_state``, compose (Colossal-AI's
  ``booster.boost``);
* ``hybrid_parallel(tp_size=2, zero_stage=2)`` (no model): the :class:`Preset`, which is itself
  a transform ``(step, state) -> (step, state)`` of a fresh state, composable with others.

Both return a :class:`Composed`: the pair ``(step, state)`` (a ``TrainStep`` and a
``TrainState``, the very objects the manual composition gives) that also carries ``.plan``
(:class:`~funcpar.presets.plan.Plan`: mesh, layouts, expected communication per step, memory
per rank). ``plan=True`` prints it on rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from funcpar.offload.store import TensorStore
from funcpar.optim.base import GradientTransformation, chain
from funcpar.optim.clip import clip_by_global_norm
from funcpar.pipeline.schedules import SCHEDULES
from funcpar.presets.plan import Plan, describe
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import (
    LocalAttr,
    Rule,
    bert_rules,
    gpt2_rules,
    hf_rules,
    llama_rules_for,
    plan_sharding,
)
from funcpar.state.functional import functionalize
from funcpar.state.train_state import TrainState, init_state
from funcpar.train.step import TrainStep, make_train_step
from funcpar.transforms.accumulate_grads import accumulate_grads
from funcpar.transforms.amp_cast import amp_cast
from funcpar.transforms.compose import require_fresh
from funcpar.transforms.context_parallel import context_parallel
from funcpar.transforms.data_parallel import data_parallel
from funcpar.transforms.expert_parallel import expert_parallel
from funcpar.transforms.offload import offload as offload_transform
from funcpar.transforms.pipeline_split import pipeline_split
from funcpar.transforms.shard_params import shard_params
from funcpar.transforms.tp_modes import plan_2d
from funcpar.transforms.zero_partition import zero_partition

__all__ = [
    "PRECISIONS",
    "Composed",
    "Preset",
    "ddp",
    "gemini",
    "hybrid_parallel",
    "low_level_zero",
    "pick_rules",
    "titan_parallelize",
]

#: Colossal-AI's precision names; "fp32" means no amp_cast.
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD_TARGETS = ("cpu", "nvme")

Transform = Callable[[TrainStep, TrainState], tuple[TrainStep, TrainState]]


class Composed(tuple):
    """``(step, state)``: unpacks like the manual composition's pair; ``.plan`` describes it.

    The plan is computed on first access (it reads the layouts and the state, no
    communication). ``offload_store``: the optimizer state's store when offloading (flush or
    close it when training ends; ``funcpar.transforms.offload.read_state`` reads the state
    back), else None."""

    def __new__(cls, step: TrainStep, state: TrainState,
                plan: Callable[[], Plan] | None = None, store: TensorStore | None = None
                ) -> Composed:
        obj = super().__new__(cls, (step, state))
        obj._make_plan = plan
        obj._plan = None
        obj.offload_store = store
        return obj

    @property
    def step(self) -> TrainStep:
        return self[0]

    @property
    def state(self) -> TrainState:
        return self[1]

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            if self._make_plan is None:
                raise ValueError("this pair was not built by a preset: use "
                                 "funcpar.presets.describe(step, state, mesh, ...)")
            self._plan = self._make_plan()
        return self._plan


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def pick_rules(model: nn.Module, *, vocab_parallel_loss: bool = True) -> list[Rule | LocalAttr]:
    """The tensor-parallel rules funcpar knows for ``model``.

    funcpar's :class:`~funcpar.models.Llama` -> ``llama_rules_for`` (with its MoE blocks'
    experts); Hugging Face's ``GPT2LMHeadModel``/``GPT2Model`` -> ``gpt2_rules``;
    ``BertForMaskedLM``/``BertModel`` -> ``bert_rules``; any other Hugging Face model (a
    ``config.model_type``) -> ``hf_rules`` (its ``tp_plan``, funcpar's rules for a family
    without one, or a refusal with the reason). Anything else is a ValueError asking for
    ``rules=``.
    ``vocab_parallel_loss``: keep the LM head's logits split and compute the loss vocab-parallel
    (the loss must then be token-mean cross-entropy, ``funcpar.models.lm_loss`` or
    ``moe_lm_loss``).
    """
    from funcpar.models.llama import Llama

    vpl = vocab_parallel_loss
    if isinstance(model, Llama):
        return list(llama_rules_for(model.cfg, vocab_parallel_loss=vpl))
    name = type(model).__name__
    cfg = getattr(model, "config", None)
    # By class name: importing transformers to test isinstance would cost seconds.
    if name == "GPT2LMHeadModel":
        return list(gpt2_rules(_head_dim(cfg), vocab_parallel_loss=vpl))
    if name == "GPT2Model":
        return list(gpt2_rules(_head_dim(cfg), prefix=""))
    if name == "BertForMaskedLM":
        return list(bert_rules(_head_dim(cfg), vocab_parallel_loss=vpl))
    if name == "BertModel":
        return list(bert_rules(_head_dim(cfg), prefix="", mlm_head=False))
    if getattr(model, "tp_plan", None) or getattr(cfg, "model_type", None):
        return list(hf_rules(model, vocab_parallel_loss=vpl))
    raise ValueError(
        f"no tensor-parallel rules are known for {type(model).__module__}.{name}: pass "
        "rules=[Rule(pattern, style), ...] (funcpar.shard.rules; funcpar's Llama, Hugging "
        "Face GPT-2, BERT and models with a tp_plan are picked automatically)"
    )


def _rules_text(model: nn.Module, rules: Sequence[Rule | LocalAttr]) -> str:
    return f"<{len(rules)} rules for {type(model).__name__}>"


#: Colossal-AI's ``sequence_parallelism_mode`` values; the context-parallel ones -> mode.
SP_MODES = ("split_gather", "all_to_all", "ring_attn")
CP_MODES = {"all_to_all": "ulysses", "ring_attn": "ring"}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A composition of funcpar's transforms, chosen by Colossal-AI-style arguments.

    ``tp_size`` / ``pp_size`` / ``dp_size`` (None: what the world leaves): the mesh
    ``dp x tp`` (``pp x dp x tp`` with a pipeline) built from the torchrun world unless
    ``mesh`` is given. ``zero_stage`` 0-3 over ``dp``. ``precision`` "fp32", "bf16" or "fp16"
    (with dynamic loss scaling from ``initial_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``). ``max_norm``: gradient clipping by the global norm. ``offload``:
    optimizer state in host memory ("cpu") or in files under ``offload_path`` ("nvme").
    ``bucket_mb``: data-parallel gradient bucket size. ``rules``: tensor-parallel rules
    (default :func:`pick_rules`). ``sequence_parallel``: with ``tp_size > 1``. ``microbatches``
    (required with ``pp_size > 1``; Colossal-AI's ``num_microbatches``): pipeline micro-batches
    per step; ``sp_size`` and ``sequence_parallelism_mode`` (Colossal-AI's names):
    ``"split_gather"`` is ``sequence_parallel=True`` (over ``tp``; ``sp_size`` 1 or
    ``tp_size``), ``"ring_attn"`` and ``"all_to_all"`` are :func:`context_parallel` ring and
    Ulysses over a ``cp`` axis of ``sp_size`` ranks; ``pp_style`` the schedule ("1f1b",
    "gpipe" or "interleaved" with ``num_model_chunks`` stages per rank). ``batch_shape``
    ``(batch, seq)`` of the global batch: lets the plan give the activation collectives in
    bytes. ``plan``: print the plan on rank 0 when composing. ``grad_accum``: gradient
    accumulation over that many micro-batches of each step's batch, reduced once per step
    (:func:`~funcpar.transforms.accumulate_grads`; HF Trainer's
    ``gradient_accumulation_steps``); with a pipeline, ``grad_accum`` times ``microbatches``
    pipeline micro-batches (the same sum of gradients). ``tp_mode``: "1d" (Megatron), "2d"
    (SUMMA on a ``q x q`` grid, ``tp_size = q * q``: :mod:`funcpar.transforms.tp_modes`),
    "2.5d" (``tp_depth`` such grids, ``tp_size = tp_depth * q * q``) or "3d" (a ``q x q x q``
    cube, ``tp_size = q ** 3``: :mod:`funcpar.transforms.tp_cube`).
    """

    name: str = "preset"
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int | None = None
    zero_stage: int = 0
    precision: str = "fp32"
    microbatches: int | None = None
    sequence_parallel: bool = False
    rules: Sequence[Rule | LocalAttr] | None = None
    mesh: DeviceMesh | None = None
    max_norm: float | None = None
    offload: str | None = None
    offload_path: str | os.PathLike | None = None
    keep_fp32: Any = None
    bucket_mb: float = 25.0
    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    batch_shape: tuple[int, int] | None = None
    plan: bool = False
    pp_style: str = "1f1b"
    num_model_chunks: int = 1
    ep_size: int = 1
    grad_accum: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1
    sp_size: int = 1
    sequence_parallelism_mode: str | None = None

    @property
    def cp_size(self) -> int:
        """The ``cp`` axis' size: ``sp_size`` under a context-parallel mode, else 1."""
        return self.sp_size if self.sequence_parallelism_mode in CP_MODES else 1

    def __post_init__(self) -> None:
        who = self.name
        for field in ("tp_size", "pp_size", "num_model_chunks", "ep_size", "grad_accum",
                      "sp_size"):
            v = getattr(self, field)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{who}: {field} must be an int >= 1, got {v!r}")
        if self.dp_size is not None and (not _is_int(self.dp_size) or self.dp_size < 1):
            raise ValueError(f"{who}: dp_size must be an int >= 1 or None (what the world "
                             f"leaves), got {self.dp_size!r}")
        if not _is_int(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"{who}: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{who}: unknown precision {self.precision!r}; use one of "
                             f"{PRECISIONS}")
        if self.offload not in (None, *OFFLOAD_TARGETS):
            raise ValueError(f"{who}: offload must be None, 'cpu' or 'nvme', got "
                             f"{self.offload!r}")
        if self.offload == "nvme" and self.offload_path is None:
            raise ValueError(f"{who}: offload='nvme' needs offload_path=, the directory for the "
                             "optimizer-state files")
        if self.offload != "nvme" and self.offload_path is not None:
            raise ValueError(f"{who}: offload_path is for offload='nvme' (offload is "
                             f"{self.offload!r})")
        if self.max_norm is not None and not (math.isfinite(self.max_norm)
                                              and self.max_norm > 0):
            raise ValueError(f"{who}: max_norm must be a finite number > 0 or None, got "
                             f"{self.max_norm!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"{who}: bucket_mb must be > 0, got {self.bucket_mb}")
        self._check_sp(who)
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError(f"{who}: sequence_parallel splits activations over tp: it needs "
                             "tp_size > 1")
        if self.microbatches is not None:
            if not _is_int(self.microbatches) or self.microbatches < 1:
                raise ValueError(f"{who}: microbatches must be an int >= 1, got "
                                 f"{self.microbatches!r}")
            if self.pp_size == 1:
                raise ValueError(f"{who}: microbatches={self.microbatches} are pipeline "
                                 "micro-batches: they need pp_size > 1 (for gradient "
                                 "accumulation use grad_accum=)")
        if self.pp_size > 1 and self.microbatches is None:
            raise ValueError(f"{who}: pp_size={self.pp_size} needs microbatches= (Colossal-AI's "
                             "num_microbatches): how many micro-batches the pipeline runs per "
                             "step")
        if self.pp_style not in SCHEDULES:
            raise ValueError(f"{who}: unknown pp_style {self.pp_style!r}; use one of "
                             f"{SCHEDULES}")
        if self.num_model_chunks > 1 and self.pp_style != "interleaved":
            raise ValueError(f"{who}: num_model_chunks={self.num_model_chunks} needs "
                             f"pp_style='interleaved', got {self.pp_style!r}")
        if self.batch_shape is not None and (
                len(self.batch_shape) != 2 or not all(_is_int(s) and s > 0
                                                      for s in self.batch_shape)):
            raise ValueError(f"{who}: batch_shape must be (batch, seq) of positive ints, got "
                             f"{self.batch_shape!r}")
        if self.ep_size > 1 and self.tp_size > 1 and self.plan:
            raise ValueError(f"{who}: the plan of ep_size={self.ep_size} with tp_size="
                             f"{self.tp_size} is not modeled yet (docs/MOE.md, Not yet): drop "
                             "plan=True and measure a step with funcpar.shard.comm.comm_report")
        if self.tp_mode != "1d":
            self._check_tp_mode()
        elif self.tp_depth != 1:
            raise ValueError(f"{who}: tp_depth={self.tp_depth} is for tp_mode='2.5d'")
        if self.mesh is not None:
            self._check_mesh(self.mesh)

    def _check_tp_mode(self) -> None:
        """``tp_mode="2d" | "2.5d" | "3d"``: ``tp_size`` fits the mode's grid
        (:func:`funcpar.transforms.tp_modes.mode_axes`); what it does not compose with yet is
        refused (2D's compositions: tests/test_tp_2d_compose.py; 2.5D's and 3D's:
        tests/test_tp_modes_nd.py)."""
        try:
            self._tp_axes()
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        tested = self.tp_mode == "2d"
        for what, on in (("sequence_parallel", self.sequence_parallel),
                         ("ep_size > 1", self.ep_size > 1),
                         ("pp_size > 1", self.pp_size > 1 and not tested),
                         (f"precision={self.precision!r}", self.precision != "fp32"
                          and not tested),
                         ("zero_stage=3", self.zero_stage == 3 and not tested),
                         ("a context-parallel sequence_parallelism_mode", self.cp_size > 1)):
            if on:
                raise ValueError(f"{self.name}: tp_mode={self.tp_mode!r} does not compose with "
                                 f"{what} yet")
        if self.plan and (why := self._grid_unplanned()):
            raise ValueError(why)

    def _grid_unplanned(self) -> str | None:
        """Why the plan cannot model this multi-dimensional mode (None when it can): it models
        2D's collectives only (``Plan._tp2d_rows``), and not under ``grad_accum > 1``."""
        if self.tp_mode == "1d" or (self.tp_mode == "2d" and self.grad_accum == 1):
            return None
        why = (f"tp_mode={self.tp_mode!r} does not compose with plan=True yet (the plan models "
               "2D's collectives only)" if self.tp_mode != "2d" else
               f"the plan of tp_mode='2d' with grad_accum={self.grad_accum} is not modeled "
               "(each micro-batch repeats the SUMMA panels)")
        return (f"{self.name}: {why}: drop plan=True and measure a step with "
                "funcpar.shard.comm.comm_report")

    def _tp_axes(self) -> dict[str, int]:
        """The tensor-parallel mesh axes: ``tp`` (1D), or ``tp`` of size 1 and the grid."""
        from funcpar.transforms.tp_modes import mode_axes

        if self.tp_mode == "1d":
            return {"tp": self.tp_size}
        return {"tp": 1, **mode_axes(self.tp_mode, self.tp_size, self.tp_depth)}

    def _check_sp(self, who: str) -> None:
        mode = self.sequence_parallelism_mode
        if mode is None:
            if self.sp_size > 1:
                raise ValueError(f"{who}: sp_size={self.sp_size} needs sequence_parallelism_mode"
                                 f" (one of {SP_MODES})")
            return
        if mode not in SP_MODES:
            why = (" (Colossal-AI's 'ring' is split_gather with ring-exchanged gathers: use "
                   "'split_gather', or 'ring_attn' for ring attention)" if mode == "ring" else "")
            raise ValueError(f"{who}: unknown sequence_parallelism_mode {mode!r}; use one of "
                             f"{SP_MODES}{why}")
        if mode == "split_gather":
            if self.sp_size not in (1, self.tp_size):
                raise ValueError(f"{who}: split_gather splits the sequence over tp: sp_size "
                                 f"({self.sp_size}) must be 1 or tp_size ({self.tp_size})")
            if self.tp_size == 1:
                raise ValueError(f"{who}: split_gather splits activations over tp: it needs "
                                 "tp_size > 1")
            object.__setattr__(self, "sequence_parallel", True)
        elif self.sp_size == 1:
            raise ValueError(f"{who}: sequence_parallelism_mode={mode!r} needs sp_size > 1")

    # ------------------------------------------------------------------------------- mesh
    def _check_mesh(self, mesh: DeviceMesh) -> None:
        sizes = mesh.shape
        known = ("pp", "dp", "tp", "ep", "cp", *self._tp_axes())
        extra = {a: s for a, s in sizes.items() if a not in known and s > 1}
        if extra:
            raise ValueError(f"{self.name}: the mesh has axes {extra} that the preset does not "
                             "use; its axes are 'dp' and 'tp' (and 'pp')")
        tp_axes = self._tp_axes()
        for axis, want in (*tp_axes.items(), ("pp", self.pp_size), ("ep", self.ep_size),
                           ("cp", self.cp_size)):
            if sizes.get(axis, 1) != want:
                if axis == "cp":
                    asked = f"sp_size (context-parallel modes)={want}"
                elif axis in ("pp", "ep") or self.tp_mode == "1d":
                    asked = f"{axis}_size={want}"
                else:
                    asked = (f"tp_size={self.tp_size} with tp_mode={self.tp_mode!r} (axes "
                             f"{tp_axes})")
                raise ValueError(f"{self.name}: {asked} but the mesh's {axis!r} axis "
                                 f"has {sizes.get(axis, 1)} ranks ({mesh!r})")
        if self.dp_size is not None and sizes.get("dp", 1) != self.dp_size:
            raise ValueError(f"{self.name}: dp_size={self.dp_size} but the mesh's 'dp' axis "
                             f"has {sizes.get('dp', 1)} ranks ({mesh!r})")
        if "dp" not in sizes:
            raise ValueError(f"{self.name}: the mesh needs a 'dp' axis (size 1 if unused), got "
                             f"{mesh!r}")
        if self.tp_size > 1 and not set(tp_axes) <= set(sizes):
            raise ValueError(f"{self.name}: tp_size={self.tp_size} needs a 'tp' mesh axis")

    def build_mesh(self) -> DeviceMesh:
        """``mesh`` if given, else ``DeviceMesh.from_env(dp=..., tp=...)`` over the torchrun
        world (a local mesh for one process); checked against the world size first."""
        if self.mesh is not None:
            return self.mesh
        world = _world_size()
        fixed = self.tp_size * self.pp_size * self.ep_size * self.cp_size
        what = f"tp_size {self.tp_size} x pp_size {self.pp_size}"
        if self.ep_size > 1:
            what += f" x ep_size {self.ep_size}"
        if self.cp_size > 1:
            what += f" x sp_size {self.cp_size}"
        if self.dp_size is None:
            if world % fixed:
                raise ValueError(f"{self.name}: {what} = {fixed} does not divide the world of "
                                 f"{world} process(es); launch a multiple of {fixed}")
            dp = world // fixed
        else:
            dp = self.dp_size
            if fixed * dp != world:
                raise ValueError(f"{self.name}: {what} x dp_size {dp} = {fixed * dp} processes, "
                                 f"but the world has {world}; tp_size * pp_size * dp_size must "
                                 "equal the number of processes")
        axes = {"pp": self.pp_size} if self.pp_size > 1 else {}
        if self.ep_size > 1:
            axes["ep"] = self.ep_size
        axes.update(dp=dp)
        if self.cp_size > 1:
            axes["cp"] = self.cp_size
        axes.update(self._tp_axes())
        return DeviceMesh.from_env(**axes)

    # ------------------------------------------------------------------------ composition
    def transforms(self, step: TrainStep, mesh: DeviceMesh) -> list[tuple[str, Transform]]:
        """The transforms this preset applies (after clipping), in order, each with the
        manual call it stands for."""
        out: list[tuple[str, Transform]] = []
        if self.pp_size > 1:
            out.append(self._pipeline(mesh))
        elif self.grad_accum > 1:
            out.append((f"accumulate_grads({self.grad_accum})",
                        accumulate_grads(self.grad_accum)))
        if self.tp_size > 1:
            module = getattr(step.apply_fn, "module", None)
            if module is None:
                raise TypeError(f"{self.name}: tp_size > 1 needs a step built on "
                                "functionalize(module)'s apply_fn (its modules are sharded)")
            rules = self._rules(module, step)
            sp = ", sequence_parallel=True" if self.sequence_parallel else ""
            if self.tp_mode != "1d":
                sp += f", mode={self.tp_mode!r}"
            out.append((f"shard_params({_rules_text(module, rules)}, mesh{sp})",
                        shard_params(rules, mesh, sequence_parallel=self.sequence_parallel,
                                     mode=self.tp_mode)))
        if self.cp_size > 1:  # after shard_params, whose vocab-parallel loss it weights
            mode = CP_MODES[self.sequence_parallelism_mode]
            out.append((f"context_parallel(mesh, mode={mode!r}, bucket_mb={self.bucket_mb})",
                        context_parallel(mesh, mode=mode, bucket_mb=self.bucket_mb)))
        if self.ep_size > 1:  # before ZeRO, which partitions the expert shards over dp
            out.append((f"expert_parallel(mesh, bucket_mb={self.bucket_mb})",
                        expert_parallel(mesh, bucket_mb=self.bucket_mb)))
        if mesh.size("dp") > 1:
            out.append((f"data_parallel(mesh, bucket_mb={self.bucket_mb})",
                        data_parallel(mesh, bucket_mb=self.bucket_mb)))
        if self.zero_stage:
            out.append((f"zero_partition({self.zero_stage}, mesh)",
                        zero_partition(self.zero_stage, mesh)))
        if self.offload is not None:
            path = "" if self.offload_path is None else f", path={str(self.offload_path)!r}"
            out.append((f"offload({self.offload!r}{path})",
                        offload_transform(self.offload, path=self.offload_path)))
        if self.precision != "fp32":
            kw: dict[str, Any] = {"keep_fp32": self.keep_fp32, "mesh": mesh}
            if self.precision == "fp16":
                kw.update(init_scale=self.initial_scale, growth_factor=self.growth_factor,
                          backoff_factor=self.backoff_factor,
                          growth_interval=self.growth_interval)
            out.append((f"amp_cast({self.precision!r}, mesh=mesh)", amp_cast(self.precision,
                                                                               **kw)))
        return out

    def _rules(self, module: nn.Module, step: TrainStep) -> list[Rule | LocalAttr]:
        if self.rules is not None:
            return list(self.rules)
        # The vocab-parallel loss replaces the step's loss, which is right only for token-mean
        # cross-entropy (declared by lm_loss); any other loss gets gathered logits.
        vpl = bool(getattr(step.loss_fn, "token_cross_entropy", False))
        return pick_rules(module, vocab_parallel_loss=vpl)

    def _pipeline(self, mesh: DeviceMesh) -> tuple[str, Transform]:
        chunks = "" if self.num_model_chunks == 1 else \
            f", virtual_stages={self.num_model_chunks}"
        # Gradient accumulation under a pipeline is more pipeline micro-batches.
        m = self.microbatches * self.grad_accum
        text = (f"pipeline_split(mesh, microbatches={m}, "
                f"schedule={self.pp_style!r}{chunks})")
        return text, pipeline_split(mesh, microbatches=m,
                                    schedule=self.pp_style,
                                    virtual_stages=self.num_model_chunks)

    def __call__(self, step: TrainStep, state: TrainState) -> Composed:
        """The composition applied to a fresh ``(step, state)`` (a transform)."""
        require_fresh(state, f"{self.name}:", "move trained states through a checkpoint")
        mesh = self.build_mesh()
        if self.max_norm is not None:
            # Prepended to the optimizer before any transform, so every transform that
            # re-initialises or wraps the optimizer sees the chain.
            opt = chain(clip_by_global_norm(self.max_norm), step.optimizer)
            step = dataclasses.replace(step, optimizer=opt)
            state = state._replace(opt_state=opt.init(state.params))
        steps = self.transforms(step, mesh)
        module = getattr(step.apply_fn, "module", None)
        sharding = grid = None
        if self.tp_size > 1 and self.tp_mode == "1d":
            # The same resolution shard_params makes (deterministic): for the plan's numbers.
            sharding = plan_sharding(module, self._rules(module, step), mesh, "tp")
        elif self.tp_size > 1 and self.tp_mode == "2d":
            grid = plan_2d(module, self._rules(module, step), mesh)
        store = None
        for _, t in steps:
            step, state = t(step, state)
            store = getattr(t, "store", store)  # the offload transform's
        texts = tuple(text for text, _ in steps)
        clip = 0 if self.max_norm is None else 1

        def make_plan() -> Plan:
            if self.tp_size > 1 and (why := self._grid_unplanned()):
                raise ValueError(why)
            return describe(step, state, mesh, name=self.name, transforms=texts,
                            sharding=sharding, sequence_parallel=self.sequence_parallel,
                            bucket_mb=self.bucket_mb, clip_norms=clip,
                            batch_shape=self.batch_shape, max_norm=self.max_norm, grid=grid)

        out = Composed(step, state, make_plan, store)
        if self.plan and mesh.rank() == 0:
            print(out.plan, flush=True)
        return out

    def boost(
        self,
        model: nn.Module | Callable,
        loss_fn: Callable,
        optimizer: GradientTransformation,
        *,
        params: Any = None,
        buffers: Any = None,
        seed: int = 0,
        compile: bool = False,
        donate: bool = True,
    ) -> Composed:
        """``make_train_step`` + ``init_state`` of ``model`` (an ``nn.Module``, or an
        ``apply_fn`` from ``functionalize`` with its ``params`` and ``buffers``), then this
        composition: Colossal-AI's ``booster.boost(model, optimizer, criterion)``. The step
        donates by default (``donate=True``, see :class:`~funcpar.train.TrainStep`): each call
        consumes the state it is given, so keep only the state it returns; the model's own
        tensors are the first state's storage and are updated with it."""
        if isinstance(model, nn.Module):
            if params is not None or buffers is not None:
                raise ValueError(f"{self.name}: params/buffers come from the module; pass them "
                                 "only with an apply_fn")
            apply_fn, params, buffers = functionalize(model)
        else:
            if params is None:
                raise ValueError(f"{self.name}: with an apply_fn, pass params= (and buffers=) "
                                 "from functionalize")
            apply_fn = model
            buffers = {} if buffers is None else buffers
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(f"{self.name}: optimizer must be a funcpar GradientTransformation "
                            f"(funcpar.optim), got {type(optimizer).__name__}")
        step = make_train_step(apply_fn, loss_fn, optimizer, compile=compile, donate=donate)
        return self(step, init_state(params, buffers, optimizer, seed))


def _preset(name: str, model: Any, loss_fn: Any, optimizer: Any, params: Any, buffers: Any,
            seed: int, compile: bool, donate: bool, /, **choices: Any) -> Preset | Composed:
    """Every preset function's body: ``Preset(name, **choices)`` (its checks run first, so a
    bad choice is reported before a missing model argument), then, with ``model``, the preset
    boosted onto it (``params``, ``buffers``, ``seed``, ``compile``, ``donate`` go to
    :meth:`Preset.boost`); without ``model``, the preset itself (a transform)."""
    preset = Preset(name, **choices)
    if model is None:
        if loss_fn is not None or optimizer is not None or params is not None \
                or buffers is not None:
            raise ValueError(f"{preset.name}: pass the model with the loss and optimizer, or "
                             "none of them to get the preset as a transform")
        return preset
    if loss_fn is None or optimizer is None:
        raise ValueError(f"{preset.name}: pass model, loss_fn and optimizer together")
    return preset.boost(model, loss_fn, optimizer, params=params, buffers=buffers, seed=seed,
                        compile=compile, donate=donate)


def hybrid_parallel(
    model: nn.Module | Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    dp_size: int | None = None,
    zero_stage: int = 0,
    precision: str = "fp32",
    microbatches: int | None = None,
    pp_style: str = "1f1b",
    num_model_chunks: int = 1,
    sequence_parallel: bool = False,
    sp_size: int = 1,
    sequence_parallelism_mode: str | None = None,
    rules: Sequence[Rule | LocalAttr] | None = None,
    mesh: DeviceMesh | None = None,
    max_norm: float | None = None,
    offload: str | None = None,
    offload_path: str | os.PathLike | None = None,
    keep_fp32: Any = None,
    bucket_mb: float = 25.0,
    initial_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    batch_shape: tuple[int, int] | None = None,
    plan: bool = False,
    grad_accum: int = 1,
    tp_mode: str = "1d",
    tp_depth: int = 1,
    params: Any = None,
    buffers: Any = None,
    seed: int = 0,
    compile: bool = False,
    donate: bool = True,
) -> Preset | Composed:
    """Colossal-AI's ``HybridParallelPlugin``: ``pp x dp x cp x tp`` with ZeRO 0-3 over dp.

    ``tp_mode``: ``"1d"`` (Megatron), ``"2d"`` (SUMMA; ``tp_size = q * q``, mesh axes
    ``tp_row`` x ``tp_col``), ``"2.5d"`` (``tp_size = tp_depth * q * q``, axes ``tp_dep`` x
    ``tp_row`` x ``tp_col``) or ``"3d"`` (``tp_size = q ** 3``, axes ``tp_in`` x ``tp_w`` x
    ``tp_out``); ``tp`` is kept at size 1 (docs/TENSOR_PARALLEL.md).

    ``compose([pipeline_split(mesh, microbatches=...)], shard_params(rules, mesh),
    [context_parallel(mesh, mode)], data_parallel(mesh), zero_partition(zero_stage, mesh),
    [offload], [amp_cast(precision)])``
    over ``DeviceMesh.from_env([pp=pp_size,] dp=-1, [cp=sp_size,] tp=tp_size)``
    (see :class:`Preset` for every argument). With ``model, loss_fn, optimizer``: the composed
    :class:`Composed` ``(step, state)``; without: the :class:`Preset` (a transform).
    """
    return _preset(
        "hybrid_parallel", model, loss_fn, optimizer, params, buffers, seed, compile, donate,
        tp_size=tp_size, pp_size=pp_size, dp_size=dp_size,
        zero_stage=zero_stage, precision=precision, microbatches=microbatches,
        sequence_parallel=sequence_parallel, sp_size=sp_size,
        sequence_parallelism_mode=sequence_parallelism_mode, rules=rules, mesh=mesh,
        max_norm=max_norm,
        offload=offload, offload_path=offload_path, keep_fp32=keep_fp32, bucket_mb=bucket_mb,
        initial_scale=initial_scale, growth_factor=growth_factor,
        backoff_factor=backoff_factor, growth_interval=growth_interval,
        batch_shape=batch_shape, plan=plan, pp_style=pp_style, num_model_chunks=num_model_chunks,
        grad_accum=grad_accum, tp_mode=tp_mode, tp_depth=tp_depth,
    )


def moe_hybrid(
    model: nn.Module | Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    ep_size: int = 2,
    tp_size: int = 1,
    pp_size: int = 1,
    dp_size: int | None = None,
    zero_stage: int = 0,
    precision: str = "fp32",
    microbatches: int | None = None,
    pp_style: str = "1f1b",
    num_model_chunks: int = 1,
    mesh: DeviceMesh | None = None,
    max_norm: float | None = None,
    keep_fp32: Any = None,
    bucket_mb: float = 25.0,
    batch_shape: tuple[int, int] | None = None,
    plan: bool = False,
    grad_accum: int = 1,
    params: Any = None,
    buffers: Any = None,
    seed: int = 0,
    compile: bool = False,
    donate: bool = True,
) -> Preset | Composed:
    """Colossal-AI's ``MoeHybridParallelPlugin``: experts over ``ep``, the batch over
    ``ep x dp``, ZeRO 0-3 over dp (the experts' own data-parallel group), with ``pp_size > 1``
    the model cut into pipeline stages first (``microbatches``, ``pp_style``,
    ``num_model_chunks`` as in :func:`hybrid_parallel`), with ``tp_size > 1`` attention, MLPs
    and every expert's ffn split over ``tp`` (:func:`pick_rules`: the rule style ``"experts"``
    for the MoE blocks; the router replicated).

    ``compose([pipeline_split(mesh, microbatches=...)], [shard_params(rules, mesh)],
    expert_parallel(mesh, bucket_mb=...), data_parallel(mesh, bucket_mb=...),
    zero_partition(zero_stage, mesh), [amp_cast(precision)])`` over
    ``DeviceMesh.from_env([pp=pp_size,] ep=ep_size, dp=-1, tp=tp_size)`` (docs/MOE.md). The
    plan (``.plan``, printed with ``plan=True``) gives the all_to_all bytes under balanced
    routing with their bound for any routing (``batch_shape`` for bytes rather than bytes per
    token; :mod:`funcpar.presets.plan`; not modeled under a pipeline, and refused with
    ``tp_size > 1``).
    """
    return _preset(
        "moe_hybrid", model, loss_fn, optimizer, params, buffers, seed, compile, donate,
        ep_size=ep_size, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size, zero_stage=zero_stage,
        precision=precision, microbatches=microbatches, pp_style=pp_style,
        num_model_chunks=num_model_chunks, mesh=mesh, max_norm=max_norm, keep_fp32=keep_fp32,
        bucket_mb=bucket_mb, batch_shape=batch_shape, plan=plan, grad_accum=grad_accum,
    )


def low_level_zero(
    model: nn.Module | Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    stage: int = 1,
    precision: str = "fp32",
    max_norm: float | None = None,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
    bucket_mb: float = 25.0,
    initial_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    batch_shape: tuple[int, int] | None = None,
    plan: bool = False,
    grad_accum: int = 1,
    params: Any = None,
    buffers: Any = None,
    seed: int = 0,
    compile: bool = False,
    donate: bool = True,
) -> Preset | Composed:
    """Colossal-AI's ``LowLevelZeroPlugin(stage)``: data parallelism over every rank with ZeRO
    stage 1 (optimizer state partitioned) or 2 (and gradients); ``cpu_offload`` keeps the
    optimizer state in host memory. ``compose(data_parallel(mesh), zero_partition(stage, mesh),
    [offload("cpu")], [amp_cast(precision)])``."""
    if stage not in (1, 2) or not _is_int(stage):
        raise ValueError(f"low_level_zero: stage must be 1 or 2 (LowLevelZeroPlugin's stages), "
                         f"got {stage!r}; ZeRO-3 is gemini() or hybrid_parallel(zero_stage=3)")
    return _preset(
        "low_level_zero", model, loss_fn, optimizer, params, buffers, seed, compile, donate,
        zero_stage=stage, precision=precision, mesh=mesh, max_norm=max_norm,
        offload="cpu" if cpu_offload else None, bucket_mb=bucket_mb, initial_scale=initial_scale,
        growth_factor=growth_factor, backoff_factor=backoff_factor,
        growth_interval=growth_interval, batch_shape=batch_shape, plan=plan,
        grad_accum=grad_accum,
    )


def ddp(
    model: nn.Module | Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    bucket_mb: float = 25.0,
    precision: str = "fp32",
    max_norm: float | None = None,
    mesh: DeviceMesh | None = None,
    initial_scale: float = 2.0**16,
    batch_shape: tuple[int, int] | None = None,
    plan: bool = False,
    grad_accum: int = 1,
    params: Any = None,
    buffers: Any = None,
    seed: int = 0,
    compile: bool = False,
    donate: bool = True,
) -> Preset | Composed:
    """Colossal-AI's ``TorchDDPPlugin`` (torch's DDP): the batch split over every rank,
    gradients averaged in ``bucket_mb`` buckets overlapped with the backward
    (``bucket_cap_mb``). ``compose(data_parallel(mesh, bucket_mb=bucket_mb),
    [amp_cast(precision)])``."""
    return _preset("ddp", model, loss_fn, optimizer, params, buffers, seed, compile, donate,
                   precision=precision, mesh=mesh, max_norm=max_norm, bucket_mb=bucket_mb,
                   initial_scale=initial_scale, batch_shape=batch_shape, plan=plan,
                   grad_accum=grad_accum)


def gemini(
    model: nn.Module | Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    offload: str | None = "cpu",
    offload_path: str | os.PathLike | None = None,
    zero_stage: int = 3,
    tp_size: int = 1,
    precision: str = "fp32",
    max_norm: float | None = None,
    mesh: DeviceMesh | None = None,
    initial_scale: float = 2.0**16,
    batch_shape: tuple[int, int] | None = None,
    plan: bool = False,
    grad_accum: int = 1,
    params: Any = None,
    buffers: Any = None,
    seed: int = 0,
    compile: bool = False,
    donate: bool = True,
) -> Preset | Composed:
    """Colossal-AI's ``GeminiPlugin``: ZeRO-3 (parameters, gradients and optimizer state
    partitioned over dp, each block gathered when it runs) with the optimizer state offloaded
    to host memory (``offload="cpu"``) or to files under ``offload_path`` (``"nvme"``);
    ``offload=None`` keeps it on the device. ``compose([shard_params], data_parallel(mesh),
    zero_partition(3, mesh), offload(target), [amp_cast(precision)])``.

    Gemini's chunk manager moves parameters and optimizer state between device and host by
    measured memory use; here the placement is static: the whole optimizer state offloaded,
    parameters partitioned on the device (the fp32 master parameters stay on the device here;
    a manual composition can offload them too, ``offload(what=("opt_state",
    "master_params"))`` after amp_cast, see docs/OFFLOAD.md).
    """
    if zero_stage != 3:
        raise ValueError(f"gemini is ZeRO-3 by construction (GeminiPlugin partitions "
                         f"parameters), got zero_stage={zero_stage!r}; for stages 1-2 with "
                         "offload use low_level_zero(stage, cpu_offload=True) or "
                         "hybrid_parallel(zero_stage=..., offload=...)")
    if offload not in (None, *OFFLOAD_TARGETS):
        raise ValueError(f"gemini: offload must be 'cpu', 'nvme' or None, got {offload!r}")
    return _preset("gemini", model, loss_fn, optimizer, params, buffers, seed, compile, donate,
                   tp_size=tp_size, zero_stage=3, precision=precision, mesh=mesh,
                   max_norm=max_norm, offload=offload, offload_path=offload_path,
                   initial_scale=initial_scale, batch_shape=batch_shape, plan=plan,
                   grad_accum=grad_accum)


def titan_parallelize(
    model: nn.Module | Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    tp: int = 1,
    dp_shard: int = -1,
    dp_replicate: int = 1,
    pp: int = 1,
    microbatches: int | None = None,
    pp_schedule: str = "1f1b",
    precision: str = "fp32",
    max_norm: float | None = None,
    mesh: DeviceMesh | None = None,
    batch_shape: tuple[int, int] | None = None,
    plan: bool = False,
    grad_accum: int = 1,
    params: Any = None,
    buffers: Any = None,
    seed: int = 0,
    compile: bool = False,
    donate: bool = True,
) -> Preset | Composed:
    """torchtitan's ``parallelize_llama`` steps in its ``ParallelDims`` vocabulary: ``tp``
    (tensor parallel), ``dp_shard`` (FSDP = ZeRO-3 over dp; -1: what the world leaves) and
    ``dp_replicate`` (DDP). One data-parallel axis only: ``dp_shard > 1`` with
    ``dp_replicate > 1`` (HSDP) is refused. ``pp`` with ``microbatches`` and ``pp_schedule``
    (torchtitan's ``pipeline_parallel_schedule``) cuts the model into stages. ``precision`` is
    FSDP's ``param_dtype`` (``"bf16"`` in torchtitan's default config; float32 gradient
    reduction either way)."""
    for name, v in (("tp", tp), ("dp_replicate", dp_replicate), ("pp", pp)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"titan_parallelize: {name} must be an int >= 1, got {v!r}")
    if not _is_int(dp_shard) or (dp_shard < 1 and dp_shard != -1):
        raise ValueError(f"titan_parallelize: dp_shard must be an int >= 1 or -1, got "
                         f"{dp_shard!r}")
    if dp_replicate > 1 and dp_shard not in (1, -1):
        raise ValueError(f"titan_parallelize: dp_replicate={dp_replicate} with dp_shard="
                         f"{dp_shard} is HSDP (replicas of shards over two axes), which funcpar "
                         "does not do; use one of them")
    if dp_replicate > 1:
        dp, stage = dp_replicate, 0
    else:
        dp, stage = (None if dp_shard == -1 else dp_shard), 3
    return _preset("titan_parallelize", model, loss_fn, optimizer, params, buffers, seed, compile,
                   donate,
                   tp_size=tp, pp_size=pp, dp_size=dp, zero_stage=stage, precision=precision,
                   mesh=mesh, max_norm=max_norm, batch_shape=batch_shape, plan=plan,
                   microbatches=microbatches, pp_style=pp_schedule, grad_accum=grad_accum)
