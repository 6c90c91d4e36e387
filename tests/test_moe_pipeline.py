"""pipeline_split of an MoE Llama (alone and with expert_parallel) equals one process.

The model (tests/_moe_model.py): the reference Llama with 4 blocks, every second one MoE (4
experts, top-1, capacity factor 2.0, so tokens are dropped), the routers skewed (uneven
all_to_all splits, an expert with no token in some step; asserted). Each
stage's weighted router losses enter the loss where they are computed - a stage before the
last returns them as a side loss, the last stage's MoEOutput carries its own - and every
stage's reach its router weights' gradients (docs/MOE.md, "Pipelines"). 10 steps in float64;
losses and parameters within 1e-10 of one process on the full batch: micro-batching only
reassociates the sums (the gradient summed over micro-batches, the router losses summed per
stage; measured <= 3e-13).

Default: in one process a pp=1 pipeline of 4 virtual stages (stages with no MoE block, a last
stage with none, side losses handed over on the rank), the same under amp_cast bf16 and fp16
against one-process amp (parameters bit for bit), the micro-batch means of the router
losses, and the errors (a loss that does not add the router loss, a stage output of another
kind); pp2 with gpipe (AdamW) and 1f1b (CAME); pp2 x ep2 (1f1b, AdamW) and the same through
``moe_hybrid(pp_size=2, ep_size=2)`` (CAME). ``-m slow``: every
optimizer on pp2 and on pp2 x ep2, the interleaved schedule, uneven cuts, pp2 x tp2 (the
experts' ffn split over tp inside each stage), pp2 x ep2 x dp2 + ZeRO-2 on 8 ranks, and a
pp2 x ep2 checkpoint resumed in one process and under pp2.
"""

import dataclasses

import pytest
import torch
from _moe_model import routing_is_skewed, skewed_model

from funcpar.models import lm_loss, moe_lm_loss
from funcpar.presets import moe_hybrid
from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules_for
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.testing.moe import one_thread
from funcpar.testing.reference import OPTIMIZERS, batches, loss_rel, max_rel, run
from funcpar.train import make_train_step
from funcpar.transforms import (
    amp_cast,
    compose,
    data_parallel,
    expert_parallel,
    pipeline_split,
    shard_params,
    zero_partition,
)

# As funcpar.testing.moe: 8-bit GaLore's quantized states amplify a reordered sum's last bit.
TOL = {"galore_adamw8bit": 1e-8}
MATRIX_OPTIMIZERS = ["sgd", "adamw", "adafactor", "adafactor_torch", "came", "lamb",
                     "galore_adamw", "galore_adamw8bit"]


#: name -> (world, pp, ep, schedule, microbatches, virtual stages, cuts); "xtp2": shard_params
#: (the experts' ffn over tp, llama_rules_for) after pipeline_split, on 4 ranks; "xdp2+zero2":
#: data_parallel and ZeRO-2 after expert_parallel, on 8 ranks
LAYOUTS = {
    "pp1 interleaved v4": (1, 1, 1, "interleaved", 2, 4, None),
    "pp2 gpipe": (2, 2, 1, "gpipe", 2, 1, None),
    "pp2 1f1b": (2, 2, 1, "1f1b", 2, 1, None),
    "pp2 1f1b m4": (2, 2, 1, "1f1b", 4, 1, None),
    "pp2 interleaved v2": (2, 2, 1, "interleaved", 4, 2, None),
    # stage 0 holds block 0 only (no MoE block, no side loss); the last stage holds two
    "pp2 1f1b cut 1": (2, 2, 1, "1f1b", 2, 1, [1]),
    "pp2xep2 1f1b": (4, 2, 2, "1f1b", 2, 1, None),
    "pp2xep2 gpipe": (4, 2, 2, "gpipe", 4, 1, None),
    "pp2xtp2 1f1b": (4, 2, 1, "1f1b", 2, 1, None),
    "pp2xep2xdp2+zero2 1f1b": (8, 2, 2, "1f1b", 2, 1, None),
    # the same composition through Colossal-AI's MoeHybridParallelPlugin mirror
    "moe_hybrid(pp2, ep2)": (4, 2, 2, "1f1b", 2, 1, None),
}


