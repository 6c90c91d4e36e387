"""funcpar: a functional, stateless trainer for PyTorch built on torch.func."""

from funcpar import typecheck  # noqa: F401  (named by the jaxtyping import hook as a path)

__version__ = "0.1.0"
