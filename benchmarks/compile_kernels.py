"""Compile every Triton kernel an optimizer step launches for an NVIDIA GPU, without one.

Each optimizer of benchmarks/check_kernels.py takes one step on CPU tensors (float32 and, where
its kernels take them, bfloat16 parameters) with ``kernel_mode("triton")`` inside
:func:`funcpar.testing.triton_aot.compile_only`: every launch is compiled for ``sm_<arch>``
(90: H100/H200) by Triton's own toolchain and not run. Printed per distinct kernel
specialisation: warps, registers per thread, local memory per thread (> 0: spills), shared
memory, and the vectorized (16/8-byte) vs scalar global loads and stores in its PTX.

Exit status 1 when a kernel fails to compile or spills (``--allow-spills`` reports spills
without failing). Usage::

    python benchmarks/compile_kernels.py                 # sm_90
    python benchmarks/compile_kernels.py --arch 80 --only adamw,lamb

Results and speed need the GPU: benchmarks/check_kernels.py and benchmarks/bench_optim.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_kernels, beside this file

# Leaves that give every kernel both full and partial tiles, factored and unfactored leaves,
# and a 3-D one.
SHAPES = {"v": (7,), "n": (1300,), "w": (33, 17), "cube": (3, 5, 7), "m": (256, 300)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    ap.add_argument("--only", default="", help="comma-separated optimizer names")
    ap.add_argument("--allow-spills", action="store_true")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: compiled kernels
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

    import check_kernels

    import funcpar.optim as fo
    from funcpar.kernels import kernel_mode, triton_available
    from funcpar.testing.triton_aot import compile_only, inspect_kernel

    if not triton_available():
        print("Triton is not installed: nothing to compile")
        return 1
    chosen = check_kernels.optimizers()
    only = [x for x in args.only.split(",") if x]
    if set(only) - set(chosen):
        ap.error(f"--only: unknown {sorted(set(only) - set(chosen))}; known: {sorted(chosen)}")
    failures, seen = [], {}
    for name, make in chosen.items():
        if only and name not in only:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.bfloat16 and name not in check_kernels.BF16:
                continue
            gen = torch.Generator().manual_seed(0)
            params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}
            grads = {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}
            opt = make()
            state = opt.init(params)
            with kernel_mode("triton"), compile_only(args.arch) as kernels:
                try:
                    fo.update_params(opt, grads, state, params)
                except Exception as err:  # a kernel that does not compile, say
                    failures.append(f"{name} {dtype}: {type(err).__name__}: {err}"[:2000])
            for k in kernels:
                seen.setdefault((k.name, k.hash), (name, str(dtype).removeprefix("torch."),
                                                   inspect_kernel(k)))
    print(f"sm_{args.arch}, Triton compiled {len(seen)} kernel specialisations")
    print(f"{'optimizer':16} {'dtype':9} {'kernel':26} {'warps':>5} {'regs':>4} {'local B':>7} "
          f"{'smem B':>7} {'ld vec/scalar':>13} {'st vec/scalar':>13}")
    for optim, dtype, k in seen.values():
        print(f"{optim:16} {dtype:9} {k.name:26} {k.num_warps:5} {k.registers:4} "
              f"{k.local_bytes:7} {k.shared_bytes:7} {k.vector_loads:>6}/{k.scalar_loads:<6} "
              f"{k.vector_stores:>6}/{k.scalar_stores:<6}")
        if k.spills and not args.allow_spills:
            failures.append(f"{optim} {dtype}: {k.name} spills ({k.local_bytes} B per thread "
                            f"of local memory at {k.registers} registers)")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
