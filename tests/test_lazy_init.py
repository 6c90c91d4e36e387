"""Lazy initialization (funcpar.init): meta-built models, each rank materializing its shards.

* Shard for shard: the example Llama built on the meta device and composed under tp2 x dp2 +
  ZeRO-3 (every rank's view through a virtual mesh, no processes), then materialized, equals
  bit for bit the same model materialized whole on one process and then sharded by the same
  transforms; the optimizer states too. Values are a function of (seed, leaf, global index)
  only, so this is exact equality, not a tolerance.
* Training: 3 AdamW steps from the lazily built tp2 x dp2 + ZeRO-3 state (4 gloo ranks) match
  one process trained from the full init, to 1e-10 relative in float64 (the collectives only
  reorder sums; tests/test_distributed_optim.py measures <= 5e-14 for the same runs).
* Memory: peak live bytes while building and materializing a 23 MB model under tp2 x dp2 +
  ZeRO-3 stay within this rank's shards plus the chunk temporaries (numbers in
  docs/LAZY_INIT.md; `-s` prints them).
* Distributions: torch's defaults per module type, checked by sample moments over >= 16k
  entries (tolerances 4-5 standard errors of the estimate).
* Errors: bad sharding rules (no module matched, heads not divisible) raised on the meta model
  before any allocation, an inits pattern matching nothing, a leaf without an init rule, a meta
  buffer, a state never materialized, materialize after amp_cast: each names the leaf.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from _lazy_check import assert_same_state
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves as torch_tree_leaves

import funcpar.init.lazy as lazy
import funcpar.optim as fo
from funcpar.init import (
    Slab,
    check_materialized,
    constant,
    init_rules,
    llama_inits,
    materialize,
    materialize_tree,
    meta_device,
    normal,
    values,
)
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.layout import Layout, Shard, shard_tensor
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import Rule, llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.testing.reference import CFG, LAYOUTS, OPTIMIZERS, batches, loss_rel, max_rel, run
from funcpar.train import make_train_step
from funcpar.transforms import amp_cast, compose, data_parallel, shard_params, zero_partition

TRAIN_STEPS = 3
TOL = 1e-10


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside (meta excluded) that are still alive:
    ``current`` now, ``peak`` the most at once. Each storage counts once (views share it) and
    leaves the count when it is freed (a weakref finalizer on the storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch_tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if id(st) not in self.live and st.nbytes():
                    self.live[id(st)] = st.nbytes()
                    self.current += st.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(st, self._freed, id(st))
        return out


def _composition(mesh, tp, dp, zero):
    out = []
    if tp > 1:
        out.append(shard_params(llama_rules(CFG.head_dim), mesh))
    if dp > 1:
        out.append(data_parallel(mesh))
    if zero:
        out.append(zero_partition(zero, mesh))
    return out


def _meta_step(cfg=CFG, dtype=torch.float64, optim="adamw"):
    with meta_device():
        model = Llama(cfg, dtype=dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = OPTIMIZERS[optim](params) if isinstance(optim, str) else optim
    return make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)


def build_lazy(mesh, tp, dp, zero, seed=1, dtype=torch.float64):
    """Meta model -> the transforms -> materialize: only this rank's shards are allocated."""
    step, state = _meta_step(dtype=dtype)
    return compose(*_composition(mesh, tp, dp, zero), materialize(seed=seed))(step, state)


def build_full(mesh, tp, dp, zero, seed=1, dtype=torch.float64):
    """The same init materialized whole on one process, then sharded by the transforms."""
    step, state = _meta_step(dtype=dtype)
    step, state = materialize(seed=seed)(step, state)
    return compose(*_composition(mesh, tp, dp, zero))(step, state)


# ------------------------------------------------------------------------------ shard for shard
@pytest.mark.parametrize("layout", ["tp2xdp2+zero3", "tp2xdp2+zero2", "tp4", "dp2+zero3"])
def test_lazy_equals_full_init_shard_for_shard(layout):
    world, tp, dp, zero = LAYOUTS[layout]
    for rank in range(world):
        mesh = DeviceMesh.virtual(rank=rank, dp=dp, tp=tp)
        lazy_step, lazy_state = build_lazy(mesh, tp, dp, zero)
        full_step, full_state = build_full(mesh, tp, dp, zero)
        assert lazy_step.layouts == full_step.layouts or tp == dp == 1
        assert_same_state(lazy_state, full_state, layout, rank)
        check_materialized(lazy_state)
    # And the shards are not all alike: the init differs by leaf and position.
    q = lazy_state.params["layers.0.self_attn.q_proj.weight"]
    assert q.std() > 0 and not torch.equal(q, lazy_state.params[
        "layers.1.self_attn.q_proj.weight"])


