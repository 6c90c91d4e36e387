"""Smoke test of examples/sweep_vmap.py (in-process: a subprocess would cost a torch import)."""

from __future__ import annotations

import math

from _examples import load_example


def test_sweep_vmap_smoke(tmp_path, capsys):
    sweep = load_example("sweep_vmap.py", "sweep_vmap")
    lrs = (1e-4, 1e-2, 3.0)
    val = sweep.main(["--lrs", ",".join(map(str, lrs)), "--steps", "30", "--eval-every", "10",
                      "--width", "16", "--batch-size", "16", "--logdir", str(tmp_path / "tb")])
    out = capsys.readouterr().out
    # 30 AdamW steps at 1e-4 barely move the weights; 1e-2 learns the unit-variance teacher.
    assert val[1e-2] < 0.5 * val[1e-4], out
    assert "best: lr=0.01" in out and all(math.isfinite(val[lr]) for lr in lrs[:2]), out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for lr in lrs:
        acc = EventAccumulator(str(tmp_path / "tb" / f"lr_{lr:g}"))
        acc.Reload()
        assert {"train/loss", "train/lr", "train/val_loss"} <= set(acc.Tags()["scalars"])
        assert len(acc.Scalars("train/loss")) == 30
        assert math.isclose(acc.Scalars("train/lr")[-1].value, lr, rel_tol=1e-6)  # float32
