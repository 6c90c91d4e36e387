"""Every Triton kernel compiles for an H100 (sm_90) on this GPU-less machine, without spilling
registers to local memory (benchmarks/compile_kernels.py; funcpar.testing.triton_aot):
the compile errors the CPU interpreter cannot see (it runs the kernels' Python on numpy) and
the register pressure that would cost a bandwidth-bound kernel its occupancy."""

import subprocess
import sys
from pathlib import Path

import pytest
from _kernel_helpers import needs_triton

ROOT = Path(__file__).resolve().parents[1]


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@needs_triton
@pytest.mark.skipif(not _ptxas_available(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm90_without_spills():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_kernels.py"), "--arch", "90"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    names = {r[2] for r in rows}
    assert {"sgd_kernel", "adamw_kernel", "lamb_moments_kernel", "lamb_update_kernel",
            "adam8bit_kernel", "_sq_sums_kernel", "_norm_kernel", "_came_res_kernel",
            "_apply_kernel", "_segsum_kernel"} <= names, out.stdout
    # The elementwise kernels' full tiles read and write in 16-byte vectors
    # (funcpar.kernels._access); columns: ... ld vector/scalar, st vector/scalar.
    for r in rows:
        if r[2] in ("sgd_kernel", "adamw_kernel", "lamb_moments_kernel", "lamb_update_kernel"):
            loads, stores = (int(x.split("/")[0]) for x in r[-2:])
            assert loads > 0 and stores > 0, (r, out.stdout)
