"""Presets (issue 10 item 1): Colossal-AI-style one-call compositions and their plans.

Acceptance: each preset reproduces its manual composition exactly - same losses and the same
parameters to the bit, in float64 on gloo ranks - for hybrid tp2 x dp2 + ZeRO-2, low-level
ZeRO-2, DDP and Gemini-like ZeRO-3 + CPU offload. Bit-identical is the right tolerance: a
preset calls the very transforms of the manual composition in the same order on the same
values, so any difference is a different composition, not rounding.

The plan's expected communication is checked against the collectives a real step records
(:func:`funcpar.shard.comm.comm_log`), count and bytes per (op, axis), exactly: both count
the same buffers, so there is no tolerance either. Its memory is checked against the bytes the
state actually holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import funcpar.optim as fo
from funcpar.models import Llama, lm_loss
from funcpar.optim.memory import state_bytes
from funcpar.presets import (
    Composed,
    ddp,
    describe,
    gemini,
    hybrid_parallel,
    low_level_zero,
    pick_rules,
    titan_parallelize,
)
from funcpar.presets.presets import Preset
from funcpar.shard.comm import comm_log, summarize
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.state.tree import tree_leaves
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, STEPS, batches, build, run, train
from funcpar.train import make_train_step
from funcpar.transforms import compose, offload
from funcpar.transforms.offload import read_state

BATCH = (8, 12)  # reference.batches(): 8 sequences of 12 tokens


def _adamw():
    # reference.OPTIMIZERS["adamw"] is chain(clip_by_global_norm(0.5), this): max_norm=0.5.
    return fo.adamw(lr=1e-2, weight_decay=0.1)


def _model(dtype=torch.float64):
    return Llama(CFG).to(dtype)


def _run(step, state, steps=STEPS):
    """``steps`` steps of the reference batches: (losses, whole params)."""
    return run(step, state, batches()[:steps])


def _step_comm(step, state):
    """{(op, axis): (count, bytes)} of the collectives one step issues (undonated: the tests
    go on from ``state``; the presets donate by default)."""
    with comm_log.capture() as recs:
        dataclasses.replace(step, donate=False)(state, batches()[0])
    return {(s.op, s.axis): (s.count, s.nbytes) for s in summarize(recs)}


def _checks(composed: Composed) -> dict:
    """What the tests compare on each rank: measured vs planned comm and memory."""
    step, state = composed
    plan = composed.plan
    offloaded = 0
    if composed.offload_store is not None:
        # The bytes the store really holds for the leaves the state tree keeps as meta.
        whole = tree_leaves(read_state(state.opt_state, composed.offload_store))
        kept = tree_leaves(state.opt_state.tree)
        offloaded = sum(x.numel() * x.element_size() for x, k in zip(whole, kept)
                        if torch.is_tensor(k) and k.is_meta)
    return {
        "comm": _step_comm(step, state),
        "planned": plan.comm_totals(BATCH),
        "params": sum(x.numel() * x.element_size() for x in tree_leaves(state.params)),
        "opt_state": state_bytes(state.opt_state),
        "offloaded": offloaded,
        "memory": plan.memory,
        "text": str(plan),
    }


# --------------------------------------------------------------------------- rank functions
def _four_ranks():
    out = {}
    manual = train(2, 2, "adamw", zero=2)
    composed = hybrid_parallel(_model(), lm_loss, _adamw(), tp_size=2, zero_stage=2,
                               max_norm=0.5, batch_shape=BATCH)
    out["check:hybrid"] = _checks(composed)
    out["equal:hybrid"] = (manual, _run(*composed))
    # More compositions, one step each, for the plan's communication and memory.
    for name, kw, dtype in [
        ("tp2xdp2", {"zero_stage": 0}, torch.float64),
        ("tp2xdp2+zero1+fp16", {"zero_stage": 1, "precision": "fp16"}, torch.float32),
        ("tp2xdp2+zero3+bf16", {"zero_stage": 3, "precision": "bf16"}, torch.float32),
        ("tp2xdp2+zero2+sp", {"zero_stage": 2, "sequence_parallel": True}, torch.float64),
    ]:
        composed = hybrid_parallel(_model(dtype), lm_loss, _adamw(), tp_size=2, max_norm=0.5,
                                   batch_shape=BATCH, **kw)
        out[f"check:{name}"] = _checks(composed)
    return out


def _two_ranks(tmp):
    out = {}
    for name, manual_zero, composed in [
        ("low_level_zero2", 2, low_level_zero(_model(), lm_loss, _adamw(), stage=2,
                                               max_norm=0.5, batch_shape=BATCH)),
        ("ddp", 0, ddp(_model(), lm_loss, _adamw(), max_norm=0.5, batch_shape=BATCH)),
    ]:
        out[f"check:{name}"] = _checks(composed)
        out[f"equal:{name}"] = (train(1, 2, "adamw", zero=manual_zero), _run(*composed))
    step, state = build(1, 2, "adamw", zero=3)
    manual = _run(*offload("cpu")(step, state))
    composed = gemini(_model(), lm_loss, _adamw(), offload="cpu", max_norm=0.5,
                      batch_shape=BATCH)
    out["check:gemini"] = _checks(composed)
    out["equal:gemini"] = (manual, _run(*composed))
    composed = hybrid_parallel(_model(), lm_loss, _adamw(), pp_size=2, microbatches=2,
                               max_norm=0.5)
    out["pp:text"] = str(composed.plan)
    held = sum(x.numel() * x.element_size() for x in tree_leaves(composed.state.params))
    out["pp:memory"] = (composed.plan.memory.params, held)
    out["equal:pp2"] = (train(1, 1, "adamw", pp=2, microbatches=2), _run(*composed))
    for name, composed in [
        ("gemini_nvme", gemini(_model(), lm_loss, _adamw(), offload="nvme", offload_path=tmp,
                               batch_shape=BATCH)),
        ("low_level_zero1+offload", low_level_zero(_model(), lm_loss, _adamw(), stage=1,
                                                   cpu_offload=True, batch_shape=BATCH)),
    ]:
        out[f"check:{name}"] = _checks(composed)
        if composed.offload_store is not None:
            composed.offload_store.close()
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=240)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("nvme")), timeout=240)


def _equal(results, key):
    """On every rank: the same losses and the same (whole over tp and dp) parameters; under a
    pipeline each rank holds its stages' leaves."""
    for rank, r in enumerate(results):
        (want_losses, want), (got_losses, got) = r[key]
        assert got_losses == want_losses, (key, rank)
        assert set(got) == set(want), (key, rank)
        for k in want:
            assert torch.equal(got[k], want[k]), (key, rank, k)


