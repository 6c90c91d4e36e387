"""Resume continues the run it was saved from (issue 20, items 1 and 3): at or past --steps it
says so and stops; model flags must match the checkpoint's, hyperparameters apply and are
reported, data-order flags must match unless --allow-data-change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _examples import load_example

from funcpar.optim import get_hyperparams, warmup_cosine
from funcpar.train.cli import run_cli
from funcpar.train.resume_args import ArgChange, compare_run_args

train_lm = load_example("train_lm.py", "train_lm_resume")


def _tiny(tmp: Path, steps: int, *extra: str) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "2", "--seq-len", "16", "--dim", "16",
            "--layers", "1", "--heads", "2", "--device", "cpu", "--corpus-bytes", "60000",
            "--data-cache", str(tmp / "dc"), "--logdir", str(tmp / "tb"), *extra]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 3-step run saved at step 3 (--warmup 1: the default would be 0 for 3 steps)."""
    tmp = tmp_path_factory.mktemp("resume")
    train_lm.main(_tiny(tmp, 3, "--warmup", "1", "--save-every", "3",
                        "--ckpt-dir", str(tmp / "ck")))
    return tmp, tmp / "ck"


def test_resume_at_or_past_steps_has_nothing_to_do(ckpt, capsys):
    tmp, ck = ckpt
    for steps in (3, 2):
        capsys.readouterr()
        run_cli(train_lm.main, _tiny(tmp, steps, "--resume", str(ck)))  # no SystemExit: exit 0
        assert "nothing to do: checkpoint is at step 3" in capsys.readouterr().out


def test_a_model_flag_that_differs_is_refused_naming_both_values(ckpt):
    tmp, ck = ckpt
    # --heads 1 on a 2-head checkpoint: the same tensor shapes, another model.
    with pytest.raises(ValueError, match=r"--heads 1 does not match the checkpoint's --heads 2"):
        train_lm.main(_tiny(tmp, 5, "--heads", "1", "--warmup", "1", "--resume", str(ck)))


def test_a_hyperparameter_change_applies_and_is_reported(ckpt, capsys):
    tmp, ck = ckpt
    out = train_lm.main(_tiny(tmp, 4, "--warmup", "1", "--weight-decay", "0.5", "--lr", "0.01",
                              "--resume", str(ck)))
    printed = capsys.readouterr().out
    assert "--weight-decay changed from 0.1 (checkpoint) to 0.5" in printed
    assert "--lr changed from unset (its default) (checkpoint) to 0.01" in printed
    assert "--steps changed from 3 (checkpoint) to 4" in printed
    hp = get_hyperparams(out["state"].opt_state)
    # The weight decay lives in the optimizer state: the new value is the one used.
    assert float(hp["weight_decay"]) == 0.5
    # The lr schedule is rebuilt from the flags: the 4th update (count 3) used the new
    # warmup_cosine(0.01, 1, 4, end=0.001), not the checkpoint's default peak 3e-3.
    new_lr = warmup_cosine(0.01, 1, 4, end=0.001)(torch.tensor(3))
    assert float(hp["lr"]) == pytest.approx(float(new_lr), rel=1e-12)
    assert len(out["history"]) == 1


def test_resume_continues_the_metrics_file(ckpt):
    """A run killed after step 4 with its checkpoint at 3: the resumed run logs step 4 again,
    and the metrics file holds steps 1 to 4 once each, step 4 from the resumed run."""
    import json

    tmp, ck = ckpt
    path = tmp / "killed" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"step": i, "loss": 99.0}) + "\n" for i in range(1, 5)))
    out = train_lm.main(_tiny(tmp, 4, "--warmup", "1", "--resume", str(ck),
                              "--metrics-jsonl", str(path)))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["loss"] == out["history"][0]["loss"] != 99.0


def test_a_data_order_flag_is_refused_unless_allowed(ckpt, capsys):
    tmp, ck = ckpt
    argv = _tiny(tmp, 4, "--warmup", "1", "--seed", "7", "--resume", str(ck))
    with pytest.raises(ValueError, match=r"--seed 7 does not match the checkpoint's --seed 0.*"
                                         r"--allow-data-change"):
        train_lm.main(argv)
    out = train_lm.main([*argv, "--allow-data-change"])
    assert len(out["history"]) == 1


def test_compare_run_args_classes():
    saved = {"dim": 8, "lr": 0.1, "seed": 0, "logdir": "a"}
    kinds = {"model": ["dim"], "hyper": ["lr"], "data": ["seed"]}
    assert compare_run_args(saved, {**saved, "logdir": "b"}, **kinds) == []
    assert compare_run_args(saved, {**saved, "lr": 0.2}, **kinds) == [ArgChange("lr", 0.1, 0.2)]
    with pytest.raises(ValueError, match="--dim 9 .* --dim 8"):
        compare_run_args(saved, {**saved, "dim": 9}, **kinds)
    with pytest.raises(ValueError, match="--seed 1 .* --seed 0"):
        compare_run_args(saved, {**saved, "seed": 1}, **kinds)
    assert compare_run_args(saved, {**saved, "seed": 1}, allow_data_change=True, **kinds) == []
    # A flag the checkpoint predates is not compared.
    assert compare_run_args({}, {"dim": 9}, **kinds) == []


def test_an_unset_flag_is_named_as_such_not_none():
    # Issue 29: "--kv-heads 2 does not match the checkpoint's --kv-heads None" read as a bug.
    with pytest.raises(ValueError, match=r"--kv-heads 2 does not match the checkpoint's "
                                         r"--kv-heads unset \(its default\)"):
        compare_run_args({"kv_heads": None}, {"kv_heads": 2}, model=["kv_heads"], hyper=[],
                         data=[])
    (change,) = compare_run_args({"lr": None}, {"lr": 0.01}, model=[], hyper=["lr"], data=[])
    assert str(change) == "--lr changed from unset (its default) (checkpoint) to 0.01"
