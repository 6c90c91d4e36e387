"""remat: activation checkpointing by block, composed with the other transforms.

* Same results: 3 AdamW steps of the example Llama in float64 give bit-identical losses and
  parameters with and without remat (all blocks, every 2nd block, sub-modules by pattern, a
  callable), on one process and under tp2 x dp2 + ZeRO-3 (4 gloo ranks; remat before and after
  the other transforms, with amp_cast bf16 + keep_fp32 norms last) and under tensor +
  sequence parallelism with the attention/MLP regions rematted. The recompute runs the same
  ops on the same values, so equality is exact, not a tolerance.
* Less memory: peak live bytes of one forward + backward (every tensor storage allocated,
  tracked by a dispatch mode) of a 4-block Llama (dim 64, seq 96, batch 4, float64): no remat
  18.7 MiB, remat every 2nd block 11.5 MiB, all blocks 8.1 MiB; asserted: all blocks < 0.5 x
  none, every-2nd strictly between. Under tp2 x dp2 + ZeRO-3 (batch 8 over dp2), rank 0:
  11.8 MiB -> 4.5 MiB, asserted < 0.5 x (`-s` prints all of them).
* ZeRO-3: the recorded block parameters go through the saved-tensor hooks in force (ZeRO-3's
  keep the part, not the gathered whole), checked with a counting hook.
* Errors: the order issue (remat of a module that shard_params swaps, applied after it), an
  empty choice, nested choices, every < 1.
* compile=True (the whole step one region, remat's recompute traced into its backward:
  funcpar/train/whole_step.py): 3 compiled float32 AdamW steps with remat against 3 compiled
  steps without it, losses and parameters within rel 1e-5 (inductor fuses the recomputed ops
  into the backward's kernels, so float32 rounding differs: measured ~1e-6, not bit for
  bit), both one whole-step region, and the traced graph's peak of live intermediates falls;
  a block with a dynamo graph break inside is traced whole by make_fx and is still exact
  (its recompute reinstalls the call's state: checked against a released module).
  ``-m slow``: the compiled Llama comparison above (remat vs none, peak falls) and the same
  on tp2 (remat after shard_params, float64).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from test_lazy_init import LiveBytes
from torch import nn

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, OPTIMIZERS, batches, run
from funcpar.train import make_train_step
from funcpar.train.step import loss_and_grads
from funcpar.transforms import (
    amp_cast,
    compose,
    data_parallel,
    remat,
    shard_params,
    zero_partition,
)
from funcpar.transforms.remat import remat_modules

# The module (the package's ``remat`` is the function), to count its state records.
remat_mod = importlib.import_module("funcpar.transforms.remat")

STEPS = 3
SP_REGIONS = ["layers.*.self_attn", "layers.*.mlp"]


def _step(cfg=CFG, dtype=torch.float64, optim="adamw", compile=False):
    model = Llama(cfg, dtype=dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params) if isinstance(optim, str) else optim
    step = make_train_step(apply_fn, lm_loss, opt, compile=compile)
    return step, init_state(params, buffers, opt)


def _train(step, state):
    return run(step, state, batches()[:STEPS])


@functools.cache
def _reference():
    return _train(*_step())


def _same(a, b):
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in b[1])


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("policy, every", [
    ("blocks", 1), ("blocks", 2), ("layers.*.mlp", 1), (SP_REGIONS, 1),
    (lambda name, m: name.endswith("self_attn"), 1),
])
def test_bit_identical_on_one_process(policy, every):
    ref = _reference()
    out = _train(*remat(policy, every=every)(*_step()))
    assert _same(out, ref)
    assert ref[0][-1] < ref[0][0]  # it trains


def test_bit_identical_with_amp_keep_fp32():
    """bf16 compute with float32 norms: remat records amp_cast's casts and hooks."""
    def run(with_remat):
        step, state = _step(dtype=torch.float32)
        ts = [remat()] if with_remat else []
        return _train(*compose(*ts, amp_cast("bf16", keep_fp32="*norm*"))(step, state))

    assert _same(run(True), run(False))


def _peak(cfg, transform):
    step, state = _step(cfg, optim=fo.sgd(lr=0.1))
    if transform is not None:
        step, state = transform(step, state)
    ids = torch.randint(0, cfg.vocab_size, (4, 97), generator=torch.Generator().manual_seed(0))
    with LiveBytes() as mem:
        loss, _, _ = loss_and_grads(step.apply_fn, lm_loss, state.params, state.buffers,
                                    (ids[:, :-1], ids[:, 1:]))
    return mem.peak, float(loss)


