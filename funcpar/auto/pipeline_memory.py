"""Peak memory of a pipeline rank during its schedule, by walking the rank's action list.

Without a pipeline the backward frees the activations as the gradients appear, so the step's
peak is the larger of "activations + transients" and "the end of the step's buffers"
(:class:`funcpar.auto.analytic.Memory`). A pipeline rank interleaves micro-batches: while the
activations of some are in flight, the gradients of others are already accumulated. What
:class:`funcpar.pipeline.runtime.Pipeline` holds, read from its code and checked against
measured peaks (tests/test_auto_pipeline.py), per local stage ``j`` of the rank:

* ``A_j`` per micro-batch in flight (``F`` done, ``B`` not yet): the saved activations of the
  stage's blocks (the last stage's head keeps its float32 log-softmax, not its logits), and
  under mixed precision the stage's half-precision parameter copy, which ``amp_cast`` makes
  per call and the matmuls save;
* the gradients: the first backward of a stage returns its gradient tuple (``G_j`` bytes),
  which becomes the accumulator; the second allocates the sum ``acc + g`` leaf by leaf (the
  largest leaf ``L_j`` above both), and every later one adds in place; a backward's gradient
  tuple is dropped once summed in, so ``2 G_j`` are held when a backward returns, ``G_j``
  between backwards;
* point-to-point buffers: the runtime waits for its sends at the step's end only, so every
  stage output sent (``O_j`` a micro-batch, non-last stages) and every input gradient sent
  back (``D_j``, non-first stages) stays allocated until then;
* transients: a forward's (the last stage's logits and their float32 copy while the loss is
  computed; a rematted block's activations) and a backward's (the head's logits gradient and
  log-softmax gradient, ``8 V / tp`` bytes a token; a block's MLP input gradients, about
  ``2 F / tp`` elements a token).

The level at each ``F`` and ``B`` is linear in these per-stage quantities, so
:func:`events` reduces a schedule (cached by ``schedule, p, m, v, rank``) to the coefficient
vectors of its candidate peaks (dominated ones dropped) and :func:`pipeline_peak` takes the
largest dot product with the layout's quantities.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

__all__ = ["StageBytes", "events", "pipeline_peak"]

_FIELDS = 7  # A, Ft, Bt, G, L, O, D per local stage


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """One local stage's quantities (module docstring), bytes."""

    acts: float  # A: kept per micro-batch in flight
    fwd_transient: float  # above A during a forward
    bwd_transient: float  # above the level during a backward
    grads: float  # G: the stage's gradient bytes
    largest_leaf: float  # L: the largest gradient leaf
    out: float  # O: the output sent per micro-batch (0 on the last stage)
    dx: float  # D: the input gradient sent back per micro-batch (0 on the first stage)

    def vector(self) -> tuple[float, ...]:
        return (self.acts, self.fwd_transient, self.bwd_transient, self.grads,
                self.largest_leaf, self.out, self.dx)


def _pareto(vectors: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors no other one dominates componentwise (all quantities are >= 0). The
    counts of sent buffers (``O``, ``D``) only grow over a schedule, so of the events
    ``vectors`` (in time order) that agree elsewhere the last dominates the others: they are
    dropped first, which leaves few for the quadratic pass."""
    latest: dict[tuple[int, ...], tuple[int, ...]] = {}
    for vec in vectors:
        latest[tuple(x for i, x in enumerate(vec) if i % _FIELDS < 5)] = vec
    keep: list[tuple[int, ...]] = []
    for vec in sorted(set(latest.values()), key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(k, vec)) for k in keep):
            keep.append(vec)
    return tuple(keep)


@lru_cache(maxsize=4096)
def events(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """Coefficient vectors (``7 v`` entries: ``A, Ft, Bt, G, L, O, D`` of each local stage)
    of the memory level at every forward and backward of rank ``rank``'s schedule
    (:func:`funcpar.pipeline.schedules.compute_order`), dominated ones dropped."""
    from funcpar.pipeline.schedules import compute_order

    n_fwd = [0] * v  # forwards done, per local stage
    n_bwd = [0] * v
    out: list[tuple[int, ...]] = []

    def level(fwd_t: int = -1, bwd_t: int = -1, new_g: int = -1, leaf: int = -1,
              in_flight_less: int = -1) -> tuple[int, ...]:
        vec = [0] * (_FIELDS * v)
        for j in range(v):
            o = _FIELDS * j
            vec[o] = n_fwd[j] - n_bwd[j] - (1 if j == in_flight_less else 0)
            vec[o + 1] = 1 if j == fwd_t else 0
            vec[o + 2] = 1 if j == bwd_t else 0
            vec[o + 3] = (1 if n_bwd[j] else 0) + (1 if j == new_g else 0)
            vec[o + 4] = 1 if j == leaf else 0
            vec[o + 5] = n_fwd[j]
            vec[o + 6] = n_bwd[j]
        return tuple(vec)

    for a in compute_order(schedule, p, v, m, rank):
        j = a.stage // p
        if a.kind == "F":
            n_fwd[j] += 1
            out.append(level(fwd_t=j))
            continue
        out.append(level(bwd_t=j))
        # autograd.grad has returned: this micro-batch's activations are freed, its gradient
        # tuple is new (dropped once summed in); the second backward of a stage allocates the
        # accumulator's sum leaf by leaf.
        out.append(level(new_g=j, in_flight_less=j, leaf=j if n_bwd[j] == 1 else -1))
        n_bwd[j] += 1
    return _pareto(out)


def pipeline_peak(schedule: str, p: int, m: int, v: int, rank: int,
                  stages: list[StageBytes]) -> float:
    """The largest memory level (bytes above the resident state) of rank ``rank`` over its
    schedule, ``stages`` its local stages' quantities in order (module docstring)."""
    q = [x for s in stages for x in s.vector()]
    return max(sum(c * x for c, x in zip(vec, q)) for vec in events(schedule, p, m, v, rank))
