"""Where a burst's decode waits under KV offload, in engine steps, on the CPU: the embedded model serves a burst
of short and long prompts (a long-prompt limit lets the short ones pass) from an HBM pool that holds a few
requests' working sets, prefill ahead on. Per request: the steps between two of its tokens that gave it none,
split into its first-to-second gap (prefill ahead) and after its second token (parked mid-answer); TPOT in
steps (1 = a token every step). Steps, not seconds: the schedule is what differs between trees, so run it with
each tree on PYTHONPATH (docs/working_set.md, share order; docs/benchmarks/serving.md, twelfth session).

    PYTHONPATH=. python scripts/cpu_share_order.py --seeds 0 1 --pools 1200 2400 --json /tmp/new.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from sparseserve.bench.hardware import print_table
from sparseserve.engine.engine import LLMEngine
from sparseserve.models.loader import DEFAULT_MODEL_DIR
from sparseserve.sampling_params import SamplingParams

ENGINE = dict(
    device="cpu",
    dtype="float32",
    max_model_len=1100,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    block_size=8,
    sparse_policy="topk",
    sparse_budget=128,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
    sparse_dense_context=0,
    kv_offload=True,
    long_prefill_token_threshold=128,
)


def run(seed: int, pool: int, num_requests: int, output_len: int) -> dict:
    rng = random.Random(seed)
    engine = LLMEngine.from_kwargs(model=str(DEFAULT_MODEL_DIR), hbm_cache_blocks=pool, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        n = rng.choice([rng.randint(40, 120), rng.randint(300, 900)])
        engine.add_request(f"r{i}", [rng.randint(10, 2000) for _ in range(n)], params)
    token_steps: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_steps.setdefault(out.request_id, []).append(step)
        step += 1
    stats = engine.get_stats(sync=True)
    idx = list(token_steps.values())
    after = [sum(b - a - 1 for a, b in zip(s[1:], s[2:])) / (len(s) - 1) for s in idx]
    every = [(s[-1] - s[0] - (len(s) - 1)) / (len(s) - 1) for s in idx]
    return {
        "seed": seed,
        "pool": pool,
        "steps": step,
        "waiting_after_2nd": statistics.fmean(after),  # steps without a token, a token
        "worst_request": max(after),
        "first_gap": statistics.fmean(s[1] - s[0] - 1 for s in idx),  # steps
        "tpot_steps": 1 + statistics.fmean(every),
        "hold_backs": stats.working_set_hold_backs,
        "prefill_aheads": stats.working_set_prefill_aheads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--pools", type=int, nargs="+", default=[1200, 2400], help="HBM pool sizes, head blocks")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [run(s, pool, args.num_requests, args.output_len) for s in args.seeds for pool in args.pools]
    print_table(rows, "steps without a token: waiting_after_2nd a token, worst_request its, first_gap a request")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": ENGINE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
