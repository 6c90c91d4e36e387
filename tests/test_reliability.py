"""Issue 29: a checkpoint directory has one owner, every I/O failure is one clear line, outputs
are checked before training, and a run that only skips steps gives up."""

from __future__ import annotations

import errno
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _examples import load_example

import funcpar.optim as fo
from funcpar.state import (
    CheckpointError,
    claim_checkpoint_dir,
    functionalize,
    init_state,
    latest_checkpoint,
    load,
    save,
)
from funcpar.state import checkpoint as ckpt_mod
from funcpar.state.ckpt_owner import LOCK_NAME
from funcpar.train import make_train_step
from funcpar.train.cli import EXIT_CODE, run_cli
from funcpar.transforms import skip_nonfinite
from funcpar.transforms.skip_nonfinite import NonFiniteError

ROOT = Path(__file__).resolve().parents[1]
train_lm = load_example("train_lm.py", "train_lm_reliability")


def _tiny(tmp: Path, *extra: str) -> list[str]:
    return ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dim", "16", "--layers",
            "1", "--heads", "2", "--device", "cpu", "--corpus-bytes", "60000", "--data-cache",
            str(tmp / "dc"), "--logdir", str(tmp / "tb"), *extra]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture
def live_pid():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_second_writer_is_refused_and_the_first_runs_checkpoints_stay(tmp_path, capsys,
                                                                        live_pid):
    ck = tmp_path / "ck"
    train_lm.main(_tiny(tmp_path, "--save-every", "2", "--ckpt-dir", str(ck)))
    first = latest_checkpoint(ck)
    before = {p.name: p.read_bytes() for p in Path(first).iterdir()}
    # Another live run holds the directory: refused before its first step, naming the holder.
    (ck / LOCK_NAME).write_text(f"{live_pid} {socket.gethostname()}\n")
    with pytest.raises(SystemExit) as exc:
        run_cli(train_lm.main, _tiny(tmp_path, "--save-every", "2", "--ckpt-dir", str(ck),
                                     "--resume", str(ck), "--steps", "4"))
    assert exc.value.code == EXIT_CODE
    assert f"in use by process {live_pid}" in _one_error_line(capsys)
    # Once it is free, a new run (not a resume) would replace the first run's checkpoints.
    (ck / LOCK_NAME).unlink()
    with pytest.raises(SystemExit):
        run_cli(train_lm.main, _tiny(tmp_path, "--save-every", "2", "--ckpt-dir", str(ck)))
    assert "holds another run's checkpoints" in _one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in Path(first).iterdir()} == before
    assert not (ck / LOCK_NAME).exists()  # released by the refused run


