"""Pipeline schedules as explicit per-rank action lists, checked for deadlock before use.

A pipeline of ``p`` ranks runs ``S = p * v`` *virtual stages* (``v`` per rank; ``v = 1``
without interleaving): stage ``s`` lives on rank ``s % p``, so with ``v > 1`` rank ``r`` holds
stages ``r, r + p, r + 2p, ...`` (Megatron-LM's interleaved layout, Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
arXiv 2104.04473). A step pushes ``m`` micro-batches through the stages; every rank executes
its own list of :class:`Action`:

* ``F`` / ``B`` (stage, micro-batch): the forward / backward of that micro-batch on that stage;
* ``SEND_F`` / ``RECV_F``: the stage's output activation to (from) the next (previous) stage's
  rank; ``SEND_B`` / ``RECV_B``: the gradient of that activation, backwards. Neighbouring
  stages on one rank (only when ``p = 1``) hand over locally, without a transfer.

Schedules (the order of ``F`` and ``B`` on each rank; the transfers follow from it, a receive
right before the compute that needs it, a send right after the compute that produced it):

* ``gpipe`` (Huang et al. 2019, arXiv 1811.06965): every forward, then every backward. Each
  rank holds the activations of all ``m`` micro-batches at the peak.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv 2006.09503): rank ``r`` runs
  ``min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. At most ``min(p - r, m)`` micro-batches are in flight on
  rank ``r``; the bubble is GPipe's, ``(p - 1) / (m + p - 1)`` of the step with backward = 2
  forwards.
* ``interleaved`` (Megatron-LM's interleaved 1F1B): micro-batches in groups of ``p``; within
  a group, forwards run stage by stage over the rank's ``v`` stages (backwards in reverse);
  warm-up ``2 (p - r - 1) + (v - 1) p`` forward steps, then one forward / one backward. The
  bubble shrinks by about ``v``: ``(p - 1) / (v m + p - 1)``. Any ``m`` is accepted (the last
  group may be short); where the warm-up formula would deadlock such a group (checked by
  simulation), that rank's warm-up grows by one step at a time until it does not.

:func:`simulate` executes the lists under the transport's semantics - a send is posted and
does not wait for its receiver (isend), a receive waits until the matching send is posted -
and raises :class:`ScheduleDeadlock` naming every blocked rank and what it waits for if the
lists cannot all complete; with unit costs (backward = 2 forwards) it also gives the ideal
timeline, bubble fraction and peak in-flight micro-batches per rank.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleDeadlock",
    "SimResult",
    "build_schedule",
    "compute_order",
    "simulate",
    "theory_bubble",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
COMPUTE = ("F", "B")


class Action(NamedTuple):
    """One step of a rank's schedule: ``kind`` in ``F``, ``B``, ``SEND_F``, ``RECV_F``,
    ``SEND_B``, ``RECV_B``; ``stage`` the virtual stage it belongs to (for a transfer: the
    stage that computes with the received / produced tensor); ``mb`` the micro-batch."""

    kind: str
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}(s{self.stage},mb{self.mb})"


class ScheduleDeadlock(RuntimeError):
    """The action lists cannot all complete: ``blocked`` maps rank -> the action it waits on."""

    def __init__(self, message: str, blocked: dict[int, Action]) -> None:
        super().__init__(message)
        self.blocked = blocked


def _check_sizes(schedule: str, p: int, v: int, m: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")
    for name, x in (("pipeline size", p), ("virtual stages", v), ("micro-batches", m)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank; {v} virtual stages "
                         "per rank need schedule='interleaved'")


def _interleaved_orders(p: int, v: int, m: int, r: int) -> tuple[list[tuple[int, int]],
                                                                   list[tuple[int, int]]]:
    """(stage, mb) of rank ``r``'s forward and backward steps, in Megatron's order."""
    fwd, bwd = [], []
    for g0 in range(0, m, p):
        group = range(g0, min(g0 + p, m))
        for c in range(v):
            fwd += [(c * p + r, mb) for mb in group]
        for c in reversed(range(v)):
            bwd += [(c * p + r, mb) for mb in group]
    return fwd, bwd


def _one_f_one_b(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]],
                 warmup: int) -> list[Action]:
    warmup = min(warmup, len(fwd))
    out = [Action("F", s, mb) for s, mb in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        s, mb = fwd[warmup + k]
        out.append(Action("F", s, mb))
        s, mb = bwd[k]
        out.append(Action("B", s, mb))
    out += [Action("B", s, mb) for s, mb in bwd[len(fwd) - warmup:]]
    return out


def compute_order(schedule: str, p: int, v: int, m: int, rank: int,
                  warmup: int | None = None) -> list[Action]:
    """Rank ``rank``'s ``F``/``B`` actions in ``schedule``'s order (``warmup`` overrides the
    number of warm-up forward steps of the 1F1B kinds)."""
    _check_sizes(schedule, p, v, m)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside a pipeline of {p}")
    if schedule == "gpipe":
        return [Action("F", rank, mb) for mb in range(m)] + [
            Action("B", rank, mb) for mb in range(m)]
    if schedule == "1f1b":
        order = [(rank, mb) for mb in range(m)]
        return _one_f_one_b(order, order, p - rank - 1 if warmup is None else warmup)
    fwd, bwd = _interleaved_orders(p, v, m, rank)
    default = 2 * (p - rank - 1) + (v - 1) * p
    return _one_f_one_b(fwd, bwd, default if warmup is None else warmup)


def _with_transfers(order: list[Action], p: int, n_stages: int) -> list[Action]:
    """``order`` with each compute's receive before it and its send after it."""
    out = []
    for a in order:
        r = a.stage % p
        if a.kind == "F":
            if a.stage > 0 and (a.stage - 1) % p != r:
                out.append(Action("RECV_F", a.stage, a.mb))
            out.append(a)
            if a.stage < n_stages - 1 and (a.stage + 1) % p != r:
                out.append(Action("SEND_F", a.stage, a.mb))
        else:
            if a.stage < n_stages - 1 and (a.stage + 1) % p != r:
                out.append(Action("RECV_B", a.stage, a.mb))
            out.append(a)
            if a.stage > 0 and (a.stage - 1) % p != r:
                out.append(Action("SEND_B", a.stage, a.mb))
    return out


