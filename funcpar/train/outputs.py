"""Outputs checked before training: a run that cannot write its results fails at the start.

A path the run writes only after training (the trained parameters, say) that turns out to be
unwritable would throw the training away. :func:`check_writable` creates and removes a probe
file where each output goes, on rank 0 (which writes them), and every rank raises the same
``ValueError`` naming the flag, the path and the cause before the first step.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence

from funcpar.state.checkpoint import _broadcast, _rank_world

__all__ = ["check_writable"]


def check_writable(outputs: Sequence[tuple[str, str | None, bool]]) -> None:
    """``outputs``: ``(flag, path, is_directory)``, None paths skipped. A directory is made if
    missing and probed; a file's directory likewise, and an existing file must be a
    writable file. A collective under torch.distributed (rank 0 probes, all raise)."""
    err = None
    if _rank_world()[0] == 0:
        for flag, path, is_dir in outputs:
            if path is not None and (err := _probe(path, is_dir)) is not None:
                err = f"{flag} {path}: cannot write there ({err}); refused before training"
                break
    err = _broadcast(err)
    if err is not None:
        raise ValueError(err)


def _probe(path: str, is_dir: bool) -> str | None:
    where = path if is_dir else os.path.dirname(os.path.abspath(path))
    try:
        if not is_dir and os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        os.makedirs(where, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".funcpar-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
        if not is_dir and os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "the file is not writable")
    except OSError as e:
        return e.strerror or str(e)
    return None
