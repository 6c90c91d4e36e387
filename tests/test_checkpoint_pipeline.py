"""Checkpoints of pipelined states: every leaf once under its global name, exact resume, and
resharding between pipeline layouts and one process.

The model is the 8-block reference Llama with its embedding tied to the LM head
(``TIED_CFG``: the tied weight lives on the first and the last stage; the checkpoint holds it
once), trained with a loss that draws from the step's RNG (so a resume that lost the RNG
changes the losses) and a data position in ``extras``. float64 runs Adafactor with momentum
(same-shape moments, factored row/column statistics, counts); float32 runs AdamW under fp16
amp (whose loss scale and clean-step count live in ``extras``).

Every comparison here is exact (``torch.equal``, equal loss lists): a checkpoint stores the
bits it was given and a load into any layout cuts the same bits back out, so the loaded state
is the saved one leaf for leaf, and a run that saved at step k and resumed repeats the
uninterrupted run bit for bit (on CPU, where the ops are deterministic). Default suite: the
pp2 resume in both dtypes, pp2 -> one process -> pp2, the errors; ``-m slow``: pp2 -> pp4,
pp2 -> pp2 x tp2, pp2 -> pp2 x dp2 + ZeRO-2 and back to one process.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from funcpar.models import Llama, lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import CheckpointError, functionalize, init_state, load, read_index, save
from funcpar.state.tree import named_leaves
from funcpar.testing import run_ranks
from funcpar.testing.reference import OPTIMIZERS, PP_CFG, batches
from funcpar.train import make_train_step
from funcpar.transforms import (
    amp_cast,
    compose,
    data_parallel,
    pipeline_split,
    shard_params,
    zero_partition,
)

TIED_CFG = dataclasses.replace(PP_CFG, tie_embeddings=True)
F64, F32 = torch.float64, torch.float32
#: dtype -> (optimizer, amp precision)
RUNS = {F64: ("adafactor_momentum", None), F32: ("adamw_small_lr", "fp16")}
SAVE_AT, STEPS = 3, 6


def _noisy_loss(out, targets):
    # Draws from the step's RNG (state.rng): a resume that lost it changes the losses.
    return lm_loss(out + 0.01 * torch.randn_like(out), targets)


def _build(pp=1, tp=1, dp=1, zero=0, *, dtype=F64, init_seed=0, loss=_noisy_loss,
           cfg=TIED_CFG, optim=None, microbatches=4):
    """``(step, state)`` on this rank: the model cut over ``pp`` (1f1b), then tp, dp, ZeRO and,
    for float32, fp16 amp. ``init_seed`` changes every value (weights and RNG), so a state
    loaded into it holds only what the checkpoint gave it."""
    optim_name, amp = RUNS[dtype]
    mesh = (DeviceMesh.from_env(pp=pp, dp=dp, tp=tp) if pp > 1
            else DeviceMesh.from_env(dp=dp, tp=tp))
    model = Llama(cfg, seed=init_seed).to(dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim or optim_name](params)
    step = make_train_step(apply_fn, loss, opt)
    state = init_state(params, buffers, opt, seed=init_seed)
    state = state._replace(extras={"data_pos": torch.zeros((), dtype=torch.int64)})
    ts = []
    if pp > 1:
        ts.append(pipeline_split(mesh, microbatches=microbatches, schedule="1f1b"))
    if tp > 1:
        ts.append(shard_params(llama_rules(cfg.head_dim), mesh))
    if dp > 1:
        ts.append(data_parallel(mesh))
    if zero:
        ts.append(zero_partition(zero, mesh))
    if amp is not None:
        ts.append(amp_cast(amp, mesh=mesh))
    return compose(*ts)(step, state)


def _train(step, state, n):
    """``n`` steps, the batch chosen by the data position in ``state.extras`` (a resumable
    loader's), which advances with each step."""
    data = batches()
    losses = []
    for _ in range(n):
        pos = int(state.extras["data_pos"])
        state, metrics = step(state, data[pos % len(data)])
        losses.append(float(metrics["loss"]))
        state = state._replace(extras={**state.extras,
                                       "data_pos": state.extras["data_pos"] + 1})
    return state, losses


def _leaves(state):
    """``{field.path: leaf}`` as the checkpoint names them."""
    return {f"{field}.{n}" if n else field: x for field in state._fields
            for n, x in named_leaves(getattr(state, field))}


def _same(a, b, what=""):
    """Exactly equal: tensors by torch.equal (and dtype), other leaves by ==."""
    assert sorted(a) == sorted(b), (what, sorted(set(a) ^ set(b))[:5])
    for n in a:
        x, y = a[n], b[n]
        if torch.is_tensor(x):
            assert torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y), (what, n)
        else:
            assert x == y, (what, n)


