"""Run a function on N local ranks, as torchrun would, and bring back what each returned.

``run_ranks(fn, world_size, *args, **kwargs)`` starts ``world_size`` processes with the torchrun
environment (``MASTER_ADDR``/``MASTER_PORT`` on a port free at call time, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), initialises the default process group
(gloo unless told otherwise), calls ``fn(*args, **kwargs)`` on each, and returns the results
as a list indexed by rank (tensors come back on CPU). ``fn`` must be picklable by reference: a
top-level function of an importable module.

It never hangs and never leaves a rank behind:

* the first rank to raise fails the whole run - the others are killed at once (they would wait
  forever in their next collective) and :class:`RankError` names the rank and carries its
  traceback, chained to the original exception when that pickles;
* ``timeout`` seconds after every rank has started (imports done, so a short timeout is not
  eaten by importing torch), the ranks still running are killed and :class:`RanksTimeout` is
  raised; start-up has its own limit, ``start_timeout``;
* every rank is killed and reaped on the way out, whatever happened; a rank whose parent dies
  kills itself within a second.

Ranks are forked from a forkserver that has imported torch and funcpar once (spawn where there
is no forkserver), so a run costs a fraction of a second after the first. When this process
checks types with an import hook (the test suite's, from :mod:`funcpar.typecheck_hook`, or
jaxtyping's) the ranks install the same hooks, so code run on the ranks is checked too.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from funcpar.typecheck_hook import HOOKS_ENV, active_hooks, install_hooks

__all__ = ["RankError", "RanksTimeout", "free_port", "run_ranks"]

_PRELOAD = ["torch", "torch.distributed"]
_RANK_PRELOAD = "funcpar.testing.rank_preload"


class RankError(RuntimeError):
    """A rank raised: ``rank``, its exception type name, and its ``remote_traceback``."""

    def __init__(self, rank: int, world_size: int, kind: str, message: str, tb: str) -> None:
        super().__init__(
            f"rank {rank} of {world_size} raised {kind}: {message}\n"
            f"--- traceback on rank {rank} ---\n{tb.rstrip()}"
        )
        self.rank = rank
        self.kind = kind
        self.remote_traceback = tb


class RanksTimeout(TimeoutError):
    """Ranks did not finish in time; ``ranks`` lists them (all were killed), ``pids`` all pids."""

    def __init__(self, message: str, ranks: list[int], pids: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.pids = pids


def free_port() -> int:
    """A TCP port free on localhost now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(hooks: list[tuple[str, list[str]]]) -> Any:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # Only takes effect if the forkserver is not running yet; then every rank starts with
        # torch and funcpar already imported, funcpar checked by this process's hooks (read by
        # the preload module from the environment the forkserver inherits).
        os.environ[HOOKS_ENV] = json.dumps(hooks)
        ctx.set_forkserver_preload([*_PRELOAD, _RANK_PRELOAD])
        return ctx
    return multiprocessing.get_context("spawn")


