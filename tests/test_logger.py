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


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_jsonl_survives_a_kill_and_a_resume_logs_every_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    killed = Logger(jsonl=path, stream=io.StringIO())
    for i in range(1, 7):
        killed.log(i, _metrics(i))
    # Not closed (a killed run): every record is already in the file.
    assert _steps(path) == [1, 2, 3, 4, 5, 6]
    # Resumed from the step-4 checkpoint: steps 5 and 6 are run (and logged) again.
    with Logger(jsonl=path, stream=io.StringIO(), start_step=4) as log:
        assert _steps(path) == [1, 2, 3, 4]
        for i in range(5, 9):
            log.log(i, _metrics(i))
    killed.close()  # had anything been left buffered, it would land in the new file now
    assert _steps(path) == list(range(1, 9))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[5]["loss"] == pytest.approx(3.0 - 0.6, rel=1e-6)
    # A new run (start_step 0) starts the file afresh.
    with Logger(jsonl=path, stream=io.StringIO()) as log:
        log.log(1, _metrics(1))
    assert _steps(path) == [1]


def test_resume_drops_a_torn_last_line_and_refuses_a_foreign_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n{"step": 3, "lo')
    with Logger(jsonl=path, stream=io.StringIO(), start_step=2) as log:
        log.log(3, _metrics(3))
    assert _steps(path) == [1, 2, 3]
    assert not list(tmp_path.glob("*.tmp"))
    # A bad line before the last is not a kill's doing: refused, and the file left alone.
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        Logger(jsonl=path, stream=io.StringIO(), start_step=2)
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'  # left as it was
    with pytest.raises(ValueError, match="start_step"):
        Logger(start_step=-1)


def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    import time

    with Logger(tmp_path / "tb", stream=io.StringIO()) as log:
        for i in range(1, 7):
            log.log(i, _metrics(i))
    # TensorBoard reads a directory's event files in name order, which starts with the second
    # and then a per-process counter: the resumed run's file must sort after the first.
    time.sleep(1.01 - time.time() % 1)
    with Logger(tmp_path / "tb", stream=io.StringIO(), start_step=4) as log:
        for i in range(5, 9):
            log.log(i, _metrics(i + 10))  # other values: the resumed run's must win
    loss = _read_scalars(tmp_path / "tb")["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 9))
    assert loss[3][1] == pytest.approx(3.0 - 0.4, rel=1e-6)
    assert loss[4][1] == pytest.approx(3.0 - 1.5, rel=1e-6)
