"""DeviceMesh and Layout: shapes, the uneven-split convention, validation, and the round trip
global -> shards -> all_gather -> global on 4 real ranks (one spawn)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from funcpar.shard import (
    DeviceMesh,
    Layout,
    Replicate,
    Shard,
    check_layouts,
    comm_log,
    shard_tensor,
    shard_tree,
    unshard,
    unshard_tree,
    with_leaf_names,
)
from funcpar.shard.reduce import Reducible
from funcpar.testing import run_ranks

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


# --------------------------------------------------------------------------------- mesh
def test_single_process_mesh_needs_no_torch_distributed(no_torchrun):
    mesh = DeviceMesh.from_env(dp=1, tp=1)
    assert mesh.kind == "local" and mesh.axis_names == ("dp", "tp")
    assert mesh.size() == 1 and mesh.size("tp") == 1 and mesh.rank() == 0 and mesh.rank("dp") == 0
    assert mesh.group("tp") is None and mesh.device == torch.device("cpu")
    assert DeviceMesh.from_env().shape == {"dp": 1}
    assert DeviceMesh.from_env(dp=-1, tp=1).shape == {"dp": 1, "tp": 1}
    assert not dist.is_initialized()


def test_mesh_size_mismatch_is_a_clear_error_before_any_init(no_torchrun, monkeypatch):
    with pytest.raises(ValueError, match=r"product 4 but the world size is 1"):
        DeviceMesh.from_env(dp=2, tp=2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # no master: reaching init would fail differently
    with pytest.raises(ValueError, match=r"\{'dp': 3, 'tp': 2\} have product 6 but the world "
                                         r"size is 4"):
        DeviceMesh.from_env(dp=3, tp=2)
    with pytest.raises(ValueError, match="world size 4 is not divisible by the product 3"):
        DeviceMesh.from_env(dp=-1, tp=3)
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        DeviceMesh.from_env(dp=-1, tp=-1)
    with pytest.raises(ValueError, match="positive"):
        DeviceMesh.from_env(dp=0, tp=4)
    assert not dist.is_initialized()


def test_virtual_mesh_coordinates_are_row_major():
    mesh = DeviceMesh.virtual(dp=2, tp=3, rank=4)
    assert mesh.coords() == {"dp": 1, "tp": 1}
    assert [tuple(mesh.coords(r).values()) for r in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert mesh.rank_of(dp=0) == 1 and mesh.rank_of(dp=1, tp=2) == 5
    assert mesh.group_ranks("tp") == [3, 4, 5] and mesh.group_ranks("dp") == [1, 4]
    assert mesh.at_rank(2).coords() == {"dp": 0, "tp": 2}
    with pytest.raises(ValueError, match="outside"):
        DeviceMesh.virtual(dp=2, rank=2)
    with pytest.raises(ValueError, match="size 1 only"):
        DeviceMesh.local(tp=2)


# ------------------------------------------------------------------------------- layout
MESH = DeviceMesh.virtual(dp=2, tp=2)


def _pieces(layout):
    """Every rank's shard of a global arange, by rank."""
    g = torch.arange(torch.Size(layout.global_shape).numel()).reshape(layout.global_shape)
    return g, [shard_tensor(g, layout, r) for r in range(layout.mesh.size())]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_uneven_splits_follow_torch_chunk(k):
    mesh = DeviceMesh.virtual(tp=k)
    for n in range(k, 12):
        lay = Layout(mesh, (n, 2), {"tp": Shard(0)})
        g, shards = _pieces(lay)
        chunks = list(g.chunk(k))
        chunks += [g[:0]] * (k - len(chunks))  # torch.chunk drops trailing empty pieces
        assert all(torch.equal(s, c) for s, c in zip(shards, chunks)), (n, k)
        assert [lay.local_shape(r)[0] for r in range(k)] == [len(c) for c in chunks]
    lay = Layout(DeviceMesh.virtual(tp=4), (6,), {"tp": Shard(0)})
    assert [lay.local_shape(r) for r in range(4)] == [(2,), (2,), (2,), (0,)]


