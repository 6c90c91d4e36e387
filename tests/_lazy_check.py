"""The shard-for-shard comparison of tests/test_lazy_init.py and tests/test_moe_compose.py."""

from __future__ import annotations

from typing import Any

import torch

from funcpar.state.tree import named_leaves


def assert_same_state(lazy_state: Any, full_state: Any, *where: Any) -> None:
    """Every ``params`` and ``opt_state`` leaf of ``lazy_state`` is materialized (not meta), of
    the shape of ``full_state``'s and bit for bit equal to it; ``where`` names the case."""
    for tree in ("params", "opt_state"):
        a = named_leaves(getattr(lazy_state, tree))
        b = named_leaves(getattr(full_state, tree))
        assert [n for n, _ in a] == [n for n, _ in b], (*where, tree)
        for (name, x), (_, y) in zip(a, b):
            if torch.is_tensor(y):
                assert not x.is_meta and x.shape == y.shape, (*where, tree, name)
                assert torch.equal(x, y), (*where, tree, name)