def test_peak_activation_memory_falls():
    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, ffn_hidden=172,
                      max_seq_len=96)
    none, loss = _peak(cfg, None)
    half, loss_half = _peak(cfg, remat(every=2))
    every, loss_all = _peak(cfg, remat())
    print(f"\npeak bytes of forward + backward: no remat {none / 2**20:.1f} MiB, every 2nd "
          f"block {half / 2**20:.1f} MiB, all blocks {every / 2**20:.1f} MiB")
    assert loss == loss_half == loss_all
    assert every < 0.5 * none
    assert every < half < none


def test_recorded_params_go_through_the_saved_tensor_hooks():
    """What ZeRO-3 relies on: the block's parameters are recorded as saved tensors, so the
    hooks in force (ZeRO-3's keep parts) decide what is kept."""
    step, state = remat()(*_step())
    packed = []

    def pack(t):
        packed.append(t)
        return t

    params = {k: v.detach().requires_grad_() for k, v in state.params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step.apply_fn(params, state.buffers, batches()[0][0])
    ids = {id(t) for t in packed}
    block = [f"layers.{i}.mlp.up_proj.weight" for i in range(CFG.n_layers)]
    assert all(id(params[n]) in ids for n in block)


def test_choices_and_errors():
    model = Llama(CFG)
    assert [n for n, _ in remat_modules(model)] == ["layers.0", "layers.1"]
    assert [n for n, _ in remat_modules(model, every=2)] == ["layers.0"]
    assert [n for n, _ in remat_modules(model, "layers.*.mlp")] == ["layers.0.mlp",
                                                                    "layers.1.mlp"]
    with pytest.raises(ValueError, match="pattern 'layers.\\*.ffn' matches no module"):
        remat_modules(model, "layers.*.ffn")
    with pytest.raises(ValueError, match="'layers.0.mlp' is inside 'layers.0'"):
        remat_modules(model, ["layers.*", "layers.*.mlp"])
    with pytest.raises(ValueError, match="chose no module"):
        remat_modules(model, lambda n, m: False)
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        remat(every=0)
    with pytest.raises(ValueError, match="'layers.0' is checkpointed twice"):
        step, state = compose(remat(), remat())(*_step())
        step(state, batches()[0])


# ----------------------------------------------------------------------------- multi-rank
def remat_runs(tp, dp):
    """Each composition with and without remat on this rank; (name -> (losses, params))."""
    mesh = DeviceMesh.from_env(dp=dp, tp=tp)
    rules = llama_rules(CFG.head_dim)
    zero = [data_parallel(mesh), zero_partition(3, mesh)] if dp > 1 else []
    runs = {
        "plain": [shard_params(rules, mesh), *zero],
        "remat after": [shard_params(rules, mesh), *zero, remat()],
        "remat first, every 2": [remat(every=2), shard_params(rules, mesh), *zero],
        "sp": [shard_params(rules, mesh, sequence_parallel=True), *zero],
        # The regions' forwards are replaced by shard_params: remat goes before it.
        "sp remat regions": [remat(SP_REGIONS), shard_params(rules, mesh,
                                                            sequence_parallel=True), *zero],
        "sp remat blocks after": [shard_params(rules, mesh, sequence_parallel=True), *zero,
                                  remat()],
    }
    out = {name: _train(*compose(*ts)(*_step())) for name, ts in runs.items()}
    for name in ("bf16", "bf16 remat"):
        step, state = _step(dtype=torch.float32)
        ts = [shard_params(rules, mesh), *zero] + ([remat()] if "remat" in name else [])
        ts.append(amp_cast("bf16", keep_fp32="*norm*"))
        out[name] = _train(*compose(*ts)(step, state))
    out["peak"] = _peak_composed(mesh, dp)
    wrong = compose(shard_params(rules, mesh, sequence_parallel=True), *zero,
                    remat(SP_REGIONS))(*_step())
    try:
        wrong[0](wrong[1], batches()[0])
        out["wrong order"] = None
    except ValueError as e:
        out["wrong order"] = str(e)
    return out


def _peak_composed(mesh, dp):
    """Peak live bytes of one forward + backward on this rank, without and with remat."""
    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, ffn_hidden=172,
                      max_seq_len=96)
    zero = [data_parallel(mesh), zero_partition(3, mesh)] if dp > 1 else []
    peaks = []
    for ts in ([], [remat()]):
        step, state = compose(shard_params(llama_rules(cfg.head_dim), mesh), *zero, *ts)(
            *_step(cfg, optim=fo.sgd(lr=0.1)))
        ids = torch.randint(0, 64, (8, 97), generator=torch.Generator().manual_seed(0))
        batch = step.local_batch((ids[:, :-1], ids[:, 1:]))
        with LiveBytes() as mem:
            loss_and_grads(step.apply_fn, step.loss_fn, state.params, state.buffers, batch)
        peaks.append(mem.peak)
    return peaks