SPECS = [
    ("tp",), (None, "tp"), ("tp", "dp"), ("dp", "tp"), (("tp", "dp"),), (("dp", "tp"),),
    (None, ("tp", "dp")), (),
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_shards_tile_the_global_tensor(spec):
    """Every element is held by exactly the ranks of the axes that do not split the leaf."""
    lay = Layout.from_spec(MESH, (7, 5), spec)
    g, shards = _pieces(lay)
    count = torch.zeros(g.shape, dtype=torch.int64)
    for r, s in enumerate(shards):
        sl = lay.local_slices(r)
        assert torch.equal(s, g[sl]) and s.shape == lay.local_shape(r)
        count[sl] += 1
    used = {a for axes in lay.spec for a in axes}
    assert torch.all(count == 4 // (2 ** len(used)))


def test_nested_split_is_outer_axis_first():
    """(tp, dp) on one dim: dim cut over tp, then each tp piece over dp (ZeRO on a TP shard)."""
    lay = Layout.from_spec(MESH, (9,), (("tp", "dp"),))
    g, shards = _pieces(lay)
    for tp in range(2):
        tp_piece = g.chunk(2)[tp]  # 5 then 4 rows
        got = torch.cat([shards[MESH.rank_of(dp=dp, tp=tp)] for dp in range(2)])
        assert torch.equal(got, tp_piece)
    assert lay == Layout(MESH, (9,), {"tp": Shard(0), "dp": Shard(0)})
    assert lay == Layout.replicated(MESH, (9,)).split(0, "tp").split(0, "dp")
    assert lay != Layout(MESH, (9,), [Shard(0), Shard(0)])  # DTensor's form: mesh order, dp first


def test_placements_are_dtensor_vocabulary():
    lay = Layout(MESH, (6, 4), {"tp": Shard(1)})
    assert lay.placements == (Replicate(), Shard(1)) and lay.spec == ((), ("tp",))
    assert Layout(MESH, (6, 4), [Replicate(), Shard(-1)]) == lay
    assert Layout.from_spec(MESH, (6, 4), (None, "tp")) == lay
    assert isinstance(lay, Reducible) and lay.axes_for([1]) == ("tp",) and lay.axes_for([0]) == ()
    from torch.distributed.tensor.placement_types import Replicate as TR
    from torch.distributed.tensor.placement_types import Shard as TS

    assert Layout(MESH, (6, 4), [TR(), TS(1)]) == lay  # torch's own objects are understood
    assert lay.torch_placements() == (TR(), TS(1))


def test_layout_errors_name_the_leaf_and_numbers():
    mesh = DeviceMesh.virtual(dp=2, tp=4)
    with pytest.raises(ValueError, match=r"'emb'.*dim 0 of size 3 .*tp \(4\).*4 pieces"):
        Layout(mesh, (3, 8), {"tp": Shard(0)}, name="emb")
    with pytest.raises(ValueError, match=r"dim 1 of size 7 .*tp \(4\) x dp \(2\).*8 pieces"):
        Layout.from_spec(mesh, (9, 7), (None, ("tp", "dp")), name="w")
    with pytest.raises(ValueError, match="no axis 'pp'"):
        Layout(mesh, (8,), {"pp": Shard(0)})
    with pytest.raises(ValueError, match="'tp' splits both dim 0 and dim 1"):
        Layout.from_spec(mesh, (8, 8), ("tp", "tp"))
    with pytest.raises(ValueError, match=r"Shard\(2\) over 'tp' but the leaf has 2 dims"):
        Layout(mesh, (8, 8), {"tp": Shard(2)}, name="w")
    with pytest.raises(TypeError, match="Shard\\(dim\\) or Replicate\\(\\)"):
        Layout(mesh, (8, 8), {"tp": "rows"})
    with pytest.raises(ValueError, match="1 placements for a mesh of 2 axes"):
        Layout(mesh, (8, 8), [Shard(0)])
    with pytest.raises(ValueError, match="3 entries for a leaf of 2 dims"):
        Layout.from_spec(mesh, (8, 8), ("tp", None, None))
    with pytest.raises(AttributeError, match="immutable"):
        Layout(mesh, (8,)).name = "x"


def test_tree_checks():
    params = {"emb": torch.zeros(8, 4), "blocks": [{"w": torch.zeros(4, 6), "b": torch.zeros(6)}]}
    layouts = {"emb": Layout(MESH, (8, 4), {"tp": Shard(0)}),
               "blocks": [{"w": Layout(MESH, (4, 6), {"tp": Shard(1)}), "b": None}]}
    check_layouts(params, layouts, shapes="global")
    named = with_leaf_names(layouts)
    assert named["emb"].name == "emb" and named["blocks"][0]["w"].name == "blocks.0.w"
    local = shard_tree(params, named)
    assert local["emb"].shape == (4, 4) and local["blocks"][0]["w"].shape == (4, 3)
    assert local["blocks"][0]["b"] is params["blocks"][0]["b"]
    check_layouts(local, named)
    with pytest.raises(ValueError, match=r"params\['blocks.0.w'\] has shape \(4, 6\) but its "
                                         r"layout says the local shape is \(4, 3\)"):
        check_layouts(params, named)
    with pytest.raises(ValueError, match=r"layouts does not match the structure of params: "
                                         r"missing \['blocks.0.b'\]"):
        check_layouts(params, {"emb": None, "blocks": [{"w": None}]})
    with pytest.raises(TypeError, match=r"layouts\['emb'\] must be a Layout or None"):
        check_layouts(params, {**layouts, "emb": "tp"}, shapes=None)
    with pytest.raises(ValueError, match=r"layout of 'emb': global shape \(8, 4\) but the "
                                         r"tensor to shard has shape \(8, 5\)"):
        shard_tensor(torch.zeros(8, 5), named["emb"])


def test_local_mesh_round_trip_communicates_nothing():
    mesh = DeviceMesh.local(dp=1, tp=1)
    g = torch.randn(5, 3)
    lay = Layout.from_spec(mesh, g.shape, ("tp", "dp"))
    with comm_log.capture() as recs:
        assert torch.equal(unshard(shard_tensor(g, lay), lay), g)
    assert recs == []


# --------------------------------------------------------------------------- on 4 ranks
ROUND_TRIP = [
    ((8, 6), ("tp",)), ((7, 6), ("tp",)), ((7, 5), (None, "dp")), ((7, 5), ("tp", "dp")),
    ((9, 5), (("tp", "dp"),)), ((9, 5), (("dp", "tp"),)), ((6, 3), (("tp", "dp"),)),
    ((4, 7, 5), (None, ("tp", "dp"), None)), ((5,), ("dp",)), ((5, 3), ()),
]


def _four_ranks() -> dict:
    out: dict = {"initialised_before": dist.is_initialized()}
    try:
        DeviceMesh.from_env(dp=3, tp=2)
    except ValueError as err:
        out["mismatch"] = str(err)
    out["initialised_after_mismatch"] = dist.is_initialized()
    mesh = DeviceMesh.from_env(dp=-1, tp=2)  # initialises gloo itself
    out["shape"], out["kind"], out["backend"] = mesh.shape, mesh.kind, dist.get_backend()
    out["groups"] = {a: dist.get_process_group_ranks(mesh.group(a)) for a in mesh.axis_names}
    out["group_ranks"] = {a: mesh.group_ranks(a) for a in mesh.axis_names}
    gen = torch.Generator().manual_seed(7)
    trips, gathered_bytes = [], []
    for shape, spec in ROUND_TRIP:
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        lay = Layout.from_spec(mesh, shape, spec, name=str(spec))
        with comm_log.capture() as recs:
            back = unshard(shard_tensor(g, lay), lay)
        trips.append(torch.equal(back, g))
        gathered_bytes.append([(r.op, r.axis, r.nbytes) for r in recs])
    out["trips"], out["gathered"] = trips, gathered_bytes
    tree = {"a": torch.randn(7, 4, generator=gen), "b": torch.randn(3, generator=gen)}
    lays = with_leaf_names({"a": Layout(mesh, (7, 4), {"tp": Shard(0), "dp": Shard(1)}),
                            "b": None})
    back = unshard_tree(shard_tree(tree, lays), lays)
    out["tree"] = all(torch.equal(back[k], tree[k]) for k in tree)
    return out


def test_mesh_and_round_trip_on_four_ranks():
    results = run_ranks(_four_ranks, 4, backend=None, timeout=60)
    for r, out in enumerate(results):
        assert not out["initialised_before"] and not out["initialised_after_mismatch"]
        assert "have product 6 but the world size is 4" in out["mismatch"]
        assert out["shape"] == {"dp": 2, "tp": 2} and out["kind"] == "distributed"
        assert out["backend"] == "gloo"
        assert out["groups"] == out["group_ranks"]
        assert out["groups"]["tp"] == [r - r % 2, r - r % 2 + 1]
        assert all(out["trips"]), [s for s, ok in zip(ROUND_TRIP, out["trips"]) if not ok]
        assert out["tree"]
        for (shape, spec), recs in zip(ROUND_TRIP, out["gathered"]):
            # one all_gather per splitting axis, innermost first, nothing for a whole leaf
            want_axes = [a for axes in spec if axes for a in reversed(
                (axes,) if isinstance(axes, str) else axes)]
            assert [ax for _, ax, _ in recs] == want_axes, (shape, spec)
            assert all(op == "all_gather" for op, _, _ in recs)
