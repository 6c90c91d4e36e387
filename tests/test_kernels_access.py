"""Full tiles in 16-byte vectors (funcpar.kernels._access): the AdamW, SGD and Lamb kernels
compile their body twice, unmasked with aligned addresses for a full tile of an aligned launch,
masked otherwise. Both bodies are run here (Triton's CPU interpreter, block 16 so that most
tiles are full) and must give what the reference gives: on fresh tensors (aligned: full tiles
take the vector body) and on views one element into their storage (unaligned: every tile takes
the masked body). Tolerances are the kernels' own tests' (1e-6, float32)."""

from __future__ import annotations

import torch
from _kernel_helpers import check_outputs, needs_triton

from funcpar.kernels import _launch
from funcpar.kernels.adamw import AdamWScalars, adamw_reference, adamw_triton
from funcpar.kernels.lamb import (
    LambScalars,
    lamb_moments_reference,
    lamb_moments_triton,
    lamb_update_reference,
    lamb_update_triton,
)
from funcpar.kernels.sgd import SGDScalars, sgd_reference, sgd_triton

SHAPES = [(50,), (3, 16), (5,), (33, 3)]
DECAY = [True, False, True, True]
TOL32 = 1e-6


def _leaves(seed, *, aligned, positive=False):
    """Leaves of SHAPES; unaligned ones start one float32 (4 bytes) into their storage."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in SHAPES:
        n = torch.Size(s).numel()
        flat = torch.randn(n + 1, generator=g)
        flat = flat.abs() if positive else flat
        out.append((flat[:n] if aligned else flat[1:]).view(s))
    return out


def test_leaf_group_alignment():
    group = _launch.LeafGroup(torch.device("cpu"), 16)
    group.add(0, True, torch.zeros(40), torch.zeros(40))
    assert group.aligned
    group.add(1, True, torch.zeros(41)[1:], None)
    assert not group.aligned


@needs_triton
def test_vector_and_masked_bodies_match_the_reference(interpret):
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    adam = AdamWScalars(f64(0.05), f64(0.3), f64(1e-8), f64(1e-3), 0.9, 0.999)
    sgd = SGDScalars(f64(0.05), f64(0.01), torch.tensor(False), 0.9, 0.1)
    lamb = LambScalars(0.9, 0.999, 0.1, f64(0.271), f64(0.003), f64(1e-6), f64(0.1),
                       f64(1 - 1e-3), True, True, False)
    coef = torch.rand(len(SHAPES), dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    for aligned in (True, False):
        g, p, m = (_leaves(i, aligned=aligned) for i in (1, 2, 3))
        v = _leaves(4, aligned=aligned, positive=True)
        assert all((x.data_ptr() % 16 == 0) == aligned for x in g)
        with _launch.poisoned_outputs():
            got = adamw_triton(g, p, m, v, [None] * 4, DECAY, adam, write_params=True, block=16)
            got_sgd = sgd_triton(g, p, m, DECAY, sgd, block=16)
            got_lamb = lamb_moments_triton(g, p, m, v, DECAY, lamb, block=16)
            got_upd = lamb_update_triton(p, m, v, DECAY, coef, lamb, block=16)
        want = adamw_reference(g, p, m, v, [None] * 4, DECAY, adam, write_params=True)
        for k, r in zip(got[:3], want[:3], strict=True):
            check_outputs(k, r, TOL32)
        for k, r in zip(got_sgd, sgd_reference(g, p, m, DECAY, sgd), strict=True):
            check_outputs(k, r, TOL32)
        want_lamb = lamb_moments_reference(g, p, m, v, DECAY, lamb)
        for k, r in zip(got_lamb[:2], want_lamb[:2], strict=True):
            check_outputs(k, r, TOL32)
        rel = ((got_lamb[2] - want_lamb[2]).abs() / want_lamb[2].abs().clamp_min(1e-30)).max()
        assert float(rel) <= TOL32
        check_outputs(got_upd, lamb_update_reference(p, m, v, DECAY, coef, lamb), TOL32)
