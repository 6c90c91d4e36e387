"""Fused optimizer-step kernels (Triton) and the dispatch between them and plain-torch references.

See :mod:`funcpar.kernels.dispatch` for how an implementation is chosen.
"""

from funcpar.kernels.dispatch import (
    MODES,
    current_mode,
    kernel_mode,
    triton_available,
    use_kernels,
)

__all__ = ["MODES", "current_mode", "kernel_mode", "triton_available", "use_kernels"]
