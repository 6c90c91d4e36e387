"""make_train_step: purity, agreement with plain PyTorch, compile, typed errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcpar.optim as fo
from funcpar.state import functionalize, generator_state, init_state
from funcpar.train import make_train_step


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.2)
        self.b = nn.Linear(16, 3)
        self.unused = nn.Linear(2, 2)  # not reached by the loss: gets a zero gradient

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def _setup(dtype=torch.float64):
    torch.manual_seed(0)
    net = DropNet().to(dtype)
    x = torch.randn(12, 6, dtype=dtype)
    y = torch.randint(0, 3, (12,))
    return net, (x, y)


def test_step_matches_module_and_torch_optim():
    net, batch = _setup()
    net.drop.p = 0.0
    apply_fn, params, buffers = functionalize(net)
    opt = fo.chain(fo.clip_by_global_norm(0.1), fo.adamw(lr=0.01))
    step = make_train_step(apply_fn, F.cross_entropy, opt)
    state = init_state(params, buffers, opt)

    ref = DropNet().double()
    ref.load_state_dict(net.state_dict())
    ref.drop.p = 0.0
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for _ in range(5):
        state, metrics = step(state, batch)
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(batch[0]), batch[1])
        loss.backward()
        for p in ref.unused.parameters():  # funcpar's zero gradient for an unreached leaf
            p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(metrics["grad_norm"], norm, rtol=1e-12, atol=0)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-12, atol=1e-15)
    assert int(state.step) == 5
    assert float(metrics["lr"]) == pytest.approx(0.01)


def test_step_is_pure_and_rng_is_state():
    net, batch = _setup()
    apply_fn, params, buffers = functionalize(net)
    opt = fo.sgd(lr=0.1)
    step = make_train_step(apply_fn, F.cross_entropy, opt)
    state = init_state(params, buffers, opt, seed=7)
    snapshot = {k: v.clone() for k, v in state.params.items()}
    s1, m1 = step(state, batch)
    torch.rand(100)  # global RNG traffic in between must not matter
    s2, m2 = step(state, batch)
    assert torch.equal(m1["loss"], m2["loss"])
    for k in s1.params:
        assert torch.equal(s1.params[k], s2.params[k])
        assert torch.equal(state.params[k], snapshot[k])  # inputs untouched
    assert not torch.equal(s1.rng, state.rng)  # dropout drew from the state's generator
    _s3, m3 = step(s1, batch)
    assert not torch.equal(m3["loss"], m1["loss"])  # a new mask on the next step


def test_rng_of_another_device_kind_is_refused_naming_the_fix():
    # A CUDA generator's 16-byte state on CPU parameters (and the CPU's 5056 bytes on CUDA
    # ones, which torch refuses as "RNG state is wrong size") is one clear error.
    net, batch = _setup()
    apply_fn, params, buffers = functionalize(net)
    opt = fo.sgd(lr=0.1)
    step = make_train_step(apply_fn, F.cross_entropy, opt)
    state = init_state(params, buffers, opt)
    assert torch.equal(state.rng, generator_state("cpu", 0))
    cuda_kind = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"state.rng \(16 bytes\).*generator_state"):
        step(state._replace(rng=cuda_kind), batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_init_state_on_cuda_trains_with_the_cuda_generator():
    net, batch = _setup()
    net = net.cuda()
    batch = tuple(b.cuda() for b in batch)
    apply_fn, params, buffers = functionalize(net)
    opt = fo.adamw(lr=0.01)
    step = make_train_step(apply_fn, F.cross_entropy, opt)
    state = init_state(params, buffers, opt, seed=3)
    assert torch.equal(state.rng, generator_state("cuda", 3))
    s1, m1 = step(state, batch)
    _, m2 = step(state, batch)
    assert torch.equal(m1["loss"], m2["loss"]) and not torch.equal(s1.rng, state.rng)


def test_compiled_step_matches_eager():
    net, batch = _setup()
    net.drop.p = 0.0
    apply_fn, params, buffers = functionalize(net)
    opt = fo.adamw(lr=0.01)
    eager = make_train_step(apply_fn, F.cross_entropy, opt)
    compiled = make_train_step(apply_fn, F.cross_entropy, opt, compile=True)
    a = b = init_state(params, buffers, opt)
    for _ in range(3):
        a, ma = eager(a, batch)
        b, mb = compiled(b, batch)
    torch.testing.assert_close(ma["loss"], mb["loss"], rtol=1e-10, atol=0)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-10, atol=1e-12)


def test_bad_batch_and_loss():
    net, batch = _setup()
    apply_fn, params, buffers = functionalize(net)
    opt = fo.sgd(lr=0.1)
    state = init_state(params, buffers, opt)
    with pytest.raises(TypeError, match="batch"):
        make_train_step(apply_fn, F.cross_entropy, opt)(state, batch[0])
    per_example = make_train_step(
        apply_fn, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt
    )
    with pytest.raises(ValueError, match="0-d tensor"):
        per_example(state, batch)
