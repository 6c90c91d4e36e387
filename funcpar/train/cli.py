"""One-line errors for command-line scripts: ``run_cli(main)`` in every example.

A mistake the user can make (a corrupt or foreign checkpoint, a mesh that does not fit the
world, a missing corpus, an unwritable offload store, a flag a config check refuses) ends the
script with ``error: <message>`` on stderr and exit code :data:`EXIT_CODE` (2, argparse's code
for a usage error), without a traceback; ``--debug`` on the command line re-raises it with its
traceback. Any other exception (a bug) keeps its traceback.

Under torchrun every rank may raise the same error. Once the process group exists, each
failing rank posts its message in the group's key-value store; rank 0 prints its own, and a
rank ``r > 0`` prints (prefixed ``rank r:``) only when no lower rank posted the same message
within :data:`AGREE_WAIT_S` seconds, so an error all ranks share is printed once and a
rank-specific one names its rank. Before the group exists (argument and mesh-size checks, the
same on every rank) only rank 0 prints. A collective that fails because another rank died
(:func:`peer_lost`) is one line naming this rank and the collective, exit 2, on the survivors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from funcpar.offload.store import StoreError
from funcpar.transforms.skip_nonfinite import NonFiniteError

__all__ = ["AGREE_WAIT_S", "EXIT_CODE", "USER_ERRORS", "add_debug_flag", "peer_lost",
           "positive_int", "report_error", "run_cli"]

EXIT_CODE = 2
#: How long a failing rank > 0 looks for the same message from a lower rank before printing.
AGREE_WAIT_S = 2.0
#: What a user can cause: CheckpointError, layout/rules/mesh/config checks (ValueError), data
#: and file errors (OSError: FileNotFoundError, PermissionError), the offload store, and the
#: --nonfinite stop policy.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, StoreError, NonFiniteError)
_KEY = "funcpar_cli_error/"


def _store_and_rank() -> tuple[Any, int, int] | None:
    """The default group's store, this rank and the world size; None without a group."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None
    return store, dist.get_rank(), dist.get_world_size()


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.strerror}: {err.filename}"  # not "[Errno 2] ..."
    # One line: a multi-line message (rare) is joined, never cut.
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text[len("error: "):] if text.startswith("error: ") else text


def report_error(message: str, *, stream: Any = None) -> bool:
    """Print ``error: <message>`` unless a lower rank already printed the same; True if printed.

    ``message`` has no ``error:`` prefix. See the module docstring for the torchrun rule.
    """
    stream = sys.stderr if stream is None else stream
    group = _store_and_rank()
    if group is None:
        if int(os.environ.get("RANK", "0")) != 0:
            return False  # before the group: the same checks on every rank, rank 0 says it
        print(f"error: {message}", file=stream, flush=True)
        return True
    store, rank, world = group
    with contextlib.suppress(RuntimeError):  # the store is gone (its host exited): print
        store.set(f"{_KEY}{rank}", message)
    if rank == 0:
        print(f"error: {message}", file=stream, flush=True)
        # Rank 0 may host the store: stay until the other failing ranks have read it (each
        # posts "decided"), or until the wait is over (the others are not failing).
        _wait_for(store, [f"{_KEY}decided{q}" for q in range(1, world)], AGREE_WAIT_S + 1.0)
        return True
    same = _wait_for(store, [f"{_KEY}{q}" for q in range(rank)], AGREE_WAIT_S, message)
    with contextlib.suppress(RuntimeError):
        store.set(f"{_KEY}decided{rank}", "1")
    if same:
        return False
    print(f"error: rank {rank}: {message}", file=stream, flush=True)
    return True


def _wait_for(store: Any, keys: list[str], seconds: float, message: str | None = None) -> bool:
    """Poll ``keys``: True once one holds ``message`` (or, with no message, once all exist);
    False when ``seconds`` pass or the store goes away."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            present = [k for k in keys if store.check([k])]
            if message is None and len(present) == len(keys):
                return True
            if message is not None and any(store.get(k).decode() == message for k in present):
                return True
        except RuntimeError:
            return False
        time.sleep(0.05)
    return False


def run_cli(main: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None
            ) -> None:
    """``main(argv)``; a user error becomes one line on stderr and exit :data:`EXIT_CODE`.

    ``--debug`` in ``argv`` (default ``sys.argv[1:]``) shows the traceback instead; the script's
    parser must accept the flag (:func:`add_debug_flag`). A ``SystemExit`` whose code is a
    message (``raise SystemExit("error: ...")``) gets the same treatment and exit code. The
    default process group, if one is left, is destroyed on the way out.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        main(args)
    except USER_ERRORS as err:
        if "--debug" in args:
            raise
        report_error(_first_line(err))
        raise SystemExit(EXIT_CODE) from None
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        report_error(_first_line(SystemExit(err.code)))
        raise SystemExit(EXIT_CODE) from None
    except RuntimeError as err:
        lost = peer_lost(err)
        if lost is None or "--debug" in args:
            raise
        # Not one the ranks share: the dead rank's own output says why it died.
        print(f"error: {lost}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE) from None
    finally:
        _leave_group()


#: What torch.distributed's backends say when the process at the other end is gone.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "remote process exited")


def peer_lost(err: BaseException) -> str | None:
    """The one line for a collective that failed because another rank died (a gloo or NCCL
    connection error), naming this rank and the collective (the innermost
    ``torch.distributed`` call in the traceback); None for any other error. Without
    torchrun nothing else stops the survivor, whose traceback would otherwise bury the
    cause."""
    text = str(err)
    if not any(p in text for p in _PEER_GONE):
        return None
    op, tb = "a collective", err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "torch/distributed/distributed_c10d.py" in code.co_filename.replace("\\", "/"):
            op = code.co_name
            break
        tb = tb.tb_next
    rank = os.environ.get("RANK")
    group = _store_and_rank()
    if group is not None:
        rank = str(group[1])
    who = f"rank {rank}: " if rank is not None else ""
    cause = text.split("] ", 1)[-1].split(". ", 1)[0]
    return (f"{who}another rank died during {op} ({cause}); its own output says why, this "
            "rank stops")


def add_debug_flag(parser: Any) -> None:
    """``--debug``: show the traceback of a user error (read by :func:`run_cli`)."""
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error instead of its one line")


def positive_int(text: str) -> int:
    """An argparse ``type=`` for counts (steps, rounds, widths): a usage error below 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _leave_group() -> None:
    # Under torchrun: leave the process group cleanly (torch warns about a live one).
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
