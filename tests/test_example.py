"""examples/train_lm.py runs in-process: the loss falls, the logs are written, and bad flags
fail clearly; under tp x dp on 4 ranks it trains exactly like one process."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
from _examples import load_example

from funcpar.testing import run_ranks

train_lm = load_example("train_lm.py", "train_lm")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets_cache")


def _small(tmp_path: Path, data_cache: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--steps", str(steps), "--batch-size", "8", "--seq-len", "64", "--dim", "64",
        "--layers", "2", "--heads", "4", "--warmup", "5", "--device", "cpu",
        "--corpus-bytes", "400000", "--data-cache", str(data_cache),
        "--logdir", str(tmp_path / "tb"), "--metrics-jsonl", str(tmp_path / "metrics.jsonl"),
        *extra,
    ]


def test_thirty_steps_learn_and_log(tmp_path, data_cache, capsys):
    out = train_lm.main(_small(tmp_path, data_cache, 30))
    history = out["history"]
    assert len(history) == 30
    # ln(256) = 5.55 at init; byte-level Python source is learnt fast. The mean of the last
    # five steps (not one noisy batch) must be clearly lower than the first loss.
    late = sum(r["loss"] for r in history[-5:]) / 5
    assert out["first_loss"] > 5.0
    assert late < out["first_loss"] - 1.0, (out["first_loss"], late)
    assert int(out["state"].step) == 30

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(r)
        assert all(math.isfinite(r[k]) for k in ("loss", "lr", "grad_norm", "tokens_per_s"))
    # Warm-up: the lr rises over the first 5 steps, then decays.
    lrs = [r["lr"] for r in rows]
    assert lrs[0] < lrs[4] and lrs[-1] < lrs[5]
    # --nonfinite skip (the default) guards every step; none was skipped here.
    assert int(out["state"].extras["skipped_steps"]) == 0 and "skipped" in history[-1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"} <= tags
    assert len(acc.Scalars("train/loss")) == 30
    assert "loss first" in capsys.readouterr().out


def test_unknown_optimizer_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        train_lm.main(["--optim", "adamm"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'adamm'" in err and "adamw" in err and "sgd" in err


def test_unavailable_optimizer_names_what_is_missing(monkeypatch, tmp_path, data_cache):
    monkeypatch.setitem(train_lm.OPTIMIZERS, "future",
                        train_lm.OptimSpec("not_written_yet", "future", lambda a, p: {}, 1e-3))
    with pytest.raises(SystemExit, match="funcpar.optim.not_written_yet.future is not available"):
        train_lm.main(_small(tmp_path, data_cache, 2, "--optim", "future", "--warmup", "1"))


def test_missing_corpus_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        train_lm.main(["--corpus", str(missing), "--logdir", str(tmp_path / "tb")])


def test_default_warmup_follows_the_run_and_an_explicit_one_is_checked(capsys):
    # 10% of --steps, at most 20: a 5-step smoke run needs no other flag.
    assert [train_lm.parse_args(["--steps", str(n)]).warmup for n in (5, 50, 1000)] == [0, 5, 20]
    assert train_lm.parse_args(["--steps", "5", "--warmup", "4"]).warmup == 4
    with pytest.raises(SystemExit):
        train_lm.main(["--steps", "10", "--warmup", "10"])
    assert "--warmup (10) must be in [0, --steps (10))" in capsys.readouterr().err


def test_bad_flags(capsys):
    with pytest.raises(SystemExit):
        train_lm.main(["--dim", "0"])
    assert "--dim must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(train_lm.OPTIMIZERS))
def test_every_registered_optimizer_runs(name, tmp_path, data_cache):
    """Each registry entry whose module exists builds and takes finite steps (the entries of
    optimizers not written yet are skipped, not failed)."""
    spec = train_lm.OPTIMIZERS[name]
    module = pytest.importorskip(f"funcpar.optim.{spec.module}")
    if not hasattr(module, spec.name):
        pytest.skip(f"funcpar.optim.{spec.module} has no {spec.name} yet")
    out = train_lm.main(_small(tmp_path, data_cache, 3, "--optim", name, "--warmup", "1"))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in out["history"])


def _rank_run(argv: list[str]) -> dict:
    """One rank of the example (run_ranks sets the torchrun environment; the script builds its
    own mesh and process group): its losses, whole parameters and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        res = train_lm.main(argv)
    return {"losses": [r["loss"] for r in res["history"]], "params": res["params"],
            "stdout": out.getvalue()}


