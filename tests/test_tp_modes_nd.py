"""shard_params(mode="2.5d" | "3d"): 2.5D (Tesseract) and 3D tensor parallelism equal one process.

float64, 10 steps, 8 gloo ranks: 2.5D on a 2 x 2 grid x depth 2 (``tp_dep x tp_row x
tp_col``), 3D on a 2 x 2 x 2 cube (``tp_in x tp_w x tp_out``), the example Llama and the plain
MLP (biases, a LayerNorm between two linears, so on the cube's second layout; odd dims, uneven
blocks; 9 batch rows under 2.5D, 12 under 3D, which cuts the rows into q² equal chunks), losses
and whole parameters against one process (relative <= 1e-10). Every optimizer reduces through
the leaves' three-axis layouts with no per-mode code. One step's collectives equal the plan's
exactly. The errors are checked on virtual meshes.
"""

import re

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
from funcpar.testing.tp_modes import MLP_RULES, PlainMLP, class_loss, records_vs_plan, train
from funcpar.train import make_train_step
from funcpar.transforms import shard_params
from funcpar.transforms.tp_modes import mode_axes

TOL = 1e-10
MATRIX = ["sgd", "adamw", "adafactor", "came", "lamb", "galore_adamw"]
#: Per mode, what build() needs: 2.5D at depth 2; 3D on 12 MLP rows (9 do not cut into 4).
KW = {"2.5d": {"depth": 2}, "3d": {"rows": 12}}


def _runs(cases):
    return {c: train(c[1], c[2], c[0], **KW[c[0]]) for c in cases}


def _check(cases):
    ref = {c: train(c[1], c[2], None, rows=KW[c[0]].get("rows", 9)) for c in cases}
    for rank, res in enumerate(run_ranks(_runs, 8, cases, timeout=1800)):
        for case, (losses, params) in res.items():
            assert loss_rel(losses, ref[case][0]) <= TOL, (rank, case)
            assert max_rel(params, ref[case][1]) <= TOL, (rank, case)
    for case in cases:  # the comparison is of training, not of a constant
        assert ref[case][0][-1] < ref[case][0][0], case


def test_2p5d_and_3d_mlp_adamw():
    _check([("2.5d", "mlp", "adamw"), ("3d", "mlp", "adamw")])


@pytest.mark.slow
def test_2p5d_every_optimizer():
    _check([("2.5d", m, o) for m in ("llama", "mlp") for o in MATRIX])


@pytest.mark.slow
def test_3d_every_optimizer():
    _check([("3d", m, o) for m in ("llama", "mlp") for o in MATRIX])


def _x_dp2_zero2():
    return {m: train("llama", "adamw", m, dp=2, zero=2, **KW[m]) for m in ("2.5d", "3d")}


@pytest.mark.slow
def test_2p5d_and_3d_x_dp2_zero2_16_ranks():
    """dp2 x (2.5D depth 2 | 3D), ZeRO-2 over dp, on 16 ranks: one process's Llama."""
    ref = train("llama", "adamw", None)
    for rank, res in enumerate(run_ranks(_x_dp2_zero2, 16, timeout=1800)):
        for mode, (losses, params) in res.items():
            assert loss_rel(losses, ref[0]) <= TOL, (rank, mode)
            assert max_rel(params, ref[1]) <= TOL, (rank, mode)


# ------------------------------------------------------------------------------ plan report
def _all_plans():
    return [records_vs_plan(mode, m, **KW[mode]) for mode in ("2.5d", "3d")
            for m in ("llama", "mlp")]


def test_2p5d_and_3d_measured_collectives_equal_the_plan():
    """Every collective of one step (all but the gradient norm's: op, axis, bytes, purpose),
    2.5D's gradient all-reduce over depth included, is the plan's, on every rank."""
    for per_case in run_ranks(_all_plans, 8, timeout=300):
        for got, want in per_case:
            assert got == want


# ----------------------------------------------------------------------------------- errors
def _step(model, loss=lm_loss):
    apply_fn, params, buffers = functionalize(model)
    opt = fo.sgd(lr=0.1)
    return make_train_step(apply_fn, loss, opt), init_state(params, buffers, opt)


def _cube(**axes):
    return DeviceMesh.virtual(rank=0, **(axes or {"tp_in": 2, "tp_w": 2, "tp_out": 2}))