@pytest.mark.parametrize("key", ["equal:hybrid"])
def test_hybrid_equals_manual(four, key):
    _equal(four, key)


@pytest.mark.parametrize("key", ["equal:low_level_zero2", "equal:ddp", "equal:gemini",
                                 "equal:pp2"])
def test_two_rank_presets_equal_manual(two, key):
    _equal(two, key)


def _check_plan(results, key):
    checks = [r[key] for r in results]
    for rank, c in enumerate(checks):
        assert c["comm"] == c["planned"], (key, rank, c["comm"], c["planned"])
        m = c["memory"]
        assert m.params == c["params"], (key, rank)
        # The store holds the whole (offloaded) state; the tree keeps what stays on the device.
        assert m.opt_state_offloaded == c["offloaded"], (key, rank)
        assert m.opt_state + m.opt_state_offloaded == c["opt_state"], (key, rank)
    assert checks[0]["memory"].params_max == max(c["params"] for c in checks), key


@pytest.mark.parametrize("key", ["check:hybrid", "check:tp2xdp2", "check:tp2xdp2+zero1+fp16",
                                 "check:tp2xdp2+zero3+bf16", "check:tp2xdp2+zero2+sp"])
def test_plan_matches_comm_report_four_ranks(four, key):
    _check_plan(four, key)


@pytest.mark.parametrize("key", ["check:low_level_zero2", "check:ddp", "check:gemini",
                                 "check:gemini_nvme", "check:low_level_zero1+offload"])
def test_plan_matches_comm_report_two_ranks(two, key):
    _check_plan(two, key)
    if "gemini" in key or "offload" in key:
        assert two[0][key]["offloaded"] > 0