def _merged(per_rank):
    """The union of the ranks' leaves; a leaf on several ranks (the tied weight and its
    optimizer state, the step, RNG, counts) must hold the same bits on each."""
    out = {}
    for r, leaves in enumerate(per_rank):
        for n, x in leaves.items():
            if n in out:
                same = torch.equal(out[n], x) if torch.is_tensor(x) else out[n] == x
                assert same, (r, n)
            out[n] = x
    return out


# ------------------------------------------------------------------------------------ ranks
def _pp2_save_and_resume(root):
    """pp2, both dtypes: 6 steps straight vs 3 + save + load into a state of another init + 3.
    Returns per dtype: the straight losses, the resumed losses, whether the loaded state equals
    the saved one and the final states equal, and this rank's leaves at the save."""
    out = {}
    for dtype in RUNS:
        step, state = _build(2, dtype=dtype)
        straight, losses_a = _train(step, state, STEPS)
        step, state = _build(2, dtype=dtype)
        state, losses_b = _train(step, state, SAVE_AT)
        path = save(state, os.path.join(root, f"pp2_{str(dtype)[6:]}"), step=step,
                    extra_meta={"data_pos": SAVE_AT})
        step2, like = _build(2, dtype=dtype, init_seed=1)
        loaded = load(path, like, step=step2)
        _same(_leaves(loaded), _leaves(state), "loaded")
        resumed, more = _train(step2, loaded, STEPS - SAVE_AT)
        _same(_leaves(resumed), _leaves(straight), "resumed")
        out[dtype] = (losses_a, losses_b + more, _leaves(state), straight)
    return out


def _pp2_from_one_process(root):
    """pp2 loads what one process saved (itself loaded from the pp2 checkpoint) and trains on;
    then the misfits: every rank raises, none hangs."""
    out = {}
    for dtype in RUNS:
        step, like = _build(2, dtype=dtype, init_seed=1)
        state = load(os.path.join(root, f"one_{str(dtype)[6:]}"), like, step=step)
        at_save = _leaves(state)
        state, more = _train(step, state, STEPS - SAVE_AT)
        out[dtype] = (at_save, more, _leaves(state))
    errors = []
    for kw in ({"optim": "adamw"}, {"cfg": PP_CFG}):  # another optimizer; untied: another model
        step, like = _build(2, **kw)
        try:
            load(os.path.join(root, "pp2_float64"), like, step=step)
        except CheckpointError as err:
            errors.append(str(err))
    return out, errors


# ---------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_pp"))
    return root, run_ranks(_pp2_save_and_resume, 2, root, backend=None, timeout=600)


@pytest.mark.parametrize("dtype", list(RUNS), ids=str)
def test_pp2_resume_is_bit_exact(pp2, dtype):
    root, res = pp2
    for rank in (0, 1):
        losses_a, losses_b, _, _ = res[rank][dtype]
        assert losses_b == losses_a, rank  # the loss is reported on every rank
    # The checkpoint holds every leaf once, under its global name and whole shape: the union
    # of the ranks' leaves, the tied weight once (it holds the same bits on both).
    merged = _merged([res[r][dtype][2] for r in (0, 1)])
    index = read_index(os.path.join(root, f"pp2_{str(dtype)[6:]}"))
    assert set(index["leaves"]) == set(merged)
    tied = index["leaves"]["params.embed_tokens.weight"]
    assert tied["kind"] == "replicated" and tied["file"] == "rank00000.safetensors"
    assert tied["global_shape"] == [TIED_CFG.vocab_size, TIED_CFG.dim]
    assert index["leaves"]["params.layers.7.mlp.up_proj.weight"]["file"] == (
        "rank00001.safetensors")
    assert index["leaves"]["rng"]["kind"] == "replicated"  # one generator state (runtime.py)
    assert index["pipeline"] == {"axis": "pp", "stages": 2, "blocks": [[0, 4], [4, 8]]}
    if dtype == F32:  # amp's loss scale and clean-step count came back with the state
        assert {"loss_scale", "good_steps"} <= {n.split(".")[-1] for n in merged}


