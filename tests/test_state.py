"""Tree helpers, functionalize and TrainState."""

import pytest
import torch
from torch import nn

import funcpar.optim as fo
from funcpar.state import (
    LeafSpec,
    functionalize,
    init_state,
    named_leaves,
    tree_flatten,
    tree_map_with_path,
    tree_shapes,
    tree_unflatten,
)
from funcpar.state.tree import leaves_like, tree_structure_check
from funcpar.train import make_train_step


def test_tree_helpers():
    tree = {"b": [torch.zeros(2), None], "a": {"x": torch.ones(3, dtype=torch.float64)}}
    names = [n for n, _ in named_leaves(tree)]
    assert names == ["a.x", "b.0", "b.1"]
    leaves, spec = tree_flatten(tree)
    assert tree_unflatten(spec, leaves)["b"][1] is None
    shapes = tree_shapes(tree)
    assert shapes["a"]["x"] == LeafSpec((3,), torch.float64)
    seen = tree_map_with_path(lambda name, x: name, tree)
    assert seen == {"a": {"x": "a.x"}, "b": ["b.0", "b.1"]}
    assert leaves_like(tree, None, what="w", against="t") == [None, None, None]
    with pytest.raises(ValueError, match="missing \\['a.x'\\]"):
        tree_structure_check(tree, {"b": [1, 2]}, what="other", against="tree")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def test_functionalize_matches_module_with_batchnorm():
    torch.manual_seed(0)
    net = Net().double()
    apply_fn, params, buffers = functionalize(net)
    before = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(8, 5, dtype=torch.float64)

    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    out, new_buffers = apply_fn(live, buffers, x)
    grads = torch.autograd.grad(out.square().sum(), list(live.values()))

    # The module's own forward, on a copy so the two runs start from the same statistics.
    ref = Net().double()
    ref.load_state_dict(net.state_dict())
    ref_out = ref(x)
    ref_out.square().sum().backward()

    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=0)
    for g, (name, p) in zip(grads, ref.named_parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=0, msg=name)
    # Buffers: the new ones moved like the module's; the ones passed in did not.
    for name, b in ref.named_buffers():
        torch.testing.assert_close(new_buffers[name], b, rtol=1e-12, atol=0)
        assert torch.equal(buffers[name], before[name]), name
    assert int(new_buffers["bn.num_batches_tracked"]) == 1
    assert int(buffers["bn.num_batches_tracked"]) == 0


def test_functionalize_fixes_the_mode():
    net = Net().double().eval()
    apply_fn, params, buffers = functionalize(net)
    net.train()  # later mode changes do not leak into apply_fn
    x = torch.randn(4, 5, dtype=torch.float64)
    _, new_buffers = apply_fn(params, buffers, x)
    assert int(new_buffers["bn.num_batches_tracked"]) == 0
    assert net.training


