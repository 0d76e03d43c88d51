"""Where a decode step's time goes on the GPU: torch profiler over full-batch decode steps of a
random-weight model (load_format='dummy'; `--engine-arg load_format=auto`: its own weights): wall time
per step, the GPU's busy and idle time, and each kernel's share of the GPU's critical path (summed kernel
times overcount: kernels overlap under PDL), and under KV offload the loads a layer-step and FlashH2D's rate.
`--cprofile`: the host's Python time by function; `--trace`: the timeline for chrome://tracing. Runs on CPU
too (no GPU timeline there).

    python -m benchmarks.model_dir --config-only --out /tmp/cfg8b
    python scripts/profile_decode.py /tmp/cfg8b --batch 32 --input-len 8192
    python scripts/profile_decode.py /tmp/smollm2 --batch 1 --engine-arg sparse_policy=topk \
        --engine-arg sparse_budget=1024 --engine-arg kv_offload=true
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve.bench.accuracy import parse_engine_args
from sparseserve.bench.gpu_trace import critical_path
from sparseserve.bench.steps import StepLog
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=15, help="kernels (and host ops) listed")
    ap.add_argument("--cprofile", action="store_true", help="also the host's Python functions (cProfile)")
    ap.add_argument("--trace", help="write the profiled steps' timeline here (Chrome trace JSON)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="engine option (repeatable)")
    args = ap.parse_args()
    log = StepLog()  # each step's schedule: the profiled steps start once the whole batch decodes
    # settle: steps until the whole batch decodes, at most (a batch the engine never runs whole must not hang).
    # No request may finish before the profiled steps: under KV offload, layer-segmented prefill runs decode
    # steps between a prompt's segments, so the first requests decode for hundreds of steps before the last joins.
    settle = args.batch * (args.input_len // 256 + 64)
    max_tokens = settle + 3 * args.steps + 16
    engine = LLMEngine.from_kwargs(
        log,
        model=args.model,
        max_model_len=args.input_len + max_tokens,
        max_num_seqs=args.batch,
        max_num_batched_tokens=32768,
        # each step timed alone unless asked; random weights unless asked (load_format=auto: the model's own)
        **{
            "dtype": "bfloat16",
            "async_scheduling": False,
            "load_format": "dummy",
            **parse_engine_args(args.engine_arg),
        },
    )
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    high = min(30000, engine.model_runner.arch.vocab_size)
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(10, high, (args.input_len,), generator=g).tolist(), params)
    engine.step()
    most = 0  # the largest batch that decoded alone: what the engine's memory runs together
    for _ in range(settle):
        if log.last.pure_decode(args.batch):
            break
        most = max(most, log.last.rows if log.last.pure_decode() else 0)
        engine.step()
    else:
        s = engine.get_stats()
        raise SystemExit(
            f"the {args.batch} requests never decoded together in {settle} steps (at most {most} did): running "
            f"{s.num_running}, waiting {s.num_waiting} ({s.working_set_held_back} held back by the working set), "
            f"{s.num_preemptions} preemptions, {s.num_blocks_used} of {s.num_blocks_total} device blocks used"
        )
    for _ in range(5):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    times = []
    for _ in range(args.steps):
        engine.step()
        times.append(time.perf_counter())
    wall = (times[-1] - t0) / args.steps * 1e3
    each = sorted((b - a) * 1e3 for a, b in zip([t0] + times, times))
    print(f"step ms: median {each[len(each) // 2]:.2f}, min {each[0]:.2f}, max {each[-1]:.2f}")
    if args.cprofile:  # the host's Python time by function (a run of its own: it slows the host)
        stats = cProfile.Profile()
        stats.runcall(lambda: [engine.step() for _ in range(args.steps)])
        pstats.Stats(stats).sort_stats("tottime").print_stats(args.rows)
    before = engine.get_stats(sync=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    after = engine.get_stats(sync=True)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            busy, idle, by_name = critical_path(json.load(f)["traceEvents"])
    print(f"{'GPU critical path (us a step; PDL overlap counted once)':<60} {'us':>9}")
    for name, us in by_name.most_common(args.rows):
        print(f"{name[:60]:<60} {us / args.steps:9.1f}")
    print(
        f"batch {args.batch} input {args.input_len}: wall {wall:.2f} ms/step; GPU busy {busy / args.steps / 1e3:.2f}, "
        f"idle {idle / args.steps / 1e3:.2f} ms/step (kernel times summed: {gpu_us / 1e3:.2f})"
    )
    layer_steps = after.offload_layer_steps - before.offload_layer_steps
    if layer_steps:  # KV offload: the profiled steps' loads, and FlashH2D's rate on the critical path
        bypass = after.offload_bypass_reads - before.offload_bypass_reads  # read over UVA inside the step
        loaded = after.offload_blocks_loaded - before.offload_blocks_loaded + bypass  # reads from the host
        held = after.sparse_held_lists - before.sparse_held_lists
        hits = after.offload_hbm_hits - before.offload_hbm_hits
        misses = after.offload_hbm_misses - before.offload_hbm_misses
        h2d = after.offload_h2d_bytes - before.offload_h2d_bytes
        flash_us = sum(us for name, us in by_name.items() if "flash_h2d" in name)
        rate = f", FlashH2D {h2d / flash_us / 1e3:.1f} GB/s on the critical path" if flash_us else ""
        print(
            f"offload: {loaded / layer_steps:.2f} head blocks read from the host a layer-step "
            f"({bypass / layer_steps:.2f} of them inside the step), hit ratio {hits / max(hits + misses, 1):.4f}, "
            f"{h2d / args.steps / 1e6:.1f} MB a step{rate}; {held} lists held"
        )


if __name__ == "__main__":
    main()
