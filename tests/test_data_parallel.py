"""data_parallel: batch split, bucketed gradient mean overlapped with the backward.

The equality of dp2/dp4 training with one process is in test_tensor_parallel.py; here, the
mechanics: buckets follow the backward's order and start during it, and errors are clear.
"""

from typing import ClassVar

import pytest
import torch
from torch import nn

import funcpar.optim as fo
from funcpar.shard.comm import comm_log
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.transforms import data_parallel
from funcpar.transforms.data_parallel import BucketedMean, split_batch


class _Probe(torch.autograd.Function):
    """Identity; its backward notes how many dp gradient buckets were already launched."""

    seen: ClassVar[list[int]] = []
    match: ClassVar[str] = "dp grads"  # the collectives counted (test_zero_buckets: ZeRO's)

    @staticmethod
    def forward(ctx, x, records):
        ctx.records = records
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Probe.seen.append(sum(_Probe.match in r.purpose for r in ctx.records))
        return g, None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 2)
        self.records = None

    def forward(self, x):
        return self.second(_Probe.apply(self.first(x), self.records))


def _overlap(zero_stage: int = 0):
    """One dp2 step with one leaf a bucket (``zero_stage``: under zero_partition, whose
    reduce-scatters are counted): the buckets the probe saw launched, the gradient
    collectives, the loss."""
    from funcpar.transforms import compose, zero_partition

    _Probe.match = "zero grads" if zero_stage else "dp grads"
    mesh = DeviceMesh.from_env(dp=2)
    torch.manual_seed(0)
    model = _Net().double()
    apply_fn, params, buffers = functionalize(model)
    opt = fo.sgd(lr=0.1)
    step = make_train_step(apply_fn, lambda out, y: ((out - y) ** 2).mean(), opt)
    parallel = [data_parallel(mesh, bucket_mb=1e-6)]
    if zero_stage:
        parallel.append(zero_partition(zero_stage, mesh, bucket_mb=1e-6))
    step, state = compose(*parallel)(step, init_state(params, buffers, opt))
    batch = (torch.randn(6, 4, dtype=torch.double), torch.randn(6, 2, dtype=torch.double))
    with comm_log.capture() as records:
        model.records = records
        _Probe.seen.clear()
        state, metrics = step(state, batch)
    grads = [r.op for r in records if _Probe.match in r.purpose]
    return _Probe.seen[0], grads, float(metrics["loss"])


def test_buckets_start_during_the_backward():
    # bucket_mb tiny: one leaf per bucket, 4 leaves. The probe sits between the two linears, so
    # when its backward runs, `second`'s weight and bias are done and must be on the wire.
    results = run_ranks(_overlap, 2, backend=None, timeout=120)
    for seen, grads, _ in results:
        assert len(grads) == 4 and seen == 2
    loss = results[0][2]  # the mean over ranks of half-batch means: the global mean
    torch.manual_seed(0)
    ref = _Net().double()
    x, y = torch.randn(6, 4, dtype=torch.double), torch.randn(6, 2, dtype=torch.double)
    assert abs(loss - float(((ref(x) - y) ** 2).mean())) <= 1e-12


def test_buckets_follow_backward_order_and_dtype():
    mesh = DeviceMesh.virtual(rank=0, dp=2)
    leaves = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64),
              torch.zeros(300)]
    sync = BucketedMean(leaves, mesh, "dp", bucket_bytes=100)
    # Reverse order; a new bucket at the size cap (4 bytes x 10 = 40 each) and at a dtype change.
    assert sync.buckets == [[3], [2], [1, 0]]


def test_batch_that_does_not_split_is_a_clear_error():
    mesh = DeviceMesh.virtual(rank=1, dp=4)
    with pytest.raises(ValueError, match=r"batch dim of \(6,\) does not split into 4"):
        split_batch((torch.zeros(6, 3), torch.zeros(6)), mesh, "dp")
    x = torch.arange(8).reshape(8, 1)
    assert split_batch((x, x), mesh, "dp")[0].flatten().tolist() == [2, 3]


def test_data_parallel_twice_is_an_error():
    mesh = DeviceMesh.virtual(rank=0, dp=2)
    model = _Net()
    apply_fn, params, buffers = functionalize(model)
    opt = fo.sgd(lr=0.1)
    step, state = data_parallel(mesh)(make_train_step(apply_fn, lambda o, y: o.sum(), opt),
                                      init_state(params, buffers, opt))
    with pytest.raises(ValueError, match="already applied"):
        data_parallel(mesh)(step, state)
