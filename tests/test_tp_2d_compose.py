"""2D tensor parallelism (``shard_params(mode="2d")``, SUMMA on a 2 x 2 grid) composed with the
other transforms, against one process.

float64, 10 steps, the example Llama of funcpar.testing.reference (vocabulary 50, MLP width 42,
GQA), AdamW after a global clip, unless stated:

* remat (whole blocks): the one process's losses and parameters (relative <= 1e-10), and bit for
  bit the 2D run without remat (the recompute runs the same SUMMA panels in the same order);
* donation (``make_train_step(..., donate=True)``): bit for bit the undonated 2D run;
* amp_cast("bf16") and ("fp16") on the float32 model: within one-process bf16's (fp16's) own
  gap (its losses and parameters against the float32 run's), doubled, as
  tests/test_context_parallel.py (`slow`);
* accumulate_grads(2) (`slow`);
* pipeline_split pp2 (1f1b, 2 micro-batches; gpipe, 4 micro-batches with Adafactor) x 2D,
  8 ranks (`slow`): each stage's rank (i, j) hands its grid block to rank (i, j) of the next;
* data_parallel dp2 + ZeRO-1 and ZeRO-3 x 2D, 8 ranks (`slow`);
* compile=True: the whole step one compiled region (no graph break, one graph) under 2D, on the
  plain MLP of funcpar.testing.tp_modes (uneven blocks) with dynamo's ``eager`` backend
  (`slow`: the trace is most of the ~20 s);
* checkpoints (Adafactor with momentum: moments and factored statistics): saved under 2D,
  resumed under 2D bit for bit and loaded in one process; (`slow`) loaded under 1D tp2 x dp2 +
  ZeRO-2, and one process's loaded under 2D, each trained on to the one process's results;
* hybrid_parallel(tp_mode="2d"): its plan's collectives = one step's comm_log (4 ranks; dp2 +
  ZeRO-2 and ZeRO-3 + bf16 on 8, `slow`), pp_size=2 bit for bit the manual composition
  (`slow`); train_lm's checks, and (`slow`) ``--preset hybrid --plan --eval-every`` on 4 ranks
  and ``--pp 2 --tp 4 --tp-mode 2d`` on 8;
* context_parallel after 2D is refused naming both.

Measured (this CPU): every exact case <= 6e-14 relative to one process; bf16 losses 3.7e-5
from one-process bf16 against its own gap of 5.7e-5 to float32, parameters 3.5e-2 against
3.0e-2; fp16 2.7e-6 against 7.1e-6, parameters 4.6e-3 against 2.9e-3 (each SUMMA panel product
is added into a half-precision block: one rounding per panel where one process rounds its
single matmul once).
"""

from __future__ import annotations

import pytest
import torch

from funcpar.models import Llama, lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks, tp_modes
from funcpar.testing.reference import CFG, OPTIMIZERS, batches, loss_rel, max_rel, run
from funcpar.train import make_train_step
from funcpar.transforms import shard_params

TOL = 1e-10


def build(mode="2d", *, model="llama", optim="adamw", **kw):
    """``(step, state, batches)``: funcpar.testing.tp_modes.build, 2D and the Llama under AdamW
    unless told."""
    return tp_modes.build(model, optim, mode, **kw)


def train(mode="2d", **kw):
    """10 steps: (losses, whole params; a pipeline rank's own stages' leaves)."""
    return run(*build(mode, **kw))


def _close(got, want, tol=TOL):
    losses, params = got
    assert loss_rel(losses, want[0]) <= tol
    assert max_rel(params, {k: want[1][k] for k in params}) <= tol


def _same(got, want):
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


# ------------------------------------------------------------------ remat, donation, bf16
def _remat_donate():
    return train(), train(rematted=True, donate=True)


def test_2d_with_remat_and_donation_bit_for_bit():
    """remat and donation together: bit for bit the plain 2D run, which equals one process."""
    ref = train(None)
    for plain, both in run_ranks(_remat_donate, 4, timeout=600):
        _close(plain, ref)
        _same(both, plain)
    assert ref[0][-1] < ref[0][0]  # it trains


def _half():
    return {p: train(dtype=torch.float32, amp=p, optim="adamw_small_lr") for p in ("bf16",
                                                                                  "fp16")}


