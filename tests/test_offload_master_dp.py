"""offload(what=("opt_state", "master_params")) after amp_cast, with data_parallel and ZeRO 1-3.

Each offloaded run is compared with the same composition without offload (the in-memory amp
run: float32 masters in ``state.params``, bf16 compute) on every rank: losses, the float32
masters, the compute copies the model sees and the optimizer state are bit-identical
(``torch.equal``) after 3 steps. Bit-identical is the right tolerance: the offloaded step
reduces the same float32 gradients (the half-precision gradient upcast exactly, as amp_cast's
cast backward does) and runs the same optimizer on the same float32 values; a rank's new
compute copies are its new master parts cast down and then gathered, which is elementwise the
in-memory run's gather then cast. The store of each rank holds exactly its partition: the
bytes of the current version's keys are the bytes of its optimizer-state parts plus its
master parts, and one step reads and writes exactly those bytes.
"""

from __future__ import annotations

import os

import pytest
import torch

from funcpar.models import Llama, lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.state.tree import named_leaves, tree_leaves
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, OPTIMIZERS, batches
from funcpar.train import make_train_step
from funcpar.transforms import (
    amp_cast,
    compose,
    data_parallel,
    offload,
    shard_params,
    zero_partition,
)
from funcpar.transforms.offload import OffloadedState, read_masters, read_state

STEPS = 3


def _build(dp, zero, tp=1, precision="bf16", offload_kw=None, order="dp_first", target="cpu",
           path=None):
    mesh = DeviceMesh.from_env(dp=dp, tp=tp)
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG))  # float32 masters
    opt = OPTIMIZERS["adamw_small_lr"](params)  # chain(clip_by_global_norm, adamw)
    step, state = make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)
    ts = []
    if tp > 1:
        ts.append(shard_params(llama_rules(CFG.head_dim), mesh))
    parallel = []
    if dp > 1:
        parallel.append(data_parallel(mesh))
    if zero:
        parallel.append(zero_partition(zero, mesh))
    ts += parallel if order == "dp_first" else parallel[::-1]
    ts.append(amp_cast(precision, keep_fp32="*norm*", mesh=mesh if precision == "fp16" else None))
    off = None
    if offload_kw is not None:
        off = offload(target, what=("opt_state", "master_params"), path=path, **offload_kw)
        ts.append(off)
    step, state = compose(*ts)(step, state)
    return step, state, off


def _nbytes(t):
    return t.numel() * t.element_size()


