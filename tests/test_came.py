"""came against came_pytorch.CAME, step by step, params and every state tensor by name."""

import pytest
import torch
from came_pytorch import CAME
from test_adafactor import TOL, run_lockstep  # the shared lockstep harness and tolerances

from funcpar.optim.came import came
from funcpar.optim.masks import matrices_only

CONFIGS = [
    dict(lr=1e-3),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, betas=(0.8, 0.99, 0.999), eps=(1e-20, 1e-10), clip_threshold=0.5,
         weight_decay=0.01),
    dict(lr=3e-2, betas=(0.0, 0.9, 0.5), clip_threshold=100.0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kwargs", CONFIGS)
def test_came_matches_came_pytorch(kwargs, dtype):
    err = run_lockstep(came(**kwargs), lambda ps: CAME(list(ps.values()), **kwargs), dtype=dtype)
    assert err <= TOL[dtype]


def test_came_zero_init():
    kw = dict(lr=1e-2, weight_decay=0.1)
    err = run_lockstep(came(**kw), lambda ps: CAME(list(ps.values()), **kw),
                       dtype=torch.float64, zeros=True)
    assert err <= TOL[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_came_weight_decay_mask_matches_param_groups(dtype):
    def theirs(ps):
        groups = [
            {"params": [p for p in ps.values() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps.values() if p.dim() < 2], "weight_decay": 0.0},
        ]
        return CAME(groups, lr=1e-2)

    ours = came(lr=1e-2, weight_decay=0.1, weight_decay_mask=matrices_only)
    assert run_lockstep(ours, theirs, dtype=dtype) <= TOL[dtype]


def test_came_state_names_and_memory():
    params = {"w": torch.zeros(300, 500), "t": torch.zeros(4, 30, 50), "b": torch.zeros(500),
              "s": torch.zeros(())}
    stats = came().init(params).inner.stats
    assert sorted(stats["w"]) == ["exp_avg", "exp_avg_res_col", "exp_avg_res_row",
                                  "exp_avg_sq_col", "exp_avg_sq_row"]
    factored = {k: v for k, v in stats["w"].items() if k != "exp_avg"}
    assert sum(v.numel() for v in factored.values()) == 2 * (300 + 500)
    assert stats["t"]["exp_avg_res_row"].shape == (4, 30)
    assert stats["t"]["exp_avg_res_col"].shape == (4, 50)
    assert sorted(stats["b"]) == ["exp_avg", "exp_avg_sq"]
    assert sorted(stats["s"]) == ["exp_avg", "exp_avg_sq"] and stats["s"]["exp_avg"].dim() == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 0.999)), "3 entries"),
        (dict(betas=(0.9, 1.0, 0.9999)), "betas"),
        (dict(betas=(-0.1, 0.999, 0.9999)), "betas"),
        (dict(eps=(0.0, 1e-16)), "eps"),
        (dict(eps=(1e-30, 0.0)), "eps"),
        (dict(eps=(1e-30,)), "pair"),
        (dict(clip_threshold=0.0), "clip_threshold"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_came_hyperparameter_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        came(**kwargs)