@pytest.mark.slow
def test_2d_bf16_and_fp16_within_their_own_gap():
    """amp_cast("bf16") and ("fp16", mesh=) after 2D (SUMMA panels, gathers and LayerNorm
    statistics in half precision; fp16's inf/nan check agreed over every axis): the float32
    model's losses and parameters against one-process bf16 (fp16) within twice one-process
    bf16's (fp16's) own distance to float32 training."""
    fp32 = train(None, dtype=torch.float32, optim="adamw_small_lr")
    ref, gap = {}, {}
    for p in ("bf16", "fp16"):
        ref[p] = train(None, dtype=torch.float32, amp=p, optim="adamw_small_lr")
        gap[p] = loss_rel(ref[p][0], fp32[0]), max_rel(ref[p][1], fp32[1])
        assert ref[p][0][-1] < ref[p][0][0]  # it trains
    for res in run_ranks(_half, 4, timeout=600):
        for p, (losses, params) in res.items():
            assert loss_rel(losses, ref[p][0]) <= 2 * gap[p][0], (p, losses, gap[p])
            assert max_rel(params, ref[p][1]) <= 2 * gap[p][1], (p, gap[p])


def _accumulated():
    return train(accumulate=2)


@pytest.mark.slow
def test_2d_with_accumulate_grads_equals_one_process():
    """accumulate_grads(2) before 2D (each micro-batch's rows cut over the grid rows)."""
    ref = train(None)
    for got in run_ranks(_accumulated, 4, timeout=600):
        _close(got, ref)


# ----------------------------------------------------------------- 8 ranks: pipeline, ZeRO
def _pp2():
    return {"1f1b m2": train(pp=2, microbatches=2),
            "gpipe m4 adafactor": train(pp=2, microbatches=4, schedule="gpipe",
                                        optim="adafactor")}


@pytest.mark.slow
def test_pp2_x_2d_equals_one_process():
    """pp2 x a 2 x 2 grid (8 ranks): every stage's leaves on every rank of its stage."""
    refs = {"1f1b m2": train(None), "gpipe m4 adafactor": train(None, optim="adafactor")}
    for res in run_ranks(_pp2, 8, timeout=900):
        for case, got in res.items():
            _close(got, refs[case])


def _zero(root):
    from funcpar.state import save

    out = {}
    for z in (1, 3):
        step, state, data = build(dp=2, zero=z)
        state, losses = _steps(step, state, data)
        save(state, f"{root}/zero{z}", step=step)
        out[z] = losses, _whole(step, state)
    return out


@pytest.mark.slow
def test_2d_x_dp2_zero1_and_zero3_equal_one_process(tmp_path):
    """10 steps, then a checkpoint of each (the 2D shards cut again over dp: three axes on a
    leaf) loaded in one process: every leaf the one process's (1e-10)."""
    from funcpar.state import load
    from funcpar.state.tree import named_leaves

    ref = train(None)
    for res in run_ranks(_zero, 8, str(tmp_path), backend=None, timeout=900):
        for got in res.values():
            _close(got, ref)
    step, state, data = build(None)
    state, _ = _steps(step, state, data)
    for z in (1, 3):
        one = load(tmp_path / f"zero{z}", build(None, seed=1)[1])
        for (n, x), (_, y) in zip(named_leaves(one), named_leaves(state)):
            if torch.is_tensor(x) and x.is_floating_point() and y.abs().max() > 0:
                assert max_rel({n: x}, {n: y}) <= TOL, (z, n)


# ------------------------------------------------------------------------------- compile
def _compiled():
    from torch._dynamo.utils import counters

    import funcpar.train.whole_step as whole_step

    whole_step.BACKEND = "eager"  # dynamo's capture without code generation
    torch._dynamo.reset()
    counters.clear()
    step, state, data = build(model="mlp", compile=True)
    out = run(step, state, data)
    return out, dict(counters["graph_break"]), counters["stats"]["unique_graphs"], \
        step._whole is not None


