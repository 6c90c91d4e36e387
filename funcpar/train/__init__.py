"""Training steps and logging."""

from funcpar.train.step import loss_and_grads, make_train_step

__all__ = ["loss_and_grads", "make_train_step"]
