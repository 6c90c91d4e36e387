"""The SUMMA primitives under 2.5D at depth 2 (a 2 x 2 grid x 2 depth slices, 8 gloo ranks).

Each depth slice multiplies its own operands (different values per slice) with ``summa_ab``,
``summa_abt``, ``summa_atb`` on its grid, forward and both gradients against torch.matmul in
float64 (uneven blocks), and every collective stays inside the slice (over tp_row or tp_col,
never tp_dep): Colossal-AI tested 2.5D only at depth 1, which is 2D.
"""

import torch

from funcpar.shard.comm import comm_log
from funcpar.shard.layout import Layout, shard_tensor
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.summa import COL, ROW, summa_ab, summa_abt, summa_atb
from funcpar.shard.tesseract import DEP, Tesseract
from funcpar.testing import run_ranks

CASES = {
    "ab": ((7, 5), (5, 3), lambda a, b: a @ b, lambda a, b: a.shape[1]),
    "abt": ((7, 5), (3, 5), lambda a, b: a @ b.T, lambda a, b: b.shape[0]),
    "atb": ((7, 5), (7, 3), lambda a, b: a.T @ b, lambda a, b: a.shape[1]),
}
FNS = {"ab": summa_ab, "abt": summa_abt, "atb": summa_atb}


def _whole(name, k):
    g = torch.Generator().manual_seed(100 * k + len(name))
    sa, sb, f, _ = CASES[name]
    a = torch.randn(sa, generator=g, dtype=torch.float64)
    b = torch.randn(sb, generator=g, dtype=torch.float64)
    c = f(a, b)
    return a, b, c, torch.randn(c.shape, generator=g, dtype=torch.float64)


def _block(x, mesh):
    return shard_tensor(x, Layout.from_spec(mesh, x.shape, (ROW, COL)))


def _on_tesseract():
    mesh = DeviceMesh.from_env(tp_dep=2, tp_row=2, tp_col=2)
    grid = Tesseract(mesh)
    assert (grid.d, grid.q, grid.batch_axes) == (2, 2, (DEP, ROW))
    out = {}
    for name, (_, _, _, size) in CASES.items():
        a, b, _c, dc = _whole(name, grid.k)
        la, lb = _block(a, mesh).requires_grad_(), _block(b, mesh).requires_grad_()
        with comm_log.capture() as recs:
            lc = FNS[name](la, lb, grid, size(a, b))
            (lc * _block(dc, mesh)).sum().backward()
        out[name] = (lc.detach(), la.grad, lb.grad, {r.axis for r in recs})
    return out


def test_summa_primitives_on_each_depth_slice_float64():
    for rank, res in enumerate(run_ranks(_on_tesseract, 8, timeout=180)):
        mesh = DeviceMesh.virtual(rank=rank, tp_dep=2, tp_row=2, tp_col=2)
        for name, (lc, ga, gb, axes) in res.items():
            a, b, c, dc = _whole(name, mesh.rank(DEP))
            a.requires_grad_(), b.requires_grad_()
            (CASES[name][2](a, b) * dc).sum().backward()
            for got, want in ((lc, c), (ga, a.grad), (gb, b.grad)):
                want = _block(want.detach(), mesh)
                assert got.shape == want.shape, (rank, name)
                assert torch.allclose(got, want, rtol=1e-13, atol=1e-13), (rank, name)
            assert axes == {ROW, COL}, (rank, name, axes)
