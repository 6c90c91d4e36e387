"""pipeline_split: schedules, stage cutting, errors, and exactness against one process.

The model is the reference Llama with 8 blocks (``PP_CFG``; uneven stages by explicit cuts),
trained 10 steps by :func:`funcpar.testing.reference.train`. A pipelined run computes the same
step as one process - the loss is the mean of equal micro-batch means, the gradients are summed
over micro-batches, the global norm the clip uses spans every stage - so float64 losses and
parameters agree to 1e-10 (summation order only; measured <= 2.2e-12) and float32 to 1e-5
(AdamW at eps 1e-5, as in tests/test_distributed_optim.py).

Default suite: one pp2 run and one world-4 run covering every schedule, micro-batch counts
below, equal to and above the stage count, pp4, pp2 x tp2, pp2 x dp2 with ZeRO 0 and 2, tied
embeddings, AdamW / Adafactor / LAMB, float32 and the comm report; one pp2 run of GaLore and a
weight-decay-masked AdamW (the optimizer sees the stage's own tree, nothing added) and of
Adafactor against one process accumulating the same micro-batches; ``-m slow`` runs the whole
matrix (layouts x schedules x optimizers) and every reference optimizer on pp2.
"""

import dataclasses
import os
import signal
from datetime import timedelta

import pytest
import torch

import funcpar.optim as fo
import funcpar.optim.clip as clip_module
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleDeadlock,
    build_schedule,
    simulate,
    theory_bubble,
)
from funcpar.pipeline.stages import llama_stages, plan_stages
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.reduce import total_sum_of_squares
from funcpar.state import functionalize, init_state
from funcpar.testing import RankError, run_ranks
from funcpar.testing.reference import (
    OPTIMIZERS,
    PP_CFG,
    batches,
    build,
    loss_rel,
    max_rel,
    train,
)
from funcpar.train import make_train_step
from funcpar.transforms import amp_cast, compose, pipeline_split

TIED_CFG = dataclasses.replace(PP_CFG, tie_embeddings=True)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# Adafactor's trajectory multiplies any last-bit difference ~10x per step from the 4th step on
# (docs/PIPELINE.md, "Adafactor and the last bit"): a micro-batched gradient or a global norm
# summed in another association (each stage's sum, then over pp) ends 10 steps at up to
# ~3e-9 from one process on the full batch. Against one process accumulating the same
# micro-batches with the norm summed as the pipeline sums it, pp2 is bit-identical
# (test_masked_optimizers_and_adafactor_on_pp2).
TOL_OPTIM = {(torch.float64, "adafactor"): 1e-9}


# ------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_complete_without_deadlock(schedule):
    for p in (1, 2, 3, 4):
        for v in ((1, 2, 3) if schedule == "interleaved" else (1,)):
            for m in range(1, 10):
                lists = build_schedule(schedule, p, m, v)  # simulated inside
                sim = simulate(lists, p, m, v)
                if schedule == "gpipe":
                    assert sim.peak_in_flight == [m] * p
                if schedule == "1f1b":
                    assert sim.peak_in_flight == [min(p - r, m) for r in range(p)], (p, m)
                if schedule != "interleaved" or m % p == 0:
                    # The simulated bubble is the textbook one where the analysis applies.
                    assert max(sim.bubble) == pytest.approx(theory_bubble(schedule, p, m, v))


def test_interleaving_shrinks_the_bubble():
    for p, m in ((2, 4), (4, 4), (4, 8)):
        one = max(simulate(build_schedule("1f1b", p, m), p, m).bubble)
        two = max(simulate(build_schedule("interleaved", p, m, 2), p, m, 2).bubble)
        assert two < one, (p, m, one, two)


