"""What the NVMe store checks (issue 20, item 5): a directory it cannot write is a StoreError
at open naming the path; a write behind that fails is reported by the step that wrote or the
next one; the checksum covers the header's shape, dtype and tag; a store directory held by
another live process is refused naming its pid (a dead holder's lock is taken over); saving an
offloaded state without its step is refused naming offload, and with it the state is read back
from the store (fp32 masters as the params) and a resume from it repeats the straight run.

A one-Linear model keeps each case well under a second.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess

import pytest
import torch

import funcpar.offload.store as store_mod
from funcpar.offload import BLOCK, NvmeStore, StoreError
from funcpar.optim import adamw
from funcpar.state import functionalize, init_state, load, save
from funcpar.state.tree import tree_leaves
from funcpar.train import make_train_step
from funcpar.transforms import amp_cast, compose
from funcpar.transforms.offload import offload, read_masters, read_state


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _step_state(path, seed=0):
    torch.manual_seed(seed)
    apply_fn, params, buffers = functionalize(torch.nn.Linear(32, 16))
    opt = adamw(lr=1e-2)
    off = offload("nvme", path=path)
    step, state = off(make_train_step(apply_fn, _mse, opt), init_state(params, buffers, opt))
    return step, state, off


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 32, generator=g), torch.randn(4, 16, generator=g)


def test_unwritable_directory_is_a_store_error_at_open(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("")
    with pytest.raises(StoreError, match=r"cannot create the directory .*a_file/store") as err:
        NvmeStore(afile / "store")
    assert err.value.path == str(afile / "store")
    ro = tmp_path / "ro"
    os.makedirs(ro)
    os.chmod(ro, 0o555)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode bits: nothing to refuse here
            NvmeStore(ro).close()
        else:
            with pytest.raises(StoreError, match=r"cannot write in .*ro .*writable directory"):
                NvmeStore(ro)
    finally:
        os.chmod(ro, 0o755)


def test_failed_write_is_reported_by_the_next_step(tmp_path, monkeypatch):
    step, state, off = _step_state(tmp_path)
    state, _ = step(state, _batch(0))
    # Step 0's writes land first: still in flight when pwrite fails, one of them would fail
    # and be raised by step 1's read of it, before step 1 wrote anything (a flaky test).
    off.store.flush()
    real = os.pwrite

    def readonly(fd, data, offset):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(store_mod.os, "pwrite", readonly)
    # The writes of this step fail behind it: reported at its end when they failed already,
    # else at the start of the next one, before any read.
    with pytest.raises(StoreError, match=r"writing tensor 'opt\.r0\..*' to .*\.fpt failed: "
                                         r".*Read-only file system"):
        state, _ = step(state, _batch(1))
        state, _ = step(state, _batch(2))
    monkeypatch.setattr(store_mod.os, "pwrite", real)
    # Each failure is raised once: the step's other failed writes (four moments) at flush,
    # those the steps above have not met already. How many that leaves depends on the order
    # in which the write-behind threads fail (a full-suite CI run once had none left), so
    # flush may raise one of them or nothing, never another error.
    try:
        off.store.flush()
    except StoreError as err:
        assert "Read-only file system" in str(err)
    off.store.close()


def _rewrite_header(path, edit):
    with open(path, "r+b") as f:
        block = f.read(BLOCK)
        magic, line = block.split(b"\n", 1)[0] + b"\n", block.split(b"\n", 2)[1]
        header = json.loads(line)
        edit(header)
        head = magic + json.dumps(header).encode() + b"\n"
        f.seek(0)
        f.write(head + bytes(BLOCK - len(head)))


def test_header_shape_dtype_and_tag_are_checksummed(tmp_path):
    store = NvmeStore(tmp_path)
    x = torch.randn(64, 32)
    edits = {"shape": lambda h: h.update(shape=[32, 64]),
             "dtype": lambda h: h.update(dtype="torch.int32"),
             "tag": lambda h: h.update(tag=5)}
    for what, edit in edits.items():
        store.put("w", x, tag=5 if what != "tag" else 4)
        store.flush()
        assert torch.equal(store.get("w"), x)
        _rewrite_header(store.path("w"), edit)
        with pytest.raises(StoreError, match=r"'w'.*is corrupt .*covers the data and the "
                                             r"header's key, dtype, shape"):
            store.get("w")
    store.close()


def test_a_live_holder_is_refused_a_dead_one_taken_over(tmp_path):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock = tmp_path / ".funcpar-store-rank00000.lock"
        lock.write_text(f"{holder.pid} {socket.gethostname()}\n")
        with pytest.raises(StoreError, match=rf"in use by process {holder.pid} on "):
            NvmeStore(tmp_path)
        assert lock.read_text().split()[0] == str(holder.pid)  # left to its holder
    finally:
        holder.kill()
        holder.wait()
    store = NvmeStore(tmp_path)  # the holder is gone: its lock is stale
    assert lock.read_text().split()[0] == str(os.getpid())
    store.close()
    assert not lock.exists()


def test_saving_an_offloaded_state(tmp_path):
    step0, straight, off0 = _step_state(tmp_path / "store0")
    for i in range(4):
        straight, _ = step0(straight, _batch(i))
    step, state, off = _step_state(tmp_path / "store")
    for i in range(2):
        state, _ = step(state, _batch(i))
    with pytest.raises(TypeError, match=r"leaf 'opt_state\..*' is a meta tensor .*offload "
                                        r"transform lives in its store \(pass step="):
        save(state, tmp_path / "ck")  # without the step, nothing says where the data are
    path = save(state, tmp_path / "ck", step=step)
    # Saved as a run without offload holds it: load into such a state, offload it again, and
    # train on: the same bits as the run that never stopped.
    torch.manual_seed(1)
    apply_fn, params, buffers = functionalize(torch.nn.Linear(32, 16))
    opt = adamw(lr=1e-2)
    fresh = init_state(params, buffers, opt)
    back = load(path, fresh)
    plain = read_state(state.opt_state, off.store)
    for a, b in zip(tree_leaves(back.opt_state), tree_leaves(plain)):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
    off3 = offload("nvme", path=tmp_path / "store3")
    step3, resumed = off3(make_train_step(apply_fn, _mse, opt), back)
    for i in range(2, 4):
        resumed, _ = step3(resumed, _batch(i))
    for a, b in zip(tree_leaves(resumed.params), tree_leaves(straight.params)):
        assert torch.equal(a, b)
    for o in (off0, off, off3):
        o.store.close()


def test_saving_offloaded_masters(tmp_path):
    # With the fp32 masters in the store the checkpoint holds them as the params (the state
    # of amp_cast without offload), not the bf16 compute copies the step holds.
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(torch.nn.Linear(32, 16))
    opt = adamw(lr=1e-2)
    off = offload("nvme", ("opt_state", "master_params"), path=tmp_path / "store")
    step, state = compose(amp_cast("bf16"), off)(make_train_step(apply_fn, _mse, opt),
                                                  init_state(params, buffers, opt))
    state, _ = step(state, _batch(0))
    assert state.params["weight"].dtype == torch.bfloat16
    path = save(state, tmp_path / "ck", step=step)
    back = load(path, init_state(params, buffers, opt))
    masters = read_masters(state.params, state.opt_state, off.store)
    assert back.params["weight"].dtype == torch.float32
    assert torch.equal(back.params["weight"], masters["weight"])
    assert torch.equal(back.params["weight"].bfloat16(), state.params["weight"])
    off.store.close()


def _zero2_saves(root):
    from funcpar.shard.mesh import DeviceMesh
    from funcpar.transforms import data_parallel, zero_partition

    mesh = DeviceMesh.from_env(dp=2, tp=1)
    for name, off in (("plain", None), ("offloaded", offload("nvme", path=f"{root}/store"))):
        torch.manual_seed(0)
        apply_fn, params, buffers = functionalize(torch.nn.Linear(32, 16))
        opt = adamw(lr=1e-2)
        ts = [data_parallel(mesh), zero_partition(2, mesh)] + ([off] if off else [])
        step, state = compose(*ts)(make_train_step(apply_fn, _mse, opt),
                                   init_state(params, buffers, opt))
        for i in range(2):
            state, _ = step(state, _batch(i))
        save(state, f"{root}/{name}", step=step)
        if off is not None:
            off.store.close()


def test_saving_an_offloaded_zero2_state(tmp_path):
    from funcpar.testing import run_ranks

    run_ranks(_zero2_saves, 2, str(tmp_path), backend=None, timeout=120)
    _apply, params, buffers = functionalize(torch.nn.Linear(32, 16))
    like = init_state(params, buffers, adamw(lr=1e-2))
    plain, offloaded = (load(tmp_path / n, like) for n in ("plain", "offloaded"))
    for a, b in zip(tree_leaves(plain), tree_leaves(offloaded)):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