@pytest.mark.slow
def test_2d_whole_step_compile_equals_one_process():
    """compile=True under 2D: one compiled region (the broadcasts and reduce-scatters of SUMMA
    traced in as functional collectives), no graph break, one graph for the 10 steps; the one
    process's losses and parameters (the MLP: uneven blocks, an uneven batch)."""
    ref = train(None, model="mlp")
    for got, breaks, graphs, whole in run_ranks(_compiled, 4, timeout=900):
        assert whole and breaks == {} and graphs == 1, (whole, breaks, graphs)
        _close(got, ref)


# ---------------------------------------------------------------------------- checkpoints
# Adafactor with momentum: moments of the parameters' shape and factored row/column statistics
# (a dim dropped: replicated over the grid axis that split it), saved under the 2D layouts.
CKPT_OPT = "adafactor_momentum"
HALF = 3


def _steps(step, state, data):
    losses = []
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return state, losses


def _whole(step, state):
    from funcpar.shard.layout import unshard_tree

    return state.params if step.layouts is None else unshard_tree(state.params, step.layouts)


def _save_2d(root):
    """2D: 6 steps straight; 3 steps, save, load into a fresh 2D state of another init, 3."""
    from funcpar.state import load, save

    step, state, data = build(optim=CKPT_OPT)
    straight, losses = _steps(step, state, data[:2 * HALF])
    step, state, _ = build(optim=CKPT_OPT)
    state, _ = _steps(step, state, data[:HALF])
    at_save = _whole(step, state)
    save(state, f"{root}/2d", step=step)
    step2, like, _ = build(optim=CKPT_OPT, seed=1)
    resumed, more = _steps(step2, load(f"{root}/2d", like, step=step2), data[HALF:2 * HALF])
    return losses, _whole(step, straight), at_save, more, _whole(step2, resumed)


def test_checkpoint_saved_under_2d_loads_in_one_process(tmp_path):
    """Saved under 2D (4 ranks): resumed under 2D bit for bit; loaded in one process, the
    parameters are the 2D run's bit for bit, every optimizer leaf (moments, factored
    statistics) the one process's at that step (1e-10: another summation order), and 3 more
    steps give the 2D run's losses and parameters (1e-10)."""
    from funcpar.state import load
    from funcpar.state.tree import named_leaves

    ranks = run_ranks(_save_2d, 4, str(tmp_path), backend=None, timeout=600)
    losses, straight, at_save, _, _ = ranks[0]
    for r in ranks:
        assert r[3] == losses[HALF:]
        assert all(torch.equal(r[4][k], straight[k]) for k in straight)
    step, like, data = build(None, optim=CKPT_OPT, seed=1)
    one = load(tmp_path / "2d", like)
    assert all(torch.equal(one.params[k], at_save[k]) for k in at_save)
    ref_step, ref, _ = build(None, optim=CKPT_OPT)
    ref, _ = _steps(ref_step, ref, data[:HALF])
    assert int(one.step) == HALF and torch.equal(one.rng, ref.rng)
    for (n, x), (_, y) in zip(named_leaves(one.opt_state), named_leaves(ref.opt_state)):
        if torch.is_tensor(x) and x.is_floating_point():
            assert max_rel({n: x}, {n: y}) <= TOL, n
        else:
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y, n
    one, more = _steps(step, one, data[HALF:2 * HALF])
    _close((more, one.params), (losses[HALF:], straight))


def _load_elsewhere(root):
    """The 2D checkpoint under 1D tp2 x dp2 + ZeRO-2, and a one-process one under 2D: 3 more
    steps each."""
    from funcpar.state import load
    from funcpar.testing.reference import build as build_1d

    step, like = build_1d(2, 2, CKPT_OPT, zero=2)
    state, losses_1d = _steps(step, load(f"{root}/2d", like, step=step), batches()[HALF:2 * HALF])
    out = {"1d": (losses_1d, _whole(step, state))}
    step, like, data = build(optim=CKPT_OPT, seed=1)
    state, losses = _steps(step, load(f"{root}/one", like, step=step), data[HALF:2 * HALF])
    out["2d"] = (losses, _whole(step, state))
    return out


