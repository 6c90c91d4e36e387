"""Training metrics to TensorBoard, a terminal progress bar and a JSON-lines file.

A step's metrics arrive as a dict of 0-d tensors (possibly on the GPU, possibly still being
computed); :meth:`Logger.log` moves them to the host in one transfer per device, which is the
step's only synchronisation point, and derives the throughput from the wall time between two
calls. TensorBoard tags are ``train/<name>`` for the step's metrics, ``perf/tokens_per_s``,
``eval/<name>`` for a metric ``eval_<name>`` (a held-out evaluation logged with the step) and,
on CUDA, ``memory/allocated_gib`` and ``memory/peak_gib``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["Logger", "host_scalars"]

_GIB = float(1 << 30)


@runtime_checkable
class TextStream(Protocol):
    """What the bar needs of a stream (``sys.stdout``, ``io.StringIO``, ...)."""

    def write(self, s: str, /) -> Any: ...

    def flush(self) -> Any: ...


def host_scalars(metrics: Mapping[str, Tensor | float | int]) -> dict[str, float]:
    """``{name: float}`` from 0-d tensors and numbers, one device-to-host copy per device."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for name, value in metrics.items():
        if torch.is_tensor(value):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} must be a scalar, got shape "
                                 f"{tuple(value.shape)}")
            by_device.setdefault(value.device, []).append((name, value.detach()))
        else:
            out[name] = float(value)
    for items in by_device.values():
        stacked = torch.stack([v.reshape(()).to(torch.float64) for _, v in items]).cpu()
        out.update(zip((n for n, _ in items), stacked.tolist()))
    return {name: out[name] for name in metrics}


