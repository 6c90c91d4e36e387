"""Training steps and logging."""

from funcpar.train.step import TrainStep, loss_and_grads, make_train_step

__all__ = ["TrainStep", "loss_and_grads", "make_train_step"]