def test_a_stale_lock_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(f"{dead.pid} {socket.gethostname()}\n")
    lock = claim_checkpoint_dir(tmp_path, "run-a")
    assert (tmp_path / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_resuming_a_directory_of_two_runs_needs_the_flag(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    train_lm.main(_tiny(tmp_path, "--steps", "4", "--save-every", "4", "--ckpt-dir", ck))
    # A second run writes over it on purpose: the directory now holds two runs' checkpoints.
    train_lm.main(_tiny(tmp_path, "--save-every", "2", "--ckpt-dir", ck, "--allow-other-run"))
    with pytest.raises(SystemExit):
        run_cli(train_lm.main, _tiny(tmp_path, "--steps", "6", "--resume", ck))
    assert "holds checkpoints of 2 runs" in _one_error_line(capsys)
    out = train_lm.main(_tiny(tmp_path, "--steps", "6", "--resume", ck, "--allow-other-run"))
    assert int(out["state"].step) == 6


def _state(seed=0):
    net = torch.nn.Linear(4, 3)
    apply_fn, params, buffers = functionalize(net)
    opt = fo.adamw(lr=1e-2)
    return make_train_step(apply_fn, torch.nn.functional.mse_loss, opt), init_state(
        params, buffers, opt, seed=seed)


def test_a_failed_write_is_one_checkpoint_error_and_the_previous_checkpoint_loads(
        tmp_path, monkeypatch):
    _, state = _state()
    good = save(state, tmp_path / "step_1")
    real = ckpt_mod._sha256_file

    def full(path, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(ckpt_mod, "_sha256_file", full)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step_2 .*ENOSPC"):
        save(state, tmp_path / "step_2")
    monkeypatch.setattr(ckpt_mod, "_sha256_file", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # partial removed
    loaded = load(good, state)
    assert all(torch.equal(a, b) for a, b in zip(loaded.params.values(),
                                                 state.params.values(), strict=True))


def test_a_file_size_limit_during_a_save_ends_the_script_with_one_line(tmp_path):
    # RLIMIT_FSIZE: a write past 2 MiB fails with EFBIG (Python ignores SIGXFSZ), as on a
    # full disk or over a quota. The checkpoint's rank file (~3 MB: 0.27 M parameters and two
    # moments) is the first file that large (the tokenized corpus is ~0.5 MB).
    limit = 2 << 20

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    argv = _tiny(tmp_path, "--dim", "128", "--save-every", "2", "--ckpt-dir",
                 str(tmp_path / "ck"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_lm.py"), *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=cap)
    assert proc.returncode == EXIT_CODE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write checkpoint" in lines[0] and "EFBIG" in lines[0]
    assert not any((tmp_path / "ck").glob(".*partial*"))


def test_an_unwritable_save_path_is_refused_before_the_first_step(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        run_cli(train_lm.main, _tiny(tmp_path, "--save", str(blocker / "params.pt")))
    line = _one_error_line(capsys)
    assert "--save" in line and "refused before training" in line
    assert not (tmp_path / "tb").exists()  # nothing ran: the logger was never opened


def test_a_run_that_only_skips_gives_up():
    step, state = _state()
    step, state = skip_nonfinite("skip", give_up_after=3)(step, state)
    x, y = torch.full((2, 4), float("nan")), torch.zeros(2, 3)
    for _ in range(2):
        state, metrics = step(state, (x, y))
        assert bool(metrics["skipped"])
    with pytest.raises(NonFiniteError, match="3 consecutive steps .* giving up"):
        step(state, (x, y))
    with pytest.raises(ValueError, match="give_up_after"):
        skip_nonfinite("skip", give_up_after=0)


def _claim_on_ranks(directory: str, holder: str) -> str:
    # Rank 0 finds the directory held by another live process; every rank must raise alike
    # (none left waiting in a later collective).
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(directory, LOCK_NAME).write_text(holder)
    dist.barrier()
    try:
        claim_checkpoint_dir(directory, "run-b")
    except CheckpointError as err:
        return str(err)
    return "claimed"


@pytest.mark.slow
def test_every_rank_refuses_a_held_directory(tmp_path, live_pid):
    from funcpar.testing import run_ranks

    out = run_ranks(_claim_on_ranks, 2, str(tmp_path), f"{live_pid} {socket.gethostname()}\n",
                    timeout=60)
    assert out[0] == out[1] and f"in use by process {live_pid}" in out[0]


def test_a_read_only_store_directory_is_a_store_error(tmp_path, monkeypatch):
    # A read-only filesystem (EROFS; chmod does not stop root): at open, at a write-behind and
    # at close, a StoreError naming the path, never a raw OSError.
    import funcpar.offload.store as store_mod

    real = os.open

    def read_only(path, flags, *a, **k):
        if str(path).startswith(str(tmp_path)) and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, flags, *a, **k)

    monkeypatch.setattr(store_mod.os, "open", read_only)
    with pytest.raises(store_mod.StoreError, match="cannot write in"):
        store_mod.NvmeStore(tmp_path)
    monkeypatch.setattr(store_mod.os, "open", real)
    store = store_mod.NvmeStore(tmp_path)
    monkeypatch.setattr(store_mod.os, "open", read_only)
    with pytest.raises(store_mod.StoreError, match="a.fpt failed: .*Read-only"):
        store.put("a", torch.ones(100))
        store.flush()
    store.put("b", torch.ones(100))
    with pytest.raises(store_mod.StoreError, match="b.fpt failed"):
        store.close()


_PEER = """
import os, sys, time, torch, torch.distributed as dist
from funcpar.train.cli import run_cli
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
if rank == 0:
    os._exit(1)  # dies without a word, as a killed rank does
def main(argv):
    time.sleep(0.3)
    dist.all_reduce(torch.ones(3))
run_cli(main, [])
"""


@pytest.mark.slow
def test_a_dead_peer_without_torchrun_is_one_line_naming_the_rank_and_collective(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(_PEER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    init = str(tmp_path / "init")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), init], env=env,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        err = procs[1].communicate(timeout=120)[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == EXIT_CODE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: rank 1: another rank died during all_reduce ("), lines
