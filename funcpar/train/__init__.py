"""Training steps and logging."""

from funcpar.train.eval import EvalStep, evaluate, make_eval_step
from funcpar.train.logger import Logger, host_scalars
from funcpar.train.step import TrainStep, loss_and_grads, make_train_step
from funcpar.train.vmap import stack_states, unstack_states, vmap_step

__all__ = [
    "EvalStep",
    "Logger",
    "TrainStep",
    "evaluate",
    "host_scalars",
    "loss_and_grads",
    "make_eval_step",
    "make_train_step",
    "stack_states",
    "unstack_states",
    "vmap_step",
]