def test_mesh_must_fit_the_mode():
    rules = llama_rules(CFG.head_dim)
    with pytest.raises(ValueError, match=r"a 3D cube needs mesh axes \('tp_in', 'tp_w', 'tp_out'"):
        shard_params(rules, _cube(tp_row=2, tp_col=2), mode="3d")(*_step(Llama(CFG)))
    with pytest.raises(ValueError, match="a 3D cube has equal sides"):
        shard_params(rules, _cube(tp_in=2, tp_w=2, tp_out=4), mode="3d")(*_step(Llama(CFG)))
    with pytest.raises(ValueError, match=r"a 2.5D grid needs mesh axes \('tp_dep'"):
        shard_params(rules, _cube(), mode="2.5d")(*_step(Llama(CFG)))
    assert mode_axes("2.5d", 8, 2) == {"tp_dep": 2, "tp_row": 2, "tp_col": 2}
    assert mode_axes("3d", 27) == {"tp_in": 3, "tp_w": 3, "tp_out": 3}
    for args, msg in ((("3d", 4), "a cube q \\* q \\* q >= 8, got 4"),
                      (("2.5d", 8, 3), "8 ranks do not split into depth 3"),
                      (("2.5d", 4, 2), "depth \\(2\\) \\* q \\* q with q >= 2, got 4"),
                      (("2d", 8, 2), "a depth \\(2\\) is for tp_mode='2.5d'")):
        with pytest.raises(ValueError, match=msg):
            mode_axes(*args)


class _Mixed(nn.Module):
    """Adds its input to a linear's output: the two are on different faces of the cube."""

    supports_tp_2d = True

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(x + self.fc(x))


def test_3d_refuses_what_it_cannot_place():
    with pytest.raises(ValueError, match="combines activations of both layouts"):
        shard_params([Rule("out", "vocab_parallel")], _cube(), mode="3d")(
            *_step(_Mixed(), class_loss))
    moe = Llama(LlamaConfig(vocab_size=16, dim=16, n_layers=1, n_heads=4, n_experts=2))
    with pytest.raises(ValueError, match=r"mode='3d' cannot place 'layers.0.mlp.experts'"):
        shard_params(llama_rules(4, dense_mlp=False), _cube(), mode="3d")(*_step(moe))
    with pytest.raises(ValueError, match="leaves a rank no entry"):
        shard_params(MLP_RULES, _cube(), mode="3d")(*_step(PlainMLP(hidden=6), class_loss))
    step, state = shard_params(llama_rules(CFG.head_dim), _cube(), mode="3d")(
        *_step(Llama(CFG).double()))
    with pytest.raises(ValueError, match="6 batch rows; 3D cuts them into q² = 4 equal"):
        step(state, (torch.zeros(6, 4, dtype=torch.long),) * 2)
    with pytest.raises(ValueError, match="3 batch rows, fewer than tp_dep=2 x tp_row=2"):
        step, state = shard_params(
            llama_rules(CFG.head_dim), _cube(tp_dep=2, tp_row=2, tp_col=2), mode="2.5d")(
            *_step(Llama(CFG).double()))
        step(state, (torch.zeros(3, 4, dtype=torch.long),) * 2)


def test_3d_layouts_follow_the_trace():
    """Llama: q/k/v, gate/up and the head read layout 0, o/down layout 1, norms layout 0; the
    MLP's LayerNorm sits between fc1 and fc2, on layout 1. Every parameter is 1/8 per rank."""
    from funcpar.transforms.tp_cube import plan_3d

    plan = plan_3d(Llama(CFG), llama_rules(CFG.head_dim), _cube())
    par = plan.parity
    assert [par[f"layers.0.{n}"] for n in ("self_attn.q_proj", "self_attn.o_proj",
                                           "mlp.up_proj", "mlp.down_proj",
                                           "post_attention_layernorm")] == [0, 1, 0, 1, 0]
    assert (par["norm"], par["lm_head"], plan.logits_parity) == (0, 0, 1)
    lay = plan.layouts
    assert lay["layers.0.self_attn.o_proj.weight"].dim_axes == (("tp_out", "tp_w"), ("tp_in",))
    assert lay["embed_tokens.weight"].local_shape() == (50, 4)
    assert lay["lm_head.weight"].local_shape() == (13, 16)
    released = Llama(CFG)
    functionalize(released, release=True)  # its own tensors on meta: the trace runs on fakes
    assert plan_3d(released, llama_rules(CFG.head_dim), _cube()).parity == par
    mlp = plan_3d(PlainMLP(), MLP_RULES, _cube())
    assert mlp.parity == {"fc1": 0, "norm": 1, "fc2": 1, "out": 0}
    assert mlp.layouts["norm.weight"].dim_axes == (("tp_in", "tp_w", "tp_out"),)


