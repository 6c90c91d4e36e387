#!/usr/bin/env bash
# Issue 16's GPU measurements in one device call: peak CUDA memory per parameter (the 58 M
# Llama, plain PyTorch vs funcpar undonated / donated / optimizer in the backward), end-to-end
# tokens/s of the 271 M Llama (preset h100: torch eager and compiled against funcpar's donated
# eager and whole-step compiled steps) and the optimizer steps of the 888 M parameter set.
#
#     bash benchmarks/gpu_issue16.sh                 # memory,train (~2 min on an H200)
#     bash benchmarks/gpu_issue16.sh optim           # the optimizer steps (~2 min), a 2nd call
#     LIMIT_kernels=150 bash benchmarks/gpu_issue16.sh kernels,compile   # 2026-11-28: each >60/110 s
#     SMOKE=1 bash benchmarks/gpu_issue16.sh kernels,memory,train,compile,optim   # CPU, tiny sizes
#
# Parts: kernels (check_kernels.py: every Triton kernel against its reference, compiled for the
# GPU), memory, train (the eager steps), compile (the compiled steps, a separate run so that a
# slow compile cannot cost the eager rows), optim. Each part runs under its own time limit
# (LIMIT_<part> seconds overrides it) and writes its whole output to $OUT/<part>.txt
# (default ./gpu_out); the console gets each part's exit code and last lines. A part that
# fails or runs out of time does not stop the next. Needs torch (CUDA), optree, jaxtyping and
# tensorboard: the device machine's own Python has them, beartype and datasets are not needed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_out}"
mkdir -p "$out"
parts="${1:-memory,train}"

if [[ -n "${SMOKE:-}" ]]; then
    dev=(--device cpu)
    memory=(--small --optims adamw --variants plain,donate_on)
    train=(--preset tiny --precision fp32 --optims adamw --variants torch-eager,funcpar-donate
           --steps 1 --reps 1 --warmup 1)
    compile=(--preset tiny --precision fp32 --optims adamw
             --variants torch-compile,funcpar-compile-donate --steps 1 --reps 1 --warmup 1)
    kernels=(--quick)
    optim=(--preset tiny --only adamw --donate --steps 1 --reps 1)
else
    dev=(--device cuda)
    memory=(--optims adamw,adafactor)
    train=(--preset h100 --optims adamw --steps 5 --reps 3 --nominal-tflops 989
           --variants torch-eager,funcpar-donate)
    compile=(--preset h100 --optims adamw --steps 5 --reps 3 --nominal-tflops 989
             --variants torch-compile,funcpar-compile-donate)
    kernels=()
    optim=(--preset h100 --only adamw,adafactor,came,lamb --donate --reps 3)
fi

run() {  # run NAME LIMIT_S COMMAND...
    local name=$1 var="LIMIT_$1"
    local limit=${!var:-$2}
    shift 2
    echo "== $name ($(date +%T), limit ${limit} s): $*"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "== $name: exit $? at $(date +%T)"
    tail -n 12 "$out/$name.txt"
}

{
    python -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm \
        --format=csv,noheader
    date -u
} >"$out/device.txt" 2>&1
cat "$out/device.txt"

export PYTHONUNBUFFERED=1  # a part stopped at its limit still leaves what it printed
[[ ,$parts, == *,kernels,* ]] && run kernels 110 python benchmarks/check_kernels.py "${dev[@]}" \
    "${kernels[@]}"
[[ ,$parts, == *,train,* ]] && run train 330 python benchmarks/bench_train.py "${dev[@]}" \
    "${train[@]}"
[[ ,$parts, == *,compile,* ]] && run compile 150 python benchmarks/bench_train.py "${dev[@]}" \
    "${compile[@]}"
[[ ,$parts, == *,memory,* ]] && run memory 150 python benchmarks/bench_memory.py "${dev[@]}" \
    "${memory[@]}"
[[ ,$parts, == *,optim,* ]] && run optim 150 python benchmarks/bench_optim.py "${dev[@]}" \
    "${optim[@]}"
exit 0
