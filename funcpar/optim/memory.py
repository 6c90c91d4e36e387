"""What an optimizer state costs: total bytes and a per-leaf report."""

from __future__ import annotations

import optree
import torch

from funcpar.state.tree import NAMESPACE, Tree, path_name

__all__ = ["format_state_report", "state_bytes", "state_bytes_by_leaf"]

SHARED = "(not per leaf)"


def _paths(tree: Tree) -> list[tuple[tuple, object]]:
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True, namespace=NAMESPACE)
    return list(zip(paths, leaves))


def _nbytes(x: object) -> int:
    return x.numel() * x.element_size() if torch.is_tensor(x) else 0


def state_bytes(opt_state: Tree) -> int:
    """Bytes held by all tensors of ``opt_state`` (8-bit codes count one byte each)."""
    return sum(_nbytes(x) for _, x in _paths(opt_state))


def state_bytes_by_leaf(opt_state: Tree, params: Tree) -> dict[str, int]:
    """Bytes of optimizer state per parameter name.

    A state tensor belongs to the parameter whose path appears inside its own path (optimizer
    states keep one sub-tree per parameter, keyed like ``params``); counters, hyperparameters
    and anything else fall under ``"(not per leaf)"``.
    """
    param_paths = [p for p, _ in _paths(params)]
    report = {path_name(p): 0 for p in param_paths}
    report[SHARED] = 0
    # Longest parameter paths first, so "a.b" is not claimed by a parameter named "a".
    by_len = sorted(param_paths, key=len, reverse=True)
    for path, leaf in _paths(opt_state):
        owner = next((p for p in by_len if _contains(path, p)), None)
        report[path_name(owner) if owner is not None else SHARED] += _nbytes(leaf)
    return report


def _contains(path: tuple, sub: tuple) -> bool:
    n = len(sub)
    return any(path[i : i + n] == sub for i in range(len(path) - n + 1))


def format_state_report(opt_state: Tree, params: Tree) -> str:
    """A table: parameter, its shape, its bytes, the state's bytes and their ratio."""
    per_leaf = state_bytes_by_leaf(opt_state, params)
    rows = [("leaf", "shape", "param bytes", "state bytes", "state/param")]
    for path, p in _paths(params):
        name = path_name(path)
        pb = _nbytes(p)
        rows.append((name, str(tuple(p.shape)), str(pb), str(per_leaf[name]),
                     f"{per_leaf[name] / pb:.3f}" if pb else "-"))
    rows.append((SHARED, "", "", str(per_leaf[SHARED]), ""))
    rows.append(("total", "", str(sum(_nbytes(p) for _, p in _paths(params))),
                 str(state_bytes(opt_state)), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
