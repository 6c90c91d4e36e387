"""One run owns a checkpoint directory: a lock while it writes, and a run id in every checkpoint.

Two runs given one checkpoint directory (a sweep launched with one default) would replace each
other's ``step_*`` checkpoints, and a later resume would continue whichever wrote last. So a
run that writes checkpoints first :func:`claim_checkpoint_dir`: rank 0 takes the directory's
lock (:class:`~funcpar.state.dir_lock.DirLock`: pid and host; a dead holder's lock is taken
over) and checks that the newest complete checkpoint there is this run's own - its
``extra_meta["run_id"]`` equals this run's id, which a run creates at its start
(:func:`new_run_id`) and a resumed run takes over from the checkpoint it resumed. A checkpoint
without a run id (written before ids existed) counts as the resumed run's. Anything else is a
:class:`~funcpar.state.checkpoint.CheckpointError` on every rank before the first step, unless
the caller allows it. :func:`check_one_run` refuses to resume from a directory whose
checkpoints come from more than one run.
"""

from __future__ import annotations

import os
import uuid

from funcpar.state.checkpoint import (
    CheckpointError,
    _broadcast,
    _rank_world,
    latest_checkpoint,
    read_index,
)
from funcpar.state.dir_lock import DirLock, LockHeld

__all__ = ["LOCK_NAME", "check_one_run", "claim_checkpoint_dir", "new_run_id", "run_id_of"]

LOCK_NAME = ".funcpar-checkpoints.lock"


def new_run_id() -> str:
    """A fresh run id: 16 hex digits of a random UUID."""
    return uuid.uuid4().hex[:16]


def run_id_of(checkpoint: str) -> str | None:
    """The run id saved in ``checkpoint``'s index (None for one saved without)."""
    return read_index(checkpoint, verify_files=False)["extra_meta"].get("run_id")


def claim_checkpoint_dir(directory: str | os.PathLike, run_id: str, *, resumed: bool = False,
                         allow_other_run: bool = False) -> DirLock | None:
    """Take ``directory`` for run ``run_id`` (module docstring); a collective. Returns the
    held lock on rank 0 (release it when the run ends), None on the others. ``resumed``: this
    run continues a checkpoint (one without a run id then counts as its own).
    ``allow_other_run``: write over another run's checkpoints (the lock is still required)."""
    rank, _ = _rank_world()
    lock, err = None, None
    if rank == 0:
        directory = os.path.abspath(os.fspath(directory))
        lock = DirLock(os.path.join(directory, LOCK_NAME))
        try:
            os.makedirs(directory, exist_ok=True)
            lock.acquire()
            newest = latest_checkpoint(directory)
            other = None if newest is None else run_id_of(newest)
            if newest is not None and other != run_id and not (other is None and resumed) \
                    and not allow_other_run:
                lock.release()
                err = (f"checkpoint directory {directory} holds another run's checkpoints "
                       f"(newest {os.path.basename(newest)}, run "
                       f"{other or 'without a run id'}; this run is {run_id}): writing here "
                       "would replace them. Use another --ckpt-dir, --resume that run, or "
                       "--allow-other-run to write over them")
        except LockHeld as held:
            err = (f"checkpoint directory {directory} is in use by process {held.pid} on "
                   f"{held.host} (lock {held.path}): one run writes a checkpoint directory. "
                   "If no funcpar run is using it, delete the lock file")
        except (OSError, CheckpointError) as e:
            lock.release()
            err = f"cannot use checkpoint directory {directory}: {e}"
    err = _broadcast(err)
    if err is not None:
        raise CheckpointError(err)
    return lock


def check_one_run(directory: str | os.PathLike, *, allow_other_run: bool = False) -> None:
    """Refuse to resume from ``directory`` when its complete checkpoints carry more than one
    run id (two runs wrote there; ids absent in old checkpoints are not counted). Every rank
    reads the same files, so every rank refuses alike."""
    directory = os.path.abspath(os.fspath(directory))
    if allow_other_run or not os.path.isdir(directory) or latest_checkpoint(directory) in (
            None, directory):
        return
    runs: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if entry.startswith(".") or not os.path.isdir(path):
            continue
        try:
            rid = run_id_of(path)
        except (CheckpointError, OSError):
            continue  # incomplete: latest_checkpoint skips it with a warning
        if rid is not None:
            runs.setdefault(rid, []).append(entry)
    if len(runs) > 1:
        which = "; ".join(f"run {r}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
                          for r, v in runs.items())
        raise CheckpointError(f"{directory} holds checkpoints of {len(runs)} runs ({which}): "
                              "the newest may not be the run you mean. Resume one "
                              "checkpoint directly (--resume DIR/step_N) or pass "
                              "--allow-other-run")
