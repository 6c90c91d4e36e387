"""shard_params(mode="2d"): 2D tensor parallelism (SUMMA) equals one process.

float64, 10 steps, on a 2 x 2 grid (4 gloo ranks): the example Llama (vocabulary 50, MLP width
42, GQA) and a plain MLP with biases, a LayerNorm and odd dims everywhere (uneven blocks, an
uneven batch of 9 rows), losses and whole parameters against one process (relative <= 1e-10;
measured <= 1e-13: the collectives only reorder sums). Every optimizer reduces through the
leaves' two-axis layouts, with no per-mode code. The errors are checked on virtual meshes.
"""

import pytest
import torch
from torch import nn

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import Rule, llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, loss_rel, max_rel
from funcpar.testing.tp_modes import MLP_RULES, PlainMLP, class_loss, train
from funcpar.train import make_train_step
from funcpar.transforms import shard_params

TOL = 1e-10
MATRIX = ["sgd", "adamw", "adafactor", "came", "lamb", "galore_adamw"]


def _runs(cases, **kw):
    return {(m, o): train(m, o, "2d", **kw) for m, o in cases}


def _check(cases, world, **kw):
    ref = {(m, o): train(m, o, None) for m, o in cases}
    results = run_ranks(_runs, world, cases, timeout=900, **kw)
    for rank, res in enumerate(results):
        for case, (losses, params) in res.items():
            assert loss_rel(losses, ref[case][0]) <= TOL, (rank, case)
            assert max_rel(params, ref[case][1]) <= TOL, (rank, case)
    for case in cases:  # the comparison is of training, not of a constant
        assert ref[case][0][-1] < ref[case][0][0], case


def test_2d_llama_and_mlp_adamw():
    _check([("llama", "adamw"), ("mlp", "adamw")], 4)


@pytest.mark.slow
def test_2d_every_optimizer():
    _check([(m, o) for m in ("llama", "mlp") for o in MATRIX], 4)


@pytest.mark.slow
def test_2d_x_dp2_zero2_8_ranks():
    _check([("llama", "adamw")], 8, dp=2, zero=2)


# ----------------------------------------------------------------------------------- errors
def _step(model, loss=lm_loss):
    apply_fn, params, buffers = functionalize(model)
    opt = fo.sgd(lr=0.1)
    return make_train_step(apply_fn, loss, opt), init_state(params, buffers, opt)


def _grid(**axes):
    return DeviceMesh.virtual(rank=0, **(axes or {"tp_row": 2, "tp_col": 2}))


def test_mesh_must_fit_the_mode():
    rules = llama_rules(CFG.head_dim)
    with pytest.raises(ValueError, match="needs mesh axes 'tp_row' and 'tp_col'"):
        shard_params(rules, _grid(tp=4), mode="2d")(*_step(Llama(CFG)))
    with pytest.raises(ValueError, match="square: tp_row=2 but tp_col=4"):
        shard_params(rules, _grid(tp_row=2, tp_col=4), mode="2d")(*_step(Llama(CFG)))
    with pytest.raises(ValueError, match=r"a 2.5D grid needs mesh axes \('tp_dep', 'tp_row'"):
        shard_params(rules, _grid(), mode="2.5d")(*_step(Llama(CFG)))
    with pytest.raises(ValueError, match="square: tp_row=2 but tp_col=1"):
        shard_params(rules, _grid(tp_dep=2, tp_row=2, tp_col=1), mode="2.5d")(
            *_step(Llama(CFG)))
    with pytest.raises(ValueError, match="one of"):
        shard_params(rules, _grid(), mode="4d")
    with pytest.raises(ValueError, match="sequence_parallel is a 1D mode option"):
        shard_params(rules, _grid(), mode="2d", sequence_parallel=True)


def test_parts_the_mode_cannot_place_are_named():
    moe = Llama(LlamaConfig(vocab_size=16, dim=16, n_layers=1, n_heads=4, n_experts=2))
    with pytest.raises(ValueError, match=r"cannot place 'layers.0.mlp.experts' \(Experts"):
        shard_params(llama_rules(4, dense_mlp=False), _grid(), mode="2d")(*_step(moe))
    tied = Llama(LlamaConfig(vocab_size=16, dim=16, n_layers=1, n_heads=4,
                             tie_embeddings=True))
    with pytest.raises(ValueError, match="tied to embed_tokens.weight"):
        shard_params(llama_rules(4), _grid(), mode="2d")(*_step(tied))
    with pytest.raises(ValueError, match="do not cut into whole heads over q=2"):
        one_kv = Llama(LlamaConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=1))
        shard_params(llama_rules(8), _grid(), mode="2d")(*_step(one_kv))
    with pytest.raises(ValueError, match="not known to keep to the 2D contract"):
        shard_params([Rule("1", "vocab_parallel")], _grid(), mode="2d")(
            *_step(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), class_loss))
    with pytest.raises(ValueError, match="needs the LM head"):
        shard_params([], _grid(), mode="2d")(*_step(PlainMLP(), class_loss))
    with pytest.raises(ValueError, match="must be token-mean cross-entropy"):
        shard_params(MLP_RULES, _grid(), mode="2d")(
            *_step(PlainMLP(), lambda out, y: out.mean()))
    with pytest.raises(ValueError, match="leaves a rank no entry"):
        shard_params(MLP_RULES, _grid(tp_row=3, tp_col=3), mode="2d")(
            *_step(PlainMLP(hidden=4), class_loss))


