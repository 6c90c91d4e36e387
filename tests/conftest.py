# Every annotated function of funcpar is type-checked during the tests (shapes and dtypes by
# jaxtyping, the rest by beartype): the hook must be in place before the first funcpar import.
from funcpar.typecheck_hook import install_import_hook

install_import_hook("funcpar")

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (pytest -n 2): each takes one intra-op thread, and so do the
    # interpreters it starts, so that two workers never oversubscribe the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


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


@pytest.fixture
def float64_default():
    # torchopt computes Adam's bias corrections 1 - b^t from an integer count tensor, in the
    # default dtype: float64 makes its reference exact to float64 rounding.
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