def test_plan_text(four, two):
    text = four[0]["check:hybrid"]["text"]
    for want in ["hybrid_parallel plan (rank 0 of 4)", "mesh: dp=2 x tp=2",
                 "chain(clip_by_global_norm(0.5), optimizer)",
                 "shard_params(<9 rules for Llama>, mesh)", "data_parallel(mesh, bucket_mb=25.0)",
                 "zero_partition(2, mesh)", "dim 0 over tp", "dim 1 over tp",
                 "ZeRO-2 parts over dp", "reduce_scatter  dp         1",
                 "tp: row-split linear outputs (forward)", "total over dp", "total over tp",
                 "optimizer state"]:
        assert want in text, (want, text)
    gem = two[0]["check:gemini"]["text"]
    assert "zero_partition(3, mesh)" in gem and "offload('cpu')" in gem
    assert "offloaded" in gem and "zero-3 gathered" in gem
    assert "amp_cast('bf16', mesh=mesh)" in four[0]["check:tp2xdp2+zero3+bf16"]["text"]


# ------------------------------------------------------------------------- one process
def test_one_process_equals_plain_step(capsys):
    """On one process every axis has size 1: the preset is the plain step (with the clip)."""
    apply_fn, params, buffers = functionalize(_model())
    opt = fo.chain(fo.clip_by_global_norm(0.5), _adamw())
    want = _run(make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt), 3)
    composed = hybrid_parallel(_model(), lm_loss, _adamw(), max_norm=0.5, zero_stage=1,
                               plan=True)
    assert isinstance(composed, tuple) and len(composed) == 2
    got = _run(*composed, 3)
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    printed = capsys.readouterr().out
    assert "mesh: dp=1 x tp=1 (local)" in printed and "zero_partition(1, mesh)" in printed
    assert "expected communication per step:\n  none" in printed


def test_preset_is_a_transform():
    """Without a model the preset is a transform of a fresh (step, state), composable."""
    preset = hybrid_parallel(zero_stage=2, max_norm=1.0)
    assert isinstance(preset, Preset)
    apply_fn, params, buffers = functionalize(_model())
    opt = _adamw()
    step, state = compose(preset)(make_train_step(apply_fn, lm_loss, opt),
                                  init_state(params, buffers, opt))
    assert step.partition.stage == 2
    other_step, other_state = low_level_zero(_model(), lm_loss, _adamw(), stage=2, max_norm=1.0)
    a, b = _run(step, state, 2), _run(other_step, other_state, 2)
    assert a[0] == b[0]
    with pytest.raises(ValueError, match="fresh state"):
        preset(step, state._replace(step=torch.tensor(3)))


def test_describe_manual_composition():
    step, state = build(1, 1, "adamw", zero=1)
    plan = describe(step, state, DeviceMesh.local(dp=1, tp=1), clip_norms=1)
    assert plan.comm_totals() == {}
    assert plan.memory.opt_state == state_bytes(state.opt_state)
    with pytest.raises(ValueError, match="sequence_parallel needs sharding"):
        describe(step, state, DeviceMesh.local(), sequence_parallel=True)


def test_plan_per_token_without_batch_shape():
    """Planning tp2 x dp2 from one process: a virtual mesh gives shapes, not groups. The
    activation traffic without a batch shape is given per local token."""
    from funcpar.presets.plan import Plan
    from funcpar.shard.rules import plan_sharding

    mesh = DeviceMesh.virtual(dp=2, tp=2)
    model = _model()
    sharding = plan_sharding(model, llama_rules(CFG.head_dim), mesh, "tp")
    step, state = build(1, 1, "adamw")
    plan = Plan(step, state, mesh, name="virtual", transforms=(), sharding=sharding,
                sequence_parallel=False, bucket_mb=25.0, clip_norms=0, batch_shape=None,
                max_norm=None)
    rows = {r.what: r for r in plan.expected_comm()}
    row = rows["tp: row-split linear outputs (forward)"]
    # o_proj and down_proj of 2 layers: 4 all-reduces of dim (32) float64 values per token.
    assert row.per_token and row.count == 4 and row.nbytes == 4 * 32 * 8
    with pytest.raises(ValueError, match="needs batch_shape"):
        plan.comm_totals()
    assert plan.comm_totals((8, 12))[("all_reduce", "tp")][0] == 5 + 4 + 1 + 3


