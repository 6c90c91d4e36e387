"""The MoE block and router against a plain per-token loop (float64), capacity, losses, noise."""

import math

import pytest
import torch
import torch.nn.functional as F

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, MoE, moe_lm_loss, rotary_cos_sin
from funcpar.models.moe import expert_capacity
from funcpar.shard.mesh import DeviceMesh
from funcpar.state import functionalize, init_state
from funcpar.train import make_train_step


def _moe(top_k, capacity_factor, *, n_experts=4, dim=6, hidden=5, seed=0, noise=0.0):
    torch.manual_seed(seed)
    moe = MoE(dim, hidden, n_experts, top_k=top_k, capacity_factor=capacity_factor,
              noise_std=noise).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.7)
    return moe


def _reference(moe, x):
    """A per-token loop: python sorting for the top-k, explicit per-expert counters for the
    capacity (first choices of the whole sequence before second choices), per-token matmuls."""
    groups, seq, _ = x.shape
    n_exp, k = moe.n_experts, moe.top_k
    cap = seq if moe.capacity_factor is None else math.ceil(moe.capacity_factor * k * seq / n_exp)
    wr, ex = moe.router.weight, moe.experts
    out = torch.zeros_like(x)
    aux, z, dropped = 0.0, [], 0
    for g in range(groups):
        probs, choices = [], []
        for t in range(seq):
            logits = torch.stack([wr[e] @ x[g, t] for e in range(n_exp)])
            z.append(torch.log(torch.exp(logits).sum()) ** 2)
            p = torch.exp(logits) / torch.exp(logits).sum()
            probs.append(p)
            choices.append(sorted(range(n_exp), key=lambda e, p=p: -float(p[e].detach()))[:k])
        load = [0] * n_exp
        for j in range(k):
            for t in range(seq):
                e = choices[t][j]
                if load[e] >= cap:
                    dropped += 1
                    continue
                load[e] += 1
                p = probs[t]
                gate = p[e] if k == 1 else p[e] / sum(p[c] for c in choices[t])
                xt = x[g, t]
                h = F.silu(ex.gate_proj[e] @ xt) * (ex.up_proj[e] @ xt)
                out[g, t] = out[g, t] + gate * (ex.down_proj[e] @ h)
        frac = [sum(c.count(e) for c in choices) / (k * seq) for e in range(n_exp)]
        mean_p = [sum(p[e] for p in probs) / seq for e in range(n_exp)]
        aux = aux + n_exp * sum(f * m for f, m in zip(frac, mean_p, strict=True))
    return out, aux / groups, sum(z) / len(z), dropped


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 0.75), (2, None)])
def test_moe_matches_per_token_loop(top_k, capacity_factor):
    moe = _moe(top_k, capacity_factor)
    x = torch.randn(3, 8, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, 6, dtype=torch.float64)
    y, stats = moe(x)
    ry, raux, rz, rdropped = _reference(moe, x)
    torch.testing.assert_close(y, ry, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.aux_loss, raux, rtol=1e-12, atol=0)
    torch.testing.assert_close(stats.z_loss, rz, rtol=1e-12, atol=0)
    assert int(stats.dropped) == rdropped
    assert int(stats.tokens_per_expert.sum()) == 3 * 8 * top_k - rdropped
    if capacity_factor is not None and capacity_factor < 1.1:
        assert rdropped > 0  # the capacity really bites in these cases
    else:
        assert rdropped == 0
    wrt = [x, *moe.parameters()]
    got = torch.autograd.grad((y * w).sum() + stats.aux_loss + stats.z_loss, wrt)
    want = torch.autograd.grad((ry * w).sum() + raux + rz, wrt)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_capacity_drops_the_latest_tokens_of_an_overloaded_expert():
    # Every token prefers expert 2: with top-1 and capacity 1.0 it keeps ceil(8 / 4) = 2 tokens
    # of each sequence, the first two, and drops the other six (their output is 0).
    moe = _moe(1, 1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 50.0
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    x[..., 0] = x[..., 0].abs() + 1.0
    y, stats = moe(x)
    assert stats.tokens_per_expert.tolist() == [0, 0, 4, 0] and int(stats.dropped) == 12
    assert y[:, :2].abs().min() > 0 and (y[:, 2:] == 0).all()


def test_aux_loss_is_one_under_uniform_routing_and_z_loss_formula():
    moe = _moe(2, None)
    with torch.no_grad():
        moe.router.weight.zero_()  # every probability 1/E: E * sum_e f_e / E = 1
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    _, stats = moe(x)
    torch.testing.assert_close(stats.aux_loss, torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(stats.z_loss, torch.tensor(math.log(4) ** 2, dtype=torch.float64))


def _llama_step(noise, **kw):
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=8, n_experts=4,
                      top_k=2, moe_every=1, router_noise=noise, **kw)
    apply_fn, params, buffers = functionalize(Llama(cfg, dtype=torch.float64))
    opt = fo.adamw(lr=1e-2)
    step = make_train_step(apply_fn, moe_lm_loss, opt)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    return step, init_state(params, buffers, opt, seed=3), batch


def test_router_noise_repeats_for_the_same_state():
    step, state, batch = _llama_step(0.5)
    s1, m1 = step(state, batch)
    s2, m2 = step(state, batch)
    assert torch.equal(m1["loss"], m2["loss"])
    assert all(torch.equal(a, b) for a, b in zip(s1.params.values(), s2.params.values(),
                                                  strict=True))
    _, m3 = step(s1, batch)  # the generator moved on: other noise, another loss
    quiet_step, quiet_state, _ = _llama_step(0.0)
    _, m0 = quiet_step(quiet_state, batch)
    assert not torch.equal(m1["loss"], m0["loss"]) and not torch.equal(m3["loss"], m1["loss"])


def test_llama_moe_loss_adds_weighted_router_losses():
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, ffn_hidden=8, n_experts=4,
                      top_k=1, moe_every=2, aux_loss_weight=0.1, z_loss_weight=0.01)
    model = Llama(cfg, dtype=torch.float64)
    assert [type(b).__name__ for b in model.layers] == ["Block", "MoEBlock", "Block"]
    tokens = torch.randint(0, 32, (2, 8))
    out = model(tokens)
    x = model.embed_tokens(tokens)
    cos, sin = rotary_cos_sin(
        8, cfg.head_dim, cfg.rope_theta, dtype=x.dtype, device=x.device)
    _, stats = model.layers[1](model.layers[0](x, cos, sin), cos, sin)
    torch.testing.assert_close(out.router_loss, 0.1 * stats.aux_loss + 0.01 * stats.z_loss)
    assert out.tokens_per_expert.shape == (1, 4)
    assert int(out.tokens_per_expert.sum() + out.dropped.sum()) == 16
    loss = moe_lm_loss(out, tokens)
    assert loss > out.router_loss


