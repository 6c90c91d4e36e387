"""The gradient norm is reduced once per step: the ``grad_norm`` metric and
``clip_by_global_norm`` share it (``funcpar.optim.clip.reuse_global_norm``).

Every comparison here is exact (``torch.equal``, ``==`` on records): reusing the norm hands the
clip the very tensor it would have computed with the same ops in the same order, so nothing
may differ by even one bit, and the messages must be the unshared step's minus exactly the
clip's norm all-reduces.

``python tests/test_clip_once.py`` prints the second step's collectives per case, with and
without sharing (the numbers in docs/DISTRIBUTED_OPTIM.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcpar.optim as fo
from funcpar.models import Llama, lm_loss
from funcpar.optim import clip as clip_mod
from funcpar.optim.base import EmptyState, GradientTransformation
from funcpar.optim.clip import global_norm, reuse_global_norm
from funcpar.shard.comm import comm_log
from funcpar.shard.layout import Layout, Shard, unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.state.tree import tree_map
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, PP_CFG, batches, build
from funcpar.train import make_train_step
from funcpar.transforms import offload

STEPS = 2


def _halve() -> GradientTransformation:
    """A transformation that returns new gradients: a clip after it must compute its own."""

    def update(grads, state, params=None, *, layouts=None):
        return tree_map(lambda g: None if g is None else g * 0.5, grads), state

    return GradientTransformation(lambda params: EmptyState(), update)


@pytest.fixture
def norms_computed(monkeypatch):
    """How many norms ``global_norm`` really computes (its calls of the reduction)."""
    calls = []
    real = clip_mod.total_sum_of_squares

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(clip_mod, "total_sum_of_squares", counting)
    return calls


# --------------------------------------------------------------------------- the scope itself
def test_scope_reuses_only_the_same_tensors(norms_computed):
    torch.manual_seed(0)
    g = {"a": torch.randn(5, 3, dtype=torch.float64), "b": None, "c": torch.randn(4)}
    with reuse_global_norm():
        n = global_norm(g)
        assert global_norm(g) is n
        assert global_norm(dict(g)) is n  # another container of the same leaves
        assert len(norms_computed) == 1
        new = tree_map(lambda x: None if x is None else x.clone(), g)
        n_new = global_norm(new)  # equal values, other tensors: computed
        assert n_new is not n and torch.equal(n_new, n)
        assert len(norms_computed) == 2
        g["c"].mul_(2.0)  # changed in place: its version counter moved, so computed again
        n2 = global_norm(g)
        assert n2 is not n and not torch.equal(n2, n)
        assert len(norms_computed) == 3
        assert global_norm(g) is n2
    assert global_norm(g) is not n2  # outside the scope nothing is remembered
    assert len(norms_computed) == 4


def test_scope_compares_layouts_and_empty_trees(norms_computed):
    mesh = DeviceMesh.local(tp=1)
    g = {"w": torch.randn(4, 6)}
    lay = {"w": Layout(mesh, (4, 6), {"tp": Shard(0)}, name="w")}
    renamed = {"w": lay["w"].named("other")}  # equal: the name only labels messages
    other = {"w": Layout(mesh, (4, 6), {"tp": Shard(1)}, name="w")}
    with reuse_global_norm():
        n = global_norm(g, lay)
        assert global_norm(g, renamed) is n
        assert global_norm(g, other) is not n
        assert global_norm(g) is not n  # no layouts: another computation
        empty = {}
        e = global_norm(empty)
        assert global_norm(empty) is e
        assert global_norm({}) is not e  # no leaf to recognise it by: the tree object itself
    assert len(norms_computed) == 5


# --------------------------------------------------------------------------- one process
def _llama_step(opt, *, compile=False, chunk_bytes=None):
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG).double())
    step = make_train_step(apply_fn, lm_loss, opt, compile=compile)
    state = init_state(params, buffers, opt)
    if chunk_bytes is not None:
        step, state = offload("cpu", chunk_bytes=chunk_bytes)(step, state)
    return step, state


def _run(step, state, steps=STEPS):
    out = []
    for batch in batches()[:steps]:
        state, m = step(state, batch)
        out.append((m["loss"], m["grad_norm"]))
    return out, state.params


def _assert_identical(a, b):
    (ma, pa), (mb, pb) = a, b
    assert len(ma) == len(mb)
    for (la, na), (lb, nb) in zip(ma, mb):
        assert torch.equal(la, lb) and torch.equal(na, nb)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.parametrize("case, shared_norms, plain_norms", [
    # per STEPS = 2 steps: the metric's norm, and the clip's unless it takes the metric's
    ("clip", 2, 4),             # the clip takes the metric's norm
    ("identity+clip", 2, 4),    # identity passes the same tensors on
    ("halve+clip", 4, 4),       # new gradients: the clip computes its own
    ("offload_chunked", 2, 4),  # offload clips the whole tree first, same tensors on the host
    # accumulate(every=2): the clip runs on the 2nd step only, on the mean (new tensors)
    ("accumulate", 3, 3),
])
def test_one_process_norm_count_and_bits(norms_computed, case, shared_norms, plain_norms):
    head = [_halve()] if case == "halve+clip" else [fo.identity()] if case == "identity+clip" \
        else []
    opt = fo.chain(*head, fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2, weight_decay=0.1))
    if case == "accumulate":
        opt = fo.accumulate(opt, every=2)
    chunk = 16 << 10 if case == "offload_chunked" else None
    shared = _run(*_llama_step(opt, chunk_bytes=chunk))
    assert len(norms_computed) == shared_norms
    norms_computed.clear()
    step, state = _llama_step(opt, chunk_bytes=chunk)
    plain = _run(dataclasses.replace(step, share_grad_norm=False), state)
    assert len(norms_computed) == plain_norms
    _assert_identical(shared, plain)


def test_compiled_step_traces_the_norm_once(norms_computed):
    # compile=True compiles the whole step as one region (funcpar.train.whole_step): the
    # metric's and the clip's norms are traced into its graph once (no reuse while tracing:
    # 2 norms per trace), and no norm is computed outside it afterwards; with or without
    # sharing, the graph and the bits are the same.
    # (A plain MLP: the Llama's jaxtyping-annotated forward does not trace under the test
    # hook's beartype checks.)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 3)).double()
    apply_fn, params, buffers = functionalize(net)
    opt = fo.chain(fo.clip_by_global_norm(0.1), fo.adamw(lr=1e-2))
    step = make_train_step(apply_fn, torch.nn.functional.cross_entropy, opt, compile=True)
    state = init_state(params, buffers, opt)
    data = [(torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
            for _ in range(STEPS)]

    def run(step):
        out, s = [], state
        for batch in data:
            s, m = step(s, batch)
            out.append((m["loss"], m["grad_norm"]))
        return out, s.params

    shared = run(step)
    assert step._whole is not None and len(norms_computed) == 2
    plain = run(dataclasses.replace(step, share_grad_norm=False))
    assert len(norms_computed) == 4
    _assert_identical(shared, plain)
    assert float(shared[0][0][1]) > 0.1  # the clip really scaled the steps


# --------------------------------------------------------------------------- several ranks
def _case(name):
    """``(step, state)`` of a case (rank function side)."""
    if name == "one process":
        return build(1, 1, "adamw")
    if name == "tp2":
        return build(2, 1, "adamw")
    if name == "pp2":
        return build(1, 1, "adamw", cfg=PP_CFG, pp=2, microbatches=2)
    if name == "dp2+zero1":
        return build(1, 2, "adamw", zero=1)
    if name == "tp2xdp2+zero2":
        return build(2, 2, "adamw", zero=2)
    if name == "tp2 halve+clip":
        step, state = build(2, 1, "adamw")  # tp alone leaves the optimizer unwrapped
        opt = fo.chain(_halve(), fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2))
        return (dataclasses.replace(step, optimizer=opt),
                state._replace(opt_state=opt.init(state.params)))
    raise AssertionError(name)


def _measure(names):
    """Per case and per sharing mode: each step's records, metrics and the final params."""
    out = {}
    for name in names:
        for share in (True, False):
            step, state = _case(name)
            step = dataclasses.replace(step, share_grad_norm=share)
            recs, metrics = [], []
            for batch in batches()[:STEPS]:
                with comm_log.capture() as r:
                    state, m = step(state, batch)
                recs.append(list(r))
                metrics.append((m["loss"], m["grad_norm"]))
            params = (state.params if step.layouts is None
                      else unshard_tree(state.params, step.layouts))
            out[name, share] = (recs, (metrics, params))
    return out


