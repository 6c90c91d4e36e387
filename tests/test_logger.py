"""The Logger: TensorBoard event files, JSON lines, the progress bar."""

from __future__ import annotations

import io
import json

import pytest
import torch

from funcpar.train.logger import Logger, host_scalars


def _metrics(i: int) -> dict[str, torch.Tensor]:
    return {
        "loss": torch.tensor(3.0 - 0.1 * i),  # float32, as a loss is
        "grad_norm": torch.tensor(1.0 + i, dtype=torch.float32),
        "lr": torch.tensor(1e-3 * i, dtype=torch.float64),  # hyperparameters are float64
    }


def _read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_jsonl(tmp_path):
    stream = io.StringIO()
    with Logger(tmp_path / "tb", jsonl=tmp_path / "m" / "metrics.jsonl", total_steps=4,
                stream=stream) as log:
        for i in range(1, 5):
            log.log(i, _metrics(i), tokens=128)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    scalars = _read_scalars(tmp_path / "tb")
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(scalars)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    # TensorBoard stores float32: compare at float32 resolution.
    assert scalars["train/lr"][2][1] == pytest.approx(3e-3, rel=1e-6)
    assert scalars["train/loss"][0][1] == pytest.approx(2.9, rel=1e-6)

    lines = (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 4
    for i, row in enumerate(rows, start=1):
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(row)
        assert row["step"] == i and row["tokens_per_s"] > 0
    # The float64 lr reaches the file exactly.
    assert rows[1]["lr"] == 2e-3
    assert stream.getvalue() == ""  # not a terminal: no bar


def test_progress_bar_and_plain_lines():
    bar = io.StringIO()
    with Logger(total_steps=3, progress=True, stream=bar) as log:
        for i in range(1, 4):
            log.log(i, _metrics(i))
    text = bar.getvalue()
    assert text.count("\r") == 3 and "3/3" in text and text.endswith("\n")
    assert "[" + "#" * 20 + "]" in text and "loss 2.7000" in text

    plain = io.StringIO()
    with Logger(total_steps=6, print_every=2, stream=plain) as log:
        for i in range(1, 7):
            log.log(i, _metrics(i), tokens=10)
    lines = plain.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["2/6", "4/6", "6/6"]
    assert "\r" not in plain.getvalue() and "tok/s" in lines[0]


def test_host_scalars_and_history():
    values = host_scalars({"a": torch.tensor(2, dtype=torch.int64), "b": 1.5,
                           "c": torch.tensor([0.25], dtype=torch.float16)})
    assert values == {"a": 2.0, "b": 1.5, "c": 0.25}
    assert list(values) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="'v' must be a scalar"):
        host_scalars({"v": torch.ones(2)})
    log = Logger(stream=io.StringIO())
    rec = log.log(7, {"loss": torch.tensor(1.0)})
    assert rec == {"step": 7, "loss": 1.0} and log.history == [rec]
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.log(8, {"loss": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="print_every"):
        Logger(print_every=0)
