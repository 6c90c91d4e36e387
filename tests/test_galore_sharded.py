"""GaLore (AdamW, 8-bit AdamW, Adafactor) under tensor parallelism gives the one-process run.

The example Llama of tests/test_tensor_parallel.py (vocab 50, MLP width 42: uneven shards over
4) trained 10 steps in float64 under tp2 and tp4 against the same 10 steps in one process.
Every attention/MLP weight is projected, rank 4, ``update_proj_gap=3`` (refreshes at steps 0,
3, 6, 9), with the projection on every kind of side against the split:

==============  ======  ==============  =========================================  ==========
leaf            split   proj_type       projected side                             per step
==============  ======  ==============  =========================================  ==========
q_proj          rows    left            rows (split): P^T G is a partial sum       all-reduce
k_proj          rows    right           columns (whole): low-rank state row-split  none
v_proj          rows    full            both: P^T G Q^T partial over the rows      all-reduce
o_proj          cols    reverse_std     left (rows, whole): state column-split     none
gate/up_proj    rows    std             right (cols, whole): state rows 11/11/11/9 none
down_proj       cols    std             left (rows, whole): state cols 11/11/11/9  none
==============  ======  ==============  =========================================  ==========

Under tp4 a shard of ``up_proj`` is (11, 32), "wide", where the whole (42, 32) is "tall":
``shard_params`` initialises the optimizer with the shards' layouts (``init_laid_out``), so the
init plans the whole leaf's side; an init on bare shards would pick the other side and the
first update would rebuild the zero state (``_fit_state``); the results must match either way.

Tolerances: float64 collectives only reorder sums (~1e-16 relative per step); 1e-10 leaves
room for 10 steps of that through the SVD, whose singular vectors move by (perturbation / gap
between the 4th and 5th singular values). The projector's SVD runs in float32 by default
(galore-torch's); the gathered gradient then rounds to the same float32 numbers as the
one-process one unless a float64 value sits within ~1e-16 of a float32 rounding boundary, so
the tests run both the default float32 SVD and float64. 8-bit: the states are quantized in the
whole state's blocks (funcpar.optim.quant8, ``layout=``), so codes and absmax are those of one
process; a code can differ only if a float64 state value rounds to a different float32 than in
one process (the same ~1e-16 boundary case), which would show as an error of one code step
(~1e-2 of the block's absmax). Measured: see the asserts' comments.
"""

import math

import pytest
import torch

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim.galore import galore_adafactor, galore_adamw, galore_param_groups
from funcpar.optim.projector import low_rank_shape
from funcpar.optim.quant8 import Quantized
from funcpar.shard.comm import chunk_sizes, comm_log
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.transforms import shard_params

# tests/test_tensor_parallel.py's example model and batches (kept here so this file stands
# alone): 8 heads and 4 kv heads of 4, vocabulary 50 and MLP width 42 (uneven over 4).
CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=42,
                  max_seq_len=16)
STEPS = 10
OPTIMS = ("adamw", "adamw_8bit", "adafactor")
GAP = 3
TOL = {"adamw": 1e-10, "adafactor": 1e-10, "adamw_8bit": 1e-9}  # module docstring
SVD = torch.float64  # the float32 SVD (the default) is not exact to 1e-10: module docstring
OVERRIDES = {
    r"q_proj": {"proj_type": "left"},
    r"k_proj": {"proj_type": "right"},
    r"v_proj": {"proj_type": "full"},
    r"o_proj": {"proj_type": "reverse_std"},
}
OVERRIDES_BY_LEAF = {k: v["proj_type"] for k, v in OVERRIDES.items()}


def _batches(seed=0):
    # Two batches in turn: random tokens, seen repeatedly, so the loss can fall.
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (2, 8, 13), generator=g)
    return [(ids[i % 2, :, :-1], ids[i % 2, :, 1:]) for i in range(STEPS)]


