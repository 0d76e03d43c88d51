#!/usr/bin/env bash
# Serving under load for the ladder dense -> + sparse -> + KV offload (working-set control included: the engine takes
# no offload without it) -> + layer-segmented prefill, a `sparseserve serve` per (config, load) with dummy bf16
# weights and GPU memory capped at CAP_GB, loaded by `sparseserve bench serve`. Per (config, load): the client's
# JSON, the server's /metrics and log (in $LOGS); at the end `benchmarks.serve_ladder` prints the ladder table
# (ratios against dense of the same load, the workload's bound) and writes ladder.json and ladder.png
# (TTFT/TPOT/throughput against the request rate).
#
# SHAPE: 8b (default: Llama-3.1-8B), mha7b (Llama-2-7B / LWM-7B: 32 KV heads, intermediate 11008), gqa8b
#   (Llama-3-8B-262K) or 70b (Llama-3.1-70B: needs TP), each over the embedded tokenizer's vocabulary
#   (benchmarks/model_dir.py).
# TP: tensor_parallel_size of every server (default 1); at TP > 1 a config's results are named NAME_tpTP, CAP_GB
#   and OFFLOAD_FLAGS' --host-kv-memory are per GPU (scripts/gpu_tp_check.sh serve: TP=1 against TP=N).
# WORKLOAD: mooncake (default: the first N requests of the Mooncake conversation trace, inputs capped at MAX_INPUT,
#   outputs at OUTPUT_LEN, replayed at each time scale of SCALES) or longbench (N requests of LongBench v1's mix,
#   Poisson arrivals at each rate of RATES, prompts capped at MAX_INPUT by cutting the middle, LongBench's output
#   caps (LB_OUTPUT=mean: a real model's mean outputs), lengths in LB_TOKENIZER's counts: llama2 for mha7b, else
#   llama3).
#
# Usage (project root; on the device carry .whl with the server's wheels and .data with the haystack and the trace,
# and set SPARSESERVE_DATA_DIR=.data):
#   SCALES="1 4" bash scripts/gpu_serve_check.sh dense sparse offload layerseg
#   SCALES=1 bash scripts/gpu_serve_check.sh dense dense_async layerseg_async   # NAME_async: --async-scheduling
#   FIXED_OUTPUT=1 OUTPUT_LEN=2048 SCALES=1 bash scripts/gpu_serve_check.sh dense offload   # decode-heavy: every
#   request asks for exactly OUTPUT_LEN tokens (without FIXED_OUTPUT the trace's output lengths are capped at it)
#   SHAPE=mha7b WORKLOAD=longbench RATES="0.5 1 2" N=96 bash scripts/gpu_serve_check.sh dense sparse layerseg
# Each (config, load) is a separate server with a fresh Triton cache (FRESH_TRITON_CACHE=0: the shared one);
# results accumulate in $OUT across calls (the report reads all).
# PACK=name.tgz leaves only that archive of $OUT (with the servers' log tails) for the device tool to bring back.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${N:-48}; SCALES=${SCALES:-1 4}; OUTPUT_LEN=${OUTPUT_LEN:-512}; MAX_INPUT=${MAX_INPUT:-32768}
SHAPE=${SHAPE:-8b}; WORKLOAD=${WORKLOAD:-mooncake}; RATES=${RATES:-0.5 1 2}; LB_OUTPUT=${LB_OUTPUT:-max}
SLO=${SLO:-ttft:10000 tpot:150}  # goodput: requests within every SLO (ms)
declare -A PRESET=([8b]=llama-3.1-8b [mha7b]=mha7b [gqa8b]=gqa8b [70b]=llama-3.1-70b)
[ -v "PRESET[$SHAPE]" ] || { echo "unknown SHAPE $SHAPE (one of ${!PRESET[*]})"; exit 2; }
[ "$SHAPE" = mha7b ] && LB_TOKENIZER=${LB_TOKENIZER:-llama2} || LB_TOKENIZER=${LB_TOKENIZER:-llama3}
[ "$SHAPE" = 8b ] && MODEL=${MODEL:-/tmp/m8b} || MODEL=${MODEL:-/tmp/$SHAPE}
CAP_GB=${CAP_GB:-40}; PORT=${PORT:-8123}; RUN_TIMEOUT=${RUN_TIMEOUT:-540}; TP=${TP:-1}
# BUDGET_S: wall seconds this call may take (a device call ends at 600 s); a config that could not finish by then
# (SERVER_START_S to start, 90 s to run) is skipped, and a run's timeout shrinks to what is left once its server is
# up. LADDER=0: no ladder report at the end. OFFLOAD_FLAGS go to the KV-offload configs only
# (e.g. --host-kv-memory 88GB for the decode-heavy variant, whose KV outgrows the default host store).
BUDGET_S=${BUDGET_S:-0}; OFFLOAD_FLAGS=${OFFLOAD_FLAGS:-}; LOGS=${LOGS:-/tmp/serve_logs}; mkdir -p "$LOGS"
SERVER_START_S=${SERVER_START_S:-60}
START=$(date +%s)
DATA=${SPARSESERVE_DATA_DIR:-../shared/data}
TRACE=${TRACE:-$DATA/traces/mooncake_conversation.jsonl}
SPARSE="--sparse-policy topk --sparse-budget 2048"
declare -A FLAGS=(
  [dense]=""
  [sparse]="$SPARSE"
  # KV offload is the full system: working-set control and prefill ahead are part of it (docs/working_set.md)
  [offload]="$SPARSE --kv-offload --sparse-lag 0 --no-layer-segmented-prefill"
  [layerseg]="$SPARSE --kv-offload --layer-segmented-prefill --sparse-lag 0"
  # without prefill ahead: requests over the limit wait unprefilled (to compare side by side)
  [offload_wait]="$SPARSE --kv-offload --sparse-lag 0 --no-layer-segmented-prefill --max-prefilled-waiting 0"
  [layerseg_wait]="$SPARSE --kv-offload --layer-segmented-prefill --sparse-lag 0 --max-prefilled-waiting 0"
  # prefill ahead's horizon: none (requests park as soon as prefilled, the rule before max_park_steps), or longer
  [layerseg_unbounded]="$SPARSE --kv-offload --layer-segmented-prefill --sparse-lag 0 --max-prefilled-waiting 16 \
--max-park-steps 1000000"
  [layerseg_park32]="$SPARSE --kv-offload --layer-segmented-prefill --sparse-lag 0 --max-park-steps 32"
  # lagged selection: the pool reads each step's next lists beside it (docs/offload.md, "Lagged reads"); KV
  # offload's default (the rungs above turn it off to name what each adds)
  [layerseg_lag]="$SPARSE --kv-offload --layer-segmented-prefill --sparse-lag 1"
  # --kv-offload with its defaults (on these shapes: layerseg_lag); kvoffload_async is a user's --kv-offload on CUDA
  [kvoffload]="$SPARSE --kv-offload"
)
for name in "${!FLAGS[@]}"; do  # NAME_async: the same with async scheduling; NAME: synchronous (KV offload's
  FLAGS[${name}_async]="${FLAGS[$name]} --async-scheduling"  # default on CUDA is async, so its configs say so)
  [[ ${FLAGS[$name]} == *--kv-offload* ]] && FLAGS[$name]="${FLAGS[$name]} --no-async-scheduling"
