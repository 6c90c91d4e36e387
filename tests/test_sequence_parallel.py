"""shard_params(sequence_parallel=True) gives the single-process training, step for step.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198): between the tensor-parallel
regions the activations are split on the sequence dim. The example Llama (8 query / 4 kv heads,
vocabulary 50 and MLP width 42 that 4 does not divide) trains 10 steps of AdamW with global-norm
clipping under tp2, tp4 and tp2 x dp2, on sequences of 12 tokens (even chunks) and 11 (uneven:
6/5 over 2, 3/3/3/2 over 4), against the same 10 steps in one process. float64: the collectives
only reorder sums, so the error is rounding; measured ~1e-13 relative on the parameters (AdamW's
division by sqrt(v) + eps amplifies the rounding of near-zero gradients) and ~5e-16 on the
losses, so 1e-10 leaves room. Without the tp sum of the norm weights' gradients the parameters
are off by ~1e-1, far outside it.
"""


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcpar.optim as fo
from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.shard.comm import comm_log
from funcpar.shard.layout import unshard_tree
from funcpar.shard.mesh import DeviceMesh
from funcpar.shard.rules import llama_rules
from funcpar.state import functionalize, init_state
from funcpar.testing import run_ranks
from funcpar.train import make_train_step
from funcpar.transforms import compose, data_parallel, shard_params

CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=42,
                  max_seq_len=16)
STEPS = 10
SEQS = (12, 11)
NORMS = ("layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
         "layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight",
         "norm.weight")


def _batches(seq):
    # Two batches in turn: random tokens seen repeatedly, so the loss can fall.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (2, 8, seq + 1), generator=g)
    return [(ids[i % 2, :, :-1], ids[i % 2, :, 1:]) for i in range(STEPS)]


def _optimizer():
    return fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2, weight_decay=0.1))


def _setup(tp, dp, dtype=torch.float64, sequence_parallel=True):
    mesh = DeviceMesh.from_env(dp=dp, tp=tp)
    model = Llama(CFG).to(dtype)
    apply_fn, params, buffers = functionalize(model)
    opt = _optimizer()
    step, state = make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt)
    transforms = []
    if tp > 1:
        transforms.append(shard_params(llama_rules(CFG.head_dim), mesh,
                                       sequence_parallel=sequence_parallel))
    if dp > 1:
        transforms.append(data_parallel(mesh))
    return compose(*transforms)(step, state)


def train(tp, dp, seq):
    """10 steps on sequences of ``seq`` tokens; (losses, whole params) on every rank."""
    step, state = _setup(tp, dp)
    losses = []
    for batch in _batches(seq):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    params = state.params if step.layouts is None else unshard_tree(state.params, step.layouts)
    return losses, params


def _cases(world):
    """(tp, dp, seq) of one world size: both lengths at tp2; at 4 ranks the uneven length at
    tp4 (3/3/3/2) and the even one at tp2 x dp2, to keep the spawn short."""
    if world == 2:
        return [(2, 1, seq) for seq in SEQS]
    return [(4, 1, 11), (2, 2, 12)]


def _one_step_records():
    """The collectives of one tp2 sequence-parallel step, as (op, axis, bytes, purpose)."""
    step, state = _setup(2, 1)
    with comm_log.capture() as records:
        step(state, _batches(12)[0])
    return [(r.op, r.axis, r.nbytes, r.purpose) for r in records]


def _all_cases(world):
    """Every case of one world size in one spawn (a spawn costs seconds on 2 cores)."""
    out = {case: train(*case) for case in _cases(world)}
    if world == 2:
        out["records"] = _one_step_records()
    return out


@pytest.fixture(scope="module")
def reference():
    return {seq: train(1, 1, seq) for seq in SEQS}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_all_cases, 2, 2, backend=None, timeout=240)


def _max_rel(a, b):
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def _check_training(results, world, reference):
    for rank, res in enumerate(results):
        for tp, dp, seq in _cases(world):
            losses, params = res[(tp, dp, seq)]
            ref_losses, ref_params = reference[seq]
            assert set(params) == set(ref_params)
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            assert err <= 1e-10, (rank, tp, dp, seq, err)
            err = _max_rel(params, ref_params)
            assert err <= 1e-10, (rank, tp, dp, seq, err)
    for seq in SEQS:  # the comparison is of training, not of a constant
        assert reference[seq][0][-1] < reference[seq][0][0] - 0.5


def test_sp_tp2_matches_single_process_float64(world2, reference):
    _check_training(world2, 2, reference)


def test_sp_tp4_and_tp2xdp2_match_single_process_float64(reference):
    results = run_ranks(_all_cases, 4, 4, backend=None, timeout=240)
    _check_training(results, 4, reference)


