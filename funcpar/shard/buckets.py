"""Buckets: which leaves travel together in one flat buffer, one collective per bucket.

A collective per leaf pays its latency once per leaf (a transformer has ~10 leaves a block);
a bucket of many leaves pays it once (PyTorch DDP's and DeepSpeed's buckets, FSDP's flat
groups). Leaves are taken in reverse order - the order the backward produces their gradients,
so a bucket is complete, and its collective can start, while the backward goes on - and a new
bucket starts when the next leaf would take it past ``cap`` bytes or has another dtype (a flat
buffer has one). A leaf larger than ``cap`` is a bucket of its own. Data parallelism's gradient
all-reduce, ZeRO's reduce-scatters and gathers, and the plan's prediction of them all cut
their buckets here, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["bucket_indices"]


def bucket_indices(nbytes: Sequence[int], dtypes: Sequence[torch.dtype], cap: int
                   ) -> list[list[int]]:
    """The buckets of leaves ``0..n-1`` (``nbytes[i]`` bytes of dtype ``dtypes[i]``): lists of
    leaf indices, the first bucket holding the last leaves (module docstring)."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        if not buckets or size + nbytes[i] > cap or dtypes[buckets[-1][0]] != dtypes[i]:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes[i]
    return buckets