@pytest.fixture(scope="module")
def one(pp2):
    """The pp2 checkpoints loaded into one process (another init), and saved from there."""
    root, _ = pp2
    out = {}
    for dtype in RUNS:
        step1, like = _build(dtype=dtype, init_seed=1)
        state = load(os.path.join(root, f"pp2_{str(dtype)[6:]}"), like, step=step1)
        save(state, os.path.join(root, f"one_{str(dtype)[6:]}"), step=step1)
        out[dtype] = state
    return out


@pytest.mark.parametrize("dtype", list(RUNS), ids=str)
def test_pp2_to_one_process(pp2, one, dtype):
    _, res = pp2
    # The whole state, leaf for leaf: params, optimizer state, step, RNG, extras.
    _same(_leaves(one[dtype]), _merged([res[r][dtype][2] for r in (0, 1)]), "pp2 -> one")
    assert int(one[dtype].step) == SAVE_AT and int(one[dtype].extras["data_pos"]) == SAVE_AT


def test_one_process_to_pp2_trains_on_exactly(pp2, one):
    root, res = pp2
    results = run_ranks(_pp2_from_one_process, 2, root, backend=None, timeout=600)
    for dtype in RUNS:
        # The state at the save again, and the steps after it are the uninterrupted pp2
        # run's, bit for bit.
        _same(_merged([results[r][0][dtype][0] for r in (0, 1)]),
              _merged([res[r][dtype][2] for r in (0, 1)]), f"one -> pp2 {dtype}")
        for r in (0, 1):
            losses_a, _, _, straight = res[r][dtype]
            _, more, final = results[r][0][dtype]
            assert more == losses_a[SAVE_AT:], (dtype, r)
            _same(final, _leaves(straight), f"trained on, {dtype} rank {r}")
    # Misfits raise on every rank (the rank that found one is named), none is left waiting.
    for r in (0, 1):
        optim_err, model_err = results[r][1]
        assert "has no leaf 'opt_state" in optim_err and "another optimizer" in optim_err, r
        # Untied: the last stage's head is a leaf of its own, which the checkpoint lacks.
        assert model_err.startswith("rank 1: ") and "'params.lm_head.weight'" in model_err, r


def test_another_shape_is_refused_naming_the_leaf(pp2):
    root, _ = pp2
    _, like = _build(cfg=dataclasses.replace(TIED_CFG, ffn_hidden=40))
    with pytest.raises(CheckpointError, match=r"'params\.layers\.0\.mlp\.down_proj\.weight' "
                                              r"has global shape \(32, 42\).*\(32, 40\)"):
        load(os.path.join(root, "pp2_float64"), like)
    _, like = _build(optim="adafactor")  # no momentum: the checkpoint has leaves it lacks
    with pytest.raises(CheckpointError, match=r"has leaf 'opt_state.*that the state lacks"):
        load(os.path.join(root, "pp2_float64"), like)


def test_save_plan_writes_each_leaf_once():
    """Who writes what, from every rank's view (3 ranks; no process group needed)."""
    from funcpar.state.checkpoint import _plan_save

    def sharded(sl, shape=(4, 6)):
        return {"kind": "sharded", "dtype": "float64", "global_shape": list(shape),
                "spec": [["tp"], []], "blocks": [1, 1], "slice": sl}

    def whole(digest, shape=(3,)):
        return {"kind": "tensor", "dtype": "float64", "shape": list(shape), "digest": digest}

    every = [
        {"w": sharded([[0, 2], [0, 6]]), "tied": whole("a"), "step": whole("s"),
         "noise": whole("x"), "lr": {"kind": "value", "value": 0.5}},
        {"w": sharded([[2, 2], [0, 6]]), "step": whole("s"), "noise": whole("y", (2,)),
         "lr": {"kind": "value", "value": 0.5}},
        {"w": sharded([[0, 2], [0, 6]]), "tied": whole("a"), "step": whole("s"),
         "late": whole("z"), "lr": {"kind": "value", "value": 0.5}},
    ]
    plan = _plan_save(every)
    assert list(plan.records) == ["w", "tied", "step", "noise", "lr", "late"]
    # Two distinct slices: rank 2 holds rank 0's again and skips it.
    assert plan.writers["w"] == [0, 1]
    assert [sh["file"] for sh in plan.records["w"]["shards"]] == [
        "rank00000.safetensors", "rank00001.safetensors"]
    # A leaf held (equal) by ranks 0 and 2, one held by rank 2 alone: first holders write.
    assert plan.writers["tied"] == [0] and plan.writers["late"] == [2]
    assert plan.records["late"] == {"kind": "replicated", "dtype": "float64",
                                    "global_shape": [3], "file": "rank00002.safetensors"}
    assert plan.records["noise"]["kind"] == "per_rank" and plan.writers["noise"] == [0, 1]
    assert plan.records["noise"]["shapes"] == [[3], [2], None]
    assert "lr" not in plan.writers and plan.records["lr"] == {"kind": "value", "value": 0.5}
    # Holders that disagree: refused naming the leaf and the ranks.
    every[2]["w"] = whole("w", (4, 6))
    with pytest.raises(ValueError, match=r"leaf 'w' is held as sharded on rank 0, sharded on "
                                         r"rank 1, tensor on rank 2"):
        _plan_save(every)
    every[2]["w"] = sharded([[0, 2], [0, 6]], shape=(4, 7))
    with pytest.raises(ValueError, match=r"leaf 'w' is sharded as \[\[4, 6\].* on rank 0 but "
                                         r"as \[\[4, 7\].* on rank 2"):
        _plan_save(every)


