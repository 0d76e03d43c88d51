#!/usr/bin/env bash
# The one command run on the device machine.
#   bash scripts/gpu_train.sh [train] [ARGS...]   train the test model, save it under $OUT, evaluate it
#                                                 in transformers (ARGS go to scripts/train_test_model.py)
#   bash scripts/gpu_train.sh eval [MODEL_DIR]    the accuracy harness in the engine (dense) with
#                                                 transformers parity, JSON under $OUT
#   bash scripts/gpu_train.sh harness ARGS...     one harness run with ARGS (JSON: $OUT/acc.json)
# The essays travel in .out/data/haystack (name .out/data, and for eval the model dir, in `carry`):
#   mkdir -p .out/data && cp -r ../shared/data/haystack .out/data/
set -euo pipefail
OUT=${OUT:-.out/run}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
date -u
mode=train
if [[ "${1:-}" == "train" || "${1:-}" == "eval" || "${1:-}" == "harness" ]]; then mode=$1; shift; fi
if [[ $mode == train ]]; then
    python3 scripts/train_test_model.py --data-dir .out/data/haystack --out "$OUT" --time-limit 7.0 "$@"
    exit
fi
if [[ $mode == harness ]]; then
    python3 -m sparseserve.bench.accuracy --data-dir .out/data/haystack --output "$OUT/acc.json" "$@"
    exit
fi
model=${1:-.out/trained_model}
acc="python3 -m sparseserve.bench.accuracy $model --data-dir .out/data/haystack --device cuda --compare-hf --quiet"
# The targets (passkey, niah_single at 4K-16K), eagerly with the attention probe ...
timeout 280 $acc --lengths 4096,8192,16384 --num-samples 50 --tasks passkey,niah_single \
    --probe-steps 4 --probe-samples 2 --output "$OUT/acc_main.json" || echo "main run failed: $?"
# ... then every task up to 32K (CUDA graphs on: no probe).
timeout 250 $acc --lengths 4096,8192,16384,32768 --num-samples 20 --probe-steps 0 \
    --output "$OUT/acc_all.json" || echo "all-task run failed: $?"