def test_2d_layouts_and_batch_rows():
    step, state = shard_params(llama_rules(CFG.head_dim), _grid(), mode="2d")(
        *_step(Llama(CFG).double()))
    lay = step.layouts
    # q_proj [32, 32]: out over tp_col, in over tp_row; the embedding and norms over both.
    assert lay["layers.0.self_attn.q_proj.weight"].dim_axes == (("tp_col",), ("tp_row",))
    assert lay["embed_tokens.weight"].local_shape() == (50, 8)
    assert lay["norm.weight"].local_shape() == (8,)
    assert state.params["lm_head.weight"].shape == (25, 16)
    with pytest.raises(ValueError, match="1 batch rows, fewer than tp_row=2"):
        step(state, (torch.zeros(1, 4, dtype=torch.long),) * 2)


# ------------------------------------------------------------------------------ plan report
def _both_models():
    from funcpar.testing.tp_modes import records_vs_plan

    return [records_vs_plan("2d", m) for m in ("llama", "mlp")]


def test_2d_measured_collectives_equal_the_plan():
    """Every collective of one step's forward and backward (all but the gradient norm's), op,
    axis, bytes and purpose, is the plan's; the MLP's uneven blocks and batch included."""
    for per_model in run_ranks(_both_models, 4, timeout=120):
        for got, want in per_model:
            assert got == want


# ----------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_train_lm_tp_mode_2d_matches_one_process(tmp_path):
    """``train_lm --tp 4 --tp-mode 2d`` (a 2 x 2 grid) on 4 ranks: the one-process losses and
    whole parameters (float64, 1e-10), saved whole."""
    from _examples import load_example
    from test_example import _rank_run, _small

    train_lm = load_example("train_lm.py", "train_lm")
    cache = tmp_path / "cache"
    steps = ["--dtype", "float64", "--print-every", "2", "--seq-len", "16", "--dim", "32",
             "--corpus-bytes", "100000", "--warmup", "1"]
    one = train_lm.main(_small(tmp_path / "one", cache, 4, *steps))
    argv = _small(tmp_path / "2d", cache, 4, *steps, "--tp", "4", "--tp-mode", "2d")
    for rank, res in enumerate(run_ranks(_rank_run, 4, argv, backend=None, timeout=300)):
        assert loss_rel(res["losses"], [r["loss"] for r in one["history"]]) <= TOL, rank
        assert max_rel(res["params"], one["params"]) <= TOL, rank


def test_train_lm_tp_mode_errors(capsys):
    from _examples import load_example

    train_lm = load_example("train_lm.py", "train_lm")
    for argv, msg in ((["--tp", "2", "--tp-mode", "2d"], "square q * q"),
                      (["--tp", "4", "--tp-mode", "3d"], "a cube q * q * q >= 8, got 4"),
                      (["--tp", "8", "--tp-mode", "2.5d", "--tp-depth", "3"],
                       "8 ranks do not split into depth 3"),
                      (["--tp", "4", "--tp-depth", "2"], "--tp-depth is for --tp-mode 2.5d"),
                      (["--tp", "4", "--tp-mode", "2d", "--sequence-parallel"],
                       "--sequence-parallel does not work with --tp-mode 2d")):
        with pytest.raises(SystemExit):
            train_lm.main(argv)
        assert msg in capsys.readouterr().err


# ------------------------------------------------------------------------------- the preset
def _preset_run():
    from funcpar.presets import hybrid_parallel
    from funcpar.testing.reference import OPTIMIZERS, batches, run

    torch.manual_seed(0)
    model = Llama(CFG).double()
    _, params, _ = functionalize(model)
    opt = OPTIMIZERS["adamw"](params)
    composed = hybrid_parallel(model, lm_loss, opt, tp_size=4, tp_mode="2d", donate=False)
    step, state = composed.step, composed.state
    assert step.layouts["lm_head.weight"].dim_axes == (("tp_col",), ("tp_row",))
    return run(step, state, batches())


@pytest.mark.slow
def test_hybrid_parallel_tp_mode_2d_matches_one_process():
    ref = train("llama", "adamw", None)
    for losses, params in run_ranks(_preset_run, 4, timeout=300):
        assert loss_rel(losses, ref[0]) <= TOL and max_rel(params, ref[1]) <= TOL


def test_hybrid_parallel_tp_mode_errors():
    from funcpar.presets import hybrid_parallel

    with pytest.raises(ValueError, match="square q \\* q >= 4, got 2"):
        hybrid_parallel(tp_size=2, tp_mode="2d")
    with pytest.raises(ValueError, match="does not compose with sequence_parallel"):
        hybrid_parallel(tp_size=4, tp_mode="2d", sequence_parallel=True)
    with pytest.raises(ValueError, match="a cube q \\* q \\* q >= 8, got 4"):
        hybrid_parallel(tp_size=4, tp_mode="3d")
    with pytest.raises(ValueError, match="tp_depth=2 is for tp_mode='2.5d'"):
        hybrid_parallel(tp_size=4, tp_depth=2)
    with pytest.raises(ValueError, match="tp_mode=.2d. \\(axes .* axis has 4 ranks"):
        hybrid_parallel(tp_size=4, tp_mode="2d", mesh=DeviceMesh.virtual(dp=1, tp=4))


def _eval_2d(mode):
    from funcpar.testing.tp_modes import build
    from funcpar.train import make_eval_step

    step, state, data = build("llama", "adamw", mode)
    x, y = data[0]
    y = y.clone()
    y[:, :3] = -100
    m = make_eval_step(step)(state, (x, y))
    return float(m["loss"]), int(m["tokens"])


@pytest.mark.slow
def test_evaluation_under_2d_equals_one_process():
    """make_eval_step of a 2D step (the SUMMA apply_fn and its grid loss) on ignored targets:
    one process's loss and token count on every rank."""
    loss, tokens = _eval_2d(None)
    for got, n in run_ranks(_eval_2d, 4, "2d", backend=None, timeout=180):
        assert n == tokens and abs(got - loss) <= 1e-13 * loss