def _compare(dp, zero, tp=1, precision="bf16", offload_kw=None, order="dp_first", target="cpu",
             path=None):
    """On this rank: the in-memory run and the offloaded run, compared leaf by leaf; returns
    the numbers the test asserts on and reports."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    step, ref, _ = _build(dp, zero, tp, precision)
    ref_metrics = []
    for batch in batches()[:STEPS]:
        ref, m = step(ref, batch)
        ref_metrics.append(m)
    ostep, st, off = _build(dp, zero, tp, precision, offload_kw or {}, order, target, path)
    store = off.store
    out = {"io": []}
    for batch, m_ref in zip(batches()[:STEPS], ref_metrics):
        r0, w0 = store.bytes_read, store.bytes_written
        st, m = ostep(st, batch)
        out["io"].append((store.bytes_read - r0, store.bytes_written - w0))
        assert torch.equal(m["loss"], m_ref["loss"])
        assert torch.equal(m["grad_norm"], m_ref["grad_norm"])
    plan = ostep.partition
    # The float32 masters: this rank's parts under ZeRO, whole otherwise.
    ref_own = ref.params if plan is None or plan.stage == 3 else plan.to_parts(ref.params)
    masters = read_masters(st.params, st.opt_state, store, partition=plan)
    for (name, a), b in zip(named_leaves(ref_own), tree_leaves(masters)):
        assert b.dtype == torch.float32 and torch.equal(a, b), name
    # The compute copies the model sees: gathered as the stage gathers (whole at 1-2).
    flagged = 0
    for (name, a), b in zip(named_leaves(ref.params), tree_leaves(st.params)):
        want = a if "norm" in name else a.to(half)
        flagged += "norm" not in name
        assert b.dtype == want.dtype and torch.equal(a.to(b.dtype), b), name
    assert flagged > 0
    # The optimizer state: the in-memory run's (its parts under ZeRO) to the bit.
    assert isinstance(st.opt_state, OffloadedState)
    back = read_state(st.opt_state, store)
    for a, b in zip(tree_leaves(ref.opt_state), tree_leaves(back)):
        assert (a is None and b is None) or torch.equal(a, b)
    # The store holds this rank's partition and nothing more: the current version's keys are
    # the state's stored leaves (>= 2 entries) and the flagged leaves' master parts.
    v = int(st.opt_state.version)
    want = sum(_nbytes(x) for x in tree_leaves(ref.opt_state)
               if torch.is_tensor(x) and x.numel() >= 2)
    want += sum(_nbytes(x) for (name, x) in named_leaves(ref_own) if "norm" not in name)
    mine = f"opt.r{torch.distributed.get_rank()}."  # ranks may share an NVMe directory
    held = sum(_nbytes(store.get(k)) for k in store.keys()
               if k.startswith(mine) and k.endswith(f".s{v % 2}"))
    # Resident on the (CPU standing in for the) device between steps: the params (2 B per
    # entry of a flagged leaf, the norms' 4 B), the state's leaves too small to store and the
    # OffloadedState's version counter (0-d int64).
    resident = sum(_nbytes(x) for x in tree_leaves(st.params))
    resident += sum(_nbytes(x) for x in tree_leaves(st.opt_state) if torch.is_tensor(x)
                    and not x.is_meta)
    expect = sum(x.numel() * (4 if "norm" in name else 2) for name, x in named_leaves(ref.params))
    expect += sum(_nbytes(x) for x in tree_leaves(ref.opt_state)
                  if torch.is_tensor(x) and x.numel() < 2) + 8
    ref_resident = sum(_nbytes(x) for x in tree_leaves((ref.params, ref.opt_state))
                       if torch.is_tensor(x))
    out.update(want=want, held=held, chunks=off.stats.chunks, resident=resident,
               expect=expect, ref_resident=ref_resident, peak=off.stats.peak_resident,
               bound=(offload_kw or {}).get("max_resident") if off.stats.chunks else None)
    store.close()
    return out


def _check(results):
    for rank, out in enumerate(results):
        assert out["held"] == out["want"], (rank, out)
        for read, written in out["io"]:  # every step moves exactly this rank's partition
            assert read == written == out["want"], (rank, out)
        assert out["resident"] == out["expect"] < out["ref_resident"] / 2, (rank, out)
        if out["bound"] is not None:  # chunked: really, and within max_resident chunks
            assert out["chunks"] >= 3 and 1 <= out["peak"] <= out["bound"], (rank, out)


def _stages():
    return [_compare(2, zero) for zero in (0, 1, 2, 3)]


def test_master_offload_dp2_zero_bit_identical():
    """dp2 alone (each rank stores the whole masters and state, as data parallelism
    replicates them) and dp2 + ZeRO stages 1, 2, 3 (each rank stores its parts)."""
    for outs in zip(*run_ranks(_stages, 2, backend=None, timeout=300)):
        _check(outs)


def _chunked(path):
    """Chunked updates (about 16 KiB of state and masters per chunk) on this rank's parts:
    ZeRO-1 from files (at most 2 chunks resident), ZeRO-3 streamed to the params' device (the
    CPU here) with 1 resident, dp alone from host memory."""
    return [_compare(2, 1, offload_kw={"chunk_bytes": 16 << 10, "max_resident": 2},
                     target="nvme", path=os.path.join(path, "z1")),
            _compare(2, 3, offload_kw={"chunk_bytes": 16 << 10, "max_resident": 1,
                                       "update_on": "device"}),
            _compare(2, 0, offload_kw={"chunk_bytes": 16 << 10, "max_resident": 2})]


def test_master_offload_dp2_zero_chunked_bit_identical(tmp_path):
    for outs in zip(*run_ranks(_chunked, 2, str(tmp_path), backend=None, timeout=300)):
        assert outs[0]["bound"] is not None
        _check(outs)


def _fp16_and_refusal():
    """fp16 (dynamic loss scaling, the skip check agreed over the mesh) with zero_partition
    applied before data_parallel; then data_parallel applied after offload(master_params),
    which would all-reduce the half-precision gradients: the first step says so, before the
    optimizer runs."""
    out = _compare(2, 2, precision="fp16", order="zero_first")
    mesh = DeviceMesh.from_env(dp=2, tp=1)
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(CFG))
    opt = OPTIMIZERS["adamw_small_lr"](params)
    step, state = compose(amp_cast("bf16"), offload("cpu", what=("opt_state", "master_params")),
                          data_parallel(mesh))(make_train_step(apply_fn, lm_loss, opt),
                                               init_state(params, buffers, opt))
    with pytest.raises(ValueError, match=r"without its float32 upcast; a transform applied "
                                         r"after offload \(data_parallel\?\)"):
        step(state, batches()[0])
    return out


def test_master_offload_fp16_dp2_zero2_and_dp_after_refused():
    _check(run_ranks(_fp16_and_refusal, 2, backend=None, timeout=240))


@pytest.mark.slow
def test_master_offload_tp2_dp2_zero2_bit_identical():
    """tp2 x dp2 + ZeRO-2 (4 ranks): the parts of tensor-parallel shards."""
    _check(run_ranks(_compare, 4, 2, 2, 2, backend=None, timeout=400))


# -- measurement (not a test): `python tests/test_offload_master_dp.py --dim 256 --layers 4` ---


def _measure(cfg_kw, zero, steps):
    """Per rank, for dp2 (+ ZeRO ``zero``) + amp bf16 + adamw: the bytes resident on the
    (CPU standing in for the) device between steps - ``state.params`` and the state's tensors
    that are not meta handles - without offload, with the optimizer state offloaded, and with
    the masters too; and the store's bytes read / written per step."""
    from funcpar.models import LlamaConfig

    mesh = DeviceMesh.from_env(dp=2, tp=1)
    cfg = LlamaConfig(**cfg_kw)
    ids = torch.randint(0, cfg.vocab_size, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1], ids[:, 1:])
    rows = {}
    for what in (None, ("opt_state",), ("opt_state", "master_params")):
        torch.manual_seed(0)
        apply_fn, params, buffers = functionalize(Llama(cfg))
        opt = OPTIMIZERS["adamw_small_lr"](params)
        ts = [data_parallel(mesh)] + ([zero_partition(zero, mesh)] if zero else [])
        ts.append(amp_cast("bf16", keep_fp32="*norm*"))
        off = offload("cpu", what=what) if what else None
        step, st = compose(*ts, *([off] if off else []))(
            make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt))
        io = []
        for _ in range(steps):
            r0 = off.store.bytes_read if off else 0
            w0 = off.store.bytes_written if off else 0
            st, _m = step(st, batch)
            if off:
                io.append((off.store.bytes_read - r0, off.store.bytes_written - w0))
        p = sum(_nbytes(x) for x in tree_leaves(st.params))
        s = sum(_nbytes(x) for x in tree_leaves(st.opt_state) if torch.is_tensor(x)
                and not x.is_meta)
        rows["+".join(what) if what else "in-memory"] = (p, s, io[-1] if io else (0, 0),
                                                          off.store.nbytes() if off else 0)
    n = sum(x.numel() for x in tree_leaves(params))
    return n, rows