done
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# NVLink multicast off in every server and rank it starts (docs/tensor_parallel.md)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")
DEVFLAGS="--max-model-len $(( MAX_INPUT + OUTPUT_LEN ))"
if [ "$CUDA" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  [ -f "$MODEL/config.json" ] || python3 -m benchmarks.model_dir --preset "${PRESET[$SHAPE]}" --embedded-vocab \
    --config-only --out "$MODEL" >/dev/null
  [ -f "$OUT/hardware.json" ] || [ "${LADDER:-1}" = 0 ] || python3 -c "import json; from sparseserve.bench.hardware import hbm_bandwidth, \
matmul_flops; json.dump({'hbm_bytes_per_s': hbm_bandwidth(), 'matmul_flops': matmul_flops()}, open('$OUT/hardware.json', 'w'))"
  UTIL=$(python3 -c "import torch; print(round($CAP_GB * 1e9 / torch.cuda.mem_get_info()[1], 4))")
  DEVFLAGS="$DEVFLAGS --load-format dummy --dtype bfloat16 --gpu-memory-utilization $UTIL"
fi
TPTAG=""; [ "$TP" -gt 1 ] && { TPTAG=_tp$TP; DEVFLAGS="$DEVFLAGS --tensor-parallel-size $TP"; }
OUTTAG=out$OUTPUT_LEN; OUTARGS="--max-output-len $OUTPUT_LEN"
case $WORKLOAD in
  mooncake) POINTS=$SCALES; LADDER_ARGS="--trace $TRACE" ;;
  longbench) POINTS=$RATES; LADDER_ARGS=""; OUTTAG=lb$LB_OUTPUT
    OUTARGS="--longbench-tokenizer $LB_TOKENIZER --longbench-output $LB_OUTPUT" ;;
  *) echo "unknown WORKLOAD $WORKLOAD (mooncake or longbench)"; exit 2 ;;