class Logger:
    """Logs one step at a time; use as a context manager (or call :meth:`close`).

    ``logdir``: TensorBoard directory (None: no TensorBoard). ``jsonl``: path of a metrics file
    with one JSON object per logged step (None: none). ``total_steps`` sizes the progress bar,
    which is drawn on ``stream`` only when it is a terminal (``progress=None``) or when
    ``progress=True``. When the bar is hidden and ``print_every`` is set, a plain line is
    printed every ``print_every`` steps instead. ``device`` decides whether CUDA memory is
    logged (``None``: when CUDA is initialised).

    ``start_step``: the step a resumed run continues from (0: a new run). A new run truncates
    the JSONL file. A resumed one keeps the file's records with ``step <= start_step`` (the
    steps after it are run again), drops a torn last line left by a kill, and appends, so the
    file reads as one run with every step once; TensorBoard hides the events after
    ``start_step`` (``SummaryWriter``'s ``purge_step``). Every record is flushed as it is
    written: a killed run loses none of the steps it logged.
    """

    def __init__(
        self,
        logdir: str | Path | None = None,
        *,
        jsonl: str | Path | None = None,
        total_steps: int | None = None,
        progress: bool | None = None,
        print_every: int | None = None,
        stream: TextStream | None = None,
        device: torch.device | str | None = None,
        start_step: int = 0,
    ) -> None:
        self.stream = sys.stdout if stream is None else stream
        self.total_steps = total_steps
        if progress is None:
            progress = bool(getattr(self.stream, "isatty", lambda: False)())
        self.progress = progress
        if print_every is not None and print_every <= 0:
            raise ValueError(f"print_every must be positive, got {print_every}")
        self.print_every = print_every
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        dev = torch.device(device) if device is not None else None
        self._cuda = (dev.type == "cuda") if dev is not None else torch.cuda.is_initialized()
        self._cuda_device = dev if self._cuda else None
        self._writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides this directory's events from that step on, which a
            # resumed run logs again (otherwise each such step shows twice).
            self._writer = SummaryWriter(log_dir=str(logdir),
                                         purge_step=start_step + 1 if start_step else None)
        self._jsonl = None
        if jsonl is not None:
            path = Path(jsonl)
            path.parent.mkdir(parents=True, exist_ok=True)
            if start_step and path.exists():
                _keep_steps_up_to(path, start_step)
                self._jsonl = path.open("a", encoding="utf-8")
            else:
                self._jsonl = path.open("w", encoding="utf-8")
        self._last_time = time.perf_counter()
        self._bar_width = 0
        self.history: list[dict[str, float]] = []
        self._closed = False

    def reset_timer(self) -> None:
        """Start the throughput clock now (e.g. after data loading, before the first step)."""
        self._last_time = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the block (an evaluation, a sample) is left out of the next step's
        throughput."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._last_time += time.perf_counter() - start

    def log(
        self, step: int, metrics: Mapping[str, Tensor | float | int], *, tokens: int | None = None
    ) -> dict[str, float]:
        """Record ``metrics`` for ``step`` (the step just finished, counting from 1).

        ``tokens`` is the number of tokens the step processed, for ``tokens_per_s``. Returns the
        logged values as floats (they are also kept in :attr:`history`).
        """
        if self._closed:
            raise RuntimeError("the Logger is closed")
        values = host_scalars(metrics)
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        if tokens is not None:
            values["tokens_per_s"] = tokens / elapsed if elapsed > 0 else math.inf
        if self._cuda:
            values["memory_allocated_gib"] = torch.cuda.memory_allocated(self._cuda_device) / _GIB
            values["memory_peak_gib"] = torch.cuda.max_memory_allocated(self._cuda_device) / _GIB
        record = {"step": step, **values}
        self.history.append(record)
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(_tag(name), value, step)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            # To the OS at once: a killed run (the usual end of a long one) keeps every step.
            self._jsonl.flush()
        if self.progress:
            self._draw_bar(step, values)
        elif self.print_every and (step % self.print_every == 0 or "eval_loss" in values):
            self.stream.write(_summary(step, self.total_steps, values) + "\n")
            self.stream.flush()
        return record

    def _draw_bar(self, step: int, values: dict[str, float]) -> None:
        text = _summary(step, self.total_steps, values)
        if self.total_steps:
            filled = min(20, int(20 * step / self.total_steps))
            text = f"[{'#' * filled}{'.' * (20 - filled)}] " + text
        pad = max(0, self._bar_width - len(text))
        self._bar_width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.progress and self._bar_width:
            self.stream.write("\n")
            self.stream.flush()
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _keep_steps_up_to(path: Path, last_step: int) -> None:
    """Rewrite the JSONL file ``path`` with its records of ``step <= last_step`` only.

    A last line without its newline that does not parse is what a kill mid-write leaves: it is
    dropped. Any other line that is not a record with a step is refused (ValueError), not
    rewritten away: the file is then not this logger's. The rewrite goes through a temporary
    file and ``os.replace``, so a kill during it leaves the old file whole.
    """
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            keep = json.loads(line)["step"] <= last_step
        except (ValueError, TypeError, KeyError) as err:
            if number == len(lines) and not line.endswith("\n"):
                break  # torn by a kill
            raise ValueError(f"metrics file {str(path)!r} line {number} is not a JSON record "
                             f"with a step ({type(err).__name__}): not written by a Logger?"
                             ) from None
        if keep:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def _tag(name: str) -> str:
    if name == "tokens_per_s":
        return "perf/tokens_per_s"
    if name.startswith("memory_"):
        return "memory/" + name[len("memory_"):]
    if name.startswith("eval_"):  # a held-out evaluation (examples/train_lm.py --eval-every)
        return "eval/" + name[len("eval_"):]
    return "train/" + name


def _summary(step: int, total: int | None, values: dict[str, float]) -> str:
    parts = [f"{step}/{total}" if total else f"step {step}"]
    for name in ("loss", "grad_norm"):
        if name in values:
            parts.append(f"{name} {values[name]:.4f}")
    if "lr" in values:
        parts.append(f"lr {values['lr']:.2e}")
    if "tokens_per_s" in values:
        parts.append(f"{values['tokens_per_s']:,.0f} tok/s")
    if "memory_peak_gib" in values:
        parts.append(f"peak {values['memory_peak_gib']:.2f} GiB")
    if "eval_loss" in values:
        parts.append(f"eval loss {values['eval_loss']:.4f} ppl {values['eval_ppl']:.2f}")
    return " | ".join(parts)