def test_tp2_dp2_on_four_ranks_matches_one_process(tmp_path, data_cache):
    """``--tp 2 --dp 2`` on 4 ranks gives the one-process losses and final (whole) parameters.

    float64: the collectives only reorder sums, so the two runs differ by rounding (~1e-15
    relative per op); 1e-10 leaves room for 6 steps of AdamW on it, and a wrong reduction
    (a missing all-reduce, a double-counted shard) is off by O(1).
    """
    steps = ["--dtype", "float64", "--print-every", "2"]
    one = train_lm.main(_small(tmp_path / "one", data_cache, 6, *steps))
    ref_losses = [r["loss"] for r in one["history"]]
    argv = _small(tmp_path / "tpdp", data_cache, 6, *steps, "--tp", "2", "--dp", "2",
                  "--comm-report", "--save", str(tmp_path / "tpdp" / "params.pt"))
    results = run_ranks(_rank_run, 4, argv, backend=None, timeout=120)

    assert ref_losses[-1] < ref_losses[0] - 0.5  # it trained: the comparison is not of constants
    for rank, res in enumerate(results):
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses))
        assert len(res["losses"]) == 6 and rel <= 1e-10, (rank, rel)
        assert set(res["params"]) == set(one["params"])
        for name, ref in one["params"].items():
            got = res["params"][name]
            assert got.shape == ref.shape, (rank, name)  # whole, not a shard
            err = float((got - ref).abs().max() / ref.abs().max())
            assert err <= 1e-10, (rank, name, err)

    printed = results[0]["stdout"]
    assert "dp 2 x tp 2" in printed and "loss first" in printed
    # The comm report: a table for step 1 with tp all-reduces (activations) and the dp gradient
    # all-reduce, and the per-step byte total of the whole run.
    assert "step 1 (" in printed and "step 2 (" not in printed
    assert "all_reduce      tp" in printed and "all_reduce      dp" in printed
    assert "dp grads" in printed and "o_proj: output" in printed
    assert "all 6 steps:" in printed
    assert all(res["stdout"] == "" for res in results[1:])  # only rank 0 prints
    # Only rank 0 logs, and what it logged is the one-process run's.
    rows = [json.loads(line) for line in
            (tmp_path / "tpdp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert list((tmp_path / "tpdp" / "tb").glob("events.out.tfevents.*"))
    saved = torch.load(tmp_path / "tpdp" / "params.pt")
    assert all(torch.equal(saved[k], results[0]["params"][k]) for k in saved)


def test_zero3_and_sequence_parallel_on_four_ranks_match_one_process(tmp_path, data_cache):
    """``--tp 2 --dp 2 --zero 3 --sequence-parallel``: the same training as one process."""
    steps = ["--dtype", "float64", "--print-every", "2"]
    one = train_lm.main(_small(tmp_path / "one", data_cache, 6, *steps))
    ref_losses = [r["loss"] for r in one["history"]]
    argv = _small(tmp_path / "z3", data_cache, 6, *steps, "--tp", "2", "--dp", "2",
                  "--zero", "3", "--sequence-parallel", "--comm-report")
    for rank, res in enumerate(run_ranks(_rank_run, 4, argv, backend=None, timeout=120)):
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses))
        assert len(res["losses"]) == 6 and rel <= 1e-10, (rank, rel)
        for name, ref in one["params"].items():
            err = float((res["params"][name] - ref).abs().max() / ref.abs().max())
            assert err <= 1e-10, (rank, name, err)
        if rank == 0:  # parameters gathered for the forward, gradients reduce-scattered
            assert "zero3 param gather" in res["stdout"] and "zero grad" in res["stdout"]