esac
[ "${FIXED_OUTPUT:-0}" = 1 ] && { OUTTAG=fix$OUTPUT_LEN; OUTARGS="${OUTARGS/--max-output-len*/} --trace-output-len $OUTPUT_LEN"; }
echo "model=$MODEL ($SHAPE) N=$N workload=$WORKLOAD loads=[$POINTS] outputs=$OUTTAG cap=${CAP_GB}GB flags: $DEVFLAGS"
rc=0
for point in $POINTS; do
  if [ "$WORKLOAD" = mooncake ]; then
    load=ts$point; LOADARGS="--trace $TRACE --trace-time-scale $point"
  else
    load=rate$point; LOADARGS="--dataset longbench --request-rate $point"
  fi
  for name in "$@"; do
    [ -v "FLAGS[$name]" ] || { echo "unknown config $name (one of ${!FLAGS[*]})"; exit 2; }
    tag="${name}${TPTAG}_${load}_${OUTTAG}"
    t0=$(date +%s)
    timeout_s=$RUN_TIMEOUT; wait_s=300
    if [ "$BUDGET_S" -gt 0 ]; then
      left=$(( START + BUDGET_S - t0 - SERVER_START_S - 30 ))  # server start and stop
      [ $left -lt 90 ] && { echo "== $tag: skipped ($left s left after a server start of ~$SERVER_START_S s)"; continue; }
      wait_s=$(( left + SERVER_START_S - 90 ))
    fi
    flags="${FLAGS[$name]} ${EXTRA_FLAGS:-}"
    [[ $flags == *--kv-offload* ]] && flags="$flags $OFFLOAD_FLAGS"
    # A fresh Triton cache per server: each compiles from nothing (kernels another config compiled earlier in the
    # call would otherwise make the order of the servers matter); jit_TAG.txt lists what compiled while serving.
    tc=/tmp/triton_$tag; rm -rf "$tc" "$tc.up"
    [ "${FRESH_TRITON_CACHE:-1}" = 1 ] && export TRITON_CACHE_DIR=$tc
    # SERVER_TREE: serve from another checkout (e.g. an old commit unpacked in .old), the client from this one
    PYTHONPATH=${SERVER_TREE:+$SERVER_TREE:}$PYTHONPATH python3 -m sparseserve serve "$MODEL" --port "$PORT" \
      $DEVFLAGS $flags >"$LOGS/server_$tag.log" 2>&1 &
    pid=$!
    up=0
    for _ in $(seq 1 $wait_s); do
      curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && { up=1; touch "$tc.up"; break; }
      kill -0 $pid 2>/dev/null || break
      sleep 1
    done
    echo "== $tag: server up=$up after $(( $(date +%s) - t0 )) s (${flags:-defaults})"
    if [ "$BUDGET_S" -gt 0 ]; then
      left=$(( START + BUDGET_S - $(date +%s) - 30 ))  # what is left once the server is up, less its stop
      [ $left -lt $timeout_s ] && timeout_s=$left
    fi
    if [ $up = 1 ]; then
      timeout "$timeout_s" python3 -m sparseserve bench serve --base-url "http://127.0.0.1:$PORT" \
        --tokenizer "$MODEL" $LOADARGS --num-prompts "$N" --max-input-len "$MAX_INPUT" \
        $OUTARGS --slo $SLO \
        --timeout "$timeout_s" --save-details --output-json "$OUT/serve_$tag.json" 2>&1 | tail -12
      rc=$(( rc || PIPESTATUS[0] ))
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -vE '^#|_bucket' >"$OUT/metrics_$tag.txt"
      [ -d "$tc" ] && find "$tc" -newer "$tc.up" -name '*.json' ! -name '__grp*' -printf '%f\n' | sort | uniq -c \
        >"$OUT/jit_$tag.txt" && echo "compiled while serving: $(tr -s ' \n' ' ' <"$OUT/jit_$tag.txt")"
    else
      rc=1; tail -20 "$LOGS/server_$tag.log"
    fi
    # the server's processes (at TP > 1 its ranks): none may outlive it
    kids=$(for c in $(pgrep -P $pid); do echo $c; pgrep -P $c; done)
    kill -INT $pid 2>/dev/null
    stopped=0
    for _ in $(seq 1 30); do kill -0 $pid 2>/dev/null || { stopped=1; break; }; sleep 1; done
    kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; status=$?
    [ $stopped = 1 ] || echo "== $tag: the server did not exit within 30 s of SIGINT (killed)"
    for _ in $(seq 1 20); do  # its forkserver and resource tracker follow it within a few seconds
      stray=$(for k in $kids; do ps -o stat= -p $k 2>/dev/null | grep -qv Z && echo $k; done)
      [ -z "$stray" ] && break; sleep 0.5
    done
    [ -n "$stray" ] && { echo "== $tag: alive 10 s after the server: $(ps -o pid=,args= -p "$(echo $stray | tr ' ' ,)" | cut -c1-80) (killed)"; kill -9 $stray; }
    echo "== $tag: done in $(( $(date +%s) - t0 )) s (server exit status $status)"
  done
done
[ "${LADDER:-1}" = 1 ] && { python3 -m benchmarks.serve_ladder "$OUT" $LADDER_ARGS --model "$MODEL" --num-prompts "$N" \
  --max-input-len "$MAX_INPUT" || rc=1; }
if [ -n "${PACK:-}" ]; then  # the device tool brings back only a few files: one archive of $OUT and the log tails
  mkdir -p "$OUT/logs"
  for f in "$LOGS"/*.log; do [ -f "$f" ] && tail -60 "$f" >"$OUT/logs/$(basename "$f")"; done
  (cd "$OUT" && tar czf "/tmp/$PACK" --exclude "$PACK" . && find . -mindepth 1 -delete && mv "/tmp/$PACK" .)
fi
exit $rc