def _watch_parent() -> None:
    """Exit when the process that started this rank is gone (no orphan waits in a collective)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="funcpar-parent-watch").start()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    hooks: list[tuple[str, list[str]]],
    payload: bytes,
    conn: Any,
) -> None:
    """What each rank runs: environment, process group, ``fn``, result or error to the parent."""
    _watch_parent()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if sys.platform.startswith("linux"):
        # All ranks are on this host: talk over loopback, whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ok = False
    failed_at = None
    try:
        import torch
        import torch.distributed as dist

        # Ranks share the host's cores; one thread each avoids oversubscription.
        torch.set_num_threads(1)
        install_hooks(hooks)
        fn, args, kwargs = pickle.loads(payload)
        conn.send(("ready",))
        try:
            if backend is not None:
                dist.init_process_group(backend, rank=rank, world_size=world_size)
            result = fn(*args, **kwargs)
        except BaseException:
            # Stamped before the group is torn down: tearing it down makes the peers fail
            # too, and the parent reports the earliest failure as the cause.
            failed_at = time.time()
            raise
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)
        msg: tuple[Any, ...] = ("ok", buf.getvalue())
        ok = True
    except BaseException as err:
        try:
            exc = pickle.dumps(err)
            pickle.loads(exc)
        except Exception:
            exc = None
        msg = ("error", failed_at or time.time(), type(err).__qualname__, str(err),
               traceback.format_exc(), exc)
    try:
        conn.send(msg)
    finally:
        conn.close()
    if not ok:
        sys.exit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    start_timeout: float = 120.0,
    backend: str | None = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` ranks; the results, indexed by rank.

    ``backend``: the default process group each rank initialises before ``fn`` (and destroys
    after); None leaves torch.distributed uninitialised for ``fn`` to set up (e.g. through
    ``DeviceMesh.from_env``), the environment being set either way. ``timeout`` counts from the
    moment every rank has started. Raises :class:`RankError` (first rank to fail) or
    :class:`RanksTimeout`; no rank outlives the call.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0 or not start_timeout > 0:
        raise ValueError(f"timeouts must be positive, got {timeout=} {start_timeout=}")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise TypeError(
            f"run_ranks needs fn and its arguments picklable (fn a top-level function of an "
            f"importable module): {err}"
        ) from err

    hooks = active_hooks()
    ctx = _context(hooks)
    port = free_port()
    procs, conns = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, backend, hooks, payload, writer),
                name=f"funcpar-rank-{rank}",
                daemon=True,
            )
            p.start()
            writer.close()
            procs.append(p)
            conns.append(reader)
        return _collect(procs, conns, timeout, start_timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
            p.close()
        for c in conns:
            c.close()


#: After a rank's error, how long the parent waits for the other ranks' reports (seconds).
ERROR_GRACE_S = 5.0


def _collect(procs: list[Any], conns: list[Any], timeout: float, start_timeout: float) -> list:
    n = len(procs)
    ready: set[int] = set()
    results: dict[int, Any] = {}
    errors: list[tuple[float, int, tuple[Any, ...]]] = []
    exited: set[int] = set()
    start_deadline = time.monotonic() + start_timeout
    deadline: float | None = None

    def drain(rank: int) -> None:
        conn = conns[rank]
        while not conn.closed and conn.poll():
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                conn.close()
                return
            if msg[0] == "ready":
                ready.add(rank)
            elif msg[0] == "ok":
                results[rank] = msg[1]
            else:
                errors.append((msg[1], rank, msg))

    grace: float | None = None
    while len(results) < n:
        now = time.monotonic()
        if errors:
            # The first error to arrive need not be the cause: a peer blocked in a collective
            # fails as soon as the failing rank tears its group down, possibly before that
            # rank's own report is read. Wait briefly for every rank to report or exit.
            grace = now + ERROR_GRACE_S if grace is None else grace
            if now >= grace or all(r in results or r in exited for r in range(n)):
                break
        if deadline is None and len(ready) == n:
            deadline = now + timeout
        limit = deadline if deadline is not None else start_deadline
        if now >= limit and not errors:
            late = [r for r in range(n) if r not in results]
            what = "finish" if deadline is not None else "start"
            allowed = timeout if deadline is not None else start_timeout
            raise RanksTimeout(
                f"ranks {late} of {n} did not {what} within {allowed} s (finished: "
                f"{sorted(results)}); all ranks were killed",
                late,
                [p.pid for p in procs],
            )
        waitables = [c for c in conns if not c.closed] + [
            p.sentinel for r, p in enumerate(procs) if r not in exited
        ]
        wait_until = limit if grace is None else grace
        multiprocessing.connection.wait(waitables, timeout=max(0.0, min(wait_until - now, 1.0)))
        for rank, p in enumerate(procs):
            drain(rank)
            if rank not in exited and p.exitcode is not None:
                drain(rank)
                exited.add(rank)
                if rank not in results and not any(r == rank for _, r, _ in errors):
                    errors.append((time.time(), rank, ("died", p.exitcode)))

    if errors:
        # A rank that died without a word is the likelier cause of its peers' errors (their
        # collectives lost a partner); otherwise the earliest exception is the cause.
        _, rank, msg = min(errors, key=lambda e: (e[2][0] != "died", e[0], e[1]))
        if msg[0] == "died":
            code = msg[1]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise RankError(rank, n, "ProcessDied", f"rank process ended ({how}) without a "
                            f"result", "(no traceback: the process died)")
        _, _, kind, message, tb, exc = msg
        err = RankError(rank, n, kind, message, tb)
        original = None
        if exc is not None:
            try:
                original = pickle.loads(exc)
            except Exception:
                original = None
        raise err from original

    import torch

    return [torch.load(io.BytesIO(results[r]), map_location="cpu", weights_only=False)
            for r in range(n)]