def test_simulator_reports_a_deadlock():
    # Rank 1 waits for micro-batch 1 first; rank 0 sends it only after the backward of
    # micro-batch 0, which needs rank 1's gradient: a cycle.
    r0 = [Action("F", 0, 0), Action("SEND_F", 0, 0), Action("RECV_B", 0, 0), Action("B", 0, 0),
          Action("F", 0, 1), Action("SEND_F", 0, 1), Action("RECV_B", 0, 1), Action("B", 0, 1)]
    r1 = [Action("RECV_F", 1, 1), Action("F", 1, 1), Action("B", 1, 1), Action("SEND_B", 1, 1),
          Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0)]
    with pytest.raises(ScheduleDeadlock, match="rank 0 waits at RECV_B") as err:
        simulate([r0, r1], 2, 2)
    assert set(err.value.blocked) == {0, 1}


def test_simulator_rejects_incomplete_lists():
    lists = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="lacks its backward"):
        simulate([lists[0], [a for a in lists[1] if a != Action("B", 1, 1)]], 2, 2)
    with pytest.raises(ValueError, match="per rank need schedule='interleaved'"):
        build_schedule("1f1b", 2, 2, 2)


# --------------------------------------------------------------------------------- stages
def test_stage_plan_balanced_explicit_and_tied():
    model = Llama(dataclasses.replace(PP_CFG, n_layers=9))
    plan = plan_stages(model, llama_stages(), 2)
    # 9 equal blocks; the embedding and head weigh about a fifth of a block each.
    assert plan.ranges == ((0, 5), (5, 9))
    # Over 4, the stage of 3 blocks is a middle one: it carries neither embedding nor head.
    assert plan_stages(model, llama_stages(), 4).ranges == ((0, 2), (2, 4), (4, 7), (7, 9))
    assert plan.names[0][0] == "embed_tokens.weight"
    assert plan.names[1][-2:] == ("norm.weight", "lm_head.weight")
    assert plan_stages(model, llama_stages(), 2, 2, cuts=[1, 2, 7]).ranges == (
        (0, 1), (1, 2), (2, 7), (7, 9))
    names = {n for ns in plan.names for n in ns}
    assert names == {n for n, _ in model.named_parameters()}
    assert plan.shared() == {}
    tied = plan_stages(Llama(TIED_CFG), llama_stages(), 4)
    assert tied.shared() == {"embed_tokens.weight": [0, 3]}
    assert tied.stages_of(1) == [1] and plan_stages(model, llama_stages(), 2, 3).stages_of(1) == [
        1, 3, 5]


def _fresh(cfg=PP_CFG, dtype=torch.float64):
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(cfg).to(dtype))
    opt = OPTIMIZERS["adamw"](params)
    return make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp=4, microbatches=4, schedule="interleaved", virtual_stages=3),
     r"12 stages \(pp=4 x 3 virtual stages per rank\) but the model has only 8 blocks"),
    (dict(pp=2, microbatches=2, cuts=[3, 6]),
     r"give 3 stages but the mesh's pp size \(2\) x virtual stages \(1\) is 2"),
    (dict(pp=2, microbatches=2, cuts=[6]), None),
    (dict(pp=2, microbatches=2, cuts=[8]), r"must increase strictly within 1..7"),
    (dict(pp=2, microbatches=2, virtual_stages=2), r"needs schedule='interleaved'"),
    (dict(pp=2, microbatches=0), r"microbatches must be an int >= 1, got 0"),
    (dict(pp=2, microbatches=2, schedule="zigzag"), r"unknown pipeline schedule 'zigzag'"),
])
def test_split_errors(kwargs, match):
    pp = kwargs.pop("pp")
    mesh = DeviceMesh.virtual(pp=pp, rank=0)
    if match is None:  # the valid neighbour of the errors: rank 0 keeps stage 0's leaves
        _step, state = pipeline_split(mesh, **kwargs)(*_fresh())
        assert "layers.5.mlp.up_proj.weight" in state.params
        assert "layers.6.mlp.up_proj.weight" not in state.params
        return
    with pytest.raises(ValueError, match=match):
        pipeline_split(mesh, **kwargs)(*_fresh())


