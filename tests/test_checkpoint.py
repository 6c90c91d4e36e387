"""Checkpoints: exact resume, resharding across layouts, atomicity against a kill, refusal of
another model, export of whole params.

The distributed runs use funcpar.testing.reference's example Llama (uneven tp/dp shards)
in float64 with Adafactor + momentum, whose state holds same-shape moments and factored
row/column statistics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import (
    CheckpointError,
    export_params,
    functionalize,
    init_state,
    latest_checkpoint,
    load,
    read_index,
    save,
)
from funcpar.state.tree import named_leaves
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, OPTIMIZERS, batches, max_rel
from funcpar.train import make_train_step
from funcpar.transforms import compose, data_parallel, shard_params, zero_partition

OPTIM = "adafactor_momentum"
#: Steps before the save and after the resume: three each make every state leaf (moments,
#: factored statistics, counts, loss scale, data position, RNG) differ from its initial value.
HALF = 3
HERE = os.path.dirname(os.path.abspath(__file__))


def _noisy_loss(out, targets):
    # Draws from the step's RNG (state.rng), so a resume that lost the RNG changes the losses.
    return lm_loss(out + 0.01 * torch.randn_like(out), targets)


def _build(tp=1, dp=1, zero=0, *, init_seed=0, loss=lm_loss, cfg=CFG, optim=OPTIM,
           dtype=torch.float64):
    mesh = DeviceMesh.from_env(dp=dp, tp=tp)
    torch.manual_seed(init_seed)
    model = Llama(cfg).to(dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params)
    step = make_train_step(apply_fn, loss, opt)
    state = init_state(params, buffers, opt, seed=init_seed)
    state = state._replace(extras={"data_pos": torch.zeros((), dtype=torch.int64),
                                   "loss_scale": torch.tensor(65536.0)})
    ts = []
    if tp > 1:
        ts.append(shard_params(llama_rules(cfg.head_dim), mesh))
    if dp > 1:
        ts.append(data_parallel(mesh))
    if zero:
        ts.append(zero_partition(zero, mesh))
    step, state = compose(*ts)(step, state)
    return step, state


def _train(step, state, n):
    """``n`` steps; the batch comes from the data position in ``state.extras`` (as a resumable
    loader does), which advances with each step; the loss scale changes too."""
    data = batches()
    losses = []
    for _ in range(n):
        pos = int(state.extras["data_pos"])
        state, m = step(state, data[pos % len(data)])
        losses.append(float(m["loss"]))
        state = state._replace(extras={"data_pos": state.extras["data_pos"] + 1,
                                       "loss_scale": state.extras["loss_scale"] * 0.5})
    return state, losses


def _whole(step, state):
    return state.params if step.layouts is None else unshard_tree(state.params, step.layouts)


def _assert_same_state(a, b):
    la, lb = named_leaves(a), named_leaves(b)
    assert [n for n, _ in la] == [n for n, _ in lb]
    for (n, x), (_, y) in zip(la, lb):
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and torch.equal(x, y), n
        else:
            assert x == y, n


# ------------------------------------------------------------------------------ single process
def test_resume_single_process_is_bit_exact(tmp_path):
    step, state = _build(loss=_noisy_loss, dtype=torch.float32)
    straight, losses_a = _train(step, state, 2 * HALF)

    step, state = _build(loss=_noisy_loss, dtype=torch.float32)
    state, losses_b = _train(step, state, HALF)
    path = save(state, tmp_path / "ck", extra_meta={"note": "three steps"})
    # A fresh state object from another init: every value must come from the checkpoint.
    step2, like = _build(loss=_noisy_loss, dtype=torch.float32, init_seed=1)
    resumed = load(path, like)
    _assert_same_state(resumed, state)
    assert int(resumed.extras["data_pos"]) == HALF and int(resumed.step) == HALF
    assert torch.equal(resumed.rng, state.rng)
    resumed, more = _train(step2, resumed, HALF)
    assert losses_b + more == losses_a  # bit-exact on CPU
    _assert_same_state(resumed, straight)
    assert read_index(path)["extra_meta"] == {"note": "three steps"}
    assert latest_checkpoint(tmp_path) == str(path)


def test_other_model_is_refused(tmp_path):
    _step, state = _build()
    path = save(state, tmp_path / "ck")
    other = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=8, n_kv_heads=4,
                        ffn_hidden=40, max_seq_len=16)
    _, like = _build(cfg=other)
    with pytest.raises(CheckpointError, match=r"'params\.layers\.0\.mlp\.down_proj\.weight' "
                                              r"has global shape \(32, 42\).*\(32, 40\)"):
        load(path, like)
    _, like = _build(optim="adamw")  # another optimizer: leaves missing
    with pytest.raises(CheckpointError, match="has no leaf 'opt_state"):
        load(path, like)


def test_corrupt_files_are_refused(tmp_path):
    _step, state = _build()
    path = save(state, tmp_path / "ck")
    shard = os.path.join(path, "rank00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 3)
        f.write(b"\x7f\x7f\x7f")
    with pytest.raises(CheckpointError, match="rank00000.safetensors is corrupt"):
        load(path, state)
    path = save(state, tmp_path / "ck")  # replaces the corrupt one
    load(path, state)
    with open(os.path.join(path, "index.json"), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="index.json is corrupt"):
        load(path, state)


_KILLED_SAVE = """
import sys, time, torch
sys.path.insert(0, {here!r})
from test_checkpoint import _build, _train
from funcpar.state import save
step, state = _build()
state, _ = _train(step, state, 3)
def hook(path):
    print("wrote", path, flush=True)
    time.sleep(120)  # killed here, with the rank file written and the index not
