"""Where a decode step's time goes on the GPU: torch profiler over full-batch decode steps of a
random-weight model (load_format='dummy'), GPU kernel time per step vs wall time per step.

    python -m benchmarks.model_dir --config-only --out /tmp/cfg8b
    python scripts/profile_decode.py /tmp/cfg8b --batch 32 --input-len 8192
    python scripts/profile_decode.py /tmp/smollm2 --batch 1 --engine-arg sparse_policy=topk \
        --engine-arg sparse_budget=1024 --engine-arg kv_offload=true
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve.bench.accuracy import parse_engine_args
from sparseserve.bench.steps import StepLog
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine option (repeatable)")
    args = ap.parse_args()
    log = StepLog()  # each step's schedule: the profiled steps start once the whole batch decodes
    engine = LLMEngine.from_kwargs(
        log,
        model=args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.input_len + 256,
        max_num_seqs=args.batch,
        max_num_batched_tokens=32768,
        **parse_engine_args(args.engine_arg),
    )
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(100, 30000, (args.input_len,), generator=g).tolist(), params)
    engine.step()
    while not log.last.pure_decode(args.batch):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    print(f"batch {args.batch} input {args.input_len}: wall {wall:.2f} ms/step, GPU kernels {gpu_us / 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
