"""Test helpers: :func:`run_ranks` runs a function on N local gloo ranks (see multirank.py)."""

from funcpar.testing.multirank import RankError, RanksTimeout, free_port, run_ranks

__all__ = ["RankError", "RanksTimeout", "free_port", "run_ranks"]
