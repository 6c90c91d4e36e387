"""Interleaved timing shared by the small benchmarks (bench_meta, bench_vmap): 1 thread, the
ways alternated round by round, per-step times in ms for medians and minimums."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def add_clock_flag(parser: argparse.ArgumentParser) -> None:
    """``--clock wall|cpu``."""
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: time.process_time, this process's "
                             "CPU time (with 1 thread, less sensitive to other jobs' scheduling "
                             "on a loaded machine than wall time; it still counts cache and "
                             "memory contention)")


def interleaved(ways: dict[str, Callable[[int], None]], *, rounds: int, steps: int,
                clock: str) -> dict[str, list[float]]:
    """Per way, one ms-per-step time per round: ``ways[name](steps)`` runs ``steps`` steps,
    the ways in order on even rounds and reversed on odd ones (so neither always runs on a
    machine the other just warmed or loaded)."""
    tick = time.perf_counter if clock == "wall" else time.process_time
    times: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            t0 = tick()
            ways[name](steps)
            times[name].append((tick() - t0) / steps * 1e3)
    return times
