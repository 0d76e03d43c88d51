#!/usr/bin/env bash
# One device run for KV offload: GPU tests (FlashH2D, write-through, FlashD2H, the offloaded
# sparse decode through the pool and in a CUDA graph, engine offload on == off), then the benchmarks:
# transfers (FlashH2D vs one large pinned copy vs a per-block loop; FlashD2H vs per-block copies), the
# 32K prefill with and without saving, and capacity/throughput at a 40 GB cap (Llama-3.1-8B config,
# random weights). Logs and JSON go to $OUT.
# Usage: scripts/gpu_offload_check.sh [tests|transfers|capacity|all]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; grep MemAvailable /proc/meminfo
[ -f /tmp/cfg8b/config.json ] || python3 -m benchmarks.model_dir --config-only --out /tmp/cfg8b >/dev/null
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest tests/kernels/test_flash_h2d.py tests/kernels/test_pool_plan.py tests/kvcache -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_offload.log" | tail -15
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$what" = transfers ] || [ "$what" = all ]; then
  python3 -m benchmarks.offload --transfers --prefill /tmp/cfg8b --json "$OUT/offload_transfers.json" 2>&1 \
    | grep -v "Processed prompts" | tee "$OUT/offload_transfers.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$what" = capacity ] || [ "$what" = all ]; then
  python3 -m benchmarks.offload --capacity /tmp/cfg8b ${CAPACITY_ARGS:-} --json "$OUT/offload_capacity.json" \
    2>&1 | grep -v "Processed prompts" | tee "$OUT/offload_capacity.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit $rc