def test_bit_identical_under_tp2xdp2_zero3_and_sequence_parallel():
    for rank, out in enumerate(run_ranks(remat_runs, 4, 2, 2, backend=None, timeout=900)):
        for name in ("remat after", "remat first, every 2"):
            assert _same(out[name], out["plain"]), (rank, name)
        for name in ("sp remat regions", "sp remat blocks after"):
            assert _same(out[name], out["sp"]), (rank, name)
        assert _same(out["bf16 remat"], out["bf16"]), rank
        assert "the forward of 'layers.0.self_attn' was replaced" in out["wrong order"], rank
        plain, rematted = out["peak"]
        if rank == 0:
            print(f"\ntp2xdp2+zero3 rank 0 peak bytes of forward + backward: no remat "
                  f"{plain / 2**20:.1f} MiB, remat {rematted / 2**20:.1f} MiB")
        assert rematted < 0.5 * plain, (rank, out["peak"])


# --------------------------------------------------------------------------- compile=True
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _CountingSnapshot(remat_mod._Snapshot):
    """Counts the module-state records, i.e. the checkpoints that ran eagerly."""

    made = 0

    def __init__(self, root):
        type(self).made += 1
        super().__init__(root)


def compiled_runs():
    """Compiled float32 AdamW steps of the example Llama without and with remat: losses,
    the largest relative parameter difference, whether each ran as one whole-step region,
    and the peak of live intermediate bytes of its traced graph (in graph order:
    ``whole_step.peak_live_bytes``). Run in a subprocess (see
    test_compiled_remat_matches_compiled_without)."""
    from funcpar.train.whole_step import peak_live_bytes

    out = {}
    for name, ts in (("plain", []), ("remat", [remat()])):
        step, state = _step(dtype=torch.float32, compile=True)
        step, state = compose(*ts)(step, state) if ts else (step, state)
        losses = []
        for batch in batches()[:STEPS]:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        whole = step._whole is not None
        peak = peak_live_bytes(step._whole.traced_graphs()[0]) if whole else None
        out[name] = (losses, state.params, peak, whole)
    (lp, pp, sp, wp), (lr, pr, sr, wr) = out["plain"], out["remat"]
    return {"losses": lp, "remat losses": lr, "peak": sp, "remat peak": sr,
            "whole": [wp, wr],
            "max rel": max(float((pr[k] - pp[k]).abs().max() / pp[k].abs().max())
                           for k in pp),
            "bitwise": all(torch.equal(pr[k], pp[k]) for k in pp)}


