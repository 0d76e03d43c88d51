"""Sparse decode speed against dense, side by side in one run (ratios, not absolute times).

    python -m benchmarks.sparse [--kernel] [--step MODEL_DIR] [--json out.json]

--kernel: one layer's decode attention at 128K context, batch 8, Llama-3.1-8B heads (32/8, D=128),
bf16, blocks of 32: the dense paged kernel against sparse decode with scoring and selection
included (topk and topp at budget 2048, without and with reuse R=4; and topk with sparse_lag=1, the
selection beside the attention on a second stream), each captured in a CUDA graph
(R consecutive steps per graph, so reuse is timed as it runs), plus a breakdown of the parts. Each
variant is timed as the engine runs it, per layer inside one graph of 8 distinct layers (own
cache and metadata each), and also as a graph of that one layer, which adds the ~5 us a graph replay
costs on an H200 (paid once per decode step in the engine, not once per layer).
--step: the whole decode step (model forward + sampling) of MODEL_DIR's architecture (random weights:
load_format='dummy') at 128K context, batch 4, with sparse topk 2048 variants and then dense, an engine per
variant (random KV: cost does not depend on the values), each step built by hand at a fixed context and run
through the runner. Both report the median of many steps (the graph: its replay's GPU time, CUDA events from
the engine's profiler).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time

import torch
import triton

from sparseserve.attention.backend import AttentionMetadata, BackendContext
from sparseserve.attention.sparse import SparseBackend, SparseStepMeta
from sparseserve.bench.hardware import hbm_bandwidth, print_table
from sparseserve.bench.steps import StepLog
from sparseserve.config import SparseConfig, policy_default
from sparseserve.engine.cuda_graph import collector_paused
from sparseserve.kernels.block_score import ScoreConfig, SelectConfig, block_scores_triton, select_blocks_triton
from sparseserve.kernels.key_meta import rebuild_key_meta
from sparseserve.kernels.paged_decode import paged_decode
from sparseserve.kernels.sparse_decode import FAST_CONFIG, SparseDecodeConfig, default_config, sparse_decode_triton
from sparseserve.kvcache.metadata import key_meta_block_bytes

DTYPE = torch.bfloat16


def backend(
    cfg: SparseConfig, layers: int, hkv: int, d: int, bs: int, batch: int, caches, dtype: torch.dtype = DTYPE
) -> SparseBackend:
    """A sparse backend over given caches (one [NB, Hkv, 2, bs, D] a layer), its key metadata built from them."""
    num_blocks = caches[0].shape[0]
    sp = SparseBackend(BackendContext(layers, hkv, d, bs, dtype, caches[0].device, batch, 1 << 30, cfg))
    sp.allocate(num_blocks)
    rebuild_key_meta(caches, sp.key_meta.codes, sp.key_meta.scale, sp.params.page_size)
    return sp


def with_slots(meta: AttentionMetadata) -> AttentionMetadata:
    """Row b in state slot b (what the runner's prepare gives a batch of fresh sequences)."""
    slots = torch.arange(meta.num_seqs, dtype=torch.int32, device=meta.seq_lens.device)
    meta.backend_meta = SparseStepMeta(slots, meta)
    return meta


def selection_counts(sp: SparseBackend) -> tuple[int, int]:
    c = sp.counters()
    return int(c["sparse_blocks_selected"]), int(c["sparse_selections"])


def graph_ms(fn, calls: int = 1) -> float:
    """Median time of one call of fn, from replays of a CUDA graph of `calls` consecutive calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / calls


def kernel_bench(
    batch: int = 8,
    ctx: int = 131072,
    hq: int = 32,
    hkv: int = 8,
    d: int = 128,
    bs: int = 32,
    budget: int = 2048,
    layers: int = 8,
    sweep: bool = False,
    profile: bool = False,
) -> list[dict]:
    per_seq = triton.cdiv(ctx, bs)
    caches = torch.randn(layers, batch * per_seq, hkv, 2, bs, d, device="cuda", dtype=DTYPE)
    cache = caches[0]
    tables = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, d, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    scale = d**-0.5
    meta = with_slots(
        AttentionMetadata(
            torch.full((batch,), -1, device="cuda"),
            torch.arange(batch + 1, device="cuda", dtype=torch.int32),
            seq_lens,
            tables,
            num_decodes=batch,
            max_query_len=1,
            max_seq_len=ctx,
        )
    )

    def timed(layer_call, calls: int = 1) -> tuple[float, float]:
        """(per layer in a graph of all layers, in a graph of layer 0 alone), ms per call."""
        per_layer = graph_ms(lambda: [layer_call(i) for i in range(layers)], calls) / layers
        return per_layer, graph_ms(lambda: layer_call(0), calls)

    kv_bytes = 2 * batch * hkv * ctx * d * DTYPE.itemsize
    dense_ms, dense_1 = timed(lambda i: paged_decode(q, caches[i], tables, seq_lens, scale, ctx, out=out))
    rows = [
        {
            "case": f"dense paged decode B={batch} L={ctx}",
            "ms": dense_ms,
            "speedup": 1.0,
            "tb_s": kv_bytes / dense_ms / 1e9,
            "ms_1layer_graph": dense_1,
            "speedup_1layer_graph": 1.0,
        }
    ]
    paged_decode(q, cache, tables, seq_lens, scale, ctx, out=out)
    ref = out.clone()
    for policy, reuse in (("topk", 1), ("topk", 4), ("topp", 1), ("topp", 4)):
        cfg = SparseConfig(
            sparse_policy=policy, sparse_budget=budget, sparse_reuse=reuse, sparse_top_p=0.9, sparse_dense_layers=0
        )
        sp = backend(cfg, layers, hkv, d, bs, batch, caches)
        ms, ms_1 = timed(lambda i: sp.attend(i, q, caches[i], meta, scale), reuse)
        blocks, selections = selection_counts(sp)
        rows.append(
            {
                "case": f"sparse {policy} budget={budget} R={reuse}",
                "ms": ms,
                "speedup": dense_ms / ms,
                "ms_1layer_graph": ms_1,
                "speedup_1layer_graph": dense_1 / ms_1,
                "mean_blocks": blocks / max(selections, 1),
            }
        )
        print(f"{rows[-1]['case']}: {1e3 * ms:.1f} us a layer ({1e3 * ms_1:.1f} us in a one-layer graph)", flush=True)
        if profile and policy == "topk":
            rows += kernel_profile(lambda: sp.attend(0, q, cache, meta, scale), reuse)
        if reuse == 1:
            rows += parts(
                sp, policy, q, cache, tables, seq_lens, scale, per_seq, out, dense_1, sweep=sweep and policy == "topk"
            )
        sp = None  # frees its buffers before the next variant
    for reuse in (1, 4):
        rows.append(lagged_row(reuse, budget, caches, q, meta, scale, dense_ms, dense_1))
    rows[0]["rel_err_vs_dense_full_budget"] = full_budget_error(q, cache, meta, ref, scale, bs)
    caches = cache = None
    torch.cuda.empty_cache()
    return rows


def lagged_row(reuse: int, budget: int, caches, q, meta, scale, dense_ms, dense_1) -> dict:
    """sparse_lag=1: each layer's scoring and selection (of the next step's lists) on a side stream beside its
    attention and the next layers', as SparseBackend.attend_layer runs them (joined at the step's end). R
    steps a graph whose contexts advance by one token, so that one of them selects (at the multiple of R) as
    in the engine; each step computes its rows once."""
    layers, batch, (_, hkv, _, bs, d) = caches.shape[0], q.shape[0], caches.shape[1:]
    cfg = SparseConfig(
        sparse_policy="topk", sparse_budget=budget, sparse_reuse=reuse, sparse_dense_layers=0, sparse_lag=1
    )
    sp = backend(cfg, layers, hkv, d, bs, batch, caches)
    metas = [with_slots(dataclasses.replace(meta, seq_lens=meta.seq_lens + c + 1 - reuse)) for c in range(reuse)]
    state = {"call": 0}

    def step(n: int) -> None:
        m = metas[state["call"] % reuse]
        state["call"] += 1
        sp.begin_step(m)
        for i in range(n):
            sp.attend_layer(i, q, caches[i], m, scale)
        sp.end_step()

    for _ in range(reuse):
        step(layers)
    mirror_lists(sp)
    ms, ms_1 = graph_ms(lambda: step(layers), reuse) / layers, graph_ms(lambda: step(1), reuse)
    blocks, selections = selection_counts(sp)
    row = {
        "case": f"sparse topk budget={budget} R={reuse} lag=1",
        "ms": ms,
        "speedup": dense_ms / ms,
        "ms_1layer_graph": ms_1,
        "speedup_1layer_graph": dense_1 / ms_1,
        "mean_blocks": blocks / max(selections, 1),
    }
    print(f"{row['case']}: {1e3 * ms:.1f} us a layer ({1e3 * ms_1:.1f} us in a one-layer graph)", flush=True)
    return row


def mirror_lists(sp: SparseBackend) -> None:
    """sparse_lag where the benchmark's contexts do not grow past the step it replays: a sequence's steps then
    read one of its two list rows and write the other, so copy the fuller row over both (as a growing
    context would have the latest selection in the row it reads)."""
    a, b = sp.state.sel.chunk(2, dim=1)
    src = torch.where(((a >= 0).sum(-1) >= (b >= 0).sum(-1))[..., None], a, b)
    a.copy_(src)
    b.copy_(src)


def kernel_profile(fn, calls: int) -> list[dict]:
    """Mean GPU time per step of each kernel of fn's CUDA graph (R calls), from the PyTorch profiler:
    what the graph replay's time holds besides the kernels is launch gaps."""
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    reps = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        if us > 0:
            rows.append(
                {"case": f"    kernel {e.key[:60]} (x{e.count / reps / calls:.2g}/step)", "ms": us / 1e3 / reps / calls}
            )
    return rows


