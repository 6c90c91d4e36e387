"""Smoke tests of examples/maml_sine.py and examples/hypergrad_lr.py (in-process, tiny)."""

from __future__ import annotations

from _examples import load_example


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def test_maml_sine_meta_test_loss_falls(tmp_path):
    maml = load_example("maml_sine.py", "maml_sine")
    losses = maml.main(["--meta-steps", "20", "--tasks", "2", "--inner-steps", "2", "--width",
                        "16", "--eval-every", "10", "--eval-tasks", "8", "--meta-lr", "0.01",
                        "--inner-lr", "0.05", "--logdir", str(tmp_path)])
    # Meta-test loss at meta-steps 0, 10, 20 on fixed held-out tasks (measured 6.71 -> 6.23).
    assert len(losses) == 3 and losses[-1] < 0.98 * losses[0], losses
    acc = _scalars(tmp_path)
    assert len(acc.Scalars("train/meta_loss")) == 20
    assert len(acc.Scalars("train/meta_test_loss")) == 3


def test_hypergrad_lr_learns_the_learning_rate(tmp_path):
    hyper = load_example("hypergrad_lr.py", "hypergrad_lr")
    hist = hyper.main(["--rounds", "12", "--unroll", "3", "--lr0", "1e-4",
                       "--logdir", str(tmp_path)])
    (_, val0), (lr, val) = hist[0], hist[-1]
    # Started 10-100x too low, the hypergradient raises the lr (signed steps of e^0.3 per
    # round) and the validation loss falls.
    assert lr > 10 * 1e-4 and val < 0.7 * val0, hist
    acc = _scalars(tmp_path)
    assert {"train/val_loss", "train/lr", "train/hypergrad"} <= set(acc.Tags()["scalars"])