@pytest.mark.slow  # two inductor compilations of the Llama step: 105 s on an AVX2-only 2-core VM;
# the default suite keeps compiled remat by test_compiled_step_with_a_graph_break_in_a_block
def test_compiled_remat_matches_compiled_without():
    """compile=True with remat against compile=True without, 3 float32 AdamW steps. In a
    subprocess: beartype's checks of the Llama's annotations (this session's import hook) do
    not trace under dynamo (as in tests/test_amp.py). Tolerance rel 1e-5: the recompute is
    fused into the compiled backward, so float32 rounding differs (measured ~1e-6)."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_remat; "
            "print(json.dumps(test_remat.compiled_runs()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\ncompiled: remat vs none, max rel param difference {out['max rel']:.1e} "
          f"(bitwise {out['bitwise']}), losses {out['remat losses']} vs {out['losses']}; "
          f"peak live intermediates of the traced step {out['peak'] / 2**10:.0f} KiB -> "
          f"{out['remat peak'] / 2**10:.0f} KiB")
    for a, b in zip(out["remat losses"], out["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert out["max rel"] <= 1e-5
    assert out["losses"][-1] < out["losses"][0]
    assert out["whole"] == [True, True]  # one region each, remat's recompute inside it
    assert out["remat peak"] < 0.8 * out["peak"]  # measured 628 -> 396 KiB


class _Block(nn.Module):
    def __init__(self, dim, graph_break):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.graph_break = graph_break

    def forward(self, x):
        h = torch.tanh(self.up(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.down(h)


class _Net(nn.Module):
    def __init__(self, dim=8, graph_break=True):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block(dim, graph_break) for _ in range(2))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_compiled_step_with_a_graph_break_in_a_block(monkeypatch):
    """A block with a graph break inside (which dynamo could not trace as one checkpoint
    graph) is traced whole by the whole-step region's make_fx, its checkpoint run as eager
    runs it: the traced recompute must reinstall the call's parameters. With the module
    released (meta tensors) a recompute in the module's own state would fail; the results
    equal the eager step without remat."""
    monkeypatch.setattr(remat_mod, "_Snapshot", _CountingSnapshot)
    monkeypatch.setattr(_CountingSnapshot, "made", 0)
    torch._dynamo.reset()  # a fresh cache: earlier tests' compiles do not count to the limit
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))
    runs = []
    for compiled in (False, True):
        apply_fn, params, buffers = functionalize(_Net().double(), release=True)
        opt = fo.adamw(lr=0.01)
        step = make_train_step(apply_fn, torch.nn.functional.cross_entropy, opt,
                               compile=compiled)
        state = init_state(params, buffers, opt)
        if compiled:
            step, state = remat()(step, state)
        losses = []
        for _ in range(STEPS):
            state, metrics = step(state, (x, y))
            losses.append(float(metrics["loss"]))
        runs.append((losses, state.params))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert _CountingSnapshot.made > 0  # the checkpoints recorded the call's module state
    (le, pe), (lc, pc) = runs
    # float64; compiled against eager as in tests/test_step.py (1e-10).
    for a, b in zip(lc, le):
        assert abs(a - b) <= 1e-10 * abs(b)
    assert le[-1] < le[0]
    for k in pe:
        torch.testing.assert_close(pc[k], pe[k], rtol=1e-10, atol=1e-12, msg=k)


def compiled_tp2_runs(dtype_name):
    """On this rank of a tp2 mesh: compiled steps without and with remat (after
    shard_params), (losses, whole params) each."""
    mesh = DeviceMesh.from_env(tp=2)
    rules = llama_rules(CFG.head_dim)
    out = {}
    for name, ts in (("plain", []), ("remat", [remat()])):
        step, state = _step(dtype=getattr(torch, dtype_name), compile=True)
        out[name] = _train(*compose(shard_params(rules, mesh), *ts)(step, state))
    return out


_TP2_COMPILED = """
import json, sys
sys.path.insert(0, "tests")
import test_remat
from funcpar.testing import run_ranks
from funcpar.testing.reference import loss_rel, max_rel
ranks = run_ranks(test_remat.compiled_tp2_runs, 2, "float64", timeout=1200)
print(json.dumps([(loss_rel(r["remat"][0], r["plain"][0]), max_rel(r["remat"][1], r["plain"][1]))
                  for r in ranks]))
"""


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the whole step compiled on 2 ranks, 4 times: ~5 min when loaded
def test_compiled_remat_under_tp2():
    """tp2 (2 gloo ranks, in a subprocess as above), compiled, remat after shard_params
    against the same without remat, 3 AdamW steps in float64: rel <= 1e-10. Also a test that
    compile=True works under shard_params (it failed before shard_params stopped deleting the
    swapped forwards with ``del``). Slow: four compilations on two ranks, 20-40 s. (The blocks run
    as eager checkpoints there: shard_params' per-call cache is a side effect dynamo refuses
    inside a checkpoint graph, so the comparison is compiled against partly eager)."""
    run = subprocess.run([sys.executable, "-c", _TP2_COMPILED], capture_output=True,
                         text=True, timeout=1500, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank, (losses, params) in enumerate(json.loads(run.stdout.strip().splitlines()[-1])):
        print(f"\ntp2 compiled, rank {rank}: remat vs none, loss rel {losses:.1e}, "
              f"param rel {params:.1e}")
        assert losses <= 1e-10 and params <= 1e-10, rank


# --------------------------------------------------------------------------- torch.func
def test_higher_order_through_the_torch_func_checkpoint():
    """Under torch.func (outside TrainStep's first-order gradients) remat's torch.func
    checkpoint keeps the graph of its recompute: a Hessian-vector product through a rematted
    model equals the one without remat (float64; the same ops, 1e-12 for the summation order
    of the double backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2)).double()
    apply_fn, params, buffers = functionalize(model)
    step = make_train_step(apply_fn, lambda o, y: ((o - y) ** 2).mean(), fo.sgd(lr=0.1))
    rstep = remat(lambda n, m: isinstance(m, nn.Linear))(step, init_state(params, buffers,
                                                                           step.optimizer))[0]
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    v = {k: torch.randn_like(t) for k, t in params.items()}

    def hvp(s):
        def loss(q):
            return ((s.apply_fn(q, buffers, x)[0] - y) ** 2).mean()

        def gv(q):
            g = torch.func.grad(loss)(q)
            return sum((g[k] * v[k]).sum() for k in q)

        return torch.func.grad(gv)(params)

    ref, got = hvp(step), hvp(rstep)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-12)
    assert any(ref[k].abs().max() > 1e-3 for k in ref)  # a real second derivative
