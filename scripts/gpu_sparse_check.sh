#!/usr/bin/env bash
# One device run for sparse decode: GPU tests (kernels vs references, CUDA-graph replay, engine sparse ==
# dense), then the speed benchmark: one layer at 128K / batch 8, and the decode step of a random-weight
# Llama-3.1-8B at 128K / batch 4 (needs an H200's memory). Logs and JSON go to $OUT.
# Usage: scripts/gpu_sparse_check.sh [tests|bench|all]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
what=${1:-all}
test_rc=0
if [ "$what" != bench ]; then
  python3 -m pytest tests/kernels/test_sparse_kernels.py tests/kernels/test_topp_prune.py tests/attention -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
  test_rc=${PIPESTATUS[0]}
fi
bench_rc=0
if [ "$what" != tests ]; then
  [ -f /tmp/cfg8b/config.json ] || python3 -m benchmarks.model_dir --config-only --out /tmp/cfg8b
  python3 -m benchmarks.sparse --kernel --step /tmp/cfg8b --json "$OUT/bench_sparse.json" 2>&1 \
    | grep -v "Processed prompts" | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi
echo "pytest rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc || bench_rc ))
