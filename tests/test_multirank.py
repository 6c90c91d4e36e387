"""The multi-rank harness: results come back, failures name their rank, hangs are killed, and
no rank process outlives a call."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from funcpar.testing import RankError, RanksTimeout, run_ranks


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _typechecked() -> bool:
    """The jaxtyping hook is installed, and funcpar's modules (preloaded by the forkserver in a
    rank) are instrumented by it: a checked function is a wrapper."""
    hooked = any(type(f).__module__.startswith("jaxtyping") for f in sys.meta_path)
    from funcpar.optim.projector import fit_projector

    return hooked and hasattr(fit_projector, "__wrapped__")


def _report(scale, *, offset):
    t = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {"env": env, "sum": t * scale + offset, "world": dist.get_world_size(),
            "pid": os.getpid(), "typechecked": _typechecked()}


def test_results_come_back_by_rank():
    out = run_ranks(_report, 2, 10.0, offset=1, timeout=60)
    assert [o["env"] for o in out] == [
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1"}
        for r in range(2)]
    assert all(torch.equal(o["sum"], torch.tensor([11.0], dtype=torch.float64)) for o in out)
    assert all(o["world"] == 2 for o in out)
    assert all(_gone(o["pid"]) for o in out)
    # ranks check annotations exactly when this process does (pytest's jaxtyping hook)
    assert all(o["typechecked"] == _typechecked() for o in out)


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes: must be killed, not awaited


def test_exception_names_the_rank_and_carries_its_traceback():
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ValueError: rank one is broken") as e:
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    assert e.value.rank == 1
    assert "_raise_on_rank_1" in e.value.remote_traceback
    assert isinstance(e.value.__cause__, ValueError)
    assert multiprocessing.active_children() == []


def _die_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def test_a_rank_dying_without_exception_is_reported():
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ProcessDied: .*exit code 7"):
        run_ranks(_die_on_rank_1, 2, timeout=60)


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)
    return os.getpid()


def test_a_hanging_rank_is_killed_at_the_timeout():
    t0 = time.monotonic()
    # 5 s: rank 0 must finish (tear down its group, send its result) within it, even on a
    # loaded machine; rank 1 never does.
    with pytest.raises(RanksTimeout, match=r"ranks \[1\] of 2 did not finish within 5 s") as e:
        run_ranks(_hang_on_rank_1, 2, timeout=5)
    assert e.value.ranks == [1] and len(e.value.pids) == 2
    assert all(_gone(pid) for pid in e.value.pids)  # killed and reaped, rank 0 included
    assert multiprocessing.active_children() == []
    assert time.monotonic() - t0 < 60  # start-up is not counted in the 0.5 s


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(lambda: 0, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        run_ranks(_report, 0)
    with pytest.raises(ValueError, match="timeouts must be positive"):
        run_ranks(_report, 2, timeout=0)