@pytest.mark.parametrize("call, match", [
    (lambda: hybrid_parallel(zero_stage=4), r"zero_stage must be 0, 1, 2 or 3, got 4"),
    (lambda: hybrid_parallel(precision="fp8"), r"unknown precision 'fp8'"),
    (lambda: hybrid_parallel(tp_size=0), r"tp_size must be an int >= 1, got 0"),
    (lambda: hybrid_parallel(dp_size=0), r"dp_size must be an int >= 1"),
    (lambda: hybrid_parallel(microbatches=4), r"microbatches=4 are pipeline micro-batches"),
    (lambda: hybrid_parallel(pp_size=2), r"pp_size=2 needs microbatches="),
    (lambda: hybrid_parallel(pp_size=2, microbatches=2, pp_style="zbv"),
     r"unknown pp_style 'zbv'"),
    (lambda: hybrid_parallel(pp_size=2, microbatches=2, num_model_chunks=2),
     r"num_model_chunks=2 needs pp_style='interleaved'"),
    (lambda: hybrid_parallel(sequence_parallel=True), r"sequence_parallel .* tp_size > 1"),
    (lambda: hybrid_parallel(offload="disk"), r"offload must be None, 'cpu' or 'nvme'"),
    (lambda: hybrid_parallel(offload="nvme"), r"offload='nvme' needs offload_path"),
    (lambda: hybrid_parallel(offload="cpu", offload_path="/x"), r"offload_path is for"),
    (lambda: hybrid_parallel(max_norm=0.0), r"max_norm must be a finite number > 0"),
    (lambda: hybrid_parallel(batch_shape=(8, 0)), r"batch_shape must be \(batch, seq\)"),
    (lambda: gemini(zero_stage=2), r"gemini is ZeRO-3 .* got zero_stage=2"),
    (lambda: gemini(offload="disk"), r"gemini: offload must be"),
    (lambda: low_level_zero(stage=3), r"stage must be 1 or 2 .* got 3"),
    (lambda: titan_parallelize(dp_shard=2, dp_replicate=2), r"HSDP"),
    (lambda: hybrid_parallel(tp_size=2, mesh=DeviceMesh.virtual(dp=2, tp=1)),
     r"tp_size=2 but the mesh's 'tp' axis has 1 ranks"),
    (lambda: hybrid_parallel(dp_size=4, mesh=DeviceMesh.virtual(dp=2, tp=1)),
     r"dp_size=4 but the mesh's 'dp' axis has 2"),
    (lambda: hybrid_parallel(mesh=DeviceMesh.virtual(tp=1, sp=2)), r"axes \{'sp': 2\}"),
    (lambda: hybrid_parallel(mesh=DeviceMesh.virtual(tp=1, cp=2)),
     r"sp_size \(context-parallel modes\)=1 but the mesh's 'cp' axis has 2 ranks"),
    (lambda: hybrid_parallel(_model(), lm_loss), r"pass model, loss_fn and optimizer"),
    (lambda: hybrid_parallel(loss_fn=lm_loss), r"or none of them"),
])
def test_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_pipeline_plan(two):
    """Under pipeline_split the plan gives the layouts and memory of this rank's stages and
    says that it does not model the communication."""
    text = two[0]["pp:text"]
    assert "pipeline_split(mesh, microbatches=2, schedule='1f1b')" in text
    assert "mesh: pp=2 x dp=1 x tp=1" in text and "not modeled under pipeline_split" in text
    for r in two:
        planned, held = r["pp:memory"]
        assert planned == held


@pytest.mark.parametrize("world, kw, match", [
    ("4", {"tp_size": 3}, r"tp_size 3 x pp_size 1 = 3 does not divide the world of 4"),
    ("4", {"tp_size": 2, "dp_size": 3},
     r"tp_size 2 x pp_size 1 x dp_size 3 = 6 processes, but the world has 4"),
    ("1", {"dp_size": 2}, r"dp_size 2 = 2 processes, but the world has 1"),
])
def test_world_size_mismatch(monkeypatch, world, kw, match):
    """Refused from the sizes alone, before torch.distributed is initialised."""
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=match):
        hybrid_parallel(_model(), lm_loss, _adamw(), **kw)


def test_pick_rules():
    assert pick_rules(_model()) == llama_rules(CFG.head_dim)
    assert pick_rules(_model(), vocab_parallel_loss=False) == llama_rules(
        CFG.head_dim, vocab_parallel_loss=False)
    with pytest.raises(ValueError, match=r"no tensor-parallel rules are known for .*Linear"):
        pick_rules(torch.nn.Linear(2, 2))