def _max_rel(a, b):
    """Max over leaves of max|a - b| / max|b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def _mask():
    # From the whole model (names and whole shapes), as a user builds it before sharding.
    return galore_param_groups(Llama(CFG), rank=4, update_proj_gap=GAP, scale=0.25,
                               overrides=OVERRIDES)


def _optimizer(name):
    mask = _mask()
    if name == "adamw":
        return fo.chain(fo.clip_by_global_norm(0.5),
                        galore_adamw(lr=1e-2, weight_decay=0.1, galore_mask=mask,
                                     svd_dtype=SVD))
    if name == "adamw_svd32":
        return galore_adamw(lr=1e-2, weight_decay=0.1, galore_mask=mask)
    if name == "adamw_8bit":
        # Small blocks (24) and threshold (100) so that the low-rank states (128 to 168
        # elements) and the vocab-split embedding and head are quantized, in blocks that
        # straddle the shard boundaries (11 rows x 4 = 44 elements, 13 x 32 = 416, ...); the
        # (4, 4) state of "full" and the norms stay float64.
        return galore_adamw(lr=1e-2, galore_mask=mask, eight_bit=True, block_size=24,
                            min_8bit_size=100, adam_variant="bnb", eps=1e-8, svd_dtype=SVD)
    if name == "adafactor":
        return galore_adafactor(lr=0.5, relative_step=False, beta1=0.9, weight_decay=0.1,
                                galore_mask=mask, svd_dtype=SVD)
    raise ValueError(name)


def train(tp, optim):
    """10 float64 steps; (losses, whole params, per-step comm records, the absmax bytes of the
    8-bit states that are split) on every rank."""
    mesh = DeviceMesh.from_env(dp=1, tp=tp)
    torch.manual_seed(0)
    model = Llama(CFG).double()
    apply_fn, params, buffers = functionalize(model)
    opt = _optimizer(optim)
    step = make_train_step(apply_fn, lm_loss, opt)
    state = init_state(params, buffers, opt)
    if tp > 1:
        step, state = shard_params(llama_rules(CFG.head_dim), mesh)(step, state)
    losses, records = [], []
    for batch in _batches():
        with comm_log.capture() as recs:
            state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        records.append([(r.op, r.axis, r.nbytes, r.purpose) for r in recs])
    params = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    return losses, params, records, _split_absmax_bytes(state.opt_state)


def _split_absmax_bytes(opt_state):
    """Bytes of the absmax (float32, m and v) of the 8-bit states that are cut on this rank:
    what the absmax all-reduce carries per step."""
    inner = getattr(opt_state, "inner", None)
    if inner is None or not hasattr(inner, "exp_avg"):
        return 0
    shapes = {n: tuple(p.shape) for n, p in Llama(CFG).named_parameters()}
    total = 0
    for name, proj in inner.projector.items():
        for q in (inner.exp_avg[name], inner.exp_avg_sq[name]):
            if not isinstance(q, Quantized):
                continue
            whole = shapes[name] if proj is None else low_rank_shape(
                shapes[name], 4, OVERRIDES_BY_LEAF.get(name.split(".")[-2], "std"))
            if math.prod(whole) != q.codes.numel():
                total += q.absmax.numel() * 4
    return total


def _all(tp):
    return {o: train(tp, o) for o in OPTIMS}


def _projected():
    return [n for n, c in _mask().items() if c is not None]


@pytest.fixture(scope="module")
def reference():
    return {o: train(1, o)[:2] for o in OPTIMS}


def _check(results, reference, tp):
    projected = _projected()
    for rank, res in enumerate(results):
        assert set(res) == set(OPTIMS)
        for optim, (losses, params, records, absmax_bytes) in res.items():
            ref_losses, ref_params = reference[optim]
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            param_err = _max_rel(params, ref_params)
            tol = TOL[optim]
            assert loss_err <= tol, (tp, rank, optim, loss_err)
            assert param_err <= tol, (tp, rank, optim, param_err)
            _check_comm(records, projected, tp, optim, absmax_bytes)
    # The runs train: the comparison is of training, not of a constant.
    for optim in OPTIMS:
        assert reference[optim][0][-1] < reference[optim][0][0], optim


def _gathered_bytes(projected, tp, elem):
    """What the refresh's one all-gather carries (the comm log's convention: the gathered
    output): every rank sends its pieces of all projected leaves as one buffer, padded to the
    longest rank's (uneven splits: MLP width 42 over 4 is 11, 11, 11, 9 rows)."""
    shapes = {n: tuple(p.shape) for n, p in Llama(CFG).named_parameters()}
    per_rank = [0] * tp
    for name in projected:
        rows, cols = shapes[name]
        split_rows = not any(k in name for k in ("o_proj", "down_proj"))  # llama_rules
        n, other = (rows, cols) if split_rows else (cols, rows)
        # q/k/v are cut by heads (blocks of head_dim), evenly here; the MLP by rows/columns.
        for r, piece in enumerate(chunk_sizes(n, tp)):
            per_rank[r] += piece * other
    return tp * max(per_rank) * elem


