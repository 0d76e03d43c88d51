#!/usr/bin/env bash
# The one command run on the device machine: train the test model, save it under $OUT, evaluate it.
# The essays travel in .out/data/haystack (name .out/data in the run's `carry`):
#   mkdir -p .out/data && cp -r ../shared/data/haystack .out/data/
# Extra arguments go to scripts/train_test_model.py (e.g. --resume .out/prev --steps 600).
set -euo pipefail
OUT=${OUT:-.out/run}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
date -u
python3 scripts/train_test_model.py --data-dir .out/data/haystack --out "$OUT" --time-limit 7.0 "$@"
