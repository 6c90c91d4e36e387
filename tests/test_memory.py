import pytest
import torch

import funcpar.optim as fo
from funcpar.optim.memory import format_state_report, state_bytes, state_bytes_by_leaf


def test_adamw_state_bytes_are_two_copies_per_param():
    params = {"w": torch.zeros(10, 20), "w.b": torch.zeros(20), "s": torch.zeros(())}
    state = fo.adamw().init(params)
    per_leaf = state_bytes_by_leaf(state, params)
    assert per_leaf["w"] == 2 * 200 * 4
    assert per_leaf["w.b"] == 2 * 20 * 4  # not claimed by "w"
    assert per_leaf["s"] == 2 * 4
    # Two int64 counters and three float64 hyperparameters.
    assert per_leaf["(not per leaf)"] == 2 * 8 + 3 * 8
    assert state_bytes(state) == sum(per_leaf.values())
    table = format_state_report(state, params)
    assert "w.b" in table and "total" in table


def test_sgd_without_momentum_has_no_buffers():
    params = {"w": torch.zeros(10, 20)}
    assert state_bytes_by_leaf(fo.sgd().init(params), params)["w"] == 0


# ---- the issue-4 optimizers: what each costs per leaf ------------------------------------------

F32 = 4  # bytes per float32 element
SHAPES = {"w": (300, 500), "t": (4, 30, 50), "b": (500,), "s": ()}


def _params():
    return {k: torch.zeros(s) for k, s in SHAPES.items()}


def test_adafactor_is_rows_plus_cols_per_matrix():
    params = _params()
    for opt in (fo.adafactor(), fo.adafactor_torch()):
        per_leaf = state_bytes_by_leaf(opt.init(params), params)
        # O(rows + cols) per 2-D leaf: 3.2 KB for a 600 KB matrix (Adam: 1.2 MB).
        assert per_leaf["w"] == (300 + 500) * F32
        # A 3-D leaf is a batch of 4 matrices: 4 * (rows + cols).
        assert per_leaf["t"] == 4 * (30 + 50) * F32
        # 1-D and 0-d leaves keep the full second moment.
        assert per_leaf["b"] == 500 * F32 and per_leaf["s"] == F32
        assert state_bytes(opt.init(params)) == sum(per_leaf.values())
    # The first moment (beta1) costs a full copy again.
    per_leaf = state_bytes_by_leaf(fo.adafactor(beta1=0.9).init(params), params)
    assert per_leaf["w"] == (300 + 500 + 300 * 500) * F32


def test_came_is_momentum_plus_two_factored_statistics():
    params = _params()
    per_leaf = state_bytes_by_leaf(fo.came().init(params), params)
    assert per_leaf["w"] == (300 * 500 + 2 * (300 + 500)) * F32
    assert per_leaf["t"] == (4 * 30 * 50 + 2 * 4 * (30 + 50)) * F32
    assert per_leaf["b"] == 2 * 500 * F32  # came-pytorch keeps no confidence for vectors


def test_lamb_is_two_moments_and_a_trust_ratio():
    params = _params()
    per_leaf = state_bytes_by_leaf(fo.lamb().init(params), params)
    assert per_leaf["w"] == (2 * 300 * 500 + 1) * F32


@pytest.mark.parametrize("eight_bit", [False, True])
def test_galore_keeps_low_rank_moments_and_a_projector(eight_bit):
    params = _params()
    rank, block = 16, 256
    opt = fo.galore_adamw(rank=rank, eight_bit=eight_bit, block_size=block, min_8bit_size=4096)
    per_leaf = state_bytes_by_leaf(opt.init(params), params)
    # (300, 500) is wide: left projection P (300, r); moments (r, 500).
    low = rank * 500
    projector = 300 * rank * F32
    if eight_bit:
        # uint8 codes plus one float32 absmax per block, for each of m and v.
        moments = 2 * (low + -(-low // block) * F32)
    else:
        moments = 2 * low * F32
    assert per_leaf["w"] == projector + moments
    # Unprojected leaves: full AdamW moments; "b" (500 elements) is under min_8bit_size.
    assert per_leaf["b"] == 2 * 500 * F32
    assert per_leaf["t"] == (2 * 4 * 30 * 50 * F32 if not eight_bit
                             else 2 * (6000 + -(-6000 // block) * F32))


def test_report_lists_every_leaf():
    params = _params()
    table = format_state_report(fo.adafactor().init(params), params)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["leaf", "shape"]
    row = next(line for line in lines if line.startswith("w "))
    # param bytes, state bytes, their ratio.
    assert row.split()[-3:] == [str(300 * 500 * F32), str(800 * F32), "0.005"]