def test_sp_comm_log(world2):
    for res in world2:
        records = res["records"]
        by_op: dict[str, list[str]] = {}
        for op, axis, _, purpose in records:
            assert axis == "tp", (op, axis, purpose)
            by_op.setdefault(op, []).append(purpose)
        # Forward: the embedding reduce-scatters over the sequence, each region (attention,
        # MLP) all-gathers its input, each row-split linear reduce-scatters its output, the LM
        # head all-gathers its input. Backward: each of them the other way round.
        gathers, scatters = by_op["all_gather"], by_op["reduce_scatter"]
        regions = [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")]
        for who in [*regions, "lm_head"]:
            assert f"{who}: input" in gathers, who
            assert f"{who}: input (grad)" in scatters, who
        for who in ("layers.0.self_attn.o_proj", "layers.1.mlp.down_proj"):
            assert f"{who}: output" in scatters, who
            assert f"{who}: output (grad)" in gathers, who
        assert "embed_tokens" in scatters and "embed_tokens (grad)" in gathers
        assert len(gathers) == len(scatters) == 2 * (len(regions) + 1)
        # All-reduces: the vocab-parallel loss's per-token scalars, the global norm's per-leaf
        # sums of squares, and one sum of the replicated leaves' gradients - the norm weights,
        # which are used on sequence-split activations. No activation is all-reduced any more
        # (plain tp's "input grad" and "output" all-reduces are gone).
        sp_grads = [p for p in by_op["all_reduce"] if p.startswith("sequence-parallel grads")]
        assert len(sp_grads) == 1
        assert sorted(sp_grads[0].split(": ", 1)[1].split(", ")) == sorted(NORMS)
        others = [p for p in by_op["all_reduce"] if p not in sp_grads]
        assert all(p.startswith("cross_entropy") or p.endswith("global_norm")
                   for p in others), others
        # No message is the size of a parameter matrix: activations [8, 12, 32] at most.
        assert max(n for *_, n, _ in records) <= 8 * 12 * CFG.dim * 8


def _sp_step(model, rules=None, mesh=None):
    mesh = mesh or DeviceMesh.virtual(rank=0, tp=2)
    apply_fn, params, buffers = functionalize(model)
    opt = _optimizer()
    return shard_params(rules or llama_rules(CFG.head_dim), mesh, sequence_parallel=True)(
        make_train_step(apply_fn, lm_loss, opt), init_state(params, buffers, opt))


def test_sp_sequence_that_does_not_split():
    # Raised by the embedding, before any collective: a virtual mesh (no process group) does.
    step, state = _sp_step(Llama(CFG), mesh=DeviceMesh.virtual(rank=1, tp=4))
    ids = torch.randint(0, CFG.vocab_size, (2, 4))
    with pytest.raises(ValueError, match=r"shape \(2, 3\), whose dim 1 .* into 4 chunks"):
        step(state, (ids[:, :-1], ids[:, 1:]))


def test_sp_plan_errors():
    with pytest.raises(ValueError, match="vocab-parallel embedding"):
        _sp_step(Llama(CFG), llama_rules(CFG.head_dim, embedding=False))

    class Custom(Llama):  # a subclass may read lengths from hidden states: not assumed safe
        pass

    with pytest.raises(ValueError, match="supports_sequence_parallel"):
        _sp_step(Custom(CFG))
    Custom.supports_sequence_parallel = True
    _sp_step(Custom(CFG))  # declared: accepted

    # The classic bug guarded: a replicated leaf inside a region sees the whole sequence.
    model = Llama(CFG)
    model.layers[1].mlp.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"replicated parameter layers\.1\.mlp\.scale"):
        _sp_step(model)


def test_sp_region_guards():
    # On a 1-rank mesh the collectives are identities, so the region's checks run alone.
    mesh = DeviceMesh.virtual(rank=0, tp=1)
    batch = _batches(12)[0]
    model = Llama(CFG)
    mlp = model.layers[0].mlp
    # Something after the row-split linear would run on partial sums.
    mlp.forward = lambda x: 2 * mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    step, state = _sp_step(model, mesh=mesh)
    with pytest.raises(ValueError, match="must return the output of its row-split linear"):
        step(state, batch)
    # A column-split linear fed something other than the gathered input.
    mlp.forward = lambda x: mlp.down_proj(F.silu(mlp.gate_proj(x * 2)) * mlp.up_proj(x))
    step, state = _sp_step(model, mesh=mesh)
    with pytest.raises(ValueError, match="must be called on its region"):
        step(state, batch)
    del mlp.forward
    step, state = _sp_step(model, mesh=mesh)
    step(state, batch)  # the model's own forward passes both checks
