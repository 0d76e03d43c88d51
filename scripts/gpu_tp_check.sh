#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU host (device kind nvidia-h200-x2): the 2-GPU tests (tiny models: NCCL, Triton,
# a CUDA graph per rank), then the measurements, each against TP=1 in the same run (scripts/tp_bench.py).
# Usage: scripts/gpu_tp_check.sh [tests|parity|step|capacity]   (one per call: each fits a 10-minute command)
set -uo pipefail
# NVLink multicast stays off, also in what this starts (docs/tensor_parallel.md).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-tests}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
python -c "import torch, torch.distributed as d; print(torch.__version__, torch.cuda.device_count(), 'GPUs, NCCL', d.is_nccl_available())"
case "$what" in
  tests)
    python -m pytest -q -x tests/distributed 2>&1 | tail -15 ;;
  parity)
    grep -q LlamaForCausalLM /tmp/llama8b-r2/config.json 2>/dev/null || python -m benchmarks.model_dir --out /tmp/llama8b-r2
    python scripts/tp_bench.py parity /tmp/llama8b-r2 --json "$OUT/tp_parity.json" 2>&1 | grep -v "^INFO" | tail -8 ;;
  step)
    grep -q LlamaForCausalLM /tmp/llama8b-cfg/config.json 2>/dev/null || python -m benchmarks.model_dir --out /tmp/llama8b-cfg --config-only
    python scripts/tp_bench.py step /tmp/llama8b-cfg --batch 32 --context 8192 --json "$OUT/tp_step.json" 2>&1 | grep -v "^INFO" | tail -8 ;;
  capacity)
    grep -q LlamaForCausalLM /tmp/llama8b-cfg/config.json 2>/dev/null || python -m benchmarks.model_dir --out /tmp/llama8b-cfg --config-only
    python scripts/tp_bench.py capacity /tmp/llama8b-cfg --context 131072 --gpu-memory-gb 40 --host-kv-gb ${HOST_KV_GB:-100} \
      --requests-tp1 ${REQ1:-8} --requests ${REQ2:-16} --json "$OUT/tp_capacity.json" 2>&1 | grep -v "^INFO" | tail -8 ;;
  *) echo "usage: $0 [tests|parity|step|capacity]"; exit 2 ;;
esac