def build(layout, optim, *, loss_fn=moe_lm_loss):
    """``(step, state)`` of ``optim`` on the skewed MoE model under ``layout`` (None: one process):
    pipeline_split over ``pp``, then expert_parallel over ``ep``."""
    model = skewed_model()
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params)
    step = make_train_step(apply_fn, loss_fn, opt)
    state = init_state(params, buffers, opt)
    if layout is None:
        return step, state
    _, pp, ep, schedule, m, v, cuts = LAYOUTS[layout]
    if layout.startswith("moe_hybrid"):  # its own mesh: from_env(pp=, ep=, dp=-1, tp=1)
        return tuple(moe_hybrid(ep_size=ep, pp_size=pp, microbatches=m, pp_style=schedule)(
            step, state))
    tp = 2 if "xtp2" in layout else 1
    dp = 2 if "xdp2" in layout else 1
    mesh = DeviceMesh.from_env(pp=pp, ep=ep, dp=dp, tp=tp)
    transforms = [pipeline_split(mesh, microbatches=m, schedule=schedule, virtual_stages=v,
                                 cuts=cuts)]
    if tp > 1:
        transforms.append(shard_params(llama_rules_for(model.cfg), mesh))
    if ep > 1:
        transforms.append(expert_parallel(mesh))
    if dp > 1:  # after expert_parallel: ZeRO partitions the expert shards over dp
        transforms += [data_parallel(mesh), zero_partition(2, mesh)]
    return compose(*transforms)(step, state)


def _train(pairs, steps):
    out = {}
    for lay, optim in pairs:
        step, state = build(lay, optim)
        with comm.comm_log.capture() as recs:
            losses, params = run(step, state, batches()[:steps])
        out[(lay, optim)] = losses, params, {r.op for r in recs}
    return out


def _check(world, pairs, steps=10):
    """Each ``(layout, optimizer)``, ``steps`` steps: every rank's losses and its leaves (whole
    over ep) within TOL (default 1e-10) of one process, all leaves covered by the pp ranks
    together, and the one-process loss falling."""
    with one_thread():
        refs = {o: run(*build(None, o), batches()[:steps]) for o in {o for _, o in pairs}}
        assert routing_is_skewed() == (True, True)
        results = [_train(pairs, steps)] if world == 1 else run_ranks(
            _train, world, pairs, steps, timeout=900)
    for lay, o in pairs:
        ref_losses, ref_params = refs[o]
        tol = TOL.get(o, 1e-10)
        covered = set()
        for rank, res in enumerate(results):
            losses, params, ops = res[(lay, o)]
            err = max(loss_rel(losses, ref_losses),
                      max_rel(params, {n: ref_params[n] for n in params}))
            print(f"rank {rank} {lay} {o}: max rel err {err:.2e}")  # shown under pytest -s
            assert err <= tol, (rank, lay, o, err)
            assert (LAYOUTS[lay][2] > 1) == ("all_to_all" in ops), (rank, lay, o)
            covered |= set(params)
        assert covered == set(ref_params), (lay, o)
        assert ref_losses[-1] < ref_losses[0], o


def test_pipeline_stages_on_one_rank_add_every_stages_router_losses():
    # Four stages on one rank: the hand-overs are local, two stages hold no MoE block (one
    # of them the last) and two return side losses. 3 steps keep it cheap.
    _check(1, [("pp1 interleaved v4", "adamw")], steps=3)


def _amp(precision, piped):
    apply_fn, params, buffers = functionalize(skewed_model(torch.float32))
    opt = OPTIMIZERS["adamw_small_lr"](params)
    step = make_train_step(apply_fn, moe_lm_loss, opt)
    mesh = DeviceMesh.from_env(pp=1)
    transforms = [pipeline_split(mesh, microbatches=1, schedule="interleaved",
                                 virtual_stages=4)] if piped else []
    transforms.append(amp_cast(precision, mesh=mesh))
    return compose(*transforms)(step, init_state(params, buffers, opt))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pipeline_under_amp_equals_one_process_amp(precision):
    # 4 stages on one rank, one micro-batch: the same bf16/fp16 products as one process, the
    # side losses in float32 and scaled like the last stage's under fp16 (whose first two steps
    # overflow the initial scale and are skipped: both paths run). Parameters bit for bit; the
    # loss to float32 rounding (the pipeline adds the stages' parts in float64).
    with one_thread():
        one = run(*_amp(precision, False), batches()[:5])
        piped = run(*_amp(precision, True), batches()[:5])
    assert loss_rel(piped[0], one[0]) <= 1e-6
    assert all(torch.equal(piped[1][n], one[1][n]) for n in one[1])
    assert one[0][3] != one[0][1]  # it trained