save(state, {path!r}, on_file=hook)
"""


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    step, state = _build()
    state, _ = _train(step, state, 1)
    path = save(state, tmp_path / "ck")
    code = textwrap.dedent(_KILLED_SAVE).format(here=HERE, path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("wrote"), proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    partial = tmp_path / ".ck.partial"
    assert os.path.exists(partial / "rank00000.safetensors")
    _, like = _build(init_seed=1)
    _assert_same_state(load(path, like), state)  # the previous checkpoint, intact
    with pytest.raises(CheckpointError, match="no COMPLETE marker: it is half-written"):
        load(partial, like)
    assert latest_checkpoint(tmp_path) == str(path)  # hidden partial dirs are skipped


def test_export_params(tmp_path):
    from safetensors.torch import load_file

    _step, state = _build()
    out = export_params(state, None, tmp_path / "model.safetensors")
    model = Llama(CFG).double()
    assert set(load_file(tmp_path / "model.safetensors")) == set(dict(model.named_parameters()))
    for name, x in load_file(tmp_path / "model.safetensors").items():
        assert torch.equal(x, out[name]) and torch.equal(x, state.params[name])


# ------------------------------------------------------------------------------ distributed
def _resume_ranks(root):
    """tp2 x dp2 + zero2: 6 steps straight vs 3 + save + load into a fresh state + 3."""
    step, state = _build(2, 2, 2)
    straight, losses_a = _train(step, state, 2 * HALF)
    step, state = _build(2, 2, 2)
    state, losses_b = _train(step, state, HALF)
    at_save = _whole(step, state)
    path = save(state, os.path.join(root, "tp2dp2z2"), step=step)
    export_params(state, step.layouts, os.path.join(root, "export.safetensors"))
    step2, like = _build(2, 2, 2, init_seed=1)
    resumed = load(path, like, step=step2)
    same_local = all(torch.equal(x, y) for (_, x), (_, y) in
                     zip(named_leaves(resumed), named_leaves(state)) if torch.is_tensor(x))
    resumed, more = _train(step2, resumed, HALF)
    return (losses_a, losses_b + more, same_local, _whole(step, straight),
            _whole(step2, resumed), at_save)


def _reshard_ranks(root):
    """Load the tp2 x dp2 + zero2 checkpoint under dp2 + zero3 and save it again."""
    step, like = _build(1, 2, 3, init_seed=1)
    state = load(os.path.join(root, "tp2dp2z2"), like, step=step)
    save(state, os.path.join(root, "dp2z3"), step=step)
    return _whole(step, state)


@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    res = run_ranks(_resume_ranks, 4, root, backend=None, timeout=240)
    return root, res


def test_resume_tp2xdp2_zero2_is_bit_exact(tp2dp2):
    _, res = tp2dp2
    for rank, (losses_a, losses_b, same_local, p_a, p_b, _) in enumerate(res):
        assert same_local, rank
        assert losses_b == losses_a, rank
        for k in p_a:
            assert torch.equal(p_a[k], p_b[k]), (rank, k)


def test_reshard_tp2xdp2_zero2_to_one_process_and_dp2_zero3(tp2dp2):
    root, res = tp2dp2
    at_save = res[0][5]
    _step1, like = _build(init_seed=1)
    one = load(os.path.join(root, "tp2dp2z2"), like)
    for k in at_save:  # the gathered params, exactly
        assert torch.equal(one.params[k], at_save[k]), k
    # Against one process trained alike: every leaf (moments and factored rows/columns
    # included) agrees to float64 round-off of another summation order (dist_train: 1e-10).
    step0, ref = _build()
    ref, _ = _train(step0, ref, HALF)
    for (n, x), (_, y) in zip(named_leaves(one.opt_state), named_leaves(ref.opt_state)):
        if torch.is_tensor(x) and x.is_floating_point():
            assert max_rel({n: x}, {n: y}) < 1e-10, n
        elif torch.is_tensor(x):
            assert torch.equal(x, y), n
    assert torch.equal(one.extras["data_pos"], ref.extras["data_pos"])
    from safetensors.torch import load_file

    exported = load_file(os.path.join(root, "export.safetensors"))
    assert set(exported) == set(at_save)
    assert all(torch.equal(exported[k], at_save[k]) for k in at_save)

    # Under dp2 + zero3 (parts of whole leaves, another cut dim than tp's) and back.
    whole = run_ranks(_reshard_ranks, 2, root, backend=None, timeout=120)
    for rank in range(2):
        for k in at_save:
            assert torch.equal(whole[rank][k], at_save[k]), (rank, k)
    again = load(os.path.join(root, "dp2z3"), like)
    _assert_same_state(again, one)
