#!/usr/bin/env bash
# Command groups side by side on one multi-GPU host, one GPU each, so that configs compared in a table ran in the
# same call (the device time of one config, not of all). Each argument is "GPUS|TAG|CMD": CMD runs under bash with
# CUDA_VISIBLE_DEVICES=GPUS, PORT=8200+first GPU, OUT=$OUT/TAG, LOGS=$OUT/TAG/logs, LADDER=0 and DEADLINE (epoch s,
# TOTAL_S after the start); `left` prints the seconds to it (for gpu_serve_check.sh's BUDGET_S). Its output goes to
# $OUT/TAG/run.log; at the end the servers' logs are cut to their tails and $OUT packed into $OUT/side_by_side.tgz
# (the device tool brings back few files). The servers share the host's CPUs and PCIe: say so beside the numbers.
# SHAPES: the model_dir presets written to /tmp/SHAPE first (default "mha7b gqa8b"; empty: none).
#
#   D='SHAPE=mha7b WORKLOAD=longbench FIXED_OUTPUT=1 OUTPUT_LEN=1024 RATES=inf N=48'
#   bash scripts/gpu_side_by_side.sh "0|dense|$D BUDGET_S=\$(left) bash scripts/gpu_serve_check.sh dense" \
#     "1|layerseg|$D OFFLOAD_FLAGS='--host-kv-memory 90GB' BUDGET_S=\$(left) bash scripts/gpu_serve_check.sh layerseg_async"
#   bash scripts/gpu_side_by_side.sh "0|dt|python3 -m benchmarks.decode_time --model mha7b --configs dense --json \$OUT/dt.json"
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
[ -d .data/haystack ] && export SPARSESERVE_DATA_DIR=${SPARSESERVE_DATA_DIR:-$PWD/.data}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpus.txt"
T0=$(date +%s); export DEADLINE=$(( T0 + ${TOTAL_S:-550} ))
for s in ${SHAPES-mha7b gqa8b}; do  # the shapes' config directories once, before the groups race for them
  [ -f /tmp/$s/config.json ] || python3 -m benchmarks.model_dir --preset $s --embedded-vocab --config-only \
    --out /tmp/$s >/dev/null
done
pids=()
for g in "$@"; do
  IFS='|' read -r gpus tag cmd <<<"$g"
  dir=$OUT/$tag; mkdir -p "$dir"
  ( export CUDA_VISIBLE_DEVICES=$gpus PORT=$(( 8200 + ${gpus%%,*} )) OUT=$dir LOGS=$dir/logs LADDER=0
    bash -c "left() { echo \$(( DEADLINE - \$(date +%s) )); }; $cmd" >"$dir/run.log" 2>&1
    echo "== $tag (GPUs $gpus): rc=$? at $(( $(date +%s) - T0 )) s" ) &
  pids+=($!)
done
wait "${pids[@]}"
for tag_dir in "$OUT"/*/; do
  echo "######## $tag_dir"
  grep -E "^== |rate=|ttft_ms|tpot_ms|passed|failed|^ *[a-z_]+ +[0-9.]+ " "$tag_dir/run.log" | head -30
  for f in "$tag_dir"/logs/*.log; do [ -f "$f" ] && { tail -60 "$f" >"$f.tail"; rm "$f"; }; done
done
(cd "$OUT" && tar czf /tmp/side_by_side.tgz --exclude side_by_side.tgz . && mv /tmp/side_by_side.tgz .)
