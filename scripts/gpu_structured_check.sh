#!/usr/bin/env bash
# Structured outputs' decode cost on the GPU (benchmarks/structured.py): Llama-3.1-8B shapes, dummy bf16 weights, a
# batch of BATCH (32) with none, one and every request JSON-constrained, sync and async scheduling. The target: one
# constrained request of 32 keeps >= 0.9x the unconstrained batch's throughput (throughput_vs_free of "one").
# Needs llguidance: carry .whl with its wheel (llguidance-*-abi3-manylinux*.whl, no dependencies).
#   bash scripts/gpu_structured_check.sh            # results in $OUT/structured.json
#   INPUT_LEN=8192 OUTPUT_LEN=128 bash scripts/gpu_structured_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BATCH=${BATCH:-32}; INPUT_LEN=${INPUT_LEN:-1024}; OUTPUT_LEN=${OUTPUT_LEN:-256}; REPEATS=${REPEATS:-3}
if ! python3 -c "import llguidance" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_llg \
    .whl/llguidance-*.whl || exit 1
  export PYTHONPATH=/tmp/site_llg:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m benchmarks.structured 8b --batch "$BATCH" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
  --repeats "$REPEATS" --json "$OUT/structured.json" 2>&1 | grep -v Warning | tail -20
exit "${PIPESTATUS[0]}"
