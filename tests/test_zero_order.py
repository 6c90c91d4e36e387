"""funcpar.meta.zero_order: the antithetic Gaussian-smoothing estimate of a quadratic's
gradient lies within 4 standard errors of the true one, and is deterministic given the seed."""

from __future__ import annotations

import torch

from funcpar.meta import zero_order

D = torch.float64


def _quadratic():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(5, 5, generator=g, dtype=D)
    a = m @ m.T + torch.eye(5, dtype=D)
    params = {"x": torch.randn(3, generator=g, dtype=D), "y": torch.randn(2, generator=g,
                                                                           dtype=D)}

    def f(p, b):
        z = torch.cat([p["x"], p["y"]])
        return 0.5 * z @ a @ z + b @ z

    b = torch.randn(5, generator=g, dtype=D)
    z = torch.cat([params["x"], params["y"]])
    return f, params, b, a @ z + b


def test_zero_order_within_its_standard_error_and_deterministic():
    f, params, b, true = _quadratic()
    n = 400
    est = zero_order(f, params, b, num_samples=n, sigma=0.1,
                     generator=torch.Generator().manual_seed(7))
    est = torch.cat([est["x"], est["y"]])
    gen = torch.Generator().manual_seed(7)
    singles = torch.stack([torch.cat(list(zero_order(f, params, b, num_samples=1, sigma=0.1,
                                                     generator=gen).values()))
                           for _ in range(n)])
    # The same draws in the same order: the n-sample estimate is the mean of the single ones
    # (to rounding of the summation order), so the samples give its standard error.
    torch.testing.assert_close(est, singles.mean(0), rtol=1e-12, atol=1e-12)
    stderr = singles.std(0) / n**0.5
    # 4 standard errors: a false failure has probability ~6e-5 per coordinate under a normal
    # approximation (n = 400), and the seed is fixed, so the test is deterministic anyway.
    assert ((est - true).abs() <= 4 * stderr).all(), ((est - true) / stderr)
    again = zero_order(f, params, b, num_samples=n, sigma=0.1,
                       generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([again["x"], again["y"]]), est)