def test_router_losses_of_equal_microbatches_average_to_the_full_batch():
    # Routing is per sequence, so micro-batching changes neither the routing nor the
    # capacity; the load-balancing loss is a mean over sequences and the z-loss a mean over
    # tokens, so the full batch's are the means of its equal micro-batches' (rounding only).
    # With unequal micro-batches they would not be: the pipeline requires equal ones.
    model = skewed_model()
    tokens = batches()[0][0]
    with one_thread(), torch.no_grad():
        full = model(tokens)
        parts = [model(t) for t in tokens.chunk(4)]
        uneven = [model(tokens[:2]), model(tokens[2:])]
    mean = torch.stack([p.router_loss for p in parts]).mean()
    torch.testing.assert_close(mean, full.router_loss, rtol=1e-14, atol=0)
    assert torch.equal(sum(p.tokens_per_expert for p in parts), full.tokens_per_expert)
    assert torch.equal(sum(p.dropped for p in parts), full.dropped)
    assert int(full.dropped.sum()) > 0  # the capacity drops tokens here
    assert abs(float((uneven[0].router_loss + uneven[1].router_loss) / 2
                     - full.router_loss)) > 1e-6


def test_pp2_gpipe_and_1f1b_match_one_process():
    _check(2, [("pp2 gpipe", "adamw"), ("pp2 1f1b", "came")])


def test_pp2_x_ep2_matches_one_process():
    _check(4, [("pp2xep2 1f1b", "adamw"), ("moe_hybrid(pp2, ep2)", "came")])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pp2_every_optimizer_schedules_and_cuts():
    _check(2, [("pp2 1f1b", o) for o in MATRIX_OPTIMIZERS]
           + [("pp2 1f1b m4", "adamw"), ("pp2 interleaved v2", "adamw"),
              ("pp2 1f1b cut 1", "came")])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pp2_x_ep2_every_optimizer():
    _check(4, [("pp2xep2 1f1b", o) for o in MATRIX_OPTIMIZERS] + [("pp2xep2 gpipe", "came")]
           + [("pp2xtp2 1f1b", o) for o in ("adamw", "came")])


def test_a_loss_that_does_not_add_the_router_loss_is_refused():
    def logits_only(out, targets):
        return lm_loss(out.logits, targets)

    with pytest.raises(ValueError, match=r"side losses .* loss_fn 'logits_only' .*extra_loss"):
        build("pp1 interleaved v4", "adamw", loss_fn=logits_only)


def test_a_stage_output_that_is_neither_hidden_states_nor_a_side_loss_is_refused():
    from funcpar.pipeline.stages import llama_stages

    apply_fn, params, buffers = functionalize(skewed_model())
    opt = OPTIMIZERS["adamw"](params)
    bad = dataclasses.replace(llama_stages(), hand_over=lambda module, x: (x.hidden, 0.0))
    step, state = pipeline_split(DeviceMesh.from_env(pp=1), microbatches=1, schedule="interleaved",
                                 virtual_stages=2, stages=bad)(
        make_train_step(apply_fn, moe_lm_loss, opt), init_state(params, buffers, opt))
    with pytest.raises(TypeError, match=r"stage 0 returned a tuple; .* or SideLoss\(hidden, 0-d"):
        step(state, batches()[0])



def _save_after(layout, optim, path, steps):
    from funcpar.state import save

    step, state = build(layout, optim)
    for batch in batches()[:steps]:
        state, _ = step(state, batch)
    save(state, path, step=step)


def _resume(layout, optim, path, steps):
    from funcpar.state import load

    step, like = build(layout, optim)
    return run(step, load(path, like, step=step), batches()[steps:])


@pytest.mark.slow
def test_checkpoint_of_pp2_x_ep2_resumes_in_one_process_and_on_pp2(tmp_path):
    """Saved after 5 steps under pp2 x ep2 (each leaf once, the experts whole from their ep
    shards); resumed for 5 more in one process and under pp2 without ep: both equal 10
    uninterrupted steps in one process (1e-10)."""
    from funcpar.state import load

    path = str(tmp_path / "ckpt")
    run_ranks(_save_after, 4, "pp2xep2 1f1b", "came", path, 5, timeout=900)
    with one_thread():
        ref_losses, ref_params = run(*build(None, "came"), batches())
        step, like = build(None, "came")
        runs = [run(step, load(path, like, step=step), batches()[5:])]
    runs += run_ranks(_resume, 2, "pp2 1f1b", "came", path, 5, timeout=900)
    for losses, params in runs:
        assert loss_rel(losses, ref_losses[5:]) <= 1e-10
        assert max_rel(params, {n: ref_params[n] for n in params}) <= 1e-10


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pp2_x_ep2_x_dp2_zero2_on_eight_ranks():
    _check(8, [("pp2xep2xdp2+zero2 1f1b", o) for o in ("adamw", "came")])
