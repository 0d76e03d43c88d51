#!/usr/bin/env bash
# One device run for the attention kernels: GPU tests, then the kernel benchmark (with the launch
# configuration sweep unless NO_SWEEP=1). Logs and JSON go to $OUT (default .out/).
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/kernels/test_paged_attention.py tests/kernels/test_small_ops.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
sweep=--sweep
[ "${NO_SWEEP:-0}" = 1 ] && sweep=
python3 -m sparseserve.bench.kernels --json "$OUT/bench_kernels.json" $sweep 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "pytest rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc || bench_rc ))
