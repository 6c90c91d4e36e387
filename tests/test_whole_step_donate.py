"""compile=True with donate=True: the whole-step region writes the new state into the input
leaves itself (funcpar/train/whole_step.py ``_into``: a traced input mutation), so the
compiled update lands in the donated storage.

Reference: the same compiled step undonated, same state and batches, the ``eager`` backend
(dynamo captures the traced graph, no code generation). The donating graph is the same graph
plus one ``copy_`` per leaf, so the results must be bit-identical (as donation promises);
an fp16 skipped step must leave the donated storage's values exactly as they were. That
comparison is slow (two compiled steps); the default test checks the region alone on a small
function.
"""

from __future__ import annotations

import pytest
import torch
from test_compile_step import _fresh, _region_ran_once  # the tests' dir is on sys.path

from funcpar.models import Llama, LlamaConfig, lm_loss
from funcpar.optim import adamw, chain, clip_by_global_norm
from funcpar.state import functionalize, init_state
from funcpar.state.donation import is_donated
from funcpar.state.tree import tree_flatten
from funcpar.train import make_train_step
from funcpar.train.whole_step import WholeStep
from funcpar.transforms import amp_cast


def _loss(out, targets):  # a factor carried by the batch: inf poisons one step's gradients
    tokens, factor = targets
    return lm_loss(out, tokens) * factor


def _batches():
    # Inputs and targets are strided slices of one token tensor, as in language modelling: the
    # donating trace runs on copies, which must keep the strides its views were traced for.
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(4)]
    return [(x[:, :-1], (x[:, 1:], torch.tensor(float("inf") if i == 2 else 1.0)))
            for i, x in enumerate(xs)]


def _run(donate):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8))
    apply_fn, params, buffers = functionalize(model)
    opt = chain(clip_by_global_norm(0.5), adamw(lr=1e-2))
    step = make_train_step(apply_fn, _loss, opt, compile=True, donate=donate)
    step, state = amp_cast("fp16")(step, init_state(params, buffers, opt))
    states, skipped = [], []
    for b in _batches():
        before = state
        ptrs = [t.data_ptr() for t in tree_flatten((before.params, before.opt_state))[0]
                if torch.is_tensor(t)]
        values = [t.clone() for t in tree_flatten(before.params)[0]]
        state, m = step(state, b)
        skipped.append(bool(m["skipped"]))
        after = [t.data_ptr() for t in tree_flatten((state.params, state.opt_state))[0]
                 if torch.is_tensor(t)]
        states.append((after == ptrs, all(is_donated(t) for t in tree_flatten(before.params)[0]),
                       values))
    return step, state, states, skipped


def test_donating_region_writes_into_its_inputs(monkeypatch):
    """WholeStep(donate=True) on a small step: the new params and state land in the input
    tensors (same storage, the values of the undonated region), the trace itself (which runs
    on copies) leaves them alone, and a strided batch slice keeps working after the trace."""
    _fresh("eager", monkeypatch)

    def core(params, buffers, opt_state, batch, extras):
        (x,) = batch
        g = x.reshape(-1)[:3].float()  # a view where x's strides allow it
        return ({"w": params["w"] - g}, buffers, {"m": opt_state["m"] + g}, g.sum(), None, None)

    tokens = torch.arange(12.0).reshape(3, 4)
    args = lambda: ({"w": torch.ones(3)}, {}, {"m": torch.zeros(3)}, (tokens[:, 1:],), None)  # noqa: E731
    ref = WholeStep(core)(*args())
    params, buffers, opt_state, batch, extras = args()
    w, m = params["w"], opt_state["m"]
    region = WholeStep(core, donate=True)
    region.graph(params, buffers, opt_state, batch, extras)  # traced: inputs untouched
    assert torch.equal(w, torch.ones(3)) and torch.equal(m, torch.zeros(3))
    got = region(params, buffers, opt_state, batch, extras)
    assert got[0]["w"].data_ptr() == w.data_ptr() and got[2]["m"].data_ptr() == m.data_ptr()
    assert torch.equal(w, ref[0]["w"]) and torch.equal(m, ref[2]["m"])


@pytest.mark.slow
def test_donated_whole_step_in_place_and_bit_identical(monkeypatch):
    _fresh("eager", monkeypatch)
    _, ref, _, ref_skipped = _run(False)
    _fresh("eager", monkeypatch)
    step, got, states, skipped = _run(True)
    _region_ran_once(step)
    assert skipped == ref_skipped == [False, False, True, False]
    for i, (same_storage, consumed, _) in enumerate(states):
        assert same_storage and consumed, i  # written into the input, the input consumed
    _, _, before_skip = states[2]
    _, _, after_skip = states[3]
    for a, b in zip(before_skip, after_skip):  # the skipped step left the values as they were
        assert torch.equal(a, b)
    for x, y in zip(tree_flatten((got.params, got.opt_state, got.extras))[0],
                    tree_flatten((ref.params, ref.opt_state, ref.extras))[0], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
