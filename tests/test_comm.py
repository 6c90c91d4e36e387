"""Collectives over mesh axes and their accounting.

The values and the records are checked on 4 gloo ranks (a 2x2 dp x tp mesh, plus a dp=4 x tp=1
mesh for size-1 axes) in one spawn; the recorder and the report on one process.
"""

from __future__ import annotations

import pytest
import torch

from funcpar.shard import DeviceMesh, comm_log, comm_report
from funcpar.shard import comm as C
from funcpar.testing import run_ranks


def _data(rank: int, shape=(3, 4)) -> torch.Tensor:
    """Rank-dependent float64 data that every rank (and the parent) can rebuild."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) + 1) * (rank + 1) - 3 * rank


def _ranks_run() -> dict:
    mesh = DeviceMesh.from_env(dp=2, tp=2)
    flat = DeviceMesh.from_env(dp=4, tp=1)
    r = mesh.rank()
    x = _data(r)
    before = x.clone()
    out: dict = {"rank": r, "coords": mesh.coords(), "tp_ranks": mesh.group_ranks("tp"),
                 "dp_ranks": mesh.group_ranks("dp")}
    comm_log.clear()
    comm_log.enable()
    comm_log.begin_step(0)
    out["sum_tp"] = C.all_reduce(x, mesh, "tp", purpose="w.sum")
    out["max_dp"] = C.all_reduce(x, mesh, "dp", op="max", purpose="w.max")
    out["min_tp"] = C.all_reduce(x, mesh, "tp", op="min", purpose="w.min")
    out["input_untouched"] = torch.equal(x, before)
    y = x.clone()
    same = C.all_reduce(y, mesh, "dp", inplace=True, purpose="inplace")
    out["inplace_is_input"] = same is y
    out["inplace"] = y
    out["async"] = C.all_reduce(x, mesh, "tp", async_op=True, purpose="async").wait()
    # size-1 axis: the input itself back, and no record
    out["size1_is_input"] = C.all_reduce(x, flat, "tp", purpose="never") is x
    comm_log.begin_step(1)
    out["gather_even_d0"] = C.all_gather(x, mesh, "tp", sizes=[3, 3], purpose="even0")
    out["gather_even_d1"] = C.all_gather(x, mesh, "dp", dim=1, sizes=[4, 4],
                                         purpose="even1")
    # uneven: rank at tp coordinate c holds 2 - c rows (2 and 1) of a 3-row tensor
    piece = x[: 2 - mesh.rank("tp")]
    out["gather_uneven_known"] = C.all_gather(piece, mesh, "tp", sizes=[2, 1], purpose="unev")
    out["gather_uneven_exchanged"] = C.all_gather(piece, mesh, "tp", purpose="unev?")
    cols = x[:, : 3 - 2 * mesh.rank("dp")]  # 3 and 1 columns
    out["gather_uneven_d1"] = C.all_gather(cols, mesh, "dp", dim=-1, sizes=[3, 1], purpose="c")
    comm_log.begin_step(2)
    big = _data(r, (7, 4))
    out["rs_uneven_d0"] = C.reduce_scatter(big, mesh, "tp", purpose="rs0")  # 4 + 3 rows
    out["rs_even_d1_max"] = C.reduce_scatter(big, mesh, "dp", dim=1, op="max", purpose="rs1")
    out["bcast"] = C.broadcast(x, mesh, "dp", src=1, purpose="bc")
    if mesh.rank("tp") == 0:
        C.send(x * 10, mesh, "tp", dst=1, purpose="p2p")
        out["recv"] = None
    else:
        out["recv"] = C.recv(x, mesh, "tp", src=0, purpose="p2p")
    out["records"] = list(comm_log.records)
    out["report"] = comm_report(echo=False)
    comm_log.enable(False)
    comm_log.clear()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ranks_run, 4, timeout=60)


def _coords(rank):
    return rank // 2, rank % 2  # dp, tp: row-major, tp neighbours


def _peers(rank, axis):
    dp, tp = _coords(rank)
    return [2 * dp, 2 * dp + 1] if axis == "tp" else [tp, 2 + tp]


def test_mesh_coordinates(ranks):
    for r, out in enumerate(ranks):
        dp, tp = _coords(r)
        assert out["coords"] == {"dp": dp, "tp": tp}
        assert out["tp_ranks"] == _peers(r, "tp") and out["dp_ranks"] == _peers(r, "dp")


def test_all_reduce_values(ranks):
    for r, out in enumerate(ranks):
        tp, dp = _peers(r, "tp"), _peers(r, "dp")
        assert torch.equal(out["sum_tp"], sum(_data(p) for p in tp))
        assert torch.equal(out["max_dp"], torch.maximum(*[_data(p) for p in dp]))
        assert torch.equal(out["min_tp"], torch.minimum(*[_data(p) for p in tp]))
        assert torch.equal(out["inplace"], sum(_data(p) for p in dp))
        assert torch.equal(out["async"], out["sum_tp"])
        assert out["input_untouched"] and out["inplace_is_input"] and out["size1_is_input"]


def test_all_gather_values(ranks):
    for r, out in enumerate(ranks):
        tp, dp = _peers(r, "tp"), _peers(r, "dp")
        assert torch.equal(out["gather_even_d0"], torch.cat([_data(p) for p in tp]))
        assert torch.equal(out["gather_even_d1"], torch.cat([_data(p) for p in dp], dim=1))
        uneven = torch.cat([_data(tp[0])[:2], _data(tp[1])[:1]])
        assert torch.equal(out["gather_uneven_known"], uneven)
        assert torch.equal(out["gather_uneven_exchanged"], uneven)
        assert torch.equal(out["gather_uneven_d1"],
                           torch.cat([_data(dp[0])[:, :3], _data(dp[1])[:, :1]], dim=1))


def test_reduce_scatter_broadcast_send_recv_values(ranks):
    for r, out in enumerate(ranks):
        dp_c, tp_c = _coords(r)
        tp, dp = _peers(r, "tp"), _peers(r, "dp")
        total = sum(_data(p, (7, 4)) for p in tp)
        assert torch.equal(out["rs_uneven_d0"], total.chunk(2)[tp_c])  # torch.chunk: 4 then 3
        biggest = torch.maximum(*[_data(p, (7, 4)) for p in dp])
        assert torch.equal(out["rs_even_d1_max"], biggest.chunk(2, dim=1)[dp_c])
        assert torch.equal(out["bcast"], _data(dp[1]))
        if tp_c == 1:
            assert torch.equal(out["recv"], _data(tp[0]) * 10)


def test_records_op_axis_bytes_purpose(ranks):
    f8 = 8
    for r, out in enumerate(ranks):
        tp_c = _coords(r)[1]
        got = [(rec.step, rec.op, rec.axis, rec.nbytes, rec.purpose) for rec in out["records"]]
        want = [
            (0, "all_reduce", "tp", 12 * f8, "w.sum"),
            (0, "all_reduce", "dp", 12 * f8, "w.max"),
            (0, "all_reduce", "tp", 12 * f8, "w.min"),
            (0, "all_reduce", "dp", 12 * f8, "inplace"),
            (0, "all_reduce", "tp", 12 * f8, "async"),
            # nothing for the size-1 axis
            (1, "all_gather", "tp", 24 * f8, "even0"),
            (1, "all_gather", "dp", 24 * f8, "even1"),
            (1, "all_gather", "tp", 2 * 8 * f8, "unev"),  # pieces padded to 2 rows of 4
            (1, "all_gather", "tp", 2 * 8, "unev? (sizes)"),  # one int64 length per rank
            (1, "all_gather", "tp", 2 * 8 * f8, "unev?"),
            (1, "all_gather", "dp", 2 * 9 * f8, "c"),  # padded to 3 columns of 3 rows
            (2, "reduce_scatter", "tp", 2 * 16 * f8, "rs0"),  # pieces padded to 4 rows
            (2, "reduce_scatter", "dp", 28 * f8, "rs1"),
            (2, "broadcast", "dp", 12 * f8, "bc"),
            (2, "send" if tp_c == 0 else "recv", "tp", 12 * f8, "p2p"),
        ]
        assert got == want, f"rank {r}"
        assert all(rec.axis_size == 2 and rec.dtype in ("float64", "int64")
                   for rec in out["records"])


def test_report_of_a_run(ranks):
    text = ranks[0]["report"]
    assert "step 0" in text and "step 1" in text and "step 2" in text
    assert "all_reduce" in text and "reduce_scatter" in text and "w.sum" in text


# ------------------------------------------------------------------------- one process
def test_chunk_sizes_follow_torch_chunk():
    for n in range(0, 13):
        for k in range(1, 6):
            sizes = C.chunk_sizes(n, k)
            want = [len(c) for c in torch.arange(n).chunk(k)] if n else []
            assert sizes == want + [0] * (k - len(want)), (n, k)
    assert C.chunk_sizes(7, 4) == [2, 2, 2, 1] and C.chunk_sizes(6, 4) == [2, 2, 2, 0]


def test_local_mesh_issues_and_records_nothing():
    mesh = DeviceMesh.local(dp=1, tp=1)
    x = torch.randn(3, 4)
    with comm_log.capture() as recs:
        assert C.all_reduce(x, mesh, "tp") is x
        assert C.all_gather(x, mesh, "dp", dim=1, sizes=[4]) is x
        assert C.reduce_scatter(x, mesh, "tp") is x
        assert C.broadcast(x, mesh, "tp") is x
    assert recs == []
    with pytest.raises(ValueError, match="another coordinate"):
        C.send(x, mesh, "tp", dst=0)
    with pytest.raises(ValueError, match="one of"):
        C.all_reduce(x, mesh, "tp", op="mean")
    with pytest.raises(KeyError, match="no axis 'pp'"):
        C.all_reduce(x, mesh, "pp")


def test_virtual_mesh_refuses_to_communicate():
    mesh = DeviceMesh.virtual(dp=2, tp=2, rank=1)
    with pytest.raises(RuntimeError, match="virtual"):
        C.all_reduce(torch.ones(2), mesh, "tp")


def _rec(step, op, axis, nbytes, purpose):
    return C.CommRecord(step, op, axis, 2, nbytes, purpose, "float32")


def test_summary_and_report_tables():
    recs = [_rec(0, "all_reduce", "tp", 8, "a"), _rec(0, "all_reduce", "tp", 8, "b"),
            _rec(0, "all_reduce", "tp", 8, "a"), _rec(0, "all_gather", "dp", 100, "c"),
            _rec(1, "all_reduce", "tp", 4, "a")]
    rows = C.summarize(recs)
    assert rows == [C.CommSummary(0, "all_reduce", "tp", 3, 24, ("a", "b")),
                    C.CommSummary(0, "all_gather", "dp", 1, 100, ("c",)),
                    C.CommSummary(1, "all_reduce", "tp", 1, 4, ("a",))]
    text = comm_report(recs, echo=False, max_purposes=1)
    lines = text.splitlines()
    assert lines[0] == "step 0 (124 bytes)" and "step 1 (4 bytes)" in lines
    row = next(line for line in lines if "all_reduce" in line)
    assert row.split()[:4] == ["all_reduce", "tp", "3", "24"] and row.endswith("a, ... (+1)")
    assert comm_report([], echo=False) == "no collectives recorded"


def test_log_records_only_when_enabled_or_capturing(capsys):
    log = C.CommLog()
    mesh = DeviceMesh.virtual(dp=2, tp=2)
    log.record("all_reduce", mesh, "tp", 8, "x", torch.float32)
    assert log.records == []
    with log.capture() as outer:
        log.begin_step(3)
        log.record("all_reduce", mesh, "tp", 8, "x", torch.float32)
        with log.capture() as inner:
            log.record("broadcast", mesh, "dp", 4, "y", torch.float64)
    assert [r.op for r in outer] == ["all_reduce", "broadcast"] and len(inner) == 1
    assert outer[0] == C.CommRecord(3, "all_reduce", "tp", 2, 8, "x", "float32")
    assert log.records == []
    log.enable()
    log.record("all_reduce", mesh, "tp", 8, "x", torch.float32)
    assert len(log.records) == 1
    log.clear()
    assert log.records == [] and log.step is None
    comm_report(outer)  # echo prints the table
    assert "broadcast" in capsys.readouterr().out
