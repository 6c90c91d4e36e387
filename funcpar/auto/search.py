"""``auto_parallel``: enumerate layouts, price each with the cost model, rank the feasible ones.

The space (each dimension can be pinned or narrowed by ``constraints``):

* meshes ``pp x ep x dp x cp x tp = world_size``: ``tp`` dividing the heads and key/value
  heads, at most ``max_tp`` (default: the profile's GPUs per node, and then dividing it, so
  tensor parallelism stays on NVLink); ``pp`` at most the layer count; ``ep`` dividing the
  experts (MoE models; with ``tp`` each expert's ffn split over it, docs/MOE.md, and no
  sequence parallelism); ``cp`` (context parallelism, ring or Ulysses) without a pipeline
  and for dense models, where the sequence cuts into ``2 cp`` chunks of at least
  ``MIN_CP_CHUNK`` positions (:func:`_cp_options`); ``dp`` the rest, with the global batch
  divisible by ``dp x ep``;
* ZeRO 0-3 over ``dp`` (0-2 under a pipeline); sequence parallelism with ``tp > 1``;
* pipelines: micro-batches ``m`` in ``{p, 2p, 4p, 8p, b}`` dividing the rank's batch ``b``;
  1F1B and interleaved (``v = 2`` where ``2 p`` stages fit the layers, ``m`` a multiple of
  ``p``);
* remat of every block, CPU offload of the optimizer state, precision (``"bf16"``; fp32 only
  when allowed).

``include_untested`` adds remat, sequence parallelism and ZeRO-3 under a pipeline (the model
prices them; funcpar does not compose or test them yet): for what-if studies only.

**Pruning** (each rule keeps the optimum of the model): GPipe is priced like 1F1B with more
memory, so it is tried only when asked for; remat and offload only cost time in the model, so
a layout is tried with them only when it does not fit without; ZeRO-3, pipelines and remat are
not combined (untested compositions, not offered).

Feasible: the predicted peak memory per rank (margin included) within ``memory_per_rank``
(default: the profile's device memory). The result ranks the feasible layouts by predicted step
time and keeps, for the best infeasible ones, why they were rejected. A search that leaves
nothing feasible raises :class:`NoFeasibleLayout` naming the tightest constraint: the one whose
removal admits the fastest layout (or the memory limit, with the least memory any layout needs).
"""

from __future__ import annotations

import dataclasses
import math
import time as _time
from collections.abc import Iterable, Mapping
from typing import Any

from funcpar.auto.analytic import Choice
from funcpar.auto.cost import Estimate, estimate, fmt_bytes
from funcpar.auto.model import ModelSpec, model_spec
from funcpar.auto.profile import DeviceProfile, load_profile

__all__ = ["AutoResult", "NoFeasibleLayout", "auto_parallel", "parse_bytes", "preset_for",
           "what_if"]

CONSTRAINT_KEYS = ("tp", "pp", "dp", "ep", "zero", "microbatches", "schedule",
                   "virtual_stages", "remat", "offload", "precision", "sequence_parallel",
                   "max_tp", "cp", "cp_mode", "tp_mode")
#: Context parallelism is offered where each of the ``2 cp`` zigzag chunks of a sequence holds
#: at least this many positions (below, a chunk pair's attention is too small to hide a ring
#: hop or to be worth an all_to_all); a ``cp`` constraint lifts it.
MIN_CP_CHUNK = 64


class NoFeasibleLayout(ValueError):
    """No layout fits: ``tightest`` names the constraint (``"memory_per_rank"`` or a key of
    ``constraints``) whose removal would admit one."""

    def __init__(self, message: str, tightest: str | None) -> None:
        super().__init__(message)
        self.tightest = tightest