@pytest.mark.parametrize("kw,match", [
    (dict(n_experts=2, top_k=3), "top_k"),
    (dict(n_experts=2, moe_every=5), "moe_every"),
    (dict(n_experts=2, capacity_factor=0.0), "capacity_factor"),
    (dict(n_experts=-1), "n_experts"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(n_layers=2, **kw)


def test_capacity_under_one_token_is_an_error():
    with pytest.raises(ValueError, match=r"0\.5 < 1 token per expert"):
        expert_capacity(0.25, 1, 16, 8)
    moe = _moe(1, 0.25, n_experts=8)
    with pytest.raises(ValueError, match="capacity_factor=0.25"):
        moe(torch.randn(1, 16, 6, dtype=torch.float64))
    assert expert_capacity(1.25, 2, 8, 4) == 5 and expert_capacity(None, 2, 8, 4) == 8


def _ep_inputs(**kw):
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=8, **kw)
    apply_fn, params, buffers = functionalize(Llama(cfg))
    opt = fo.sgd(lr=0.1)
    return make_train_step(apply_fn, moe_lm_loss, opt), init_state(params, buffers, opt)


def test_expert_parallel_shards_the_experts_on_a_virtual_mesh():
    from funcpar.shard.layout import Shard
    from funcpar.transforms import expert_parallel

    step, state = _ep_inputs(n_experts=4, top_k=1)
    whole = state.params["layers.0.mlp.experts.up_proj"]
    mesh = DeviceMesh.virtual(rank=1, ep=2)
    step, state = expert_parallel(mesh)(step, state)
    lay = step.layouts["layers.0.mlp.experts.up_proj"]
    assert lay.dim_axes[0] == ("ep",) and Shard(0) in lay.placements
    assert torch.equal(state.params["layers.0.mlp.experts.up_proj"], whole[2:])
    assert step.layouts["layers.0.mlp.router.weight"] is None


def test_expert_parallel_errors():
    from funcpar.transforms import expert_parallel, zero_partition

    mesh = DeviceMesh.virtual(rank=0, ep=2)
    with pytest.raises(ValueError, match="'layers.0.mlp' has 3 experts, not divisible by ep=2"):
        expert_parallel(mesh)(*_ep_inputs(n_experts=3, top_k=1))
    with pytest.raises(ValueError, match="no MoE block"):
        expert_parallel(mesh)(*_ep_inputs())
    with pytest.raises(ValueError, match="has no axis 'ep'"):
        expert_parallel(DeviceMesh.virtual(rank=0, dp=2))
    dp_mesh = DeviceMesh.virtual(rank=0, ep=2, dp=2)
    step, state = zero_partition(1, dp_mesh)(*_ep_inputs(n_experts=4, top_k=1))
    with pytest.raises(ValueError, match="before zero_partition"):
        expert_parallel(dp_mesh)(step, state)


def test_moe_hybrid_preset_refuses_what_is_not_supported():
    from funcpar.presets import Preset, moe_hybrid

    with pytest.raises(ValueError, match="the plan of ep_size=2 with tp_size=2 is not modeled"):
        Preset("moe_hybrid", ep_size=2, tp_size=2, plan=True)
    with pytest.raises(ValueError, match="ep_size must be an int >= 1"):
        moe_hybrid(ep_size=0)
    with pytest.raises(ValueError, match="ep_size=4 but the mesh's 'ep' axis has 2"):
        moe_hybrid(ep_size=4, mesh=DeviceMesh.virtual(rank=0, ep=2, dp=1, tp=1))
