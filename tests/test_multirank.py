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


# ---------------------------------------------- ranks agree on their run (issue 20, item 7)

def _agree_cases():
    """check_ranks_agree on configs that differ on rank 1 only: each message, or None."""
    from funcpar.shard.agree import check_ranks_agree
    from funcpar.shard.mesh import DeviceMesh

    mesh = DeviceMesh.from_env(dp=2)
    rank = dist.get_rank()
    base = {"steps": 20, "seed": 0, "lr": 3e-3, "optim": "adamw"}
    out = {}
    for key, other in (("seed", 1), ("lr", 1e-2), ("optim", "sgd"), (None, None)):
        config = dict(base)
        if key is not None and rank == 1:
            config[key] = other
        try:
            check_ranks_agree(mesh, config)
            out[key] = None
        except ValueError as err:
            out[key] = str(err)
    w = torch.full((2, 3), float(rank))  # rank 1's "initial replica" differs
    try:
        check_ranks_agree(mesh, base, {"layers.0.w": w})
    except ValueError as err:
        out["params"] = str(err)
    return out


def test_ranks_with_different_arguments_are_refused_naming_the_argument():
    for res in run_ranks(_agree_cases, 2, backend=None, timeout=60):  # every rank raises
        assert "--seed is 0 on rank 0 and 1 on rank 1" in res["seed"]
        assert "--lr is 0.003 on rank 0 and 0.01 on rank 1" in res["lr"]
        assert "--optim is 'adamw' on rank 0 and 'sgd' on rank 1" in res["optim"]
        assert res[None] is None
        assert "leaf 'layers.0.w' on rank 1" in res["params"]


def _train_lm_rank(argvs: list[list[str]]) -> None:
    from _examples import load_example

    load_example("train_lm.py", "train_lm_rank").main(argvs[int(os.environ["RANK"])])


def test_train_lm_with_other_steps_per_rank_fails_at_start_not_hangs(tmp_path):
    """The audit's repro: --steps 30 on one rank, 20 on the other hung both for 180 s+."""
    common = ["--batch-size", "2", "--seq-len", "16", "--dim", "16", "--layers", "1", "--heads",
              "2", "--device", "cpu", "--corpus-bytes", "60000", "--data-cache",
              str(tmp_path / "dc"), "--logdir", str(tmp_path / "tb")]
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"--steps is 30 on rank 0 and 20 on rank 1"):
        run_ranks(_train_lm_rank, 2, [["--steps", "30", *common], ["--steps", "20", *common]],
                  backend=None, timeout=60)
    assert time.monotonic() - t0 < 120


def _lonely_all_reduce(seconds: float):
    """Rank 0 all-reduces alone under a short mesh timeout; rank 1 waits until it has failed."""
    from funcpar.shard.mesh import TIMEOUT_ENV, DeviceMesh

    os.environ[TIMEOUT_ENV] = str(seconds)
    DeviceMesh.from_env(dp=2)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["rank0_done"], __import__("datetime").timedelta(seconds=60))
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        error = None
    except RuntimeError as err:
        error = str(err)
    store.set("rank0_done", "1")
    return {"error": error, "waited": time.monotonic() - t0}


def test_a_short_mesh_timeout_turns_a_hang_into_an_error():
    res = run_ranks(_lonely_all_reduce, 2, 3.0, backend=None, timeout=60)[0]
    assert res["error"] is not None and "timed out" in res["error"].lower(), res
    assert 2.5 < res["waited"] < 30, res


def test_the_default_mesh_timeout_is_finite_and_configurable(monkeypatch):
    from datetime import timedelta

    from funcpar.shard.mesh import DEFAULT_TIMEOUT, TIMEOUT_ENV, default_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert default_timeout() == DEFAULT_TIMEOUT == timedelta(minutes=10)
    monkeypatch.setenv(TIMEOUT_ENV, "42")
    assert default_timeout() == timedelta(seconds=42)
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="FUNCPAR_DIST_TIMEOUT must be a positive number"):
        default_timeout()
