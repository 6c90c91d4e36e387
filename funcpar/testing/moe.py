"""The MoE reference run: the reference Llama with skewed routing, under any composition of
expert, tensor and data parallelism (+ ZeRO, remat, the ``moe_hybrid`` preset), against one
process.

:data:`MOE_CFG` is :data:`funcpar.testing.reference.CFG` with an MoE feed-forward in every
block: 4 experts, top-1, capacity factor 2.0 (tokens are dropped). :func:`skewed_model` makes
the routing unbalanced - uneven all_to_all splits between ep ranks and experts with no token in
some steps (:func:`routing_is_skewed` checks both on one process) - so that the exactness
tests exercise the uneven and empty paths. :func:`check` trains 10 steps of each ``(layout,
optimizer)`` pair on spawned gloo ranks and compares losses and whole parameters with one
process (float64, max relative error :data:`TOL` or 1e-10: the collectives only reorder sums);
:func:`check_resharding` saves a checkpoint under one layout and resumes it under others.
tests/test_moe_parallel.py (ep, dp, ZeRO) and tests/test_moe_tp.py (tp, ep x tp) use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from funcpar.models import Llama, LlamaConfig, moe_lm_loss
from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules_for
from funcpar.state import functionalize, init_state
from funcpar.testing.multirank import run_ranks
from funcpar.testing.reference import CFG, OPTIMIZERS, batches, loss_rel, max_rel, run
from funcpar.train import make_train_step
from funcpar.transforms import (
    compose,
    data_parallel,
    expert_parallel,
    remat,
    shard_params,
    zero_partition,
)

__all__ = ["LAYOUTS", "MATRIX_OPTIMIZERS", "MOE_CFG", "TOL", "MoeLayout", "build", "check",
           "check_resharding", "one_thread", "routing_is_skewed", "skew", "skewed_model"]

MOE_CFG = dataclasses.replace(CFG, n_experts=4, top_k=1, capacity_factor=2.0,
                              aux_loss_weight=0.01, z_loss_weight=0.001)
# Every optimizer 1e-10 but 8-bit GaLore: its block-quantized states turn a last-bit
# difference of a reordered dp sum into a larger one (tests/test_distributed_optim.py allows
# 1e-9); measured 3.3e-9 under ep2 x dp2 (with or without ZeRO), <= 1e-9 under ep2.
TOL = {"galore_adamw8bit": 1e-8}
MATRIX_OPTIMIZERS = ["sgd", "adamw", "adafactor", "adafactor_torch", "came", "lamb",
                     "galore_adamw", "galore_adamw8bit"]


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """Mesh sizes and what is composed: ``shard_params`` (``llama_rules_for``) when ``tp > 1``,
    then ``expert_parallel`` when ``ep > 1``, ``data_parallel`` when ``dp > 1``, ZeRO,
    ``remat``; ``preset``: the same through ``moe_hybrid``."""

    ep: int = 1
    tp: int = 1
    dp: int = 1
    zero: int = 0
    remat: bool = False
    preset: bool = False

    @property
    def world(self) -> int:
        return self.ep * self.tp * self.dp


LAYOUTS = {
    "ep2": MoeLayout(ep=2),
    "ep2+remat": MoeLayout(ep=2, remat=True),
    "ep4": MoeLayout(ep=4),
    "ep2xdp2": MoeLayout(ep=2, dp=2),
    "ep2xdp2+zero1": MoeLayout(ep=2, dp=2, zero=1),
    "ep2xdp2+zero2": MoeLayout(ep=2, dp=2, zero=2),
    "ep2xdp2+zero3": MoeLayout(ep=2, dp=2, zero=3),
    "moe_hybrid(ep2, zero2)": MoeLayout(ep=2, dp=2, zero=2, preset=True),
    "tp2": MoeLayout(tp=2),
    "tp2xdp2+zero2": MoeLayout(tp=2, dp=2, zero=2),
    "ep2xtp2": MoeLayout(ep=2, tp=2),
    "ep2xtp2+remat": MoeLayout(ep=2, tp=2, remat=True),
    "moe_hybrid(ep2, tp2)": MoeLayout(ep=2, tp=2, preset=True),
    "ep2xtp2xdp2+zero2": MoeLayout(ep=2, tp=2, dp=2, zero=2),
}


def skew(model: Llama) -> Llama:
    """``model`` with its MoE blocks' routers skewed in place: each router's rows are scaled up
    and given a common direction ``v`` weighted 3, 1, -1, -3 (4 experts), so that experts 0 and
    3 take most tokens and 1 and 2 few or none."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            if not model.cfg.is_moe(i):
                continue
            w = block.mlp.router.weight
            v = torch.randn(w.shape[1], generator=gen, dtype=w.dtype)
            w.mul_(20.0).add_(torch.outer(torch.tensor([3.0, 1.0, -1.0, -3.0], dtype=w.dtype), v))
    return model


def skewed_model(dtype: torch.dtype = torch.float64, cfg: LlamaConfig = MOE_CFG) -> Llama:
    """The Llama of ``cfg`` (4 experts; default :data:`MOE_CFG`) in ``dtype``, :func:`skew`-ed."""
    torch.manual_seed(0)
    return skew(Llama(cfg).to(dtype))


