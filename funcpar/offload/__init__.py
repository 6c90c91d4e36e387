"""Tensor stores for offloading: pinned host memory and NVMe files (see :mod:`.store`)."""

from funcpar.offload.store import BLOCK, CpuStore, NvmeStore, StoreError, TensorStore

__all__ = ["BLOCK", "CpuStore", "NvmeStore", "StoreError", "TensorStore"]