def parse_bytes(text: str | int | float) -> int:
    """``"2GiB"``, ``"512 MiB"``, ``"80GB"``, ``"1e9"`` -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3,
             "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    t = text.strip().lower().replace(" ", "")
    for u, f in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * f)
    return int(float(t))


@dataclasses.dataclass
class AutoResult:
    """The feasible layouts ranked by predicted step time (``ranked``), the best rejected
    ones with their reasons (``rejected``), what was searched."""

    spec: ModelSpec
    profile: DeviceProfile
    world_size: int
    memory_per_rank: float
    global_batch: int
    seq_len: int
    ranked: list[Estimate]
    rejected: list[tuple[Estimate, str]]
    searched: int
    seconds: float

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def preset(self, **extra: Any) -> Any:
        """The winner as a preset (``hybrid_parallel``, or ``moe_hybrid`` with ``ep > 1``), a
        transform of a fresh ``(step, state)``; with remat, composed after it
        (``extra``: more preset arguments, e.g. ``batch_shape``, ``plan``, ``mesh``)."""
        return preset_for(self.best.choice, **extra)

    def why(self, top: int = 5) -> str:
        """The winner, the runners-up and the best rejected layouts, as text."""
        b = self.best
        lines = [f"auto_parallel: {self.spec.name} {_count(self.spec.n_params)} params, "
                 f"global batch {self.global_batch} x {self.seq_len} on {self.world_size} ranks, "
                 f"{fmt_bytes(self.memory_per_rank)} per rank, profile {self.profile.name} "
                 f"({self.searched} layouts priced in {self.seconds:.2f} s)",
                 f"chosen: {b.choice}  ({b.time * 1e3:,.2f} ms/step predicted, "
                 f"{fmt_bytes(b.peak)} per rank with margin, MFU {b.mfu * 100:.1f} %, "
                 f"{b.tokens_per_s:,.0f} tokens/s)",
                 "  time: " + ", ".join(f"{k} {v * 1e3:,.2f} ms" for k, v in b.parts.items()
                                        if v > 0),
                 f"  memory: {_mem_text(b)}",
                 f"ranked (feasible, fastest first, {len(self.ranked)} in all):"]
        lines += [f"  {i + 1:>2}. {e.line()}" for i, e in enumerate(self.ranked[:top])]
        if self.rejected:
            lines.append("best rejected:")
            lines += [f"      {e.line()}  <- {why}" for e, why in self.rejected[:top]]
        return "\n".join(lines)


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def _mem_text(e: Estimate) -> str:
    m = e.plan.memory
    parts = [("params", m.params), ("grads", m.grads), ("optimizer", m.opt_state),
             ("amp copy", m.compute_params), ("zero-3 gathered", m.zero3_gathered),
             ("activations", m.activations), ("transient", m.transient)]
    text = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts if v)
    text += f", end-of-step buffers {fmt_bytes(m.step_buffers)}"
    if m.opt_state_offloaded:
        text += f"; optimizer in host memory {fmt_bytes(m.opt_state_offloaded)}"
    return text


def preset_for(choice: Choice | Mapping[str, Any], **extra: Any) -> Any:
    """The preset (a transform) equal to ``choice`` (see :meth:`AutoResult.preset`; a dict
    of its fields, as a script's saved arguments hold it, is accepted)."""
    from funcpar.presets import hybrid_parallel, moe_hybrid
    from funcpar.transforms import compose, remat

    if not isinstance(choice, Choice):
        choice = Choice(**choice)

    kw = {**choice.preset_kwargs(), **extra}
    preset = moe_hybrid(**kw) if choice.ep > 1 else hybrid_parallel(**kw)
    if not choice.remat:
        return preset
    return compose(preset, remat())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(constraints: Mapping[str, Any], key: str, value: Any) -> bool:
    if key not in constraints:
        return True
    want = constraints[key]
    if isinstance(want, (list, tuple, set, frozenset)):
        return value in want
    return value == want


def _cp_options(spec: ModelSpec, world: int, tp: int, pp: int, seq: int,
                cons: Mapping[str, Any]) -> list[tuple[int, str]]:
    """``(cp, mode)`` pairs: cp 1, and where context parallelism composes (no pipeline, a
    dense model) and the zigzag cut divides the sequence into chunks long enough
    (``MIN_CP_CHUNK``, unless ``cp`` is constrained), ring always and Ulysses where the
    heads and key/value heads per tensor-parallel rank split over cp
    (:func:`funcpar.transforms.context_parallel.ulysses_kv_heads`)."""
    out = [(1, "ring")]
    if pp > 1 or spec.moe:
        return out
    h, k = spec.heads // tp, spec.kv_heads // tp
    for cp in _divisors(world // tp // pp)[1:]:
        if seq % (2 * cp) or ("cp" not in cons and seq // (2 * cp) < MIN_CP_CHUNK):
            continue
        out.append((cp, "ring"))
        if h % cp == 0 and (k % cp == 0 or cp % k == 0):
            out.append((cp, "ulysses"))
    return out


def _candidates(spec: ModelSpec, world: int, batch: int, seq: int, cons: Mapping[str, Any],
                max_tp: int, untested: bool = False, node: int = 0) -> Iterable[Choice]:
    precisions = cons.get("precision", "bf16")
    precisions = [precisions] if isinstance(precisions, str) else list(precisions)
    for tp in _divisors(world):
        if tp > max_tp or (node and node % tp):
            continue
        for tp_mode in _tp_modes(spec, tp, batch, world):
            for pp in _divisors(world // tp):
                if pp > spec.layers or (pp > 1 and tp_mode == "2d"):
                    continue
                cps = [(1, "ring")] if tp_mode == "2d" else _cp_options(spec, world, tp, pp,
                                                                        seq, cons)
                for cp, cp_mode in cps:
                    yield from _meshes(spec, world, batch, cons, untested, precisions, tp, pp,
                                       cp, cp_mode, tp_mode)


def _tp_modes(spec: ModelSpec, tp: int, batch: int, world: int) -> list[str]:
    """``"1d"`` where ``tp`` divides the heads and key/value heads; ``"2d"`` (SUMMA on a
    ``q x q`` grid, :mod:`funcpar.transforms.tp_modes`) where ``tp = q^2 >= 4``, ``q``
    divides the heads and key/value heads (whole heads over ``tp_col``), ``tp`` the hidden
    size (the embedding's and norms' two-level cut) and ``q`` the MLP's width and the
    vocabulary (even panels), and the batch has rows for every grid row."""
    out = ["1d"] if spec.heads % tp == 0 and spec.kv_heads % tp == 0 else []
    q = math.isqrt(tp)
    if (tp >= 4 and q * q == tp and not spec.moe and spec.heads % q == 0
            and spec.kv_heads % q == 0 and spec.dim % tp == 0 and spec.ffn % q == 0
            and spec.vocab % q == 0 and batch >= q * (world // tp)):
        out.append("2d")
    return out


def _meshes(spec: ModelSpec, world: int, batch: int, cons: Mapping[str, Any], untested: bool,
            precisions: list[str], tp: int, pp: int, cp: int, cp_mode: str, tp_mode: str
            ) -> Iterable[Choice]:
    """The layouts of one ``tp x pp x cp``: ep, dp, ZeRO, pipeline schedules, sequence
    parallelism and precision."""
    for ep in _divisors(world // tp // pp // cp):
        if ep > 1 and (not spec.moe or spec.n_experts % ep):
            continue
        dp = world // tp // pp // ep // cp
        if batch % (dp * ep):
            continue
        local = batch // (dp * ep)
        if pp == 1:
            pipes = [(1, "1f1b", 1)]
        else:
            ms = sorted({m for m in (pp, 2 * pp, 4 * pp, 8 * pp, local)
                         if m <= local and local % m == 0})
            scheds = [("1f1b", 1)]
            if 2 * pp <= spec.layers:
                scheds.append(("interleaved", 2))
            if "gpipe" in _as_set(cons.get("schedule")):
                scheds.append(("gpipe", 1))
            # Interleaved only with m a multiple of p (Megatron-LM's condition; the
            # bubble's closed form holds there, tests/test_auto.py).
            pipes = [(m, s, v) for m in ms for s, v in scheds
                     if s != "interleaved" or m % pp == 0]
        zeros = range(4) if dp > 1 else (0,)
        for zero in zeros:
            if pp > 1 and zero == 3 and not untested:
                continue
            # MoE with tp: tested with ep and dp up to ZeRO-2 (tests/test_moe_tp.py), not
            # under a pipeline or ZeRO-3.
            if spec.moe and tp > 1 and (pp > 1 or zero == 3) and not untested:
                continue
            for m, sched, v in pipes:
                # Sequence parallelism: not with MoE blocks (they route whole sequences).
                sps = (False, True) if tp > 1 and tp_mode == "1d" and not spec.moe and (
                    pp == 1 or untested) else (False,)
                for sp in sps:
                    for prec in precisions:
                        yield Choice(tp, pp, dp, ep, zero, m, sched, v, False, None,
                                     prec, sp, cp, cp_mode, tp_mode)


def _as_set(x: Any) -> set:
    if x is None:
        return set()
    return set(x) if isinstance(x, (list, tuple, set, frozenset)) else {x}


def _fallbacks(c: Choice, untested: bool = False) -> list[Choice]:
    """The slower variants tried when ``c`` does not fit: remat, offload, both."""
    out = []
    if c.pp > 1 and untested:
        out.append(dataclasses.replace(c, remat=True))
    if c.pp == 1:
        out.append(dataclasses.replace(c, remat=True))
        if c.ep == 1 and c.cp == 1:  # offload beside cp: composes, but neither run nor planned
            out.append(dataclasses.replace(c, offload="cpu"))
            out.append(dataclasses.replace(c, remat=True, offload="cpu"))
    return out


def _fits_constraints(c: Choice, cons: Mapping[str, Any]) -> bool:
    for key in ("tp", "pp", "dp", "ep", "zero", "microbatches", "schedule", "virtual_stages",
                "remat", "offload", "sequence_parallel", "cp", "cp_mode", "tp_mode"):
        if not _allowed(cons, key, getattr(c, key)):
            return False
    return True


def _search(spec: ModelSpec, world: int, mem: float, prof: DeviceProfile, batch: int, seq: int,
            cons: Mapping[str, Any], opt_bytes: float, margin: float, untested: bool = False
            ) -> tuple[list[Estimate], list[tuple[Estimate, str]], int]:
    max_tp = int(cons.get("max_tp", prof.gpus_per_node if prof.links else world))
    feasible: list[Estimate] = []
    rejected: list[tuple[Estimate, str]] = []
    n = 0

    def price(c: Choice) -> Estimate:
        nonlocal n
        n += 1
        return estimate(spec, c, prof, batch, seq, opt_bytes=opt_bytes, margin=margin)

    # On a profile with nodes, tp divides the node so that no tp group straddles two.
    node = prof.gpus_per_node if prof.links and "max_tp" not in cons else 0
    for c in _candidates(spec, world, batch, seq, cons, max_tp, untested, node):
        tries = [c] + _fallbacks(c, untested)
        tries = [t for t in tries if _fits_constraints(t, cons)]
        for t in tries:
            e = price(t)
            if e.peak <= mem:
                feasible.append(e)
                break
            rejected.append((e, f"needs {fmt_bytes(e.peak)} per rank > {fmt_bytes(mem)}"))
    feasible.sort(key=lambda e: e.time)
    rejected.sort(key=lambda x: x[0].time)
    return feasible, rejected, n


def auto_parallel(
    cfg_or_model: Any,
    *,
    world_size: int,
    global_batch: int,
    seq_len: int,
    memory_per_rank: str | float | None = None,
    profile: str | DeviceProfile | None = None,
    constraints: Mapping[str, Any] | None = None,
    opt_bytes: float = 8.0,
    margin: float = 0.10,
    include_untested: bool = False,
) -> AutoResult:
    """Search the layouts of ``cfg_or_model`` (a :class:`~funcpar.models.LlamaConfig`, a
    :class:`~funcpar.models.Llama` or a :class:`~funcpar.auto.model.ModelSpec`) on
    ``world_size`` ranks for a global batch of ``global_batch`` sequences of ``seq_len`` tokens
    (module docstring). ``memory_per_rank``: bytes or text (``"2GiB"``; default the profile's
    device memory). ``profile``: a :class:`~funcpar.auto.profile.DeviceProfile`, a JSON
    written by ``python -m funcpar.profile`` or a shipped name (default ``"h100"``).
    ``constraints``: ``{key: value or collection of allowed values}`` over ``tp, pp, dp, ep,
    zero, microbatches, schedule, virtual_stages, remat, offload, precision,
    sequence_parallel`` and ``max_tp``. ``opt_bytes``: optimizer state bytes per parameter
    (AdamW 8, SGD with momentum 4). ``margin``: added to the predicted peak memory.
    ``include_untested``: also price compositions funcpar does not offer yet (remat, sequence
    parallelism or ZeRO-3 under a pipeline) - for what-if studies of a cluster only: the
    winner's preset may refuse them or run them untested.

    Raises :class:`NoFeasibleLayout` when nothing fits (naming the tightest constraint)."""
    start = _time.perf_counter()
    spec = model_spec(cfg_or_model)
    prof = load_profile(profile)
    cons = dict(constraints or {})
    unknown = set(cons) - set(CONSTRAINT_KEYS)
    if unknown:
        raise ValueError(f"auto_parallel: unknown constraints {sorted(unknown)}; known: "
                         f"{list(CONSTRAINT_KEYS)}")
    if world_size < 1 or global_batch < 1 or seq_len < 1:
        raise ValueError(f"auto_parallel: world_size, global_batch and seq_len must be >= 1, "
                         f"got {world_size}, {global_batch}, {seq_len}")
    mem = float(parse_bytes(memory_per_rank) if memory_per_rank is not None
                else prof.memory.value)
    feasible, rejected, n = _search(spec, world_size, mem, prof, global_batch, seq_len, cons,
                                    opt_bytes, margin, include_untested)
    if not feasible:
        raise NoFeasibleLayout(*_explain(spec, world_size, mem, prof, global_batch, seq_len,
                                         cons, opt_bytes, margin, rejected))
    return AutoResult(spec, prof, world_size, mem, global_batch, seq_len, feasible,
                      rejected[:20], n, _time.perf_counter() - start)


def _explain(spec: ModelSpec, world: int, mem: float, prof: DeviceProfile, batch: int,
             seq: int, cons: Mapping[str, Any], opt_bytes: float, margin: float,
             rejected: list[tuple[Estimate, str]]) -> tuple[str, str | None]:
    """Which constraint binds: drop each in turn (and the memory limit) and see which
    admits the fastest layout."""
    head = (f"auto_parallel: no layout of {spec.name} ({_count(spec.n_params)} params) "
            f"fits {world} ranks with global batch {batch} x {seq} and "
            f"{fmt_bytes(mem)} per rank")
    if cons:
        head += f" under constraints {dict(cons)}"
    relaxed: list[tuple[float, str, Estimate]] = []
    for key in cons:
        rest = {k: v for k, v in cons.items() if k != key}
        ok, _, _ = _search(spec, world, mem, prof, batch, seq, rest, opt_bytes, margin)
        if ok:
            relaxed.append((ok[0].time, key, ok[0]))
    if relaxed:
        _, key, e = min(relaxed)
        return (f"{head}. Tightest constraint: {key}={cons[key]!r}; without it "
                f"{e.choice} fits ({fmt_bytes(e.peak)}, {e.time * 1e3:,.2f} ms/step)",
                key)
    if rejected:
        least = min(rejected, key=lambda x: x[0].peak)[0]
        return (f"{head}. Tightest constraint: memory_per_rank; the least any layout needs is "
                f"{fmt_bytes(least.peak)} ({least.choice}, margin "
                f"{margin * 100:.0f} % included)", "memory_per_rank")
    return (f"{head}. No layout divides: the world of {world} must split into pp x ep x dp x "
            f"tp with tp dividing {spec.heads} heads and {spec.kv_heads} key/value heads "
            f"(at most max_tp) and dp x ep dividing the batch {batch}", None)


def what_if(cfg_or_model: Any, **kwargs: Any) -> str:
    """``auto_parallel(...).why()``, or the infeasibility message (no process starts)."""
    try:
        return auto_parallel(cfg_or_model, **kwargs).why()
    except NoFeasibleLayout as err:
        return str(err)

