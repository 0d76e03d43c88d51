#!/usr/bin/env bash
# One device run for sparse prefill (SALE): GPU tests of the kernels and the engine path, then the benchmarks:
# one Llama-3.1-8B layer at 16K-128K (dense Triton prefill, SDPA flash, SALE selection + block-sparse attention)
# and the TTFT of one 128K prompt end to end (random bf16 weights). Logs and JSON go to $OUT.
# Usage: scripts/gpu_sparse_prefill_check.sh [tests|layer|ttft|accuracy|all]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/llama8b/config.json ] || python3 -m benchmarks.model_dir --config-only --out /tmp/llama8b >/dev/null
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest tests/kernels tests/attention/test_prefill.py tests/engine/test_engine_sparse_prefill.py -q -rs \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_sparse_prefill.log" | tail -15
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$what" = layer ] || [ "$what" = all ]; then
  python3 -m benchmarks.sparse_prefill --output "$OUT/sparse_prefill_layer.json" 2>&1 | tee "$OUT/layer.log" \
    | tail -60
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$what" = ttft ] || [ "$what" = all ]; then
  python3 -m sparseserve calibrate /tmp/llama8b --prefill --load-format dummy --dtype bfloat16 --random-prompts \
    --lengths 16384 --num-samples 1 --out "$OUT/cal8b.json" 2>&1 | tail -3
  python3 -m benchmarks.sparse_prefill_e2e ttft /tmp/llama8b --load-format dummy --dtype bfloat16 \
    --context 131072 --thresholds 0.01 0.1 --calibration "$OUT/cal8b.json" --repeats 2 \
    --output "$OUT/ttft128k.json" 2>&1 | grep -v Processed | tail -20
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$what" = accuracy ]; then
  python3 -m sparseserve calibrate --prefill --lengths 16384 --num-samples 2 --out "$OUT/cal_emb.json" 2>&1 | tail -3
  python3 -m benchmarks.sparse_prefill_e2e accuracy --lengths 16384,32768 --num-samples 20 \
    --thresholds 0.001 0.01 0.1 --calibration "$OUT/cal_emb.json" --output "$OUT/acc_sale.json" 2>&1 | tail -25
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit $rc