def test_split_must_come_first_and_more_stages_than_blocks():
    mesh = DeviceMesh.virtual(pp=2, rank=0)
    step, state = amp_cast("bf16")(*_fresh(dtype=torch.float32))
    with pytest.raises(ValueError, match=r"apply pipeline_split first.*'amp_cast'"):
        pipeline_split(mesh, microbatches=2)(step, state)
    small = LlamaConfig(vocab_size=50, dim=32, n_layers=1, n_heads=8, n_kv_heads=4,
                        ffn_hidden=42, max_seq_len=16)
    with pytest.raises(ValueError, match=r"2 stages \(pp=2\) but the model has only 1 blocks"):
        pipeline_split(mesh, microbatches=2)(*_fresh(small))
    with pytest.raises(ValueError, match="the mesh has no axis 'pp'"):
        pipeline_split(DeviceMesh.virtual(dp=2), microbatches=2)


def test_batch_must_divide_into_microbatches():
    step, state = build(1, 1, "adamw", cfg=PP_CFG, microbatches=3)
    with pytest.raises(ValueError, match=r"shape \(8, 12\) does not split into 3 equal"):
        step(state, batches()[0])


def _steps(n, **kw):
    step, state = build(1, 1, "adamw", cfg=PP_CFG, **kw)
    losses = []
    for batch in batches()[:n]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state.params


def test_one_process_microbatches_and_local_handoffs_equal_the_full_batch():
    ref = _steps(3)
    # pp = 1: gradient accumulation over 4 micro-batches; 3 virtual stages hand over locally.
    for kw in (dict(microbatches=4), dict(microbatches=2, schedule="interleaved",
                                           virtual_stages=3)):
        losses, params = _steps(3, **kw)
        assert loss_rel(losses, ref[0]) <= 1e-10 and max_rel(params, ref[1]) <= 1e-10, kw


# ------------------------------------------------------------------------ against one process
def _case(case):
    """(name, tp, dp, zero, optimizer, dtype, cfg, pipeline kwargs)"""
    _name, tp, dp, zero, optim, dtype, cfg, pp = case
    return train(tp, dp, optim, dtype, zero=zero, cfg=cfg, **pp)


def _run_cases(cases):
    return [_case(c) for c in cases]


def _compare(world, cases):
    refs = {}
    for _, _, _, _, optim, dtype, cfg, _ in cases:
        if (optim, dtype, cfg) not in refs:
            refs[(optim, dtype, cfg)] = train(1, 1, optim, dtype, cfg=cfg)
    results = run_ranks(_run_cases, world, cases, backend=None, timeout=900)
    for i, (name, *_, optim, dtype, cfg, _) in enumerate(cases):
        ref_losses, ref_params = refs[(optim, dtype, cfg)]
        tol = TOL_OPTIM.get((dtype, optim), TOL[dtype])
        merged = {}
        for rank in range(world):
            losses, params = results[rank][i]
            assert loss_rel(losses, ref_losses) <= tol, (name, rank)
            for n, x in params.items():  # tied leaves: every holder has the same value
                if n in merged:
                    assert torch.equal(merged[n], x), (name, n)
            merged.update(params)
        assert set(merged) == set(ref_params), name
        assert max_rel(merged, ref_params) <= tol, (name, max_rel(merged, ref_params))
    for (optim, _, _), (losses, _) in refs.items():
        assert losses[-1] < losses[0], optim  # it trains


def _pp(pp, m, schedule="1f1b", v=1, cuts=None):
    return dict(pp=pp, microbatches=m, schedule=schedule, virtual_stages=v, cuts=cuts)


