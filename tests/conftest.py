import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, tiny): the error relative to the reference's scale."""
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    scale = b.abs().max().clamp_min(torch.finfo(b.dtype).tiny)
    return float((a - b).abs().max() / scale) if b.numel() else 0.0
