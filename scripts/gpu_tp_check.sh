#!/usr/bin/env bash
# Tensor parallelism on one multi-GPU host (device kinds nvidia-h100-x4 / nvidia-h200-x4; on 2 GPUs all but TP=4).
# Several modes in one call, run in the order given, each only if what is left of BUDGET_S (default 560 s: a device
# call ends at 600) covers its usual length; what cannot start says "skipped", and a mode runs under a timeout of
# what is left. Every ratio is against TP=1 (or the other config) in the same call (scripts/tp_bench.py).
#   tests     tests/distributed on 2 GPUs (NCCL, Triton, a CUDA graph per rank; the TP server: a killed rank, exit)
#   parity    Llama-3.1-8B shape with random weights: TP=2 vs TP=1 tokens and top-5 logprobs, bf16 and float32
#             (with 4 GPUs, `tests parity` run side by side: tests on GPUs 0-1, parity on 2-3)
#   step      Llama-3.1-8B shape decode step, batch 32 at 8K: TP=1, 2 and (4 GPUs) 4
#   capacity  sparse (topk 2048) + KV offload at 128K, 40 GB per GPU, CAPACITY_HOST_GB (72) of host store per rank
#             (it bounds the requests: a 128K one's KV is 17 GB at TP=1, so about 4), REQ1 (8) and REQ2 (16)
#             offered: TP=1 vs TP=2
#   serve     `sparseserve serve` under `sparseserve bench serve` (gpu_serve_check.sh; LongBench, SERVE_N requests
#             at SERVE_RATES req/s), dense and SparseServe mode, TP=1 then TP=SERVE_TP (default 2) of each
#   serve70b  Llama-3.1-70B shape, dummy bf16 weights: TP=4 (and TP=2 where each GPU has >= 120 GB), dense and
#             SparseServe mode, N70 requests
# SparseServe mode: topk 2048 + --kv-offload (working-set control included) + --layer-segmented-prefill
# + async scheduling (gpu_serve_check.sh's `layerseg_async`) at every TP.
#
# Usage (project root; carry .whl (the server's wheels) and .data (the haystack)):
#   bash scripts/gpu_tp_check.sh step tests parity      # then: serve70b; then: capacity serve
# Results in $OUT (tp_*.json, tp_tests.log, serve8b/ and serve70b/ with the servers' log tails, summary.txt), packed
# into one archive $OUT/$PACK (default tp_check.tgz; PACK= keeps the files). DRY_RUN=1 prints the commands only.
# NGPU and GPU_GB stand in for the GPUs (no nvidia-smi): with DRY_RUN, or for `serve` on CPU ranks with MODEL set to
# a small model and MAX_INPUT small (a check of the machinery on a machine without GPUs).
set -uo pipefail
# NVLink multicast stays off, also in every process this starts (docs/tensor_parallel.md).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-560}; DRY_RUN=${DRY_RUN:-0}; PACK=${PACK-tp_check.tgz}
# host KV store per rank (GB): capacity's, serve's and serve70b's, each lowered where the host's available memory
# cannot hold it for every rank (the engine refuses more; some hosts' memory starts small and grows with use)
SERVE_TP=${SERVE_TP:-2}; SERVE_N=${SERVE_N:-24}; SERVE_RATES=${SERVE_RATES:-1}; HOST_KV_GB=${HOST_KV_GB:-48}
CONFIGS=${CONFIGS:-dense sparseserve}  # serve's and serve70b's, in order (sparseserve: SparseServe mode)
N70=${N70:-16}; RATES70=${RATES70:-1}; HOST_KV70_GB=${HOST_KV70_GB:-32}; CAPACITY_HOST_GB=${CAPACITY_HOST_GB:-72}
# the shortest time each mode needs to be worth starting (s); a mode that runs long is stopped at the budget
declare -A NEEDS=([tests]=200 [parity]=240 [step]=180 [capacity]=200 [serve]=240 [serve70b]=300)
[ $# -gt 0 ] || set -- tests
for m in "$@"; do
  [ -v "NEEDS[$m]" ] || { echo "unknown mode $m (modes: tests parity step capacity serve serve70b)"; exit 2; }
done
if [ "$DRY_RUN" != 1 ] && ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -d .data/haystack ] && export SPARSESERVE_DATA_DIR=${SPARSESERVE_DATA_DIR:-$PWD/.data}
if [ "$DRY_RUN" = 1 ] || [ -n "${NGPU:-}" ]; then
  NGPU=${NGPU:-4}; GPU_GB=${GPU_GB:-80}