F64, F32 = torch.float64, torch.float32
CASES_2 = [
    ("pp2 1f1b m1<p cuts 3/5", 1, 1, 0, "adamw", F64, PP_CFG, _pp(2, 1, cuts=[3])),
    ("pp2 gpipe m2=p", 1, 1, 0, "adamw", F64, PP_CFG, _pp(2, 2, "gpipe")),
    ("pp2 1f1b m4>p adafactor", 1, 1, 0, "adafactor", F64, PP_CFG, _pp(2, 4)),
    ("pp2 interleaved v2 m4 lamb cuts 1/3/1/3", 1, 1, 0, "lamb", F64, PP_CFG,
     _pp(2, 4, "interleaved", 2, cuts=[1, 4, 5])),
    ("pp2 interleaved v2 m1", 1, 1, 0, "adamw", F64, PP_CFG, _pp(2, 1, "interleaved", 2)),
    ("pp2 1f1b float32", 1, 1, 0, "adamw_small_lr", F32, PP_CFG, _pp(2, 4)),
]
CASES_4 = [
    ("pp4 interleaved v2 m8", 1, 1, 0, "adamw", F64, PP_CFG, _pp(4, 8, "interleaved", 2)),
    ("pp4 gpipe m2<p tied cuts 1/3/2/2", 1, 1, 0, "adamw", F64, TIED_CFG,
     _pp(4, 2, "gpipe", cuts=[1, 4, 6])),
    ("pp2xtp2 1f1b m2 lamb", 2, 1, 0, "lamb", F64, PP_CFG, _pp(2, 2)),
    ("pp2xdp2 zero0 gpipe m2 adafactor", 1, 2, 0, "adafactor", F64, PP_CFG, _pp(2, 2, "gpipe")),
    ("pp2xdp2 zero2 interleaved m2", 1, 2, 2, "adamw", F64, PP_CFG, _pp(2, 2, "interleaved", 2)),
]


def test_pipeline_equals_one_process_pp2():
    _compare(2, CASES_2)


@pytest.mark.slow  # 16 s; the default suite keeps pp2 (the slow matrix covers every 4-rank layout)
def test_pipeline_equals_one_process_world4():
    _compare(4, CASES_4)


LAYOUTS = {"pp2": (2, 1, 1, 0), "pp4": (4, 1, 1, 0), "pp2xtp2": (2, 2, 1, 0),
           "pp2xdp2": (2, 1, 2, 0), "pp2xdp2+zero2": (2, 1, 2, 2)}


def _matrix(lay):
    pp, tp, dp, zero = LAYOUTS[lay]
    cases = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for m in (1, pp, 2 * pp) if dp == 1 else (1, 2, 4):
            for optim in ("adamw", "adafactor", "lamb"):
                cases.append((f"{lay} {schedule} m{m} {optim}", tp, dp, zero, optim, F64,
                              PP_CFG, _pp(pp, m, schedule, v)))
        cases.append((f"{lay} {schedule} float32", tp, dp, zero, "adamw_small_lr", F32,
                      PP_CFG, _pp(pp, 2, schedule, v)))
    return cases


@pytest.mark.slow
@pytest.mark.timeout(900)  # 30 cases of 10 steps on up to 4 ranks: ~4 min on a loaded 2-core VM
@pytest.mark.parametrize("lay", list(LAYOUTS))
def test_pipeline_matrix(lay):
    pp, tp, dp, _ = LAYOUTS[lay]
    _compare(pp * tp * dp, _matrix(lay))


# ------------------------------------------------------- every optimizer; Adafactor's last bit
def _by_name(tree):
    """A whole-model mask tree as a predicate over leaf names: it fits the leaves of any stage,
    where a tree must have the structure of the params the optimizer sees (a stage's)."""
    return lambda name, _param: tree[name]


def _galore_groups(params):
    return fo.galore_param_groups(params, rank=4, update_proj_gap=3)


def _clipped(opt):
    return fo.chain(fo.clip_by_global_norm(0.5), opt)


def _copy_grads():
    """A transformation that replaces the gradients by equal copies (before the clip, it hides a
    tied leaf from the norm's identity check)."""
    return fo.GradientTransformation(
        lambda params: fo.EmptyState(),
        lambda grads, state, params=None, *, layouts=None: (
            {n: g.clone() for n, g in grads.items()}, state))


