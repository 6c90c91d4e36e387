"""Compile funcpar's Triton kernels for a GPU on a machine without one, and inspect the result.

Triton compiles ahead of time for any NVIDIA target from its own toolchain (LLVM to PTX,
the bundled ``ptxas`` to a cubin); only *launching* needs a driver and a device. Inside
:func:`compile_only`, every kernel an optimizer step launches is compiled for ``sm_<arch>``
instead of run: Triton's active driver is replaced by one that names the target and nothing
else, launches become Triton's ``warmup`` (compile, cache, return), and funcpar's dispatcher is
told the kernels may run on the step's CPU tensors. The step's host code then goes on with
uninitialised outputs, which is fine: only the compiled kernels are of interest.

What this checks that Triton's CPU interpreter cannot: that each kernel *compiles* for the GPU
(types, constexprs, layouts: errors the interpreter, which runs the Python body on numpy,
never meets), its registers and whether it spills to local memory, its shared memory, and
whether its global loads and stores are vectorized (``ld.global.v4``: 16-byte accesses, what a
bandwidth-bound kernel needs; scalar 4-byte accesses cost instructions and issue slots).
Resource usage comes from the cubin through the bundled ``cuobjdump``.

Not checked (needs the GPU): results and speed. benchmarks/check_kernels.py and
benchmarks/bench_optim.py do those where a GPU is lent.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CompiledInfo", "compile_only", "inspect_kernel"]


class _TargetOnlyDriver:
    """As much of Triton's CUDA driver as compiling needs: a device index, a stream handle and
    the target. Launching through it fails (there is no launcher)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


@dataclass
class CompiledInfo:
    """One compiled kernel specialisation."""

    name: str
    num_warps: int
    registers: int  # per thread
    local_bytes: int  # per thread: > 0 means spills (or a stack frame)
    shared_bytes: int
    vector_loads: int  # ld.global.v2 / .v4 instructions in the PTX
    scalar_loads: int
    vector_stores: int
    scalar_stores: int

    @property
    def spills(self) -> bool:
        return self.local_bytes > 0


def _count(ptx: str, op: str) -> tuple[int, int]:
    """(vector, scalar) global ``op`` (``ld`` / ``st``) instructions in ``ptx``."""
    lines = re.findall(rf"^\s*(?:@%p\d+\s+)?{op}\.global\S*", ptx, flags=re.M)
    vector = sum(1 for x in lines if re.search(r"\.v[24]\b", x))
    return vector, len(lines) - vector


def _tool(name: str) -> str:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = str(bundled) if bundled.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found (it ships with Triton's NVIDIA backend)")
    return found


def inspect_kernel(kernel: Any) -> CompiledInfo:
    """Registers, local and shared memory (from the cubin) and vectorized global accesses
    (from the PTX) of a Triton ``CompiledKernel``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin],
                             capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    ptx = kernel.asm["ptx"]
    vl, sl = _count(ptx, "ld")
    vs, ss = _count(ptx, "st")
    return CompiledInfo(
        name=kernel.name, num_warps=kernel.metadata.num_warps,
        registers=int(fields.get("REG", 0)),
        local_bytes=int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
        shared_bytes=max(int(fields.get("SHARED", 0)), kernel.metadata.shared),
        vector_loads=vl, scalar_loads=sl, vector_stores=vs, scalar_stores=ss)


@contextlib.contextmanager
def compile_only(arch: int = 90) -> Iterator[list[Any]]:
    """Inside: funcpar's kernels compile for ``sm_<arch>`` instead of running (see the module
    docstring); yields the list the ``CompiledKernel`` s are appended to, one per launch.

    Use with ``funcpar.kernels.kernel_mode("triton")`` around optimizer steps on CPU tensors,
    with ``TRITON_INTERPRET`` unset (kernels built under the interpreter are Python, not
    compiled; funcpar keeps the two kinds apart).
    """
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from funcpar.kernels import dispatch

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_only: unset TRITON_INTERPRET (interpreted kernels do not "
                           "compile)")
    compiled: list[Any] = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    real_interpreting = dispatch._interpreting
    real_driver = driver._active  # None until first used: reset_active would build
    driver.set_active(_TargetOnlyDriver(arch))  # the default, which needs a GPU
    JITFunction.run = run
    dispatch._interpreting = lambda: True  # let kernel_mode("triton") take CPU tensors
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        dispatch._interpreting = real_interpreting
        driver._active = real_driver
