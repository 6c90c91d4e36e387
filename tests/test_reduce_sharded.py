"""The layout-aware reductions under real sharding: every rank gets the plain op's result on the
global tensor, over exactly the collectives needed (recorded), with reduced-size messages.

Runs on 2 and 4 gloo ranks, one spawn per world size: every case is checked inside the ranks
and the ranks return their errors and any broken expectation.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import max_rel_err

from funcpar.shard import DeviceMesh, Layout, comm_log, shard_tensor
from funcpar.shard import reduce as R
from funcpar.testing import run_ranks

# float64 and the same additions in a different association: rounding only (~1e-16 relative);
# 1e-12 leaves room for sums of up to ~1e4 terms.
TOL64 = 1e-12

# (name, global shape, spec): dims split over tp, dp, both (different dims or nested).
CASES = [
    ("rows_tp", (7, 5), ("tp",)),
    ("cols_tp", (7, 5), (None, "tp")),
    ("rows_tp_cols_dp", (7, 6), ("tp", "dp")),
    ("rows_tp_then_dp", (9, 5), (("tp", "dp"),)),
    ("rows_dp_then_tp", (6, 5), (("dp", "tp"),)),
    ("rows_dp", (5, 3), ("dp",)),
    ("even", (8, 4), ("tp", "dp")),
    ("empty_shard", (6, 4), ("tp",)),  # 6 over 4 ranks: 2, 2, 2, 0
    ("vec_tp", (5,), ("tp",)),
    ("vec_nested", (7,), (("tp", "dp"),)),
    ("cube_mid_tp_last_dp", (3, 7, 5), (None, "tp", "dp")),
    ("cube_first_dp_last_tp", (4, 6, 5), ("dp", None, "tp")),
    ("replicated", (5, 3), ()),
]


def _err(got, ref) -> float:
    """max_rel_err, also for the empty results of an empty shard (conftest's needs elements)."""
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    return max_rel_err(got, ref) if ref.numel() else 0.0


def _all_dims(nd: int) -> list:
    """None (everything), each dim, each dim counted from the end, each pair."""
    out: list = [None] + list(range(nd)) + [-1]
    out += [list(p) for p in itertools.combinations(range(nd), 2)]
    return out


def _expected(fn_name, g, dims, keepdim, layout):
    """The plain op on the global tensor, cut to this rank's part of the kept dims."""
    d = tuple(range(g.dim())) if dims is None else tuple(
        x % g.dim() for x in ([dims] if isinstance(dims, int) else dims))
    full = {
        "reduce_sum": lambda: g.sum(dim=d, keepdim=True),
        "reduce_mean": lambda: g.mean(dim=d, keepdim=True),
        "reduce_max": lambda: g.amax(dim=d, keepdim=True),
    }[fn_name]()
    sl = tuple(slice(None) if i in d else s for i, s in enumerate(layout.local_slices()))
    out = full[sl]
    return out if keepdim else out.squeeze(d) if d else out


def _check_ranks(world: int) -> dict:
    """On each rank: every case on every mesh of this world; errors and broken expectations."""
    meshes = [DeviceMesh.from_env(dp=w, tp=world // w) for w in (1, 2, 4) if world % w == 0]
    gen = torch.Generator().manual_seed(1234)  # same global tensors on every rank
    errors: dict[str, float] = {}
    broken: list[str] = []
    n_collectives = 0
    for mesh in meshes:
        for name, shape, spec in CASES:
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            lay = Layout.from_spec(mesh, shape, spec, name=name)
            x = shard_tensor(g, lay)
            where = f"{name} on {mesh.shape}"
            calls = [(f, dims, kd) for f in ("reduce_sum", "reduce_mean", "reduce_max")
                     for dims in _all_dims(g.dim()) for kd in (False, True)]
            calls += [(f, None, None) for f in ("sum_of_squares", "norm", "rms")]
            for fn_name, dims, keepdim in calls:
                fn = getattr(R, fn_name)
                with comm_log.capture() as recs:
                    if keepdim is None:
                        got = fn(x, layout=lay, purpose="probe")
                        ref = {"sum_of_squares": g.square().sum(), "norm": g.norm(),
                               "rms": g.square().mean().sqrt()}[fn_name]
                    else:
                        got = fn(x, dims, layout=lay, keepdim=keepdim, purpose="probe")
                        ref = _expected(fn_name, g, dims, keepdim, lay)
                key = f"{where} {fn_name}"
                errors[key] = max(errors.get(key, 0.0), _err(got, ref))
                # Exactly one all_reduce per axis of size > 1 splitting a reduced dim, in mesh
                # order, each carrying the reduced result - never the tensor.
                red = range(g.dim()) if dims is None else (
                    [dims] if isinstance(dims, int) else dims)
                want = [a for a in lay.axes_for(list(red)) if mesh.size(a) > 1]
                seen = [r.axis for r in recs]
                if seen != want or any(r.op != "all_reduce" for r in recs):
                    broken.append(f"{key} dims={dims}: collectives {recs} but expected {want}")
                for r in recs:
                    if r.nbytes != got.numel() * 8 or r.nbytes >= g.numel() * 8:
                        broken.append(f"{key} dims={dims}: message of {r.nbytes} bytes for a "
                                      f"result of {got.numel()} float64 and a tensor of "
                                      f"{g.numel()}")
                    if r.purpose != f"{name}: probe":
                        broken.append(f"{key}: purpose {r.purpose!r}")
                n_collectives += len(recs)
    return {"errors": errors, "broken": broken, "collectives": n_collectives}


@pytest.mark.parametrize("world", [2, 4])
def test_reductions_match_the_global_op(world):
    results = run_ranks(_check_ranks, world, world, timeout=120)
    for rank, res in enumerate(results):
        assert not res["broken"], f"rank {rank}:\n" + "\n".join(res["broken"][:20])
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL64, f"rank {rank}: {worst}"
        assert res["collectives"] > 0
    # every rank agrees on how many collectives it issued (no rank skipped one)
    assert len({r["collectives"] for r in results}) == 1


def test_local_mesh_layouts_are_plain_ops_without_collectives():
    """On one process, a layout over size-1 axes changes nothing and communicates nothing."""
    mesh = DeviceMesh.local(dp=1, tp=1)
    g = torch.randn(7, 5, dtype=torch.float64)
    lay = Layout.from_spec(mesh, g.shape, ("tp", "dp"), name="w")
    assert lay.local_shape() == (7, 5) and not lay.is_sharded
    with comm_log.capture() as recs:
        assert torch.equal(R.reduce_sum(g, 0, layout=lay), g.sum(0))
        assert torch.equal(R.reduce_max(g, 1, layout=lay, keepdim=True), g.amax(1, keepdim=True))
        assert torch.equal(R.reduce_mean(g, layout=lay), g.mean())
        assert max_rel_err(R.norm(g, layout=lay), g.norm()) <= TOL64
        assert max_rel_err(R.rms(g, layout=lay), g.square().mean().sqrt()) <= TOL64
    assert recs == []


def test_reduce_max_of_an_empty_shard_is_the_identity():
    """An uneven split can leave a rank nothing: its max must not win (nor raise)."""
    lay = Layout.from_spec(DeviceMesh.local(tp=1), (0, 3), ())
    x = torch.empty(0, 3, dtype=torch.float64)
    assert torch.equal(R.reduce_max(x, 0, layout=lay), torch.full((3,), -torch.inf,
                                                                  dtype=torch.float64))
    assert R.reduce_max(x, (0, 1), layout=lay, keepdim=True).shape == (1, 1)
    assert R.reduce_max(x, 1, layout=lay).shape == (0,)
    xi = torch.empty(2, 0, dtype=torch.int64)
    lay_i = Layout.from_spec(DeviceMesh.local(tp=1), (2, 0), ())
    assert torch.equal(R.reduce_max(xi, 1, layout=lay_i),
                       torch.full((2,), torch.iinfo(torch.int64).min))
    with pytest.raises((IndexError, RuntimeError)):  # without a layout: plain amax, which refuses
        R.reduce_max(x, 0)


# Purposes of the optimizers' own reductions (not clipping's global_norm, not the gradients').
_OPT_PURPOSES = ("lamb", "rms", "factored")


def _batched_ranks() -> dict:
    """On each rank of tp2: sum_partials against sum_partial leaf by leaf, and the number of
    optimizer all-reduces in one training step of Lamb, Adafactor and CAME."""
    from funcpar.testing import reference

    mesh = DeviceMesh.from_env(dp=1, tp=2)  # dp of size 1: the CASES' specs apply as they are
    gen = torch.Generator().manual_seed(7)
    partials, layouts, dims, per_leaf = [], [], [], []
    for name, shape, spec in CASES:
        lay = Layout.from_spec(mesh, shape, spec, name=name)
        x = shard_tensor(torch.randn(shape, generator=gen, dtype=torch.float64), lay)
        for d in range(x.dim()):
            partials.append(x.sum(d))
            layouts.append(lay)
            dims.append(d)
            per_leaf.append(R.sum_partial(x.sum(d), d, layout=lay))
    with comm_log.capture() as recs:
        got = R.sum_partials(partials, layouts, dims, purpose="probe")
    out = {"equal": all(torch.equal(a, b) for a, b in zip(got, per_leaf)),
           "batched": [(r.op, r.axis, r.purpose) for r in recs]}
    for optim in ("lamb", "adafactor", "came"):
        step, state = reference.build(2, 1, optim)
        with comm_log.capture() as recs:
            step(state, reference.batches()[0])
        out[optim] = sum(1 for r in recs if any(p in r.purpose for p in _OPT_PURPOSES))
    return out


def test_batched_partials_one_message_per_axis_and_phase():
    """sum_partials completes many leaves' partial sums in one all-reduce per mesh axis, with
    exactly sum_partial's values (two ranks: each entry is one addition, the same in either
    order); the optimizers' per-leaf scalars and factors then cost one message per phase of
    their step on tp2 instead of one per leaf (before: Lamb 32, Adafactor 44, CAME 72;
    docs/DISTRIBUTED_OPTIM.md). Phases: Lamb 1 (both norms of all leaves together);
    Adafactor 3 (row and column sums; the row factor's sum; the update's sum of squares);
    CAME 5 (those three, then the residual's row and column sums and its row factor's sum)."""
    for rank, res in enumerate(run_ranks(_batched_ranks, 2, timeout=300)):
        assert res["equal"], rank
        assert res["batched"] == [("all_reduce", "tp", "probe")], (rank, res["batched"])
        assert (res["lamb"], res["adafactor"], res["came"]) == (1, 3, 5), (rank, res)


def _scripted(name: str, script: str, log: list):
    """A phased step that asks, phase by phase, for what ``script`` says: ``X`` a pass, ``P``
    a reduction (no layout: completed locally), ``F`` a final pass; it checks its results."""
    for k, what in enumerate(script):
        if what == "P":
            x = torch.tensor(float(k))
            (got,) = yield [R.Partial(x, None, None, "probe")]
            assert torch.equal(got, x)
        else:
            run = _final_pass if what == "F" else _pass
            (got,) = yield [R.Pass(run, (name, k), {}, what == "F")]
            # the result of this call, from the batched call that carried it
            assert got[:2] == (name, k) and (name, k) in log[got[2]][1], (got, name, k)
    return name


def _batched(calls, tag, log):
    log.append((tag, [args for args, _ in calls]))
    return [(*args, len(log) - 1) for args, _ in calls]


_LOG: list = []


def _pass(calls):
    return _batched(calls, "X", _LOG)


def _final_pass(calls):
    return _batched(calls, "F", _LOG)


def test_run_phased_batches_passes_per_round_and_orders_classes():
    """run_phased runs each round's passes as one call per kind (one launch for all leaves,
    not one per leaf); reductions wait while a pass other than a final one can run, so they
    meet in as few rounds as possible; final passes wait for every reduction and share one
    round. Results go back to the step that asked, in order."""
    _LOG.clear()
    scripts = {"a": "XPPXPF", "b": "XPF", "c": "PXPF", "d": "F"}
    with comm_log.capture() as recs:
        out = R.run_phased([_scripted(n, s, _LOG) for n, s in scripts.items()])
    assert out == list(scripts) and recs == []
    assert _LOG == [
        ("X", [("a", 0), ("b", 0)]),   # passes first: c's reduction waits
        ("X", [("c", 1)]),             # c's pass, after the round of a's, b's and c's reductions
        ("X", [("a", 3)]),             # a's second pass, after its second reduction round
        ("F", [("a", 5), ("b", 2), ("c", 3), ("d", 0)]),  # every final pass in one call
    ], _LOG
    # nested: together() inside a step schedules the same way (a pass of the inner steps runs
    # before the reduction of a sibling inner step).
    _LOG.clear()

    def outer():
        inner = yield from R.together(_scripted("p", "PX", _LOG), _scripted("q", "XP", _LOG))
        return inner

    assert R.run_phased([outer(), _scripted("r", "XF", _LOG)]) == [("p", "q"), "r"]
    assert _LOG == [("X", [("q", 0), ("r", 0)]), ("X", [("p", 1)]), ("F", [("r", 1)])], _LOG
    with pytest.raises(TypeError, match="not a Partial or a Pass"):
        R.run_requests([object()])


def test_together_runs_the_last_step_as_it_is_when_the_others_finish_at_once():
    """Steps that return before asking for anything (Adafactor's step size when it needs no
    reduction) leave together() the last step alone: it is delegated to, not relayed round by
    round, with the same schedule and results."""

    def done():
        return "now"
        yield  # a generator that asks for nothing

    _LOG.clear()

    def outer():
        return (yield from R.together(done(), done(), _scripted("p", "XPF", _LOG)))

    assert R.run_phased([outer(), _scripted("r", "XF", _LOG)]) == [("now", "now", "p"), "r"]
    assert _LOG == [("X", [("p", 0), ("r", 0)]), ("F", [("p", 2), ("r", 1)])], _LOG


def _tensor_fold(xs):
    """The sum of squares as tensor ops: a norm per leaf, squared, folded left to right in the
    accumulation dtype (what the general path computes for unsharded leaves)."""
    acc = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    total = None
    for x in xs:
        sq = torch.linalg.vector_norm(x, dtype=acc).square()
        total = sq if total is None else total + sq
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_host_fold_of_the_grad_norm_is_the_tensor_fold_bit_for_bit(dtype):
    """The grad-norm metric's host fold (eager CPU, one dtype) rounds each float32 product and
    sum from float64: the same bits as the float32 tensor ops, overflow to inf, subnormals and
    nan included (300 random trees of 2-30 leaves over 40 orders of magnitude)."""
    gen = torch.Generator().manual_seed(1)
    lo, hi = (-3, 3) if dtype == torch.float16 else (-25, 19)
    for trial in range(300):
        n = int(torch.randint(2, 31, (), generator=gen))
        mag = 10.0 ** (lo + (hi - lo) * torch.rand((n,), generator=gen, dtype=torch.float64))
        xs = [(torch.randn(int(torch.randint(1, 60, (), generator=gen)), generator=gen,
                           dtype=torch.float64) * m).to(dtype) for m in mag.tolist()]
        if trial % 37 == 0:
            xs[trial % n][0] = float("nan")
        if trial % 41 == 0:
            xs[trial % n][0] = float("inf")
        got = R._host_fold(xs)
        want = _tensor_fold(xs)
        assert got.dtype == want.dtype and got.dim() == 0
        both_nan = bool(got.isnan()) and bool(want.isnan())
        assert torch.equal(got, want) or both_nan, (trial, got, want)
    # a float32 sum past the largest finite float32 is inf, as the tensor addition's
    big = [torch.tensor([1.5e19]), torch.tensor([1.5e19])]
    if dtype == torch.float32:
        assert R._host_fold(big).item() == float("inf") == _tensor_fold(big).item()
    # not for tensors that are differentiated, nor a single leaf: the tensor path runs
    assert R._host_fold([torch.ones(2, requires_grad=True), torch.ones(2)]) is None
    assert R._host_fold([torch.ones(2)]) is None