@pytest.mark.slow
def test_checkpoint_2d_to_tp2_dp2_zero2_and_one_process_to_2d(tmp_path):
    """The 2D checkpoint loaded under 1D tp2 x dp2 + ZeRO-2, and one process's loaded under
    2D: 3 more steps each give the uninterrupted one-process run (1e-10)."""
    from funcpar.state import save

    run_ranks(_save_2d, 4, str(tmp_path), backend=None, timeout=600)
    step, state, data = build(None, optim=CKPT_OPT)
    state, _ = _steps(step, state, data[:HALF])
    save(state, tmp_path / "one")
    state, more = _steps(step, state, data[HALF:2 * HALF])
    for res in run_ranks(_load_elsewhere, 4, str(tmp_path), backend=None, timeout=600):
        for case, got in res.items():
            assert loss_rel(got[0], more) <= TOL, case
            assert max_rel(got[1], state.params) <= TOL, case


# ---------------------------------------------------------------------------- preset plan
BATCH = (8, 12)  # reference.batches(): 8 sequences of 12 tokens


def _hybrid_2d(dtype=torch.float64, **kw):
    import funcpar.optim as fo
    from funcpar.presets import hybrid_parallel

    torch.manual_seed(0)
    # reference.OPTIMIZERS["adamw"] is chain(clip_by_global_norm(0.5), this): max_norm=0.5.
    return hybrid_parallel(Llama(CFG).to(dtype), lm_loss, fo.adamw(lr=1e-2, weight_decay=0.1),
                           tp_size=4, tp_mode="2d", max_norm=0.5, batch_shape=BATCH,
                           donate=False, **kw)


def _plan_check(composed):
    """(measured, planned, printed plan): per (op, axis) the count and bytes of one step; the
    plan's parameter bytes are checked against the state's here."""
    from funcpar.shard.comm import comm_log, summarize

    with comm_log.capture() as recs:
        composed.step(composed.state, batches()[0])
    measured = {(s.op, s.axis): (s.count, s.nbytes) for s in summarize(recs)}
    held = sum(x.numel() * x.element_size() for x in composed.state.params.values())
    assert composed.plan.memory.params == held  # the 2D shards' bytes
    return measured, composed.plan.comm_totals(), str(composed.plan)


def _preset_plans():
    return {"fp64": _plan_check(_hybrid_2d()),
            "bf16": _plan_check(_hybrid_2d(torch.float32, precision="bf16"))}


def test_hybrid_parallel_2d_plan_equals_comm_log():
    """hybrid_parallel(tp_size=4, tp_mode="2d")'s plan: per (op, axis) the count and bytes of
    one step's collectives as measured (the SUMMA panels and partials, the gathers, the norm
    statistics and the loss's, the gradient norm's), in float64 and under bf16 (whose RMSNorm
    statistics and loss sums travel in float32)."""
    for res in run_ranks(_preset_plans, 4, backend=None, timeout=600):
        for name, (measured, planned, text) in res.items():
            assert measured == planned, (name, measured, planned)
            assert ("broadcast", "tp_col") in planned and "2d: SUMMA weight panels" in text


# ----------------------------------------------------------------------------------- the CLI
def test_train_lm_2d_composes_or_refuses(capsys):
    """--pp, --zero, --remat, --precision, --compile and --preset hybrid pass the checks with
    --tp-mode 2d; what 2D does not compose with is refused naming the flag. (--auto with
    --tp-mode 2d pins the grid: tests/test_auto.py.)"""
    from _examples import load_example

    train_lm = load_example("train_lm.py", "train_lm")
    base = ["--tp", "4", "--tp-mode", "2d"]
    for ok in (["--pp", "2"], ["--zero", "3", "--remat", "1", "--precision", "bf16"],
               ["--compile"], ["--preset", "hybrid", "--plan"]):
        train_lm.parse_args(base + ok)
    for argv, msg in ((["--cp", "2"], "--cp does not work with --tp-mode 2d"),
                      (["--preset", "zero"], "--preset zero does not work with --tp-mode 2d"),
                      (["--experts", "2"], "--experts does not work with --tp-mode 2d"),
                      (["--pp", "2", "--batch-size", "4", "--microbatches", "4"],
                       "a micro-batch has 1")):
        with pytest.raises(SystemExit):
            train_lm.parse_args(base + argv)
        assert msg in capsys.readouterr().err, argv


