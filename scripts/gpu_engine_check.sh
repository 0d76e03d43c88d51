#!/usr/bin/env bash
# Engine checks on the GPU (device tool): float32 parity with transformers on the tiny models
# (Triton backend, CUDA graphs), bf16 logits of a Llama-3.1-8B-config model, and the throughput
# benchmark against transformers and the roofline. Usage: scripts/gpu_engine_check.sh [parity|bench|all]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
grep -q LlamaForCausalLM /tmp/llama8b-r2/config.json 2>/dev/null || python -m benchmarks.model_dir --out /tmp/llama8b-r2
if [ "$what" != bench ]; then
  python -m pytest tests/kernels/test_small_ops.py tests/models/test_hf_parity.py -q -x 2>&1 | tail -5
  python -m sparseserve.bench.parity /tmp/llama8b-r2 --dtype bfloat16 --prompt-len 1024 --json "$OUT/parity_8b.json" 2>&1 | tail -4
fi
if [ "$what" != parity ]; then
  python -m sparseserve.bench.throughput /tmp/llama8b-r2 --input-lens ${INPUT_LENS:-1024,8192,32768} --output-len 256 \
    --batch-sizes ${BATCHES:-1,4,16,32,64} --hf-batch-sizes ${HF_BATCHES:-1,4,16} --hf-input-lens ${HF_INPUT_LENS:-8192} --json "$OUT/throughput.json" \
    2>&1 | grep -v "Processed prompts" | tee "$OUT/throughput.log" | tail -40
fi
