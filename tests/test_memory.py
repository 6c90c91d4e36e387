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