#: Optimizers built here: the reference GaLore ones (funcpar.testing.reference, same
#: hyperparameters) with their masks by name and from the model they train, a weight-decay
#: mask, and a transformation before the clip.
PP_OPTIMIZERS = {
    "galore_adamw": lambda p: _clipped(fo.galore_adamw(
        lr=1e-2, weight_decay=0.1, galore_mask=_by_name(_galore_groups(p)),
        svd_dtype=torch.float64)),
    "galore_adamw8bit": lambda p: _clipped(fo.galore_adamw(
        lr=1e-2, galore_mask=_by_name(_galore_groups(p)), eight_bit=True, block_size=24,
        min_8bit_size=100, adam_variant="bnb", eps=1e-8, svd_dtype=torch.float64)),
    "galore_adafactor": lambda p: _clipped(fo.galore_adafactor(
        lr=0.5, relative_step=False, beta1=0.9, weight_decay=0.1,
        galore_mask=_by_name(_galore_groups(p)), svd_dtype=torch.float64)),
    "adamw_decay_mask": lambda p: _clipped(fo.adamw(lr=1e-2, weight_decay=0.1,
                                                    weight_decay_mask=fo.matrices_only)),
    "copy_then_clip": lambda p: fo.chain(_copy_grads(), fo.clip_by_global_norm(0.5),
                                         fo.adamw(lr=1e-2)),
}


def _run(optim, cfg, pp=1, microbatches=None, schedule="1f1b", steps=None):
    """10 float64 steps of ``optim`` (PP_OPTIMIZERS, else the reference's): losses, grad_norm
    metrics and this rank's params."""
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(cfg).to(torch.float64))
    opt = PP_OPTIMIZERS.get(optim, OPTIMIZERS.get(optim))(params)
    step, state = make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)
    if microbatches is not None:
        step, state = pipeline_split(DeviceMesh.from_env(pp=pp), microbatches=microbatches,
                                     schedule=schedule)(step, state)
    losses, norms = [], []
    for batch in batches()[:steps]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms, state.params


def _run_pp2_cases(cases):
    return [_run(optim, cfg, 2, m, schedule) for optim, cfg, m, schedule, _ in cases]


def _stage0_leaves(cfg):
    return len(plan_stages(Llama(cfg), llama_stages(), 2).names[0])