else
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpus.txt"
  read -r NGPU GPU_GB < <(python3 -c "import torch, torch.distributed as d; n = torch.cuda.device_count(); \
print(n, int(torch.cuda.get_device_properties(0).total_memory / 1e9) if n else 0)")
  python3 -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'NCCL', d.is_nccl_available())"
  [ "$NGPU" -ge 2 ] || { echo "needs 2 or more CUDA GPUs ($NGPU visible)"; exit 2; }
fi
echo "$NGPU GPUs of $GPU_GB GB; modes: $*; budget $BUDGET_S s"
CONFIGS=${CONFIGS//sparseserve/layerseg_async}  # SparseServe mode, at every TP

left() { echo $(( START + BUDGET_S - $(date +%s) )); }
AVAIL_GB=$(awk '/MemAvailable/ {print int($2 / 1e6)}' /proc/meminfo)
host_gb() {  # host_gb WANT RANKS: WANT GB a rank, or 70% of the available memory over the ranks if less
  local most=$(( AVAIL_GB * 7 / 10 / $2 ))
  [ "$1" -le $most ] && { echo "$1"; return; }
  echo "host KV store: $most GB a rank, not $1 (${AVAIL_GB} GB available for $2 ranks)" >&2; echo $most
}
SUMMARY=$OUT/summary.txt; : >"$SUMMARY"
note() { echo "== $*"; echo "$*" >>"$SUMMARY"; }  # a file: a mode in the background notes too
# fits MODE: whether MODE may start (else it is noted as skipped)
fits() {
  local l; l=$(left)
  [ "$l" -ge "${NEEDS[$1]}" ] && { echo "== $1: starts with $l s left"; return 0; }
  note "$1: skipped ($l s left of BUDGET_S=$BUDGET_S, it needs ~${NEEDS[$1]} s)"; return 1
}
# bounded CMD...: CMD under a timeout of what is left (SIGINT first: pytest reports, tp_bench keeps its rows)
bounded() {
  local t=$(( $(left) - 10 )); [ $t -lt 30 ] && t=30
  if [ "$DRY_RUN" = 1 ]; then echo "+ timeout $t: ${*@Q}"; return 0; fi
  timeout -s INT -k 20 "$t" "$@"; local rc=$?
  [ $rc = 124 ] || [ $rc = 137 ] && echo "(stopped at the budget after $t s)"
  return $rc
}
model_dir() {  # model_dir DIR [--config-only]: Llama-3.1-8B's shapes (random bf16 weights unless config only)
  grep -q LlamaForCausalLM "$1/config.json" 2>/dev/null || bounded python3 -m benchmarks.model_dir --out "$@"
}
quiet() { grep -v -e "^INFO" -e "^\[transformers\]"; }

run_tests() {  # run_tests GPUS
  CUDA_VISIBLE_DEVICES=$1 bounded python3 -m pytest -q -rfEs -p no:cacheprovider --durations=5 \
    -o faulthandler_timeout=150 tests/distributed \
    >"$OUT/tp_tests.log" 2>&1
  local rc=$?
  tail -25 "$OUT/tp_tests.log"; note "tests on GPUs $1: rc=$rc ($(tail -1 "$OUT/tp_tests.log"))"
}
run_parity() {  # run_parity GPUS
  export CUDA_VISIBLE_DEVICES=$1
  model_dir /tmp/llama8b-r2 && bounded python3 scripts/tp_bench.py parity /tmp/llama8b-r2 --tp 2 \
    --dtypes bfloat16 float32 --json "$OUT/tp_parity.json" 2>&1 | quiet | tail -8
  note "parity on GPUs $1: rc=${PIPESTATUS[0]}"; unset CUDA_VISIBLE_DEVICES
}
run_step() {
  local tps=2; [ "$NGPU" -ge 4 ] && tps="2 4"
  model_dir /tmp/llama8b-cfg --config-only && bounded python3 scripts/tp_bench.py step /tmp/llama8b-cfg --tp $tps \
    --batch 32 --context 8192 --json "$OUT/tp_step.json" 2>&1 | quiet | tail -8
  note "step (TP=1 and $tps): rc=${PIPESTATUS[0]}"
}
run_capacity() {
  model_dir /tmp/llama8b-cfg --config-only && bounded python3 scripts/tp_bench.py capacity /tmp/llama8b-cfg --tp 2 \
    --context 131072 --gpu-memory-gb 40 --host-kv-gb "$(host_gb "$CAPACITY_HOST_GB" 2)" --requests-tp1 "${REQ1:-8}" \
    --requests "${REQ2:-16}" --json "$OUT/tp_capacity.json" 2>&1 | quiet | tail -8
  note "capacity: rc=${PIPESTATUS[0]}"
}
# serve_runs DIR "TP..." CONFIG... (env for gpu_serve_check.sh before it): each config at each TP, a server each
serve_runs() {
  local dir=$1 tps=$2 tp cfg l; shift 2
  for cfg in "$@"; do
    for tp in $tps; do
      l=$(( $(left) - 10 ))
      if [ "$DRY_RUN" = 1 ]; then
        echo "+ TP=$tp BUDGET_S=$l OUT=$dir ${SERVE_ENV[*]} bash scripts/gpu_serve_check.sh $cfg"; continue
      fi
      env "${SERVE_ENV[@]}" TP=$tp BUDGET_S=$l OUT="$dir" LOGS="$dir/logs_full" LADDER=0 FRESH_TRITON_CACHE=0 \
        bash scripts/gpu_serve_check.sh "$cfg" 2>&1 | quiet
      note "serve $(basename "$dir") $cfg TP=$tp: rc=${PIPESTATUS[0]}"
    done
  done
  [ "$DRY_RUN" = 1 ] || python3 scripts/tp_bench.py serve-report "$dir" --json "$OUT/tp_$(basename "$dir").json"
}
run_serve() {
  SERVE_ENV=(SHAPE=8b WORKLOAD=longbench N="$SERVE_N" RATES="$SERVE_RATES" CAP_GB=40 SERVER_START_S=90
    OFFLOAD_FLAGS="--host-kv-memory $(host_gb "$HOST_KV_GB" "$SERVE_TP")GB")
  serve_runs "$OUT/serve8b" "1 $SERVE_TP" $CONFIGS
}
run_serve70b() {
  SERVE_ENV=(SHAPE=70b WORKLOAD=longbench N="$N70" RATES="$RATES70" CAP_GB=70 SERVER_START_S=150
    OFFLOAD_FLAGS="--host-kv-memory $(host_gb "$HOST_KV70_GB" 4)GB")
  serve_runs "$OUT/serve70b" 4 $CONFIGS
  if [ "$GPU_GB" -ge 120 ]; then  # 70B's weights are ~69 GB a GPU at TP=2
    SERVE_ENV=("${SERVE_ENV[@]/CAP_GB=70/CAP_GB=125}")
    serve_runs "$OUT/serve70b" 2 $CONFIGS
  else
    note "serve70b TP=2: not run (GPUs of $GPU_GB GB; 70B at TP=2 needs >= 120 GB each)"
  fi
}

together=0  # tests and parity side by side on 4 GPUs, where the first of them comes (parity measures no time)
[[ " $* " == *" tests "* && " $* " == *" parity "* && $NGPU -ge 4 ]] && together=1
for m in "$@"; do
  if [ $together -ge 1 ] && [[ $m == tests || $m == parity ]]; then
    [ $together = 2 ] && continue
    together=2
    fits parity || { note "tests: skipped (beside parity)"; continue; }
    run_tests 0,1 &
    tests_pid=$!
    run_parity 2,3
    wait $tests_pid
    continue
  fi
  fits "$m" || continue
  case $m in
    tests) run_tests 0,1 ;;
    parity) run_parity 0,1 ;;
    step) run_step ;;
    capacity) run_capacity ;;
    serve) run_serve ;;
    serve70b) run_serve70b ;;
  esac
done

echo; echo "== summary ($(( $(date +%s) - START )) s)"
cat "$SUMMARY"
[ "$DRY_RUN" = 1 ] && exit 0
for d in "$OUT"/serve8b "$OUT"/serve70b; do  # the servers' log tails beside their results
  [ -d "$d/logs_full" ] || continue
  mkdir -p "$d/logs"
  for f in "$d"/logs_full/*.log; do [ -f "$f" ] && tail -80 "$f" >"$d/logs/$(basename "$f")"; done
  rm -rf "$d/logs_full"
done
if [ -n "$PACK" ]; then  # the device tool brings back 8 files at most: one archive, and the summary beside it
  (cd "$OUT" && tar czf "/tmp/$PACK" --exclude "$PACK" . && find . -mindepth 1 ! -name summary.txt -delete \
    && mv "/tmp/$PACK" .)
fi