def build_schedule(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's action list (index = pipeline rank), verified deadlock-free by
    :func:`simulate`; for ``interleaved`` the smallest warm-ups from Megatron's formula up that
    pass (module docstring)."""
    _check_sizes(schedule, p, v, m)
    n_stages = p * v
    warm = [None] * p
    if schedule == "interleaved":
        warm = [2 * (p - r - 1) + (v - 1) * p for r in range(p)]
    for _ in range(p * v * m + 1):
        lists = [_with_transfers(compute_order(schedule, p, v, m, r, warm[r]), p, n_stages)
                 for r in range(p)]
        try:
            simulate(lists, p, m, v)
            return lists
        except ScheduleDeadlock as err:
            if schedule != "interleaved":
                raise
            for r in err.blocked:  # more warm-up on the blocked ranks
                warm[r] = min(warm[r] + 1, v * m)
    raise AssertionError("unreachable: all-forward-first never deadlocks")  # pragma: no cover


class SimResult(NamedTuple):
    """:func:`simulate`'s ideal timeline (forward 1, backward ``backward_cost`` time units,
    transfers free): per rank its busy time, the makespan, the bubble fraction
    ``1 - busy / makespan``, and the peak number of micro-batches whose activations the rank
    holds (forwards done, backwards not yet, summed over its stages)."""

    makespan: float
    busy: list[float]
    bubble: list[float]
    peak_in_flight: list[int]
    spans: list[list[tuple[Action, float, float]]]


def _validate(lists: list[list[Action]], p: int, m: int, v: int) -> None:
    n_stages = p * v
    for r, acts in enumerate(lists):
        seen: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(acts):
            if not 0 <= a.stage < n_stages or not 0 <= a.mb < m:
                raise ValueError(f"rank {r}: {a!r} outside {n_stages} stages x {m} micro-batches")
            if a.stage % p != r:
                raise ValueError(f"rank {r}: {a!r} belongs to rank {a.stage % p}")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise ValueError(f"rank {r}: {a!r} appears twice")
            seen[key] = i
        for s in range(r, n_stages, p):
            for mb in range(m):
                f, b = seen.get(("F", s, mb)), seen.get(("B", s, mb))
                if f is None or b is None:
                    raise ValueError(f"rank {r}: stage {s} micro-batch {mb} lacks its "
                                     f"{'forward' if f is None else 'backward'}")
                if b < f:
                    raise ValueError(f"rank {r}: B(s{s},mb{mb}) before its forward")


def simulate(lists: list[list[Action]], p: int, m: int, v: int = 1, *,
             backward_cost: float = 2.0) -> SimResult:
    """Execute the action lists (module docstring); :class:`ScheduleDeadlock` if they block."""
    if len(lists) != p:
        raise ValueError(f"{len(lists)} action lists for a pipeline of {p}")
    _validate(lists, p, m, v)
    n_stages = p * v
    pos = [0] * p
    clock = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> time it completed
    busy = [0.0] * p
    held = [0] * p
    peak = [0] * p
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]

    def ready(r: int, a: Action) -> float | None:
        """When ``a`` can start on rank ``r`` (None: not yet)."""
        if a.kind == "RECV_F":
            return done.get(("SEND_F", a.stage - 1, a.mb))
        if a.kind == "RECV_B":
            return done.get(("SEND_B", a.stage + 1, a.mb))
        if a.kind == "F" and a.stage > 0:
            dep = ("RECV_F", a.stage, a.mb) if (a.stage - 1) % p != r else (
                "F", a.stage - 1, a.mb)
            return done.get(dep)
        if a.kind == "B":
            if a.stage == n_stages - 1:
                return done.get(("F", a.stage, a.mb))
            dep = ("RECV_B", a.stage, a.mb) if (a.stage + 1) % p != r else (
                "B", a.stage + 1, a.mb)
            return done.get(dep)
        return 0.0

    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                t = ready(r, a)
                if t is None:
                    break
                start = max(clock[r], t)
                cost = {"F": 1.0, "B": backward_cost}.get(a.kind, 0.0)
                clock[r] = start + cost
                busy[r] += cost
                if a.kind in COMPUTE:
                    spans[r].append((a, start, clock[r]))
                    held[r] += 1 if a.kind == "F" else -1
                    peak[r] = max(peak[r], held[r])
                # A send is posted at once and the rank goes on (isend); its data is there for
                # the receiver from now on.
                done[(a.kind, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {r: lists[r][pos[r]] for r in range(p) if pos[r] < len(lists[r])}
            what = ", ".join(f"rank {r} waits at {a!r} (action {pos[r]})"
                             for r, a in blocked.items())
            raise ScheduleDeadlock(f"pipeline schedule deadlocks: {what}", blocked)
    makespan = max(clock)
    return SimResult(makespan, busy, [1 - b / makespan for b in busy], peak, spans)


def theory_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of the textbook analysis (backward = 2 forwards, free transfers):
    ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved."""
    _check_sizes(schedule, p, v, m)
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)