def _reference(optim, cfg, accumulate):
    """One process on one thread (as a rank): on the full batch, or (``accumulate``) over the
    pipeline's micro-batches with the global norm summed as pp2 sums it - the sum over stage
    0's leaves plus the sum over stage 1's (the leaves in the same order: the stages are runs of
    the sorted names for these configs), each as ``total_sum_of_squares`` sums a rank's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    k = _stage0_leaves(cfg)

    def as_pp2(xs, layouts, *, purpose="sum_of_squares"):
        return (total_sum_of_squares(xs[:k], layouts[:k], purpose=purpose)
                + total_sum_of_squares(xs[k:], layouts[k:], purpose=purpose))

    try:
        if accumulate is None:
            return _run(optim, cfg)
        clip_module.total_sum_of_squares = as_pp2  # the clip and the grad_norm metric
        return _run(optim, cfg, 1, accumulate)
    finally:
        clip_module.total_sum_of_squares = total_sum_of_squares
        torch.set_num_threads(threads)


def _compare_to_reference(cases):
    refs = [_reference(optim, cfg, m if ref == "accumulated" else None)
            for optim, cfg, m, _, ref in cases]
    results = run_ranks(_run_pp2_cases, 2, cases, backend=None, timeout=900)
    for i, (optim, _cfg, m, schedule, ref) in enumerate(cases):
        ref_losses, ref_norms, ref_params = refs[i]
        # Against the accumulated run only the norm's association could differ, and it is the
        # pipeline's: no tolerance beyond float64's last bits (measured 0).
        tol = 1e-12 if ref == "accumulated" else 1e-10
        name = f"{optim} pp2 {schedule} m{m} vs {ref}"
        for rank in (0, 1):
            losses, norms, _ = results[rank][i]
            assert loss_rel(losses, ref_losses) <= tol, (name, rank)
            assert loss_rel(norms, ref_norms) <= tol, (name, rank, norms, ref_norms)
        merged = {**results[0][i][2], **results[1][i][2]}
        assert set(merged) == set(ref_params), name
        assert max_rel(merged, ref_params) <= tol, (name, max_rel(merged, ref_params))


PP9_CFG = dataclasses.replace(PP_CFG, n_layers=9)


def test_masked_optimizers_and_adafactor_on_pp2():
    _compare_to_reference([
        # Masks by name over the stage's own leaves (the optimizer's tree is the stage's).
        ("galore_adamw", PP_CFG, 4, "1f1b", "full"),
        ("adamw_decay_mask", PP_CFG, 2, "gpipe", "full"),
        # 9 blocks, where the full-batch run differs from the micro-batched one by 1.3e-10 and
        # a norm summed in one's own association by 1.2e-9 (docs/PIPELINE.md).
        ("adafactor", PP9_CFG, 2, "1f1b", "accumulated"),
    ])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_optimizer_on_pp2():
    _compare_to_reference([(optim, PP_CFG, 2, "1f1b", "accumulated")
                           for optim in sorted(OPTIMIZERS)])


def _tied_copy_then_clip():
    return _run("copy_then_clip", TIED_CFG, 2, 2, steps=1)


def test_tied_leaf_hidden_from_the_norm_fails_on_every_rank():
    # The clip sees copies of the gradients, so the tied weight's copy on its second holder
    # cannot be recognised: every rank raises (the check travels with the norm's all-reduce)
    # rather than count it twice or leave the other rank waiting.
    with pytest.raises(RankError, match=r"raised ValueError: .*held_elsewhere"):
        run_ranks(_tied_copy_then_clip, 2, backend=None, timeout=300)


# --------------------------------------------------------------------- comm report, amp, kill
def _p2p_records():
    from funcpar.shard.comm import comm_log, comm_report

    step, state = build(1, 1, "adamw", cfg=PP_CFG, pp=2, microbatches=4)
    with comm_log.capture() as records:
        step(state, batches()[0])
    return [(r.op, r.axis, r.nbytes, r.purpose) for r in records], comm_report(records, echo=False)


def test_comm_report_shows_p2p_traffic():
    r0, r1 = run_ranks(_p2p_records, 2, backend=None, timeout=300)
    act = 2 * 12 * PP_CFG.dim * 8  # a micro-batch's hidden states: [2, 12, 32] float64
    for records, text in (r0, r1):
        assert "send" in text and "recv" in text and "pp" in text
        assert [r for r in records if r[0] in ("send", "recv") and r[1] != "pp"] == []
    sends0 = [r for r in r0[0] if r[0] == "send"]
    recvs1 = [r for r in r1[0] if r[0] == "recv"]
    # Rank 0 sends 4 activations (+ one 80-byte shape header), rank 1 sends 4 gradients back.
    assert sorted(r[2] for r in sends0) == [80] + [act] * 4
    assert sorted(r[2] for r in recvs1) == [80] + [act] * 4
    assert sum(r[2] for r in r1[0] if r[0] == "send") == 4 * act
    assert sum(r[2] for r in r0[0] if r[0] == "recv") == 4 * act
    # The global norm over both stages: one all-reduce over pp of (sum, check count) for the
    # grad_norm metric and one for the clip, nothing else added to the optimizer.
    for records, _ in (r0, r1):
        split = [r for r in records if "tree split over pp" in r[3]]
        assert [(r[0], r[1], r[2]) for r in split] == [("all_reduce", "pp", 16)], split


def _amp_run(precision, pp):
    from funcpar.transforms import amp_cast

    mesh = DeviceMesh.from_env(pp=pp)
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(PP_CFG))
    opt = OPTIMIZERS["adamw_small_lr"](params)
    transforms = [pipeline_split(mesh, microbatches=1)] if pp > 1 else []
    if precision != "fp32":
        transforms.append(amp_cast(precision, mesh=mesh))
    step, state = compose(*transforms)(make_train_step(apply_fn, lm_loss, opt),
                                       init_state(params, buffers, opt))
    losses = []
    for batch in batches()[:4]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state.params


def test_amp_bf16_composes():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks
    try:
        ref_losses, ref_params = _amp_run("bf16", 1)
        fp32_losses, fp32_params = _amp_run("fp32", 1)
    finally:
        torch.set_num_threads(threads)
    results = run_ranks(_amp_run, 2, "bf16", 2, backend=None, timeout=300)
    merged = {**results[0][1], **results[1][1]}
    assert results[0][0] == results[1][0]  # reported on every rank
    # One micro-batch: the first step runs the very bf16 ops of the one-process forward.
    assert results[0][0][0] == ref_losses[0]
    # Later steps differ by bf16 round-off (the global norm's association and the stage boundaries
    # round differently, and a bf16 gradient's rounding flips): less than bf16 training
    # differs from float32 training.
    assert loss_rel(results[0][0], ref_losses) <= loss_rel(fp32_losses, ref_losses)
    assert max_rel(merged, ref_params) <= max_rel(fp32_params, ref_params)


def _killed(path):
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    step, state = build(1, 1, "adamw", cfg=PP_CFG, pp=2, microbatches=2)
    rank = dist.get_rank()
    try:
        for i, batch in enumerate(batches()):
            if i == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            state, _ = step(state, batch)
    except Exception as err:
        with open(path, "w") as f:
            f.write(f"{type(err).__name__}: {err}")
        raise


def test_a_killed_rank_makes_the_others_fail(tmp_path):
    path = tmp_path / "rank0.txt"
    with pytest.raises(RankError, match="rank 1 of 2 raised ProcessDied"):
        run_ranks(_killed, 2, str(path), backend=None, timeout=120)
    # Rank 0, blocked on the dead stage, raised by itself (the harness would have killed it
    # silently after its 5 s grace had it hung).
    assert path.exists() and path.read_text(), "rank 0 did not fail on its own"


def _reduction_order():
    """pp2 x dp2, 4 micro-batches, dp and dp + ZeRO-2: for this rank, the indices in the comm
    log of its gradient reductions and of its last pipeline transfer, and the params after a
    step."""
    from funcpar.shard.comm import comm_log

    out = []
    for zero in (0, 2):
        step, state = build(1, 2, "adamw", cfg=PP_CFG, pp=2, microbatches=4, zero=zero)
        with comm_log.capture() as records:
            state, _ = step(state, batches()[0])
        reduce = [k for k, r in enumerate(records)
                  if r.purpose.startswith("dp grads") or r.purpose.endswith("zero grads")]
        p2p = [k for k, r in enumerate(records) if r.op in ("send", "recv")]
        out.append((reduce, p2p[-1], {k: v.clone() for k, v in state.params.items()}))
    return out


@pytest.mark.slow  # 4 ranks, ~15 s on a loaded 2-core VM
def test_dp_reduction_starts_in_the_last_microbatch_backward():
    # The last stage's rank sends its last micro-batch's input gradient back after that
    # backward: its gradient reductions (launched from the backward's hooks as each leaf's
    # sum over micro-batches completes) come before it in the log. The first stage's last
    # backward is its last action, so its reductions follow its last receive either way.
    # Exactness under pp2 x dp2 (+ ZeRO-2) is the pipeline matrix's (slow) and
    # test_pipeline_equals_one_process_world4's.
    results = run_ranks(_reduction_order, 4, backend=None, timeout=300)
    for rank, runs in enumerate(results):
        pp_coord = rank // 2  # mesh (pp, dp)
        for reduce, last_p2p, _ in runs:
            assert reduce, rank
            if pp_coord == 1:
                assert reduce[0] < last_p2p, (rank, reduce, last_p2p)
            else:
                assert reduce[0] > last_p2p, (rank, reduce, last_p2p)