if __name__ == "__main__":
    import argparse
    import importlib

    ap = argparse.ArgumentParser(description=_measure.__doc__)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    # Through the module's import name: the ranks unpickle the function by it.
    mod = importlib.import_module("test_offload_master_dp")
    cfg_kw = {"dim": a.dim, "n_layers": a.layers, "vocab_size": a.vocab, "n_heads": 8,
              "max_seq_len": 64}
    results = run_ranks(mod._measure, 2, cfg_kw, a.zero, a.steps, backend=None, timeout=600)
    print(f"dp2{f' + zero{a.zero}' if a.zero else ''} + amp bf16 (keep_fp32 norms), adamw, "
          f"Llama dim {a.dim} x {a.layers} layers, vocab {a.vocab}: "
          f"{results[0][0]:,} params; bytes per rank")
    print(f"{'run':28} {'rank':>4} {'params':>12} {'opt state':>12} {'resident':>12} "
          f"{'store':>12} {'read/step':>12} {'written/step':>12}")
    for rank, (_, rows) in enumerate(results):
        for name, (p, s, (r, w), held) in rows.items():
            print(f"{name:28} {rank:>4} {p:>12,} {s:>12,} {p + s:>12,} {held:>12,} {r:>12,} "
                  f"{w:>12,}")