def _check_comm(records, projected, tp, optim, absmax_bytes):
    """Per step, every optimizer collective of every leaf in one message per kind: at refresh
    steps one all-gather of all projected gradients (before: one per leaf); each step one
    all-reduce of the projections of the leaves projected on their split side (q_proj: left,
    v_proj: full; before: one per leaf); with 8-bit states one all-reduce (max) of the absmax of
    every split state (before: one per state and moment)."""
    elem = 8  # float64
    for t, recs in enumerate(records):
        gathers = [r for r in recs if "galore refresh: gather gradient" in r[3]]
        if t % GAP == 0:
            assert [(r[0], r[1], r[3]) for r in gathers] == [
                ("all_gather", "tp", "galore refresh: gather gradient")], (t, optim, gathers)
            assert gathers[0][2] == _gathered_bytes(projected, tp, elem), (t, optim, gathers)
        else:
            assert gathers == [], (t, optim, gathers)
        proj = [r for r in recs if "galore projection" in r[3]]
        # q_proj: P^T G is (4, 32); v_proj: P^T G Q^T is (4, 4); two layers.
        assert [(r[0], r[1], r[3]) for r in proj] == [("all_reduce", "tp", "galore projection")]
        assert proj[0][2] == CFG.n_layers * (4 * 32 + 4 * 4) * elem, proj
        absmax = [r for r in recs if "8-bit absmax" in r[3]]
        if optim == "adamw_8bit":
            # m and v of every quantized state that is split: k/gate/up/o/down low-rank states,
            # the embedding and the LM head; float32 absmax, one per block of 24.
            assert [(r[0], r[1], r[3]) for r in absmax] == [("all_reduce", "tp", "8-bit absmax")]
            assert absmax[0][2] == absmax_bytes > 0, (absmax, absmax_bytes)
        else:
            assert absmax == []
        # All of it: per step one message per phase with a reduction (the projection; the
        # absmax; Adafactor's three: statistics with RMS(W), the row factor's sum, the update
        # RMS), one more at a refresh. Before the batching: one per leaf and phase.
        ours = [r for r in recs if any(k in r[3] for k in ("galore", "factored", "rms", "8-bit"))]
        want = {"adamw": 1, "adamw_8bit": 2, "adafactor": 4}[optim] + (t % GAP == 0)
        assert len(ours) == want, (t, optim, [r[3] for r in ours])


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_galore_tensor_parallel_matches_one_process(tp, reference):
    results = run_ranks(_all, tp, tp, backend=None, timeout=300)
    _check(results, reference, tp)


# --------------------------------------------------------------------------------------------
# Batched refresh gathers and messages per step
# --------------------------------------------------------------------------------------------

# (name, global shape, spec, blocks) on a dp2 x tp2 mesh: each kind of split the gradients of
# projected leaves meet (one axis per dim, nested axes in both orders, uneven pieces,
# a blocked split), float64 and one float32 leaf (gathered apart: one buffer per dtype).
GATHER_CASES = [
    ("rows_tp", (7, 5), ("tp",), {}),
    ("cols_tp", (7, 5), (None, "tp"), {}),
    ("rows_tp_cols_dp", (7, 6), ("tp", "dp"), {}),
    ("rows_tp_then_dp", (9, 5), (("tp", "dp"),), {}),
    ("rows_dp_then_tp", (6, 5), (("dp", "tp"),), {}),
    ("uneven_nested", (5, 4), (("tp", "dp"),), {}),  # 5 rows: 3 | 2 over tp, 2 | 1 | 1 | 1
    ("blocked", (8, 3), ("tp",), {0: 2}),
    ("whole", (4, 4), (), {}),
]


def _gather_ranks() -> dict:
    """On each rank of dp2 x tp2: gather_many of every case against unshard leaf by leaf, and
    the collectives it issued; then the optimizer messages of the comm table's GaLore cases."""
    from funcpar.optim.projector import gather_many
    from funcpar.shard.layout import Layout, Shard, shard_tensor, unshard

    mesh = DeviceMesh.from_env(dp=2, tp=2)
    gen = torch.Generator().manual_seed(3)
    xs, lays, want = [], [], []
    for i, (name, shape, spec, blocks) in enumerate(GATHER_CASES):
        dtype = torch.float32 if i == 1 else torch.float64
        g = torch.randn(shape, generator=gen, dtype=dtype)
        lay = Layout.from_spec(mesh, shape, spec, name=name)
        if blocks:
            lay = Layout(mesh, shape, {"tp": Shard(0)}, blocks=blocks, name=name)
        x = shard_tensor(g, lay)
        xs.append(x)
        lays.append(lay)
        want.append(unshard(x, lay))
    with comm_log.capture() as recs:
        got = gather_many(xs, lays)
    return {"equal": [torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want)],
            "gathers": [(r.op, r.axis, r.purpose) for r in recs],
            "messages": _galore_messages(2, 2, 2)}


_NOT_OURS = ("global_norm", "zero update gather")


