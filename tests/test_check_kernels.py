"""benchmarks/check_kernels.py (issue 9's GPU correctness check as one command) runs and passes
under Triton's CPU interpreter on its quick trees, so a GPU session finds it working."""

import subprocess
import sys
from pathlib import Path

import pytest
from _kernel_helpers import needs_triton

ROOT = Path(__file__).resolve().parents[1]


@needs_triton
@pytest.mark.slow  # 15-23 s; each kernel's interpreter cases run by default elsewhere
def test_check_kernels_script_passes_in_the_interpreter():
    # A subprocess: the script sets TRITON_INTERPRET before Triton is first imported.
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "check_kernels.py"), "--device", "cpu",
         "--quick", "--steps", "1", "--only", "came"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines()[2:] if line.endswith(" ok")]
    # came (the batched factored passes; the elementwise kernels have their own interpreter
    # tests) x 2 trees x {float32, bfloat16} x {apply, update}
    assert len(rows) == 8, out.stdout
    assert "0 out of bounds" in out.stdout
