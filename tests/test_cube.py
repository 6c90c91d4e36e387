"""The 3D cube's product on a 2 x 2 x 2 cube (8 gloo ranks), against torch.matmul in float64.

``cube_ab`` for layers of both parities (input axis tp_in or tp_out), forward and both
gradients: ``dA = dC Bᵀ`` (the cube's ``ABᵀ``) and ``dB = Aᵀ dC`` (its ``AᵀB``), each checked
on its own block, with ``K`` and ``N`` that 2 does not divide (uneven pieces 3/2, 4/3 -> 2/2,
2/1), and the collectives each issues (three forward, five backward, over the right axes);
``gather_vector`` on a vector of 11 cut three times (6/5 -> 3/3, 3/2 -> ...).
"""

import torch

from funcpar.shard.comm import comm_log
from funcpar.shard.cube import IN, OUT, WGT, Cube, cube_ab, gather_vector
from funcpar.shard.layout import Layout, shard_tensor
from funcpar.shard.mesh import DeviceMesh
from funcpar.testing import run_ranks

M, K, N, V = 12, 5, 7, 11  # M: 4 equal row chunks of 3; V: a vector's length


def _whole(parity):
    g = torch.Generator().manual_seed(10 + parity)
    a = torch.randn(M, K, generator=g, dtype=torch.float64)
    b = torch.randn(K, N, generator=g, dtype=torch.float64)
    dc = torch.randn(M, N, generator=g, dtype=torch.float64)
    v = torch.randn(V, generator=g, dtype=torch.float64)
    return a, b, dc, v


def _specs(cube, parity):
    """The blocks' layouts: A on the input face, B, C on the output face (cube.py)."""
    i_ax, o_ax = cube.io(parity)
    return {"a": ((WGT, i_ax), o_ax), "b": (o_ax, (i_ax, WGT)), "c": ((WGT, o_ax), i_ax),
            "v": ((o_ax, WGT, i_ax),)}


def _block(x, mesh, spec):
    return shard_tensor(x, Layout.from_spec(mesh, x.shape, spec))


def _on_cube():
    mesh = DeviceMesh.from_env(tp_in=2, tp_w=2, tp_out=2)
    cube = Cube(mesh)
    out = {}
    for parity in (0, 1):
        spec = _specs(cube, parity)
        a, b, dc, v = _whole(parity)
        la = _block(a, mesh, spec["a"]).requires_grad_()
        lb = _block(b, mesh, spec["b"]).requires_grad_()
        with comm_log.capture() as recs:
            lc = cube_ab(la, lb, cube, parity, N)
            (lc * _block(dc, mesh, spec["c"])).sum().backward()
        lv = _block(v, mesh, spec["v"]).requires_grad_()
        gv = gather_vector(lv, cube, parity, V, 0, "v")
        (gv * torch.arange(gv.numel(), dtype=gv.dtype)).sum().backward()
        out[parity] = (lc.detach(), la.grad, lb.grad, [(r.op, r.axis) for r in recs],
                       gv.detach(), lv.grad)
    return out


def test_cube_ab_forward_and_both_gradients_float64():
    for rank, res in enumerate(run_ranks(_on_cube, 8, timeout=180)):
        mesh = DeviceMesh.virtual(rank=rank, tp_in=2, tp_w=2, tp_out=2)
        cube = Cube(mesh)
        for parity, (lc, ga, gb, ops, gv, lvg) in res.items():
            spec = _specs(cube, parity)
            i_ax, o_ax = cube.io(parity)
            a, b, dc, v = _whole(parity)
            a.requires_grad_(), b.requires_grad_()
            c = a @ b
            (c * dc).sum().backward()
            for got, want, s in ((lc, c, "c"), (ga, a.grad, "a"), (gb, b.grad, "b")):
                want = _block(want.detach(), mesh, spec[s])
                assert got.shape == want.shape, (rank, parity, s)
                assert torch.allclose(got, want, rtol=1e-13, atol=1e-13), (rank, parity, s)
            assert ops == [("all_gather", i_ax), ("all_gather", WGT), ("reduce_scatter", o_ax),
                           ("all_gather", o_ax), ("all_gather", WGT), ("reduce_scatter", i_ax),
                           ("all_gather", i_ax), ("reduce_scatter", WGT)], (rank, parity, ops)
            # gather_vector: this rank's hidden chunk (over the output face's hidden axis O of
            # the *reading* layout), and a gradient that sums every rank's use of each entry.
            sizes = [6, 5]
            o = mesh.rank(o_ax)
            start = sum(sizes[:o])
            assert torch.equal(gv, v[start : start + sizes[o]]), (rank, parity)
            uses = torch.zeros(V, dtype=v.dtype)
            for r in range(8):  # each rank weighs its chunk's entries by their position in it
                ro = DeviceMesh.virtual(rank=r, tp_in=2, tp_w=2, tp_out=2).rank(o_ax)
                s0 = sum(sizes[:ro])
                uses[s0 : s0 + sizes[ro]] += torch.arange(sizes[ro], dtype=v.dtype)
            assert torch.equal(lvg, _block(uses, mesh, spec["v"])), (rank, parity)


def test_cube_axes_and_sides():
    import pytest

    with pytest.raises(ValueError, match=r"a 3D cube needs mesh axes \('tp_in', 'tp_w'"):
        Cube(DeviceMesh.virtual(rank=0, tp_row=2, tp_col=2))
    with pytest.raises(ValueError, match="equal sides"):
        Cube(DeviceMesh.virtual(rank=0, tp_in=2, tp_w=2, tp_out=1))
    with pytest.raises(ValueError, match="parity is 0 or 1"):
        cube_ab(torch.zeros(1, 1), torch.zeros(1, 1),
                Cube(DeviceMesh.virtual(rank=0, tp_in=1, tp_w=1, tp_out=1)), 2, 1)
    assert (IN, WGT, OUT) == ("tp_in", "tp_w", "tp_out")
