"""Buffer donation (``make_train_step(..., donate=True)``): bit-identical to the undonated step,
the result in the input's storage, the consumed state refused by name."""

import dataclasses

import pytest
import torch

from funcpar.state import save, tree_flatten
from funcpar.state.donation import DonatedError, is_donated
from funcpar.testing.multirank import run_ranks
from funcpar.testing.reference import OPTIMIZERS, batches, build

STEPS = 2  # a second step reads the first one's momentum, bias corrections and projector


def _run(step, state, n=STEPS):
    losses = []
    for batch in batches()[:n]:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    return losses, state


def _assert_same(a, b):
    la, sa = tree_flatten((a.params, a.buffers, a.opt_state))
    lb, sb = tree_flatten((b.params, b.buffers, b.opt_state))
    assert sa == sb
    for i, (x, y) in enumerate(zip(la, lb)):
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and torch.equal(x, y), f"leaf {i} differs"


def _pair(tp, dp, optim, zero=0, **kw):
    step, state = build(tp, dp, optim, zero=zero, **kw)
    plain = _run(step, state)
    dstep, dstate = build(tp, dp, optim, zero=zero, **kw)
    donated = _run(dataclasses.replace(dstep, donate=True), dstate)
    return plain, donated


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_donated_bit_identical_one_process(optim):
    (l0, s0), (l1, s1) = _pair(1, 1, optim)
    assert l0 == l1
    _assert_same(s0, s1)


def test_donated_state_in_input_storage_and_consumed():
    step, state = build(1, 1, "adamw")
    step = dataclasses.replace(step, donate=True)
    ptrs = [t.data_ptr() for t in tree_flatten(state.params)[0]]
    new, _ = step(state, batches()[0])
    assert [t.data_ptr() for t in tree_flatten(new.params)[0]] == ptrs
    assert all(is_donated(t) for t in tree_flatten(state.params)[0])
    assert not any(is_donated(t) for t in tree_flatten(new.params)[0])
    with pytest.raises(DonatedError, match="donated"):
        step(state, batches()[0])
    # an undonating step refuses it too: its values are the next state's
    with pytest.raises(DonatedError, match="tok_emb|layers|donated"):
        dataclasses.replace(step, donate=False)(state, batches()[0])
    new2, _ = step(new, batches()[1])  # the returned state goes on
    assert new2.step.item() == 2


def test_save_refuses_donated_state_and_resume_of_donated_run(tmp_path):
    from funcpar.state import load

    step, state = build(1, 1, "adamw")
    dstep = dataclasses.replace(step, donate=True)
    mid, _ = dstep(state, batches()[0])
    with pytest.raises(DonatedError, match="save.*donated"):
        save(state, tmp_path / "bad")
    path = save(mid, tmp_path / "ck")
    _, fresh = build(1, 1, "adamw")
    resumed = load(path, fresh)
    straight = _run(dstep, mid, 1)[1]
    again = _run(dstep, resumed, 1)[1]
    _assert_same(straight, again)


def test_fp16_skipped_step_under_donation_keeps_params():
    from funcpar.transforms import amp_cast

    step, state = build(1, 1, "adamw", dtype=torch.float32)
    step, state = amp_cast("fp16")(step, state)
    step = dataclasses.replace(step, donate=True)
    state, m = step(state, batches()[0])
    assert not bool(m["skipped"])
    clean_loss = step.loss_fn

    def poisoned(out, targets):  # infinite gradients everywhere: the step must be skipped
        return clean_loss(out, targets) * torch.tensor(float("inf"))

    tensors = lambda s: [t for t in tree_flatten((s.params, s.opt_state, s.buffers))[0]  # noqa: E731
                         if torch.is_tensor(t)]
    before = [t.clone() for t in tensors(state)]
    ptrs = [t.data_ptr() for t in tree_flatten(state.params)[0]]
    after, m = dataclasses.replace(step, loss_fn=poisoned)(state, batches()[1])
    assert bool(m["skipped"])
    leaves = tensors(after)
    assert len(leaves) == len(before)
    assert all(torch.equal(b, a) for b, a in zip(before, leaves))
    assert [t.data_ptr() for t in tree_flatten(after.params)[0]] == ptrs
    with pytest.raises(DonatedError):
        step(state, batches()[1])