@pytest.mark.slow
def test_cp2_with_tp2_and_dp2_on_four_ranks_match_one_process(tmp_path, data_cache):
    """``--cp 2`` (ring) with ``--tp 2`` and (Ulysses, through the hybrid preset) with
    ``--dp 2 --zero 2``: the one-process losses and parameters (float64, 1e-10)."""
    steps = ["--dtype", "float64", "--print-every", "2", "--kv-heads", "2", "--warmup", "2"]
    one = train_lm.main(_small(tmp_path / "one", data_cache, 4, *steps))
    ref_losses = [r["loss"] for r in one["history"]]
    ref_rows = [json.loads(line) for line in
                (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    for name, flags in (("cptp", ["--cp", "2", "--tp", "2"]),
                        ("cpdp", ["--cp", "2", "--cp-mode", "ulysses", "--dp", "2",
                                  "--zero", "2", "--preset", "hybrid"])):
        argv = _small(tmp_path / name, data_cache, 4, *steps, *flags)
        for rank, res in enumerate(run_ranks(_rank_run, 4, argv, backend=None, timeout=180)):
            rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses))
            assert len(res["losses"]) == 4 and rel <= 1e-10, (name, rank, rel)
            for leaf, ref in one["params"].items():
                err = float((res["params"][leaf] - ref).abs().max() / ref.abs().max())
                assert err <= 1e-10, (name, rank, leaf, err)
            if rank == 0:
                assert "cp 2 (" in res["stdout"], res["stdout"]
        rows = [json.loads(line) for line in
                (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        # The logged loss is the global batch's (tokens/s divides the global batch's tokens,
        # loader.tokens_per_batch, by the step's time, as in one process).
        for got, ref in zip(rows, ref_rows, strict=True):
            assert abs(got["loss"] - ref["loss"]) <= 1e-10 * abs(ref["loss"])
            assert set(got) == set(ref)


def _rel_losses(got, ref):
    assert len(got) == len(ref), (len(got), len(ref))
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


@pytest.mark.slow
def test_cp2_pp2_trains_evaluates_and_checkpoints_like_one_process(tmp_path, data_cache):
    """``--cp 2 --pp 2`` (4 ranks): the one-process losses, evaluation and parameters (float64,
    1e-10); its step-2 checkpoint resumes in one process onto the same steps 3-4, and the
    one-process step-2 checkpoint resumes under ``--cp 2`` (ulysses) onto them too."""
    steps = ["--dtype", "float64", "--print-every", "2", "--kv-heads", "2", "--warmup", "2",
             "--eval-every", "2", "--eval-batches", "2", "--save-every", "2"]
    one = train_lm.main(_small(tmp_path / "one", data_cache, 4, *steps,
                               "--ckpt-dir", str(tmp_path / "one_ckpt")))
    ref_losses = [r["loss"] for r in one["history"]]
    ref_rows = [json.loads(line) for line in
                (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    ckpt = tmp_path / "cppp_ckpt"
    argv = _small(tmp_path / "cppp", data_cache, 4, *steps, "--cp", "2", "--pp", "2",
                  "--ckpt-dir", str(ckpt))
    merged = {}
    for rank, res in enumerate(run_ranks(_rank_run, 4, argv, backend=None, timeout=300)):
        assert _rel_losses(res["losses"], ref_losses) <= 1e-10, rank
        merged.update(res["params"])
    assert set(merged) == set(one["params"])
    for name, ref in one["params"].items():
        err = float((merged[name] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-10, (name, err)
    rows = [json.loads(line) for line in
            (tmp_path / "cppp" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["eval_loss"], g["eval_loss"]) for r, g in zip(ref_rows, rows) if "eval_loss" in r]
    assert len(evals) == 2 and all(abs(a - b) <= 1e-10 * abs(a) for a, b in evals), evals

    # cp2 x pp2's checkpoint, resumed in one process.
    resumed = train_lm.main(_small(tmp_path / "one_resumed", data_cache, 4, *steps[:12],
                                   "--resume", str(ckpt / "step_00000002")))
    assert _rel_losses([r["loss"] for r in resumed["history"]], ref_losses[2:]) <= 1e-10
    # The one-process checkpoint, resumed under cp2.
    argv = _small(tmp_path / "cp_resumed", data_cache, 4, *steps[:12], "--cp", "2",
                  "--cp-mode", "ulysses", "--resume", str(tmp_path / "one_ckpt" / "step_00000002"))
    for rank, res in enumerate(run_ranks(_rank_run, 2, argv, backend=None, timeout=300)):
        assert _rel_losses(res["losses"], ref_losses[2:]) <= 1e-10, rank
        for name, ref in one["params"].items():
            err = float((res["params"][name] - ref).abs().max() / ref.abs().max())
            assert err <= 1e-10, (rank, name, err)


def test_pp2_interleaved_on_two_ranks_matches_one_process(tmp_path, data_cache):
    """``--pp 2 --schedule interleaved`` (4 stages of one block, 4 micro-batches): the one-process
    losses on every rank, and between them the ranks hold the whole, trained parameters."""
    steps = ["--dtype", "float64", "--print-every", "2", "--layers", "4"]
    one = train_lm.main(_small(tmp_path / "one", data_cache, 6, *steps))
    ref_losses = [r["loss"] for r in one["history"]]
    argv = _small(tmp_path / "pp", data_cache, 6, *steps, "--pp", "2", "--schedule",
                  "interleaved", "--microbatches", "4", "--comm-report")
    results = run_ranks(_rank_run, 2, argv, backend=None, timeout=120)
    merged = {}
    for rank, res in enumerate(results):
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses))
        assert len(res["losses"]) == 6 and rel <= 1e-10, (rank, rel)
        merged.update(res["params"])
    assert set(merged) == set(one["params"])
    for name, ref in one["params"].items():
        err = float((merged[name] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-10, (name, err)
    printed = results[0]["stdout"]
    assert "pp 2 (interleaved, 4 micro-batches)" in printed
    assert "send            pp" in printed and "recv            pp" in printed


def _rank_runs(argvs: list[list[str]]) -> list[dict]:
    return [_rank_run(argv) for argv in argvs]


def test_pp2_checkpoint_resumes_on_pp2_and_in_one_process(tmp_path, data_cache):
    """``--pp 2 --save-every 3``: resumed from the step-3 checkpoint, pp2 repeats the straight
    run's steps 4-6 bit for bit (the same computation from the same bits), and one process
    loads the same checkpoint (each leaf once, under its global name) and trains on to the
    same losses up to float64 rounding (micro-batched gradients and the norm summed per stage
    only reorder sums; 1e-10 as the pp2 comparison above)."""
    common = ["--dtype", "float64", "--print-every", "3", "--optim", "adafactor"]
    ckpt = tmp_path / "ckpt"
    straight = _small(tmp_path / "pp", data_cache, 6, *common, "--pp", "2", "--save-every",
                      "3", "--ckpt-dir", str(ckpt))
    resumed = _small(tmp_path / "pp_resumed", data_cache, 6, *common, "--pp", "2",
                     "--resume", str(ckpt / "step_00000003"))
    (a0, b0), (a1, b1) = run_ranks(_rank_runs, 2, [straight, resumed], backend=None,
                                   timeout=240)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003", "step_00000006"]
    assert a0["losses"] == a1["losses"] and len(a0["losses"]) == 6  # on every rank
    assert b0["losses"] == b1["losses"] == a0["losses"][3:]
    assert "resumed from" in b0["stdout"] and "at step 3" in b0["stdout"]
    for name in a0["params"].keys() | a1["params"].keys():  # each rank: its stage's leaves
        mine = a0["params"] if name in a0["params"] else a1["params"]
        theirs = b0["params"] if name in b0["params"] else b1["params"]
        assert torch.equal(mine[name], theirs[name]), name

    one = train_lm.main(_small(tmp_path / "one", data_cache, 6, *common, "--resume",
                               str(ckpt / "step_00000003")))
    losses = [r["loss"] for r in one["history"]]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, a0["losses"][3:]))
    assert len(losses) == 3 and rel <= 1e-10, rel
    for name, ref in {**a0["params"], **a1["params"]}.items():
        err = float((one["params"][name] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-10, (name, err)


def test_pipeline_flag_errors(capsys):
    for argv, message in (
        (["--pp", "2", "--layers", "2", "--schedule", "interleaved"],
         "--pp 2 x --virtual-stages 2 = 4 stages but --layers 2"),
        (["--pp", "2", "--batch-size", "6", "--microbatches", "4"],
         "each rank's batch (6 = --batch-size / --dp) does not split into --microbatches 4"),
        (["--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
        (["--pp", "2", "--compile"], "--compile does not work with --pp > 1 yet"),
        (["--cp", "2", "--seq-len", "30", "--experts", "2", "--capacity-factor", "0"],
         "--seq-len 30 must be a multiple of 4"),
        (["--cp", "2", "--experts", "2"], "--cp with --experts needs dropless routing"),
        (["--cp", "2", "--compile"], "--cp --cp-mode ring does not work with --compile"),
        (["--cp", "2", "--preset", "ddp"], "--preset ddp has no context parallelism"),
        (["--cp", "2", "--sample-every", "5"], "--sample-every with --cp: decoding cannot"),
    ):
        with pytest.raises(SystemExit):
            train_lm.main(argv)
        assert message in capsys.readouterr().err, argv


def test_parallel_flag_errors(tmp_path, capsys):
    # tp x dp must be the number of processes; DeviceMesh's message reaches the user.
    with pytest.raises(SystemExit, match=r"--tp 2 --dp 2 on 1 process.*product 4.*world size "
                                         r"is 1.*torchrun --nproc_per_node 4"):
        train_lm.main(["--tp", "2", "--dp", "2", "--logdir", str(tmp_path / "tb")])
    with pytest.raises(SystemExit):
        train_lm.main(["--tp", "3"])
    assert "--tp 3 does not divide the number of heads --heads 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_lm.main(["--heads", "8", "--kv-heads", "2", "--tp", "4"])
    assert "--tp 4 does not divide the number of heads --kv-heads 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_lm.main(["--batch-size", "6", "--dp", "4"])
    assert "--batch-size 6 is not divisible by --dp 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_lm.main(["--sequence-parallel"])
    assert "--sequence-parallel splits activations over tp" in capsys.readouterr().err


def test_default_model_splits_over_tp2_and_tp4():
    """The default flags build a model whose heads (and kv heads) divide by 2 and 4."""
    args = train_lm.parse_args([])
    for tp in (2, 4):
        train_lm.parse_args(["--tp", str(tp)])  # no usage error
        assert args.heads % tp == 0 and (args.kv_heads or args.heads) % tp == 0


def test_remat_and_preset_flags_give_the_plain_run(tmp_path, data_cache, capsys):
    """``--remat 1`` (every block recomputed) and ``--preset zero --plan`` (low_level_zero on
    one process: ZeRO-1 over a dp of 1) train to the same losses as the plain run, bit for bit:
    recomputation and a one-rank partition change no arithmetic."""
    def losses(*flags):
        out = train_lm.main(_small(tmp_path, data_cache, 3, "--warmup", "1", *flags))
        return [r["loss"] for r in out["history"]]

    plain = losses()
    assert losses("--remat", "1") == plain
    assert losses("--preset", "zero", "--plan") == plain
    printed = capsys.readouterr().out
    assert "expected communication per step" in printed and "memory on this rank" in printed


def test_remat_and_preset_flag_errors(capsys):
    for argv, message in (
        (["--plan"], "--plan prints a preset's plan: it needs --preset"),
        (["--preset", "ddp", "--zero", "2"], "--preset ddp has no ZeRO"),
        (["--zero", "2", "--no-reshard-after-forward"], "--no-reshard-after-forward is a ZeRO-3"),
        (["--preset", "zero", "--zero", "3"], "--preset zero is LowLevelZeroPlugin"),
        (["--preset", "gemini", "--zero", "2"], "--preset gemini is ZeRO-3"),
        (["--preset", "ddp", "--tp", "2"], "--preset ddp is data parallel only"),
        (["--preset", "zero", "--remat", "1"], "--remat is not part of the presets"),
        (["--preset", "hybrid", "--experts", "4"], "--preset hybrid has no expert parallelism"),
        (["--preset", "moe", "--experts", "4"], "--preset moe is moe_hybrid: it needs"),
        (["--preset", "moe"], "--preset moe is moe_hybrid: it needs"),
    ):
        with pytest.raises(SystemExit):
            train_lm.main(argv)
        assert message in capsys.readouterr().err, argv
