"""Resume continues the run it was saved from: compare the saved run arguments with the new.

A checkpoint made by a script keeps its arguments (``extra_meta["args"]``). On resume, each
argument the script names falls in one class:

* **model** (sizes, heads, experts, dtype, the optimizer and its state shapes): a different
  value would load the saved tensors into another model (same shapes, other meaning, e.g. 4
  heads of 32 read as 8 of 16): refused, naming the argument and both values;
* **hyperparameters** (learning rate, schedule, weight decay, clipping): the new value applies
  from the resumed step on, and each change is reported in one line (the caller prints it and
  sets the values that live in the optimizer state);
* **data order** (seed, batch size, corpus): a different value silently changes which batches
  follow: refused unless ``allow_data_change``.

Arguments in no class (layout, logging, paths) may change freely: a checkpoint loads into any
layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = ["ArgChange", "compare_run_args"]


class ArgChange(NamedTuple):
    """A hyperparameter that differs from the checkpoint's: it applies from now on."""

    name: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return (f"{_flag(self.name)} changed from {_shown(self.saved)} (checkpoint) to "
                f"{_shown(self.current)}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    # An unset flag is None in the saved arguments: say what it means, not "None".
    return "unset (its default)" if value is None else repr(value)


def compare_run_args(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    model: Iterable[str],
    hyper: Iterable[str],
    data: Iterable[str],
    allow_data_change: bool = False,
    override_flag: str = "--allow-data-change",
) -> list[ArgChange]:
    """The hyperparameter changes, in ``hyper``'s order; ``ValueError`` for a model or (unless
    ``allow_data_change``) data-order argument that differs.

    A name absent from ``saved`` (a checkpoint older than the flag) is not compared.
    """
    def differ(names: Iterable[str]) -> list[tuple[str, Any, Any]]:
        return [(n, saved[n], current.get(n)) for n in names
                if n in saved and saved[n] != current.get(n)]

    for name, old, new in differ(model):
        raise ValueError(
            f"{_flag(name)} {_shown(new)} does not match the checkpoint's {_flag(name)} "
            f"{_shown(old)}: it defines the model (or its optimizer state); resume with the "
            "checkpoint's value"
        )
    changed_data = differ(data)
    if changed_data and not allow_data_change:
        name, old, new = changed_data[0]
        raise ValueError(
            f"{_flag(name)} {_shown(new)} does not match the checkpoint's {_flag(name)} "
            f"{_shown(old)}: it changes the data order; resume with the checkpoint's value, or "
            f"pass {override_flag} to continue with the new data order"
        )
    return [ArgChange(n, old, new) for n, old, new in differ(hyper)]