def test_blocked_layout_and_chunking_give_the_same_values(monkeypatch):
    """A fused [q | k | v] split per block (GPT-2's c_attn) and every chunking of the work
    give the entries of the whole leaf."""
    mesh = DeviceMesh.virtual(rank=1, tp=2, dp=2)
    shape = (12, 9)
    lay = Layout(mesh, shape, {"tp": Shard(0)}, blocks={0: 3}).split(1, "dp")
    rules = {"w": normal(0.5)}
    whole = materialize_tree({"w": torch.empty(shape, device="meta")}, None, rules, seed=3)["w"]
    meta = torch.empty(lay.local_shape(), device="meta")
    for chunk in (lazy.CHUNK, 1, 2, 5):
        monkeypatch.setattr(lazy, "CHUNK", chunk)
        part = materialize_tree({"w": meta}, {"w": lay}, rules, seed=3)["w"]
        assert torch.equal(part, shard_tensor(whole, lay)), chunk
        again = materialize_tree({"w": torch.empty(shape, device="meta")}, None, rules, seed=3)
        assert torch.equal(again["w"], whole), chunk
    other = materialize_tree({"w": torch.empty(shape, device="meta")}, None, rules, seed=4)
    assert not torch.equal(other["w"], whole)  # the seed matters


def _triple32(x):
    for shift, mul in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
        x = ((x ^ (x >> shift)) * mul) & 0xFFFFFFFF
    return x ^ (x >> 14)


def test_bits_are_the_documented_hash():
    """The tensor arithmetic (products split to stay below 2^49) equals the 32-bit hash of
    the module docstring computed with Python's unbounded ints, counters beyond 2^32 too."""
    shape = (3, 2**31 + 5)  # global shape only: no tensor of it is made
    index = (torch.tensor([0, 2]), torch.tensor([0, 1, 2**31 + 4]))
    slab = Slab("layers.3.w", shape, index, seed=7, device=torch.device("cpu"))
    got = slab.bits(stream=2)
    k0, k1 = lazy._keys(7, "layers.3.w", 2)
    for a, i in enumerate(index[0].tolist()):
        for b, j in enumerate(index[1].tolist()):
            c = i * shape[1] + j
            want = _triple32(_triple32((c & 0xFFFFFFFF) ^ k0) ^ (c >> 32) ^ k1)
            assert int(got[a, b]) == want, (i, j)


# -------------------------------------------------------------------------- distributions
class _Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 128)
        self.emb = nn.Embedding(100, 200, padding_idx=3)
        self.conv = nn.Conv2d(8, 64, 3)
        self.ln = nn.LayerNorm(64)
        self.bn = nn.BatchNorm1d(16)


def _stats_ok(x, mean, std, n_sigma=5.0):
    n = x.numel()
    assert abs(float(x.mean()) - mean) <= n_sigma * std / math.sqrt(n), (float(x.mean()), mean)
    # The standard error of a sample std is ~ std / sqrt(2 n).
    assert abs(float(x.std()) - std) <= n_sigma * std / math.sqrt(2 * n), (float(x.std()), std)


