"""funcpar: a functional, stateless trainer for PyTorch built on torch.func."""

__version__ = "0.1.0"