def build(layout: MoeLayout, optim: str, *, dtype: torch.dtype = torch.float64):
    """``(step, state)`` of ``optim`` on :func:`skewed_model` under ``layout`` on this rank (one
    process when ``layout.world == 1``)."""
    model = skewed_model(dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params)
    step = make_train_step(apply_fn, moe_lm_loss, opt)
    state = init_state(params, buffers, opt)
    if layout.world == 1:
        return step, state
    mesh = DeviceMesh.from_env(ep=layout.ep, dp=layout.dp, tp=layout.tp)
    if layout.preset:  # Colossal-AI's MoeHybridParallelPlugin: the same composition
        from funcpar.presets import moe_hybrid

        return tuple(moe_hybrid(ep_size=layout.ep, tp_size=layout.tp, zero_stage=layout.zero,
                                mesh=mesh)(step, state))
    transforms = []
    if layout.tp > 1:  # first: expert_parallel cuts the tensor-parallel expert shards over ep
        transforms.append(shard_params(llama_rules_for(MOE_CFG), mesh))
    if layout.ep > 1:
        transforms.append(expert_parallel(mesh))
    if layout.dp > 1:
        transforms.append(data_parallel(mesh))
    if layout.zero:
        transforms.append(zero_partition(layout.zero, mesh))
    if layout.remat:
        transforms.append(remat())
    return compose(*transforms)(step, state)


def _train(pairs: list[tuple[str, str]]) -> dict:
    out = {}
    for lay, optim in pairs:
        step, state = build(LAYOUTS[lay], optim)
        with comm.comm_log.capture() as recs:
            losses, params = run(step, state, batches())
        out[(lay, optim)] = losses, params, {(r.op, r.purpose) for r in recs}
    return out


def routing_is_skewed(model: Llama | None = None) -> tuple[bool, bool]:
    """Over the reference batches on one process (``model``: default :func:`skewed_model`):
    (an expert with no token in some step, the two halves of a batch sending different numbers
    of rows to ep rank 0 of ep2 in some step)."""
    model = skewed_model() if model is None else model
    empty = uneven = False
    for tokens, _ in batches():
        out = model(tokens)
        empty |= bool((out.tokens_per_expert == 0).any())
        halves = [model(t).tokens_per_expert[:, :2].sum() for t in tokens.chunk(2)]
        uneven |= bool(halves[0] != halves[1])
    return empty, uneven


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block: the one-process runs take 0.1 s on one
    thread but ~20 s on a loaded 2-core machine with torch's default pool (measured); the ranks
    run on one thread too."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def check(world: int, pairs: list[tuple[str, str]], *, timeout: float = 900) -> dict:
    """Train each ``(layout name, optimizer)`` of ``pairs`` on ``world`` spawned ranks and
    assert that every rank's losses and whole parameters are within :data:`TOL` (default
    1e-10) of one process, that each layout ran its collectives (all_to_all under ep, an
    experts' output all-reduce under tp), and that the one-process losses fall. Returns ``{(layout,
    optimizer): max relative error}`` (the worst rank)."""
    optimizers = sorted({o for _, o in pairs})
    with one_thread():
        refs = {o: run(*build(MoeLayout(), o), batches()) for o in optimizers}
        assert routing_is_skewed() == (True, True)
    worst: dict = {}
    for rank, res in enumerate(run_ranks(_train, world, pairs, timeout=timeout)):
        for (lay, o), (losses, params, ops) in res.items():
            tol = TOL.get(o, 1e-10)
            err = max(loss_rel(losses, refs[o][0]), max_rel(params, refs[o][1]))
            print(f"rank {rank} {lay} {o}: max rel err {err:.2e}")  # shown under pytest -s
            assert err <= tol, (rank, lay, o, err)
            if LAYOUTS[lay].ep > 1:
                assert any(op == "all_to_all" for op, _ in ops), (rank, lay, o)
            if LAYOUTS[lay].tp > 1:  # the experts' own tensor-parallel region ran
                assert any(op == "all_reduce" and "mlp.experts: output" in why
                           for op, why in ops), (rank, lay, o)
            worst[(lay, o)] = max(worst.get((lay, o), 0.0), err)
    for o in optimizers:
        assert refs[o][0][-1] < refs[o][0][0], o
    return worst


def _save_after(lay: str, optim: str, path: str, steps: int) -> None:
    from funcpar.state import save

    step, state = build(LAYOUTS[lay], optim)
    for batch in batches()[:steps]:
        state, _ = step(state, batch)
    save(state, path, step=step)


def _resume(lay: str, optim: str, path: str, steps: int) -> tuple[list[float], dict]:
    from funcpar.state import load

    step, like = build(LAYOUTS[lay], optim)
    return run(step, load(path, like, step=step), batches()[steps:])


def check_resharding(path: str, saved: str, resumed: list[str], optim: str = "adamw",
                     *, steps: int = 5, timeout: float = 900) -> None:
    """Save after ``steps`` steps under layout ``saved``, resume under one process and under
    each layout of ``resumed`` (one spawn each) for the rest of the 10, and assert that every
    run's losses and whole parameters are within 1e-10 of 10 uninterrupted steps on one
    process: the checkpoint reshards the layouts' leaves (experts over ep and tp included)."""
    from funcpar.state import load

    run_ranks(_save_after, LAYOUTS[saved].world, saved, optim, path, steps, timeout=timeout)
    with one_thread():
        ref_losses, ref_params = run(*build(MoeLayout(), optim), batches())
        step, like = build(MoeLayout(), optim)
        runs = [run(step, load(path, like, step=step), batches()[steps:])]
    for lay in resumed:
        runs += run_ranks(_resume, LAYOUTS[lay].world, lay, optim, path, steps, timeout=timeout)
    for losses, params in runs:
        assert loss_rel(losses, ref_losses[steps:]) <= 1e-10
        assert max_rel(params, ref_params) <= 1e-10