# ---------------------------------------------------------------------- the CLI and preset
@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--tp-mode", "2.5d", "--tp-depth", "2"],
                                  ["--tp-mode", "3d"]], ids=["2.5d", "3d"])
def test_train_lm_tp_modes_match_one_process(tmp_path, mode):
    """``train_lm --tp 8`` under 2.5D (depth 2) and 3D on 8 ranks: the one-process losses and
    whole parameters (float64, 1e-10)."""
    from _examples import load_example
    from test_example import _rank_run, _small

    train_lm = load_example("train_lm.py", "train_lm")
    cache = tmp_path / "cache"
    steps = ["--dtype", "float64", "--print-every", "2", "--seq-len", "16", "--dim", "32",
             "--corpus-bytes", "100000", "--warmup", "1"]
    one = train_lm.main(_small(tmp_path / "one", cache, 4, *steps))
    argv = _small(tmp_path / "nd", cache, 4, *steps, "--tp", "8", *mode)
    for rank, res in enumerate(run_ranks(_rank_run, 8, argv, backend=None, timeout=600)):
        assert loss_rel(res["losses"], [r["loss"] for r in one["history"]]) <= TOL, rank
        assert max_rel(res["params"], one["params"]) <= TOL, rank


def _preset_runs():
    from funcpar.presets import hybrid_parallel
    from funcpar.testing.reference import OPTIMIZERS, batches, run

    out = {}
    for mode, depth in (("2.5d", 2), ("3d", 1)):
        torch.manual_seed(0)
        model = Llama(CFG).double()
        _, params, _ = functionalize(model)
        opt = OPTIMIZERS["adamw"](params)
        composed = hybrid_parallel(model, lm_loss, opt, tp_size=8, tp_mode=mode,
                                   tp_depth=depth, donate=False)
        axes = composed.step.layouts["lm_head.weight"].dim_axes
        out[mode] = (axes, *run(composed.step, composed.state, batches()))
    return out


@pytest.mark.slow
def test_hybrid_parallel_tp_modes_2p5d_and_3d_match_one_process():
    ref = train("llama", "adamw", None)
    for res in run_ranks(_preset_runs, 8, timeout=600):
        assert res["2.5d"][0] == (("tp_col",), ("tp_row",))
        assert res["3d"][0] == (("tp_in", "tp_w"), ("tp_out",))
        for _, losses, params in res.values():
            assert loss_rel(losses, ref[0]) <= TOL and max_rel(params, ref[1]) <= TOL


# ------------------------------------------------------------------------------ checkpoints
def _save_after_three(root):
    from funcpar.shard.layout import unshard_tree
    from funcpar.state import save
    from funcpar.testing.tp_modes import build

    out = {}
    for mode in ("2.5d", "3d"):
        step, state, data = build("llama", "adafactor", mode, **KW[mode])
        for batch in data[:3]:
            state, _ = step(state, batch)
        save(state, f"{root}/{mode}", step=step)
        out[mode] = unshard_tree(state.params, step.layouts)
    return out


@pytest.mark.slow
def test_checkpoints_saved_under_2p5d_and_3d_load_in_one_process(tmp_path):
    """Saved after 3 Adafactor steps on 8 ranks, loaded into a one-process state: the gathered
    parameters exactly, and every optimizer leaf (factored rows and columns included) within
    float64 round-off of one process trained alike."""
    from funcpar.state import load
    from funcpar.state.tree import named_leaves
    from funcpar.testing.tp_modes import build

    res = run_ranks(_save_after_three, 8, str(tmp_path), backend=None, timeout=600)[0]
    step, ref, data = build("llama", "adafactor", None)
    for batch in data[:3]:
        ref, _ = step(ref, batch)
    for mode, whole in res.items():
        _, like, _ = build("llama", "adafactor", None)
        one = load(str(tmp_path / mode), like)
        for k, x in whole.items():
            assert torch.equal(one.params[k], x), (mode, k)
        for (n, x), (_, y) in zip(named_leaves(one.opt_state), named_leaves(ref.opt_state)):
            if torch.is_tensor(x) and x.is_floating_point():
                assert max_rel({n: x}, {n: y}) < 1e-10, (mode, n)
            elif torch.is_tensor(x):
                assert torch.equal(x, y), (mode, n)