@pytest.mark.parametrize("what", ["remat+accumulate", "offload"])
def test_donated_bit_identical_remat_accumulate_offload(what):
    from funcpar import optim as fo
    from funcpar.models import Llama, lm_loss
    from funcpar.state import functionalize, init_state
    from funcpar.testing.reference import CFG
    from funcpar.train import make_train_step
    from funcpar.transforms import offload, remat

    def build_one(donate):
        torch.manual_seed(0)
        apply_fn, params, buffers = functionalize(Llama(CFG).to(torch.float64))
        opt = fo.adamw(lr=1e-2, weight_decay=0.1)
        if what == "remat+accumulate":
            opt = fo.accumulate(opt, 2)
        step = make_train_step(apply_fn, lm_loss, opt, donate=donate)
        state = init_state(params, buffers, opt)
        t = remat() if what == "remat+accumulate" else offload("cpu")
        return t(step, state)

    l0, s0 = _run(*build_one(False), n=4)
    step, state = build_one(True)
    assert step.donate
    l1, s1 = _run(step, state, n=4)
    assert l0 == l1
    a = tree_flatten(s0.params)[0]
    b = tree_flatten(s1.params)[0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _dist_pair(tp, dp, zero, pp, optim):
    kw = {"pp": pp, "cfg": None} if pp > 1 else {}
    if pp > 1:
        from funcpar.testing.reference import PP_CFG

        kw["cfg"] = PP_CFG
    (l0, s0), (l1, s1) = _pair(tp, dp, optim, zero, **kw)
    assert l0 == l1
    _assert_same(s0, s1)


@pytest.mark.parametrize("world,tp,dp,zero,pp,optim", [
    (4, 2, 2, 3, 1, "adamw"),
])
def test_donated_bit_identical_distributed(world, tp, dp, zero, pp, optim):
    run_ranks(_dist_pair, world, tp, dp, zero, pp, optim)


@pytest.mark.slow
@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world,tp,dp,zero,pp", [
    (4, 2, 2, 2, 1), (4, 2, 2, 3, 1), (2, 1, 1, 0, 2),
])
def test_donated_bit_identical_distributed_matrix(world, tp, dp, zero, pp, optim):
    run_ranks(_dist_pair, world, tp, dp, zero, pp, optim)


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_donated_update_writes_params_and_state_in_place(optim):
    """Inside inplace_updates (a donated step) every optimizer's update leaves its new params
    and every state tensor of >= 1 dim in the storage it was given (the factored statistics,
    the 8-bit codes and block maxima included), so the step's donation has nothing to copy
    back; the values are the undonated update's, bit for bit."""
    import funcpar.optim as fo
    from funcpar.kernels.inplace import inplace_updates

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g),
              "e": torch.randn(32, 16, generator=g)}
    opt = OPTIMIZERS[optim](params)
    state = opt.init(params)
    for _ in range(STEPS):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        want = fo.update_params(opt, grads, state, params)
        leaves = [t for t in tree_flatten((params, state))[0]
                  if torch.is_tensor(t) and t.dim() > 0]
        ptrs = [t.data_ptr() for t in leaves]
        with inplace_updates():
            params, state = fo.update_params(opt, grads, state, params)
        got = [t for t in tree_flatten((params, state))[0] if torch.is_tensor(t) and t.dim() > 0]
        assert [t.data_ptr() for t in got] == ptrs
        for a, b in zip(tree_flatten(want)[0], tree_flatten((params, state))[0], strict=True):
            if torch.is_tensor(a):
                assert torch.equal(a, b)
