"""Expert parallelism: every optimizer under ep2, ep2 x dp2 (+ ZeRO) equals one process.

The reference MoE run (funcpar.testing.moe): the reference Llama with an MoE feed-forward in
every block: 4 experts, top-1, capacity factor 2.0 (tokens are dropped), the router's weights
skewed so that routing is unbalanced: uneven all_to_all splits, and experts that get no token
in some steps (asserted on the one-process run). 10 steps in float64, max relative error <=
1e-10 on every loss and parameter: the collectives only reorder sums (measured below 1e-13).

Default: one spawn of 4 ranks, ep2 x dp2 + ZeRO-2 with AdamW, and with CAME through the
``moe_hybrid`` preset; ``-m slow`` runs every
optimizer under ep2, ep2 x dp2 and ep2 x dp2 + ZeRO-1/2, and ep2 x dp2 + ZeRO-3, ep4 (one expert
per rank) and ep2 + remat with a few.
"""

import pytest
import torch

from funcpar.shard import comm
from funcpar.shard.mesh import DeviceMesh
from funcpar.testing import run_ranks
from funcpar.testing.moe import MATRIX_OPTIMIZERS, check, check_resharding


def test_ep2xdp2_zero2_matches_one_process():
    check(4, [("ep2xdp2+zero2", "adamw"), ("moe_hybrid(ep2, zero2)", "came")])


@pytest.mark.slow
def test_ep2_every_optimizer():
    check(2, [("ep2", o) for o in MATRIX_OPTIMIZERS])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2xdp2", "ep2xdp2+zero1", "ep2xdp2+zero2"])
def test_ep2xdp2_every_optimizer(layout):
    check(4, [(layout, o) for o in MATRIX_OPTIMIZERS])


@pytest.mark.slow
@pytest.mark.parametrize("world,pairs", [
    (4, [("ep2xdp2+zero3", o) for o in ("adamw", "came", "lamb")]),
    (4, [("ep4", o) for o in ("adamw", "adafactor", "galore_adamw")]),
    (2, [("ep2+remat", "adamw")]),  # the recompute repeats the all_to_alls, same values
])
def test_expert_parallel_compositions(world, pairs):
    check(world, pairs)


@pytest.mark.slow
def test_checkpoint_ep2xdp2_zero2_loads_under_one_process_and_ep4(tmp_path):
    """Saved after 5 steps under ep2 x dp2 + ZeRO-2; resumed for 5 more under one process and
    under ep4: both equal 10 uninterrupted steps on one process."""
    check_resharding(str(tmp_path / "ckpt"), "ep2xdp2+zero2", ["ep4"])


def _a2a_uneven():
    mesh = DeviceMesh.from_env(ep=2)
    r = mesh.rank("ep")
    send = [[3, 0], [1, 2]][r]  # rank 0 sends rank 1 nothing
    recv = [[3, 1], [0, 2]][r]
    x = torch.arange(3.0)[:, None].expand(3, 4) + 10 * r
    with comm.comm_log.capture() as recs:
        y = comm.all_to_all(x, mesh, "ep", send, recv, purpose="t")
    try:
        comm.all_to_all(x, mesh, "ep", [1, 1], recv)
    except ValueError as err:
        bad = str(err)
    return y[:, 0].tolist(), [(rec.op, rec.nbytes, rec.purpose) for rec in recs], bad


@pytest.mark.slow  # the default ep test runs all_to_all too; this spawn costs 5-20 s
def test_all_to_all_uneven_and_recorded():
    res = run_ranks(_a2a_uneven, 2)
    assert res[0][0] == [0.0, 1.0, 2.0, 10.0] and res[1][0] == [11.0, 12.0]
    # bytes: the larger of the send (3 x 4 float32) and receive buffers
    assert res[0][1] == [("all_to_all", 64, "t")] and res[1][1] == [("all_to_all", 48, "t")]
    assert "send sizes [1, 1]" in res[0][2] and "3 rows" in res[0][2]
