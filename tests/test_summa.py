"""The SUMMA primitives on a 2 x 2 grid (4 gloo ranks), against torch.matmul in float64.

Forward and both gradients of ``AB``, ``ABᵀ`` and ``AᵀB``, with dims that 2 does not divide
(uneven blocks 4/3, 3/2, ...), so every panel shape and reduce-scatter cut is exercised; and
the collectives each issues (broadcasts of panels, one reduce-scatter per gradient product).
Again under 2.5D at depth 2 (8 ranks, a :class:`~funcpar.shard.tesseract.Tesseract`): each
depth slice multiplies its own operands (different values per slice) and every collective
stays inside the slice (Colossal-AI tested 2.5D only at depth 1, which is 2D).
"""

import pytest
import torch

from funcpar.shard.comm import comm_log
from funcpar.shard.layout import Layout, shard_tensor
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.summa import COL, ROW, Grid, summa_ab, summa_abt, summa_atb
from funcpar.shard.tesseract import DEP, Tesseract
from funcpar.testing import run_ranks

# (name, A shape, B shape, the result, the size argument)
CASES = {
    "ab": ((7, 5), (5, 3), lambda a, b: a @ b, lambda a, b: a.shape[1]),
    "abt": ((7, 5), (3, 5), lambda a, b: a @ b.T, lambda a, b: b.shape[0]),
    "atb": ((7, 5), (7, 3), lambda a, b: a.T @ b, lambda a, b: a.shape[1]),
}
FNS = {"ab": summa_ab, "abt": summa_abt, "atb": summa_atb}


def _whole(name, k=0):
    """The operands of depth slice ``k``."""
    g = torch.Generator().manual_seed(100 * k + len(name))
    sa, sb, f, _ = CASES[name]
    a = torch.randn(sa, generator=g, dtype=torch.float64)
    b = torch.randn(sb, generator=g, dtype=torch.float64)
    c = f(a, b)
    dc = torch.randn(c.shape, generator=g, dtype=torch.float64)
    return a, b, c, dc


def _block(x, mesh):
    return shard_tensor(x, Layout.from_spec(mesh, x.shape, (ROW, COL)))


def _mesh(depth, rank=None):
    axes = {"tp_row": 2, "tp_col": 2} if depth == 1 else {"tp_dep": depth, "tp_row": 2,
                                                          "tp_col": 2}
    return DeviceMesh.from_env(**axes) if rank is None else DeviceMesh.virtual(rank=rank, **axes)


def _on_grid(depth):
    mesh = _mesh(depth)
    grid = Grid(mesh) if depth == 1 else Tesseract(mesh)
    out = {}
    for name, (_, _, _, size) in CASES.items():
        a, b, _c, dc = _whole(name, 0 if depth == 1 else grid.k)
        la = _block(a, mesh).requires_grad_()
        lb = _block(b, mesh).requires_grad_()
        with comm_log.capture() as recs:
            lc = FNS[name](la, lb, grid, size(a, b))
            (lc * _block(dc, mesh)).sum().backward()
        ops = [(r.op, r.axis) for r in recs]
        out[name] = (lc.detach(), la.grad, lb.grad, ops)
    return out


@pytest.mark.parametrize("depth", [1, 2], ids=["2d", "2.5d-depth2"])
def test_summa_primitives_forward_and_backward_float64(depth):
    results = run_ranks(_on_grid, 4 * depth, depth, timeout=180)
    for rank, res in enumerate(results):
        mesh = _mesh(depth, rank)
        for name, (lc, ga, gb, ops) in res.items():
            a, b, c, dc = _whole(name, mesh.rank(DEP) if depth > 1 else 0)
            a.requires_grad_(), b.requires_grad_()
            (CASES[name][2](a, b) * dc).sum().backward()
            for got, want in ((lc, c), (ga, a.grad), (gb, b.grad)):
                want = _block(want.detach(), mesh)
                assert got.shape == want.shape, (rank, name)
                assert torch.allclose(got, want, rtol=1e-13, atol=1e-13), (rank, name)
            # Each of the three products is one of AB (q panels of A and q of B broadcast),
            # ABt or AtB (q panels of one operand, one reduce-scatter of the q partials): the
            # forward and the two gradient products together, 4q broadcasts, 2 reduce-scatters.
            assert sorted(set(ops)) == [("broadcast", COL), ("broadcast", ROW),
                                        ("reduce_scatter", COL), ("reduce_scatter", ROW)], ops
            assert sum(op == "broadcast" for op, _ in ops) == 8, (name, ops)
            assert sum(op == "reduce_scatter" for op, _ in ops) == 2, (name, ops)