def _galore_messages(tp, dp, zero):
    """Optimizer messages (inside update, clipping and ZeRO's gathers left out: the comm
    table's "optimizer reductions") of the distributed tests' GaLore cases, per step: step 0
    refreshes the projectors, step 1 does not."""
    import dataclasses

    from funcpar.optim.base import GradientTransformation
    from funcpar.testing import reference

    out = {}
    for optim in ("galore_adamw", "galore_adamw8bit", "galore_adafactor"):
        step, state = reference.build(tp, dp, optim, torch.float32, zero=zero)
        inner, counts = step.optimizer, []

        def update(grads, st, params=None, *, layouts=None, inner=inner, counts=counts):
            with comm_log.capture() as recs:
                res = inner.update(grads, st, params, layouts=layouts)
            counts.append(sum(1 for r in recs if not r.purpose.endswith(_NOT_OURS)))
            return res

        step = dataclasses.replace(step, optimizer=GradientTransformation(inner.init, update))
        for batch in reference.batches()[:2]:
            state, _ = step(state, batch)
        out[optim] = counts
    return out


def _tp2_messages() -> dict:
    return _galore_messages(2, 1, 0)


# Optimizer messages per step, [refresh step, other step] (benchmarks/comm_table.py, the
# distributed tests' GaLore cases; docs/DISTRIBUTED_OPTIM.md). Before the per-leaf steps ran
# together: tp2 [20, 6] / [40, 26] / [54, 40], tp2 x dp2 + ZeRO-2 [42, 14] / [78, 50] / [112, 84].
MESSAGES = {
    "tp2": {"galore_adamw": [2, 1], "galore_adamw8bit": [3, 2], "galore_adafactor": [5, 4]},
    "tp2xdp2+zero2": {"galore_adamw": [4, 2], "galore_adamw8bit": [6, 4],
                      "galore_adafactor": [10, 8]},
}


def test_batched_gathers_and_messages_per_step():
    """gather_many gives unshard's tensors (bit for bit) with one all-gather per mesh axis and
    round: here dp, then tp (every leaf's first axis and the tp axes behind a dp), then dp
    again (rows_dp_then_tp's outer axis); the float32 leaf travels apart (one buffer per
    dtype). And the GaLore optimizers' messages per step: one per phase with a reduction and
    axis (the refresh's gather; the projection; the absmax; Adafactor's three)."""
    for rank, res in enumerate(run_ranks(_gather_ranks, 4, timeout=600)):
        assert all(res["equal"]), (rank, res["equal"])
        axes = [a for op, a, why in res["gathers"]
                if op == "all_gather" and why == "galore refresh: gather gradient"]
        assert len(axes) == len(res["gathers"]), res["gathers"]
        assert axes == ["dp", "tp", "tp", "dp"], axes  # tp twice: float64 and float32 buffers
        assert res["messages"] == MESSAGES["tp2xdp2+zero2"], (rank, res["messages"])
    for rank, res in enumerate(run_ranks(_tp2_messages, 2, timeout=600)):
        assert res == MESSAGES["tp2"], (rank, res)


def _zero_galore(world: int):
    from funcpar.transforms import compose, data_parallel, zero_partition

    cfg = LlamaConfig(vocab_size=64, dim=24, n_layers=2, n_heads=4, ffn_hidden=40, max_seq_len=8)
    torch.manual_seed(0)
    apply_fn, params, buffers = functionalize(Llama(cfg).to(torch.float64))
    # Rank 16 of the 24 x 24 attention weights: ZeRO-2 over 2 ranks cuts them along dim 0
    # into 12 x 24 parts, whose own shape is below the rank; the whole leaf decides.
    opt = galore_adamw(lr=1e-2, rank=16, update_proj_gap=2, svd_dtype=torch.float64,
                       galore_mask=lambda name, p: name.endswith(("q_proj.weight",
                                                                  "o_proj.weight")))
    step, state = make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)
    if world > 1:
        mesh = DeviceMesh.from_env(dp=world)
        step, state = compose(data_parallel(mesh), zero_partition(2, mesh))(step, state)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 64, (4, 9), generator=gen)
        state, _ = step(state, (tokens[:, :-1], tokens[:, 1:]))
    return {k: v.clone() for k, v in state.params.items()}


def test_galore_under_zero_checks_the_rank_against_the_whole_leaf():
    """ZeRO initialises the optimizer on its parts, telling it what they are parts of
    (``init_laid_out``): a part smaller than the rank in one dim trains as the whole leaf does
    in one process (float64, 3 steps, two projector refreshes; within 1e-10, the reordered
    sums' room through the SVD, see the module docstring); before, the init raised that the
    rank exceeded the part's shape."""
    one = _zero_galore(1)
    for got in run_ranks(_zero_galore, 2, 2, timeout=240):
        for name, p in one.items():
            torch.testing.assert_close(got[name], p, rtol=1e-10, atol=1e-10, msg=name)