def parts(
    sp: SparseBackend, policy: str, q, cache, tables, seq_lens, scale, mb, out, dense_ms, sweep: bool
) -> list[dict]:
    """Scoring, selection and attention, each in its own graph; with sweep, over launch configurations
    (the first of each is the default). tb_s: the bytes a part must read (metadata; K/V of the list
    entries and the local window) over its time."""
    p, slots = sp.params, torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    km, sel, cnt = sp.key_meta[0], sp.state.sel[0], sp.state.counter[0]
    args = p.kernel_args()
    top_p = p.top_p if policy == "topp" else None
    score_args = dict(
        max_blocks=mb, block_size=p.block_size, cap=p.cap, reuse=args["reuse"], short_dense=p.short_dense, scale=scale
    )
    scores = block_scores_triton(q, km.codes, km.scale, tables, seq_lens, slots, cnt, **score_args)
    batch, hkv, d = q.shape[0], km.codes.shape[1], q.shape[-1]
    nbytes = {
        "score": batch * mb * key_meta_block_bytes(hkv, p.block_size // p.page_size, d),
        "attend": batch * hkv * (p.cap + p.local) * cache[0, 0].numel() * cache.element_size(),
    }
    variants = {
        "score": [ScoreConfig()]
        + (
            [ScoreConfig(r, 4, st, t) for r in (64, 128) for st in (1, 3, 4) for t in (4, 8, 16)]
            + [ScoreConfig(64, 8, 3, 8)]
            if sweep
            else []
        ),
        "select": [SelectConfig()] + ([SelectConfig(k, w) for k in (2, 4, 8) for w in (8, 16)] if sweep else []),
        "attend": [sparse_decode_default(q, cache), FAST_CONFIG]
        + (
            [SparseDecodeConfig(t, 0, 4, st, n) for t in (64, 128) for n in (2, 3, 4, 6) for st in (2, 3, 4)]
            + [
                SparseDecodeConfig(64, 0, 8, 3, 4),
                SparseDecodeConfig(128, 0, 8, 3, 4),
                SparseDecodeConfig(),
            ]  # the one-tile-a-program default of run 2
            if sweep
            else []
        ),
    }
    calls = {
        "score": lambda c: block_scores_triton(
            q, km.codes, km.scale, tables, seq_lens, slots, cnt, **score_args, config=c
        ),
        "select": lambda c: select_blocks_triton(
            scores, seq_lens, slots, sel, cnt, sp.state.stats, sp.state.streaming[0], **args, top_p=top_p, config=c
        ),
        "attend": lambda c: sparse_decode_triton(
            q, cache, tables, seq_lens, sel, slots, p.local, scale, out=out, config=c
        ),
    }
    rows = []
    for name, configs in variants.items():
        for i, c in enumerate(dict.fromkeys(configs)):
            row = {"case": f"  {policy} {name} {'default ' if i == 0 else ''}{vars(c)}"}
            try:
                t = graph_ms(lambda: calls[name](c))
                rows.append(
                    row
                    | {"ms": t, "speedup": dense_ms / t}
                    | ({"tb_s": nbytes[name] / t / 1e9} if name in nbytes else {})
                )
                print(f"{row['case']}: {1e3 * t:.1f} us", flush=True)
            except Exception as e:  # out of shared memory or registers: record and go on
                rows.append(row | {"error": str(e).splitlines()[0][:80]})
    return rows


def sparse_decode_default(q: torch.Tensor, cache: torch.Tensor) -> SparseDecodeConfig:
    return SparseDecodeConfig(tile_n=32) if q.dtype == torch.float32 else default_config(cache, None)


def full_budget_error(q, cache, meta, dense_out, scale, bs) -> float:
    """Sparse path (scoring and selection included) with a budget covering the context vs dense."""
    cfg = SparseConfig(
        sparse_policy="topk", sparse_budget=meta.max_seq_len + bs, sparse_dense_layers=0, sparse_dense_context=0
    )
    sp = backend(cfg, 1, cache.shape[1], q.shape[-1], bs, q.shape[0], [cache])
    out = sp.attend(0, q, cache, meta, scale)
    return ((out.float() - dense_out.float()).norm() / dense_out.float().norm()).item()


def step_bench(
    model_dir: str,
    ctx: int = 131056,
    batch: int = 4,
    budget: int = 2048,
    dense_layers: int = 2,
    steps: int = 20,
    policies: dict[str, dict] | None = None,
) -> list[dict]:
    """policies: label -> engine arguments, measured beside topk `budget` and dense instead of the built-in
    variants (e.g. a candidate default against topk 2048)."""
    from benchmarks.common import free_memory
    from sparseserve.engine.engine import LLMEngine
    from sparseserve.engine.request import Sequence, SequenceStatus
    from sparseserve.kvcache.blocks import blocks_needed
    from sparseserve.sampling_params import SamplingParams

    max_len = ctx + 16
    base = dict(sparse_policy="topk", sparse_budget=budget, sparse_dense_layers=dense_layers)

    def measure(label: str, **sparse) -> dict:
        free_memory()
        log = StepLog(timing=True)
        bs = sparse.get("block_size") or policy_default(sparse.get("sparse_policy", "dense"), "block_size")
        engine = LLMEngine.from_kwargs(
            log,
            model=model_dir,
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=max_len,
            max_num_seqs=batch,
            num_gpu_blocks_override=batch * blocks_needed(max_len, bs) + 8,
            **sparse,
        )
        runner, backend = engine.model_runner, engine.model_runner.attn_backend
        for cache in runner.kv_caches:
            cache.normal_()
        if sparse.get("sparse_policy", "dense") != "dense":
            rebuild_key_meta(runner.kv_caches, backend.key_meta.codes, backend.key_meta.scale, backend.params.page_size)
        seqs = []
        for i in range(batch):
            seq = Sequence(i, f"b{i}", 0, [100 + i] * ctx, SamplingParams(temperature=0.0))
            seq.block_table = engine.allocator.allocate(blocks_needed(ctx, runner.block_size))
            seq.num_computed_tokens, seq.status = ctx - 1, SequenceStatus.RUNNING
            seqs.append(seq)
        scheduled = [(s, 1) for s in seqs]
        runner.execute(scheduled)  # warm-up; the sequences stay at ctx tokens: every step is alike
        if sparse.get("sparse_lag"):
            mirror_lists(backend)
        torch.cuda.synchronize()
        walls = []
        log.events.clear()
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.execute(scheduled)
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t0))
        graphs = log.times_ms("graph")
        return {  # (means beside the medians: with sparse_topp_flat_hold most steps hold, the median hides a fresh one)
            "case": f"{label} step B={batch} L={ctx}",
            "graph_ms": statistics.median(graphs),
            "engine_step_ms": statistics.median(walls),
            "graph_ms_mean": statistics.mean(graphs) if graphs else float("nan"),
            "engine_step_ms_mean": statistics.mean(walls),
        }

    rows = [measure(f"sparse topk {budget} dense_layers={dense_layers}", **base)]
    for label, kw in (policies or {}).items():
        rows.append(measure(label, **kw))
    # sparse_lag with reuse is left out: at a fixed context every step would select (or none would).
    builtin = (
        {"sparse_reuse": 4},
        {"sparse_dense_layers": 0},
        {"sparse_dense_layers": 0, "sparse_reuse": 4},
        {"sparse_lag": 1},
        {"sparse_lag": 1, "sparse_dense_layers": 0},
    )
    for change in () if policies else builtin:
        rows.append(
            measure(f"sparse topk {budget} " + " ".join(f"{k[7:]}={v}" for k, v in change.items()), **(base | change))
        )
    rows.append(measure("dense"))
    for row in rows[:-1]:
        for key in ("graph_ms", "engine_step_ms"):
            row[f"speedup_{key}"] = rows[-1][key] / row[key]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", action="store_true", help="One layer's decode attention (default if no --step).")
    ap.add_argument("--step", metavar="MODEL_DIR", help="Whole decode step of this architecture (config.json).")
    ap.add_argument("--json", help="Write the results here.")
    ap.add_argument("--sweep", action="store_true", help="--kernel: also time the parts over launch configurations.")
    ap.add_argument("--profile", action="store_true", help="--kernel: kernel times inside the topk graphs.")
    ap.add_argument(
        "--step-policies",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="--step: these instead of the built-in variants, beside topk 2048 and dense; the accuracy "
        "benchmark's specs, e.g. topp:sparse_budget=4096,sparse_top_p=0.99,block_size=16",
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[131056], help="--step: context lengths")
    ap.add_argument("--batch", type=int, default=4, help="--step: decode batch")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hbm_bytes_per_s": hbm_bandwidth(),
    }
    if args.kernel or not args.step:
        result["kernel"] = kernel_bench(sweep=args.sweep, profile=args.profile)
        print_table(result["kernel"], f"one layer, sparse vs dense decode attention ({result['device']})")
    if args.step:
        from sparseserve.bench.accuracy import parse_policy

        policies = None
        if args.step_policies:
            policies = {(p := parse_policy(spec)).name: dict(p.engine_args) for spec in args.step_policies}
        result["step"] = [
            row for ctx in args.contexts for row in step_bench(args.step, ctx, args.batch, policies=policies)
        ]
        print_table(result["step"], f"decode step ({result['device']})")
    print(
        f"{result['date']}  torch {result['torch']}  triton {result['triton']}  "
        f"HBM copy {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