def test_default_inits_mirror_torch():
    with torch.device("meta"):  # a model that never names a device needs no meta_device()
        model = _Zoo()
    assert all(p.is_meta for p in model.parameters())
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    rules = init_rules(model)
    p = materialize_tree(params, None, rules, seed=0)
    b = materialize_tree(buffers, None, rules, seed=0)
    bound = 1 / math.sqrt(256)  # Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std bound/sqrt(3)
    assert float(p["lin.weight"].abs().max()) <= bound
    _stats_ok(p["lin.weight"], 0.0, bound / math.sqrt(3))
    assert float(p["lin.bias"].abs().max()) <= bound
    emb = p["emb.weight"]
    assert torch.equal(emb[3], torch.zeros(200))  # padding_idx row
    _stats_ok(torch.cat([emb[:3], emb[4:]]), 0.0, 1.0)
    conv_bound = 1 / math.sqrt(8 * 3 * 3)
    assert float(p["conv.weight"].abs().max()) <= conv_bound
    _stats_ok(p["conv.weight"], 0.0, conv_bound / math.sqrt(3))
    assert torch.equal(p["ln.weight"], torch.ones(64)) and torch.equal(p["ln.bias"],
                                                                       torch.zeros(64))
    assert torch.equal(b["bn.running_var"], torch.ones(16))
    assert torch.equal(b["bn.running_mean"], torch.zeros(16))
    count = b["bn.num_batches_tracked"]
    assert count.dtype == torch.int64 and int(count) == 0
    # Two leaves of the same shape and distribution are uncorrelated.
    two = materialize_tree({"a": torch.empty(128, 256, device="meta"),
                            "b": torch.empty(128, 256, device="meta")}, None,
                           {"a": normal(), "b": normal()}, seed=0)
    corr = float((two["a"] * two["b"]).mean())
    assert abs(corr) <= 5 / math.sqrt(128 * 256), corr
    _stats_ok(two["a"], 0.0, 1.0)


def test_overrides_and_llama_scheme():
    with meta_device():
        model = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, ffn_hidden=128))
    assert all(p.is_meta for p in model.parameters())
    params = dict(model.named_parameters())
    cfg = model.cfg
    p = materialize_tree(params, None, init_rules(model, llama_inits(cfg)), seed=0)
    _stats_ok(p["layers.0.self_attn.q_proj.weight"], 0.0, cfg.init_std)
    _stats_ok(torch.cat([p[f"layers.{i}.mlp.down_proj.weight"].flatten() for i in range(4)]),
              0.0, cfg.init_std / math.sqrt(2 * cfg.n_layers))
    assert torch.equal(p["norm.weight"], torch.ones(64))
    # First matching pattern wins; defaults elsewhere.
    rules = init_rules(model, {"lm_head.*": constant(0.25)})
    q = materialize_tree(params, None, rules, seed=0)
    assert torch.equal(q["lm_head.weight"], torch.full((64, 64), 0.25))
    assert float(q["layers.0.mlp.up_proj.weight"].abs().max()) <= 1 / math.sqrt(64)


# --------------------------------------------------------------------------------- memory
def test_peak_memory_is_the_local_shards():
    """Building and materializing under tp2 x dp2 + ZeRO-3 holds this rank's quarter of the
    model plus the chunk temporaries, never the model."""
    cfg = LlamaConfig(vocab_size=8192, dim=256, n_layers=2, n_heads=8, ffn_hidden=688)
    mesh = DeviceMesh.virtual(rank=0, dp=2, tp=2)
    opt = fo.sgd(lr=0.1)  # no optimizer state: the bytes are the parameters'
    with LiveBytes() as lazy_mem:
        with meta_device():
            model = Llama(cfg)
        apply_fn, params, buffers = functionalize(model)
        step = make_train_step(apply_fn, lm_loss, opt)
        rules = llama_rules(cfg.head_dim)
        step, state = compose(shard_params(rules, mesh), data_parallel(mesh),
                              zero_partition(3, mesh), materialize(seed=0))(
            step, init_state(params, buffers, opt))
    local = sum(x.numel() * x.element_size() for x in state.params.values())
    full = sum(p.numel() * 4 for p in model.parameters())
    with LiveBytes() as full_mem:
        s = materialize(seed=0)(*_meta_step(cfg, torch.float32, opt))[1]
        del s
    temps = lazy.CHUNK * 6 * 8  # six int64/float64 arrays of a chunk (module docstring)
    print(f"\nfull model {full / 2**20:.1f} MiB; tp2xdp2+zero3 rank 0 shards "
          f"{local / 2**20:.1f} MiB, peak while building {lazy_mem.peak / 2**20:.1f} MiB; "
          f"one-process full init peak {full_mem.peak / 2**20:.1f} MiB")
    assert lazy_mem.peak <= local + temps + 2**20, (lazy_mem.peak, local)
    assert lazy_mem.peak < 0.5 * full
    assert full_mem.peak >= full  # the measure sees a whole model when one is made