def test_apply_fn_restores_the_module_whatever_happens():
    """apply_fn swaps the trees' tensors and the fixed mode in for one call only: the module's
    own tensors and each submodule's own mode (mixed ones included) come back, after a
    forward that raises too."""
    net = Net().double().train()
    net.bn.eval()  # a mixed mode, which the call's fixed (train) mode must not clobber
    own = {k: v for k, v in net.state_dict(keep_vars=True).items()}
    apply_fn, params, buffers = functionalize(net)
    net.eval()
    net.lin.train()
    modes = {n: m.training for n, m in net.named_modules()}
    seen = {}
    hook = net.out.register_forward_pre_hook(
        lambda m, a: seen.update(training=[x.training for x in net.modules()],
                                 weight=m.weight))
    new = {k: v + 1 for k, v in params.items()}
    apply_fn(new, buffers, torch.randn(4, 5, dtype=torch.float64))
    assert seen["training"] == [True, True, False, True]  # the modes at functionalize
    assert seen["weight"] is new["out.weight"]
    hook.remove()
    for raising in (False, True):
        if raising:
            net.out.register_forward_pre_hook(lambda m, a: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                apply_fn(new, buffers, torch.randn(4, 5, dtype=torch.float64))
        assert {n: m.training for n, m in net.named_modules()} == modes
        for k, v in net.state_dict(keep_vars=True).items():
            assert v is own[k], k


def test_functionalize_errors():
    apply_fn, params, buffers = functionalize(Net())
    with pytest.raises(KeyError, match="missing \\['lin.bias'\\]"):
        apply_fn({k: v for k, v in params.items() if k != "lin.bias"}, buffers, torch.zeros(2, 5))
    with pytest.raises(TypeError, match="module"):
        functionalize(lambda x: x)


class Tied(nn.Module):
    """An embedding and a head sharing one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_tied_weights_appear_once():
    apply_fn, params, _ = functionalize(Tied())
    assert list(params) == ["emb.weight"]
    new_w = torch.randn(10, 4)
    out, _ = apply_fn({"emb.weight": new_w}, {}, torch.tensor([1, 2]))
    torch.testing.assert_close(out, new_w[[1, 2]] @ new_w.T)


def test_train_state_is_a_tree_of_tensors():
    _, params, buffers = functionalize(Net())
    state = init_state(params, buffers, fo.adamw(), seed=3)
    leaves, _ = tree_flatten(state)
    assert all(torch.is_tensor(x) or x is None for x in leaves)
    assert int(state.step) == 0
    assert torch.equal(state.rng, torch.Generator().manual_seed(3).get_state())


# ----------------------------------------------------------------- functionalize(release=True)
def _module_bytes(module):
    """Bytes of the (non-meta) storages the module's parameters and buffers reach."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*module.parameters(), *module.buffers()] if not t.is_meta}
    return sum(storages.values())


def _tree_bytes(*trees):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for tree in trees for t in tree.values()}.values())


def test_release_moves_the_module_tensors_to_the_trees():
    torch.manual_seed(0)
    net = Net().double()
    expected = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()])
    assert _module_bytes(net) == expected
    x = torch.randn(8, 5, dtype=torch.float64)
    kept_fn, kept_params, kept_buffers = functionalize(net)
    ref_out, ref_buffers = kept_fn(kept_params, kept_buffers, x)

    apply_fn, params, buffers = functionalize(net, release=True)
    assert _module_bytes(net) == 0  # the module holds no storage any more
    assert all(t.is_meta for t in [*net.parameters(), *net.buffers()])
    assert _tree_bytes(params, buffers) == expected  # the trees hold all of it
    assert {k: (v.shape, v.dtype) for k, v in params.items()} == {
        k: (p.shape, p.dtype) for k, p in net.named_parameters()}
    out, new_buffers = apply_fn(params, buffers, x)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(new_buffers[k], ref_buffers[k]) for k in ref_buffers)
    with pytest.raises(RuntimeError, match="release=True: its parameter 'lin.weight'"):
        net(x)  # torch's own error would be "Tensor on device meta is not on ... cpu"


def test_release_trains_bit_for_bit():
    def run(release):
        torch.manual_seed(0)
        net = Net().double()
        apply_fn, params, buffers = functionalize(net, release=release)
        opt = fo.adamw(lr=0.01)
        step = make_train_step(apply_fn, torch.nn.functional.cross_entropy, opt)
        state = init_state(params, buffers, opt)
        del params, buffers  # the state holds them now
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            batch = (torch.randn(8, 5, dtype=torch.float64, generator=g),
                     torch.randint(0, 3, (8,), generator=g))
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return net, losses, state

    kept, losses, state = run(False)
    released, losses_r, state_r = run(True)
    assert losses_r == losses
    for a, b in zip(tree_flatten(state_r)[0], tree_flatten(state)[0]):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
    # Without release the module still holds the initial parameters beside the trained ones.
    assert _module_bytes(kept) > 0 and _module_bytes(released) == 0


def test_release_keeps_tied_weights_tied():
    model = Tied()
    weight = model.emb.weight
    apply_fn, params, _ = functionalize(model, release=True)
    assert list(params) == ["emb.weight"]
    # The same Parameter object, now meta, still shared by both modules.
    assert model.emb.weight is weight and model.head.weight is weight and weight.is_meta
    out, _ = apply_fn(params, {}, torch.tensor([1, 2]))
    w = params["emb.weight"]
    torch.testing.assert_close(out, w[[1, 2]] @ w.T, rtol=0, atol=0)