def _check(results, name, reuses):
    for rank, res in enumerate(results):
        recs_s, out_s = res[name, True]
        recs_p, out_p = res[name, False]
        _assert_identical(out_s, out_p)
        for step_s, step_p in zip(recs_s, recs_p, strict=True):
            norm_s = [r for r in step_s if "global_norm" in r.purpose]
            norm_p = [r for r in step_p if "global_norm" in r.purpose]
            if not reuses:
                assert step_s == step_p, (name, rank)
                continue
            # The shared step is the unshared one without the clip's norm messages: the
            # clip's all-reduces were the metric's again, message for message.
            assert norm_s and all(r.op == "all_reduce" for r in norm_s), (name, rank)
            assert norm_p == norm_s + norm_s, (name, rank)
            assert ([r for r in step_s if r not in norm_s]
                    == [r for r in step_p if r not in norm_p]), (name, rank)


def test_two_ranks_messages_and_bits():
    names = ["tp2", "pp2", "dp2+zero1", "tp2 halve+clip"]
    results = run_ranks(_measure, 2, names, timeout=600)
    _check(results, "tp2", reuses=True)
    _check(results, "pp2", reuses=True)  # the metric's norm is global over pp already
    # ZeRO-1 hands the optimizer its partitioned views (other tensors, other layouts): the
    # clip computes its own norm, as without sharing.
    _check(results, "dp2+zero1", reuses=False)
    _check(results, "tp2 halve+clip", reuses=False)


def test_four_ranks_zero2_messages_and_bits():
    results = run_ranks(_measure, 4, ["tp2xdp2+zero2"], timeout=600)
    _check(results, "tp2xdp2+zero2", reuses=True)


def _totals(recs):
    norm = [r for r in recs if "global_norm" in r.purpose]
    ar = [r for r in recs if r.op == "all_reduce"]
    return (f"{len(recs)} / {sum(r.nbytes for r in recs):,} B, all_reduce {len(ar)} / "
            f"{sum(r.nbytes for r in ar):,} B, global_norm {len(norm)} / "
            f"{sum(r.nbytes for r in norm):,} B")


if __name__ == "__main__":
    cases = [("one process", 1), ("tp2", 2), ("tp2xdp2+zero2", 4), ("pp2", 2),
             ("dp2+zero1", 2)]
    print("collectives of the 2nd step on rank 0 (reference Llama, chain(clip 0.5, adamw), "
          "float64): unshared -> shared")
    for name, world in cases:
        res = _measure([name]) if world == 1 else run_ranks(_measure, world, [name],
                                                            timeout=600)[0]
        plain, shared = res[name, False][0][1], res[name, True][0][1]
        print(f"{name}: {_totals(plain)} -> {_totals(shared)}")