def _evals():
    from funcpar.testing.tp_modes import build
    from funcpar.train import make_eval_step

    out = {}
    for mode in (None, "2.5d", "3d"):
        step, state, data = build("llama", "adamw", mode, **KW.get(mode, {}))
        x, y = data[0]
        y = y.clone()
        y[:, :3] = -100
        m = make_eval_step(step)(state, (x, y))
        out[mode] = (float(m["loss"]), int(m["tokens"]))
    return out


@pytest.mark.slow
def test_evaluation_under_2p5d_and_3d_equals_one_process():
    """make_eval_step of a 2.5D and a 3D step on ignored targets: one process's loss and
    token count on every rank."""
    for res in run_ranks(_evals, 8, backend=None, timeout=300):
        loss, tokens = res.pop(None)
        for mode, (got, n) in res.items():
            assert n == tokens and abs(got - loss) <= 1e-13 * loss, mode


def test_2p5d_and_3d_refuse_what_is_untested(capsys):
    """What only 2D is tested with (tests/test_tp_2d_compose.py) is refused under 2.5D and 3D,
    naming the mode: pipeline_split before shard_params (context_parallel after it, as under
    2D); train_lm's --pp, --precision, --remat,
    --compile, --zero 3, --preset; hybrid_parallel's pp_size, precision, zero_stage=3, plan."""
    from _examples import load_example

    from funcpar.presets import hybrid_parallel
    from funcpar.transforms import compose, context_parallel, pipeline_split

    rules = llama_rules(CFG.head_dim)
    for mode, axes in (("2.5d", {"tp_dep": 2, "tp_row": 2, "tp_col": 2}), ("3d", None)):
        mesh = DeviceMesh.virtual(rank=0, pp=2, **(axes or {"tp_in": 2, "tp_w": 2, "tp_out": 2}))
        with pytest.raises(ValueError, match=rf"shard_params\(mode='{mode}'\) under "
                                             "pipeline_split is not tested yet"):
            compose(pipeline_split(mesh, microbatches=2),
                    shard_params(rules, mesh, mode=mode))(*_step(Llama(CFG)))
    mesh = DeviceMesh.virtual(rank=0, cp=2, tp_in=2, tp_w=2, tp_out=2)
    step, state = shard_params(rules, mesh, mode="3d")(*_step(Llama(CFG)))
    with pytest.raises(ValueError, match=r"context_parallel and shard_params\(mode='3d'\) do "
                                         "not compose"):
        context_parallel(mesh)(step, state)
    train_lm = load_example("train_lm.py", "train_lm")
    for mode in (["--tp-mode", "2.5d", "--tp-depth", "2"], ["--tp-mode", "3d"]):
        name = mode[1]
        for argv, flag in ((["--pp", "2"], "--pp"), (["--precision", "bf16"], "--precision bf16"),
                           (["--remat", "1"], "--remat"), (["--compile"], "--compile"),
                           (["--zero", "3"], "--zero 3"), (["--preset", "hybrid"],
                                                           "--preset hybrid")):
            with pytest.raises(SystemExit):
                train_lm.parse_args(["--tp", "8", *mode, *argv])
            assert f"{flag} does not work with --tp-mode {name} yet" in capsys.readouterr().err
        train_lm.parse_args(["--tp", "8", *mode, "--zero", "2", "--dp", "2"])
    for kw, what in (({"pp_size": 2, "microbatches": 2}, "pp_size > 1"),
                     ({"precision": "bf16"}, "precision='bf16'"),
                     ({"zero_stage": 3}, "zero_stage=3"), ({"plan": True}, "plan=True")):
        for mode, depth in (("2.5d", 2), ("3d", 1)):
            with pytest.raises(ValueError, match=rf"tp_mode='{mode}' does not compose with "
                                                 rf"{re.escape(what)} yet"):
                hybrid_parallel(tp_size=8, tp_mode=mode, tp_depth=depth, **kw)
