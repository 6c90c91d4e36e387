"""Differentiating through training: unrolled inner loops, MAML, implicit differentiation,
zero-order (evolution-strategy) gradients.

See docs/FUNCTIONAL.md for what each optimizer lets autograd differentiate and at what cost.
"""

from funcpar.meta.implicit import custom_root
from funcpar.meta.linear_solve import SolveError, solve_cg, solve_gmres, solve_normal_cg
from funcpar.meta.maml import maml_adapt
from funcpar.meta.unroll import detach_state, inner_step, unroll, unroll_train_step
from funcpar.meta.zero_order import zero_order

__all__ = [
    "SolveError",
    "custom_root",
    "detach_state",
    "inner_step",
    "maml_adapt",
    "solve_cg",
    "solve_gmres",
    "solve_normal_cg",
    "unroll",
    "unroll_train_step",
    "zero_order",
]
