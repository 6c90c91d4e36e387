"""Tensor stores for offloading: pinned host memory and NVMe files (see :mod:`.store`)."""

from funcpar.offload.store import (
    BLOCK,
    CHECKSUMS,
    CpuStore,
    NvmeStore,
    StoreError,
    TensorStore,
    aligned_empty,
)

__all__ = ["BLOCK", "CHECKSUMS", "CpuStore", "NvmeStore", "StoreError", "TensorStore",
           "aligned_empty"]
