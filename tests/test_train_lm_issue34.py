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