def _cli_rank(argv):
    import contextlib
    import io

    from _examples import load_example

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        res = load_example("train_lm.py", "train_lm").main(argv)
    return [h["loss"] for h in res["history"]], [e["loss"] for e in res["evals"]], \
        out.getvalue()


@pytest.mark.slow
def test_train_lm_preset_hybrid_2d_plan_eval_and_losses(tmp_path):
    """``train_lm --preset hybrid --tp 4 --tp-mode 2d --plan --eval-every 2`` on 4 ranks: the
    printed plan lists the SUMMA collectives, and the run gives the one-process training and
    evaluation losses (float64, 1e-10)."""
    from _examples import load_example
    from test_example import _small

    train_lm = load_example("train_lm.py", "train_lm")
    cache = tmp_path / "cache"
    steps = ["--dtype", "float64", "--print-every", "2", "--seq-len", "16", "--dim", "32",
             "--corpus-bytes", "100000", "--warmup", "1", "--eval-every", "2",
             "--eval-batches", "1"]
    one = train_lm.main(_small(tmp_path / "one", cache, 4, *steps))
    argv = _small(tmp_path / "2d", cache, 4, *steps, "--tp", "4", "--tp-mode", "2d",
                  "--preset", "hybrid", "--plan")
    res = run_ranks(_cli_rank, 4, argv, backend=None, timeout=600)
    assert "2d: SUMMA weight panels" in res[0][2]
    for losses, evals, _ in res:
        assert loss_rel(losses, [h["loss"] for h in one["history"]]) <= TOL
        assert len(evals) == 2 and loss_rel(evals, [e["loss"] for e in one["evals"]]) <= TOL


def _eight_presets():
    return {"dp2+zero2": _plan_check(_hybrid_2d(zero_stage=2)),
            "dp2+zero3+bf16": _plan_check(_hybrid_2d(torch.float32, zero_stage=3,
                                                     precision="bf16")),
            "pp2": (train(pp=2, microbatches=2),
                    run(*_hybrid_2d(pp_size=2, microbatches=2), batches()))}


@pytest.mark.slow
def test_hybrid_parallel_2d_on_8_ranks():
    """hybrid_parallel(tp_size=4, tp_mode="2d") with dp2 + ZeRO-2 and dp2 + ZeRO-3 + bf16: the
    plan's collectives as measured; with pp_size=2: bit for bit the manual pp2 x 2D
    composition."""
    for res in run_ranks(_eight_presets, 8, backend=None, timeout=900):
        for name in ("dp2+zero2", "dp2+zero3+bf16"):
            measured, planned, _ = res[name]
            assert measured == planned, (name, measured, planned)
        _same(*res["pp2"])


def test_context_parallel_after_2d_is_refused():
    from funcpar.transforms import context_parallel

    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG).double())
    opt = OPTIMIZERS["sgd"](params)
    mesh = DeviceMesh.virtual(rank=0, cp=2, tp_row=2, tp_col=2)
    step, state = shard_params(llama_rules(CFG.head_dim), mesh, mode="2d")(
        make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt))
    with pytest.raises(ValueError, match=r"context_parallel and shard_params\(mode='2d'\) do "
                                         "not compose"):
        context_parallel(mesh)(step, state)


@pytest.mark.slow
def test_train_lm_pp2_x_2d_matches_one_process(tmp_path):
    """``train_lm --pp 2 --tp 4 --tp-mode 2d`` on 8 ranks (mesh pp x dp x tp x tp_row x
    tp_col, 4 micro-batches of 2 rows): the one-process losses (float64, 1e-10)."""
    from _examples import load_example
    from test_example import _small

    train_lm = load_example("train_lm.py", "train_lm")
    cache = tmp_path / "cache"
    steps = ["--dtype", "float64", "--print-every", "2", "--seq-len", "16", "--dim", "32",
             "--corpus-bytes", "100000", "--warmup", "1"]
    one = train_lm.main(_small(tmp_path / "one", cache, 4, *steps))
    argv = _small(tmp_path / "pp2d", cache, 4, *steps, "--pp", "2", "--tp", "4", "--tp-mode",
                  "2d")
    for losses, _, _ in run_ranks(_cli_rank, 8, argv, backend=None, timeout=900):
        assert loss_rel(losses, [h["loss"] for h in one["history"]]) <= TOL