# ------------------------------------------------------------------- other layouts (slow)
#: name -> (pp, tp, dp, zero) on 4 ranks, and pp2 x tp2 x dp2 + ZeRO-2 on 8.
RESHARD = {"pp4": (4, 1, 1, 0), "pp2xtp2": (2, 2, 1, 0), "pp2xdp2+zero2": (2, 1, 2, 2),
           "pp2xtp2xdp2+zero2": (2, 2, 2, 2)}
#: float64, 3 Adafactor steps on the 8-block model: another layout differs from one process
#: only in summation order (micro-batches, tp partial sums, the global norm summed per stage),
#: which Adafactor's trajectory amplifies (docs/PIPELINE.md, "Adafactor and the last bit");
#: test_pipeline holds 10 steps to 1e-9. Measured here: 1.2e-16 (pp2xtp2xdp2+zero2).
RESHARD_TOL = 1e-9


def _reshard(root, names):
    """Per layout: load the pp2 checkpoint into it (another init), save it back from there,
    train 3 steps on (a loss without noise, comparable across layouts); then a resume on this
    layout: save, load into a state of another init, one more step on both."""
    out = {}
    for name in names:
        pp, tp, dp, zero = RESHARD[name]

        def build(seed, pp=pp, tp=tp, dp=dp, zero=zero):
            return _build(pp, tp, dp, zero, init_seed=seed, loss=lm_loss,
                          microbatches=4 if dp == 1 else 2)

        step, like = build(1)
        state = load(os.path.join(root, "pp2_float64"), like, step=step)
        save(state, os.path.join(root, name), step=step)
        state, losses = _train(step, state, STEPS - SAVE_AT)
        path = save(state, os.path.join(root, f"{name}_trained"), step=step)
        step2, like = build(2)
        resumed = load(path, like, step=step2)
        _same(_leaves(resumed), _leaves(state), f"{name} resumed")
        (a, la), (b, lb) = _train(step, state, 1), _train(step2, resumed, 1)
        assert la == lb
        _same(_leaves(a), _leaves(b), f"{name} one step after the resume")
        out[name] = losses
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world, names", [(4, ["pp4", "pp2xtp2", "pp2xdp2+zero2"]),
                                          (8, ["pp2xtp2xdp2+zero2"])])
def test_pp2_to_other_layouts_and_back(pp2, one, world, names):
    root, _ = pp2
    # 8 ranks import torch on 2 shared cores: their start alone can exceed the default 120 s.
    results = run_ranks(_reshard, world, root, names, backend=None, timeout=1100,
                        start_timeout=600)
    # One process from the same state, with the same loss: the reference for training on.
    step1, like = _build(init_seed=1, loss=lm_loss)
    ref = _train(step1, load(os.path.join(root, "pp2_float64"), like, step=step1),
                 STEPS - SAVE_AT)[1]
    for name in names:
        # Saved from the other layout, loaded into one process: the pp2 state, every leaf.
        step1, like = _build(init_seed=2)
        back = load(os.path.join(root, name), like, step=step1)
        _same(_leaves(back), _leaves(one[F64]), f"pp2 -> {name} -> one process")
        for r in range(world):
            losses = results[r][name]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= RESHARD_TOL, (
                name, r, losses, ref)
