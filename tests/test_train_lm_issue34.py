"""examples/train_lm.py: --grad-accum, --eval-every/--eval-batches/--keep-best, --sample-every
(issue 34)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _examples import load_example

train_lm = load_example("train_lm.py", "train_lm_issue34")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets_cache")


def _small(tmp_path: Path, data_cache: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--dim", "32",
        "--layers", "2", "--heads", "4", "--warmup", "1", "--device", "cpu",
        "--corpus-bytes", "200000", "--data-cache", str(data_cache),
        "--logdir", str(tmp_path / "tb"), "--metrics-jsonl", str(tmp_path / "metrics.jsonl"),
        *extra,
    ]


def test_grad_accum_equals_the_larger_batch(tmp_path, data_cache):
    want = train_lm.main(_small(tmp_path / "a", data_cache, 3, "--dtype", "float64"))
    got = train_lm.main(_small(tmp_path / "b", data_cache, 3, "--dtype", "float64",
                               "--batch-size", "4", "--grad-accum", "2"))
    for a, b in zip(got["history"], want["history"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-12 * abs(b["loss"])
    for name, p in want["params"].items():
        err = (got["params"][name] - p).abs().max() / p.abs().max()
        assert err <= 1e-12, name


def test_eval_flags_log_and_keep_best(tmp_path, data_cache):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from funcpar.state import read_index

    ckpt = tmp_path / "ckpt"
    out = train_lm.main(_small(tmp_path, data_cache, 4, "--eval-every", "2", "--eval-batches",
                               "2", "--keep-best", "--ckpt-dir", str(ckpt)))
    assert [e["step"] for e in out["evals"]] == [2, 4]
    assert all(e["tokens"] == 2 * 8 * 32 for e in out["evals"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    with_eval = [r["step"] for r in rows if "eval_loss" in r]
    assert with_eval == [2, 4]
    assert rows[1]["eval_ppl"] == pytest.approx(__import__("math").exp(rows[1]["eval_loss"]))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"eval/loss", "eval/ppl"} <= set(acc.Tags()["scalars"])
    index = read_index(str(ckpt / "best"), verify_files=False)
    best = min(out["evals"], key=lambda e: e["loss"])
    assert index["step"] == best["step"]
    assert index["extra_meta"]["eval_loss"] == best["loss"]


def test_keep_best_needs_eval(tmp_path, data_cache, capsys):
    with pytest.raises(SystemExit):
        train_lm.main(_small(tmp_path, data_cache, 2, "--keep-best"))
    assert "--keep-best" in capsys.readouterr().err


def test_held_out_split_is_disjoint_from_training():
    import torch

    from funcpar.data import PackedBatches, held_out_split

    tokens = torch.arange(10_000, dtype=torch.int64)  # a token is its own position
    train, held = held_out_split(tokens, 0.1)
    assert train.numel() + held.numel() == tokens.numel()
    seen = {}
    for name, stream in (("train", train), ("held", held)):
        loader = PackedBatches(stream, batch_size=4, seq_len=16, seed=3)
        positions = set()
        for k in range(2 * loader.batches_per_epoch):  # two epochs: every block
            x, y = loader.batch(k)
            positions |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        seen[name] = positions
    assert seen["train"] and seen["held"]
    assert not seen["train"] & seen["held"]
    # Deterministic: the same cut every time.
    again = held_out_split(tokens, 0.1)
    assert torch.equal(again[0], train) and torch.equal(again[1], held)


generate_example = load_example("generate.py", "generate_issue34")


def test_sample_every_and_generate_from_the_checkpoint(tmp_path, data_cache, capsys):
    import torch

    from funcpar.models import Llama
    from funcpar.state import functionalize

    ckpt = tmp_path / "ckpt"
    out = train_lm.main(_small(tmp_path, data_cache, 4, "--sample-every", "2",
                               "--sample-tokens", "8", "--save-every", "4", "--ckpt-dir",
                               str(ckpt)))
    printed = capsys.readouterr().out
    assert "sample at step 2: 'def " in printed and "sample at step 4: 'def " in printed
    got = generate_example.main(["--ckpt", str(ckpt), "--prompt", "def ", "--temperature", "0",
                                 "--max-new-tokens", "12"])
    # Greedy by full recomputation from the run's own final parameters.
    run = argparse_namespace(got["ckpt_args"])
    model = Llama(train_lm.model_config(run), seed=run.seed)
    model.load_state_dict(out["params"])
    apply_fn, params, buffers = functionalize(model)
    tokens = torch.tensor([list(b"def ")])
    for _ in range(12):
        logits, _ = apply_fn(params, buffers, tokens)
        tokens = torch.cat((tokens, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(got["tokens"], tokens)
    assert got["text"].startswith("def ")


def argparse_namespace(d):
    import argparse

    return argparse.Namespace(**d)
