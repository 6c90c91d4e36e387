import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def interpret(monkeypatch):
    """``TRITON_INTERPRET=1`` for one test: Triton kernels built in it run in Triton's CPU
    interpreter (they are cached apart from compiled ones, funcpar.kernels._launch.lazy_kernels)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, tiny): the error relative to the reference's scale."""
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    scale = b.abs().max().clamp_min(torch.finfo(b.dtype).tiny)
    return float((a - b).abs().max() / scale) if b.numel() else 0.0