# --------------------------------------------------------------------------------- errors
def test_bad_rules_fail_on_the_meta_model_before_allocating():
    step, state = _meta_step()
    mesh = DeviceMesh.virtual(rank=0, tp=2, dp=1)
    with LiveBytes() as mem, pytest.raises(ValueError, match="'layers.*.nope'.*matches no"):
        shard_params([Rule("layers.*.nope", "colwise")], mesh)(step, state)
    assert mem.peak == 0
    # 8 query heads (4 key/value heads) over tp=3: the rule's unit (head_dim) does not divide.
    mesh3 = DeviceMesh.virtual(rank=0, tp=3, dp=1)
    with pytest.raises(ValueError, match="q_proj.weight.*does not divide the number of heads"):
        compose(shard_params(llama_rules(CFG.head_dim), mesh3), materialize())(step, state)


def test_init_errors_name_the_leaf():
    step, state = _meta_step()
    with pytest.raises(ValueError, match="inits pattern 'layers.\\*.attn.weight' matches no"):
        materialize(inits={"layers.*.attn.weight": normal()})(step, state)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))
            self.register_buffer("freqs", torch.arange(4.0))  # computed in __init__: lost

        def forward(self, x):
            return self.lin(x) * self.scale + self.freqs

    with meta_device():
        model = Scaled()
    apply_fn, params, buffers = functionalize(model)
    opt = fo.adamw(lr=1e-2)
    mstep = make_train_step(apply_fn, lambda out, y: ((out - y) ** 2).mean(), opt)
    mstate = init_state(params, buffers, opt)
    with pytest.raises(ValueError, match="'scale' is on the meta device and no init rule"):
        materialize()(mstep, mstate)
    with pytest.raises(ValueError, match="'freqs' is on the meta device and no init rule"):
        materialize(inits={"scale": constant(1.0)})(mstep, mstate)
    _, done = materialize(inits={"scale": constant(1.0),
                                 "freqs": values(torch.arange(4.0))})(mstep, mstate)
    assert torch.equal(done.buffers["freqs"], torch.arange(4.0))
    check_materialized(done)
    # A state never materialized: the step would compute on meta tensors.
    _, sharded = zero_partition(3, DeviceMesh.virtual(rank=0, dp=2))(step, state)
    with pytest.raises(ValueError, match="'params.embed_tokens.weight' is still on the meta"):
        check_materialized(sharded)
    # amp_cast reads values (its loss scale goes on the params' device): materialize first.
    late = amp_cast("bf16")(*_meta_step(dtype=torch.float32))
    with pytest.raises(ValueError, match="apply it before amp_cast"):
        materialize()(*late)


def test_shape_not_the_layouts_local_shape_is_refused():
    mesh = DeviceMesh.virtual(rank=0, tp=2, dp=1)
    lay = Layout(mesh, (8, 4), {"tp": Shard(0)}, name="w")
    with pytest.raises(ValueError, match="'w': the meta leaf has shape \\(8, 4\\).*\\(4, 4\\)"):
        materialize_tree({"w": torch.empty(8, 4, device="meta")}, {"w": lay},
                         {"w": normal()})


# ------------------------------------------------------------------------------- training
def train_lazy(tp, dp, zero, lazily):
    """TRAIN_STEPS of AdamW from the seed-1 lazy init; (losses, whole params) on every rank."""
    mesh = DeviceMesh.from_env(dp=dp, tp=tp)
    build = build_lazy if lazily else build_full
    return run(*build(mesh, tp, dp, zero), batches()[:TRAIN_STEPS])


def test_train_from_lazy_tp2xdp2_zero3_matches_one_process():
    ref_losses, ref_params = train_lazy(1, 1, 0, lazily=False)
    assert ref_losses[-1] < ref_losses[0]
    for rank, (losses, params) in enumerate(run_ranks(train_lazy, 4, 2, 2, 3, True,
                                                      backend=None, timeout=600)):
        if rank == 0:
            print(f"\nlazy tp2xdp2+zero3 vs one process: losses {loss_rel(losses, ref_losses):.1e}"
                  f", params {max_rel(params, ref_params):.1e}")
        assert loss_rel(losses, ref_losses) <= TOL, rank
        assert max_rel(params, ref_params) <= TOL, rank


def test_step_on_an_unmaterialized_state_names_the_leaf():
    step, state = _meta_step()
    with pytest.raises(ValueError, match=r"TrainStep: 'params\..*' is still on the meta device"):
        step(state, batches()[0])
