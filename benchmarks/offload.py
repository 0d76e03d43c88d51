"""KV offload benchmarks on the GPU, each side by side with its contrast in one run (ratios, not absolute times).

    python -m benchmarks.offload --transfers [--prefill MODEL] [--capacity MODEL] [--json out.json]

--transfers, H2D: 2048 random 16 KB head blocks of a pinned host store gathered into HBM slots by
FlashH2D (one Triton kernel reading the store over UVA), against one large pinned copy of the same
bytes (the PCIe ceiling) and a per-block copy loop (what a naive engine does).
--transfers, D2H: one layer's K/V of a 32K-token prefill leaving the GPU: FlashD2H's contiguous copy
into pinned staging (side stream) plus the CPU writes into the store rows, against per-block copies.
--prefill MODEL: a 32K-token prompt's prefill (MODEL's architecture, random weights) without saving to
the host and with FlashD2H saving (kv_offload); the per-block copies FlashD2H replaces are timed by --transfers.
--capacity MODEL: GPU memory capped at --gpu-memory-gb (default 40, the papers' GPUs), 32K-token
prompts, 256 output tokens: dense attention with every block in HBM against topk 2048 with kv_offload
(working-set-aware batch control on, or off inside the engine for a contrast no configuration gives:
--working-set-control on,off), each at several
request counts: the most requests running at once and the decode throughput; with `--engine-arg
enforce_eager=true` the offload runs also split the decode step into selection, H2D and attention (CUDA events
around each phase, the engine's profiler, on a few decode steps in the middle of the run).
--real MODEL: KV offload on a real model (e.g. smollm2) with real prompts (essays, so consecutive decode queries
have the locality of real text), at each of --batches requests: topk (--budget, default 1024; or --policy SPEC,
e.g. topp with blocks of 16) with every block in HBM against the same policy with kv_offload, side by side per
batch size: decode time per output token (the wall time of an engine step in which every request decodes), HBM
hit ratio (listed head blocks found in the pool), head blocks loaded and bypass reads, and the KV attended and the
bytes over PCIe per output token (FlashH2D's loads, bypass reads and topp's candidate keys). Runs on CPU too (a
smoke test on a tiny model). --repeats N: each pair N times, medians; --host-profile DIR: a cProfile of each
engine's decode steps and where the host's time goes; --gpu-profile STEPS: a torch profile of that many warm
decode steps of each engine, the kernels whose GPU time differs most and each decoder layer's time (the
profiler's hooks outlive it: later host times of the process include their overhead, so TPOT rows come from a
run without it); --offload-arg KEY=VALUE: the offload side's alone (e.g. layer-segmented prefill unpaced, so
that a large batch of long prompts all decode at once).
Every engine here schedules synchronously, each step timed alone, unless `--engine-arg async_scheduling=true` (a
user's `--kv-offload` on CUDA has it; --real then steps each engine in blocks).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import build_engine, free_memory
from sparseserve.bench.gpu_trace import WindowProfile, WindowReport
from sparseserve.bench.hardware import _time_ms, print_table
from sparseserve.bench.steps import StepLog
from sparseserve.config import EngineConfig
from sparseserve.kernels.flash_h2d import flash_h2d_triton

DTYPE = torch.bfloat16


def h2d_bench(num_blocks: int = 2048, store_blocks: int = 65536, bs: int = 32, d: int = 128) -> list[dict]:
    """GB/s of moving num_blocks random head blocks ([2, bs, d] bf16 = 16 KB) host -> HBM."""
    host = torch.empty(store_blocks, 2, bs, d, dtype=DTYPE, pin_memory=True)
    host.view(torch.int16).random_(-(2**15), 2**15 - 1)
    slots = torch.empty(num_blocks + 1, 2, bs, d, dtype=DTYPE, device="cuda")
    key = torch.randperm(store_blocks)[:num_blocks].cuda()
    load = torch.arange(num_blocks, device="cuda")
    nbytes = num_blocks * host[0].numel() * host.element_size()
    contiguous = host[:num_blocks]  # one large pinned copy of the same byte count: the link's ceiling
    dst = torch.empty_like(contiguous, device="cuda")
    key_cpu = key.tolist()

    def per_block() -> None:
        for i, k in enumerate(key_cpu):
            slots[i].copy_(host[k], non_blocking=True)

    rows = []
    for name, fn in [
        ("one large pinned copy", lambda: dst.copy_(contiguous, non_blocking=True)),
        ("FlashH2D (Triton, UVA gather)", lambda: flash_h2d_triton(host, slots, key, load)),
        ("per-block copy loop", per_block),
    ] + [
        (f"FlashH2D chunk={c} warps={w}", lambda c=c, w=w: flash_h2d_triton(host, slots, key, load, c, w))
        for c in (1024, 2048, 8192)
        for w in (2, 4, 8)
    ]:
        ms = _time_ms(fn, iters=20)
        rows.append({"h2d": name, "blocks": num_blocks, "MB": nbytes / 1e6, "ms": ms, "GB/s": nbytes / ms / 1e6})
    flash_h2d_triton(host, slots, key, load)
    # Bit patterns, not values: random bits include NaNs, which never compare equal.
    assert torch.equal(slots[:num_blocks].cpu().view(torch.int16), host[key.cpu()].view(torch.int16)), (
        "FlashH2D gathered wrong blocks"
    )
    for r in rows:
        r["vs large copy"] = r["GB/s"] / rows[0]["GB/s"]
    return rows


def d2h_bench(tokens: int = 32768, hkv: int = 8, d: int = 128, bs: int = 32) -> list[dict]:
    """One layer's new K/V of a `tokens` prefill leaving the GPU into the host store's block layout."""
    from sparseserve.kvcache.host import HostKVStore

    nblk = tokens // bs
    store = HostKVStore(1, nblk, hkv, bs, d, DTYPE, pin=True, device=torch.device("cuda"))
    store.attach_d2h(tokens, max_seqs=1)
    k = torch.randn(tokens, hkv, d, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    slot_mapping = torch.arange(tokens, device="cuda")
    cache = torch.empty(nblk, hkv, 2, bs, d, dtype=DTYPE, device="cuda")
    cache[:, :, 0] = k.view(nblk, bs, hkv, d).transpose(1, 2)
    cache[:, :, 1] = v.view(nblk, bs, hkv, d).transpose(1, 2)
    nbytes = 2 * k.numel() * k.element_size()

    def flash() -> None:
        store.d2h.submit(0, cache, slot_mapping, num_seqs=1)
        store.fence()

    def per_block() -> None:
        for b in range(nblk):
            store.data[0, b].copy_(cache[b], non_blocking=True)
        torch.cuda.synchronize()

    rows = []
    for name, fn in [("FlashD2H (staging copy + CPU row writes)", flash), ("per-block copies", per_block)]:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = sorted(times)[2] * 1e3
        rows.append(
            {"d2h (one layer)": name, "tokens": tokens, "MB": nbytes / 1e6, "ms": ms, "GB/s": nbytes / ms / 1e6}
        )
    flash()
    assert torch.equal(store.data[0, :nblk], cache.cpu()), "FlashD2H scattered wrong tokens"
    return rows


def _engine(model: str, profiler: StepLog | None = None, **kw):
    """A fresh engine on random weights, after the previous one's memory (the caller dropped it) is back;
    synchronous scheduling unless kw asks (each step is timed alone)."""
    free_memory()
    kw.setdefault("async_scheduling", False)
    return build_engine(profiler, model=model, load_format="dummy", dtype="bfloat16", **kw)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 32000, (n, length), generator=g).tolist()


OFFLOAD = dict(sparse_policy="topk", sparse_budget=2048, kv_offload=True)


def prefill_bench(model: str, tokens: int = 32768, reps: int = 3) -> list[dict]:
    """Prefill time of one `tokens` prompt: no saving (sparse topk, no offload) and FlashD2H saving (the host
    store's writes included: get_stats(sync=True) waits for them)."""
    from sparseserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for name, kw in [("no saving", dict(sparse_policy="topk", sparse_budget=2048)), ("FlashD2H saving", OFFLOAD)]:
        engine = _engine(
            model,
            max_model_len=tokens + 64,
            max_num_seqs=1,
            max_num_batched_tokens=8192,
            gpu_memory_utilization=0.6,
            **kw,
        )
        times = []
        for r in range(reps + 1):
            engine.add_request(f"p{r}", _prompts(1, tokens, seed=r)[0], params)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            engine.get_stats(sync=True)  # the saving is part of the prefill's cost
            times.append(time.perf_counter() - t0)
        engine = None
        ms = 1e3 * sorted(times[1:])[len(times[1:]) // 2]  # the first run compiles
        rows.append({"prefill": name, "tokens": tokens, "ms": ms})
    for r in rows:
        r["vs no saving"] = r["ms"] / rows[0]["ms"]
    return rows


def _head_block_bytes(engine) -> int:
    """Bytes of one pool slot: a KV head's K and V of one token block."""
    runner = engine.model_runner
    return 2 * runner.block_size * runner.arch.head_dim * runner.dtype.itemsize


def capacity_run(
    model: str,
    n: int,
    gpu_gb: float,
    output_len: int,
    prompt_len: int,
    offload: bool,
    host_gb: float,
    reuse: int = 1,
    profile: bool = False,
    working_set_control: bool | None = None,
    **engine_args,
) -> dict:
    """working_set_control: False turns the offload run's working-set-aware batch control off inside the engine
    (its scheduler's limit; KV offload always has it, so this is a contrast only a benchmark makes); engine_args:
    more options of the offload run (dense, the baseline, runs with its defaults).
    profile: a torch profile of one real decode step (its kernel table)."""
    from sparseserve.sampling_params import SamplingParams

    total = torch.cuda.get_device_properties(0).total_memory
    kw = (
        dict(OFFLOAD, host_kv_memory=int(host_gb * 2**30), sparse_reuse=reuse)
        if offload
        else dict(sparse_policy="dense")
    )
    if offload:
        kw.update(engine_args)
    log = StepLog(timing=True)  # GPU time of each decode graph's replay; eager steps: the sparse phases
    engine = _engine(
        model,
        log,
        max_model_len=prompt_len + output_len,
        max_num_seqs=max(n, 1),
        max_num_batched_tokens=8192,
        gpu_memory_utilization=gpu_gb * 1e9 / total,
        **kw,
    )
    control = offload and working_set_control is not False
    if offload and not control:
        engine.scheduler.working_set.ws.enabled = False
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(_prompts(n, prompt_len)):
        engine.add_request(f"c{i}", p, params)
    max_running, decode_tokens, decode_s, decode_steps, ws_max = 0, 0, 0.0, 0, 0
    replays: list[float] = []
    split: dict[str, float] = {}
    split_steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        stats = engine.get_stats()  # host counters; the working sets one step late (no sync)
        max_running, ws_max = max(max_running, stats.num_running), max(ws_max, stats.working_set_blocks)
        log.events.clear()
        torch_profile = profile and decode_steps == 110
        ts = time.perf_counter()
        if torch_profile:  # the kernels of one real decode step
            from torch.profiler import ProfilerActivity, profile as tprofile

            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        else:
            engine.step()
        te = time.perf_counter()
        # A pure decode step: one new token per sequence, none of them a prompt token. Steps that also prefill
        # (an admitted request's chunk) are not decode throughput, on either side.
        if log.last is not None and log.last.pure_decode() and not torch_profile:
            decode_tokens += log.last.rows
            decode_s += te - ts
            decode_steps += 1
            replays += log.times_ms("graph")
            if decode_steps > 100 and split_steps < 5 and any(name != "graph" for name, _, _ in log.events):
                for name in ("selection", "h2d", "attention"):  # eager steps (enforce_eager): the sparse phases
                    split[name] = split.get(name, 0.0) + sum(log.times_ms(name))
                split_steps += 1
    torch.cuda.synchronize()
    replays.sort()
    stats = engine.get_stats(sync=True)
    config = f"topk 2048 + kv_offload, R={reuse}" + ("" if control else ", no working-set control")
    config += "".join(f", {k}={v}" for k, v in engine_args.items() if offload)
    out = {
        "config": config if offload else "dense",
        "requests": n,
        "max_running": max_running,
        "decode_tok_s": decode_tokens / decode_s if decode_s else None,
        "decode_step_ms": 1e3 * decode_s / decode_steps if decode_steps else None,
        "graph_ms": replays[len(replays) // 2] if replays else None,
        # Mean and 90th percentile too: with reuse, steps where many lists are recomputed load most misses.
        "graph_ms_mean": sum(replays) / len(replays) if replays else None,
        "graph_ms_p90": replays[int(0.9 * (len(replays) - 1))] if replays else None,
        "total_s": time.perf_counter() - t0,
        "preemptions": stats.num_preemptions,
    }
    if offload:
        lookups = stats.offload_hbm_hits + stats.offload_hbm_misses
        out["hbm_hit_ratio"] = stats.offload_hbm_hits / lookups if lookups else None
        out["bypass_reads"] = stats.offload_bypass_reads
        out["h2d_GB"] = stats.offload_h2d_bytes / 1e9
        out["uva_GB"] = stats.offload_uva_bytes / 1e9  # bypass reads and topp's candidate keys
        out["hbm_pool_GiB"] = stats.offload_hbm_slots * _head_block_bytes(engine) / 2**30
        out["device_blocks"] = stats.offload_device_blocks
        out["working_set_hold_backs"] = stats.working_set_hold_backs
        out["working_set_limit"] = stats.working_set_limit
        out["working_set_blocks_max"] = ws_max
        out.update({f"eager_{k}_ms": v / split_steps for k, v in split.items() if split_steps})
    return out


def real_prompts(model: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` tokens of the essays (the model's tokenizer), each from its own seeded start."""
    from sparseserve.bench.accuracy import load_tokenizer
    from sparseserve.workloads.datasets import haystack_token_ids

    tok = load_tokenizer(model)
    return [haystack_token_ids(tok, length, f"offload-real:{seed}:{i}") for i in range(n)]


def real_policy(spec: str | None, budget: int | None, engine_args: list[str]) -> dict:
    """--real's selection: --policy SPEC (the accuracy benchmark's names) or topk, then --engine-arg; the budget
    from the spec, else --budget, else topk's 1024 here and any other policy's own (topp: its cap of 4096)."""
    from sparseserve.bench.accuracy import parse_engine_args, parse_policy

    policy = {"sparse_policy": "topk"} | (dict(parse_policy(spec).engine_args) if spec else {})
    policy |= parse_engine_args(engine_args)
    if "sparse_budget" not in policy and (budget is not None or policy["sparse_policy"] == "topk"):
        policy["sparse_budget"] = budget or 1024
    return policy


def policy_label(policy: dict) -> str:
    """`topk 1024`, or with the arguments that shape a topp / finer-block selection: `topp 4096, p=0.95, blocks=16`."""
    names = {"sparse_top_p": "p", "block_size": "blocks", "logical_page_size": "pages"}
    extra = "".join(f", {short}={policy[k]}" for k, short in names.items() if k in policy)
    return f"{policy['sparse_policy']} {policy['sparse_budget']}{extra}"


class GpuWindow:
    """A torch profile of the GPU timeline (bench/gpu_trace.py) over `steps` decode steps run back to back (RealRun.
    profile: the profiler sees the whole process, so another engine must not step inside it; under async
    scheduling the other engine's step in flight may still show at the start), once `skip` timed steps in which
    every request decoded have run (warm); the profiled steps stay out of TPOT."""

    def __init__(self, steps: int, skip: int = 12) -> None:
        self.steps, self.skip = steps, skip
        self.full_steps = self.profiled = 0
        self.report: WindowReport | None = None
        self.dense_layers = 0  # the engine's sparse_dense_layers (RealRun.profile)

    def wants(self) -> bool:
        return self.report is None and self.full_steps >= self.skip

    def result(self) -> dict | None:
        """Per profiled step: the GPU's busy and idle ms and each kernel's us on the critical path (None: no step
        was profiled)."""
        if self.report is None or not self.profiled:
            return None
        n, r = self.profiled, self.report
        return {
            "steps": n,
            "gpu_busy_ms": r.busy_ms / n,
            "gpu_idle_ms": r.idle_ms / n,
            "kernel_us": {k: 1e3 * ms / n for k, ms in sorted(r.by_kernel.items(), key=lambda kv: -kv[1])},
            "layer_us": r.layer_us,
            "dense_layers": self.dense_layers,
        }


class RealRun:
    """One engine of the real-model comparison, stepped by the caller: all prompts at once (max_num_seqs = their
    number), greedy, `output_len` tokens each (EOS ignored), topk at `budget` (or the policy that engine_args
    name, e.g. topp's sparse_policy / sparse_budget / sparse_top_p / block_size) with or without kv_offload. Decode
    time per output token is the mean wall time of the timed engine steps in which every request decodes (TPOT:
    each request gets one token per step), and their median (robust to the host's occasional stalls); on a GPU
    also the GPU time of those steps' decode graphs (CUDA events around the replay: what the device spends on
    a step's model, apart from the host's time between steps); the offload counters cover the run.
    pool_steps: HBM pool size in decode steps' selections of the whole batch (None: the engine's default, one).
    margins: also keep each step's top-2 logprobs (for `divergence`; it adds work to every step, so TPOT then is
    not comparable with runs without it)."""

    def __init__(
        self,
        model: str,
        prompts: list[list[int]],
        output_len: int,
        offload: bool,
        budget: int | None = 1024,
        pool_steps: float | None = None,
        device: str = "auto",
        dtype: str = "auto",
        margins: bool = False,
        **engine_args,
    ) -> None:
        from sparseserve.sampling_params import SamplingParams

        self.n, self.prompt_len = len(prompts), max(len(p) for p in prompts)
        offload_args = engine_args.pop("offload_engine_args", None) or {}  # the offload side's alone
        self.offload_note = "".join(f", {k}={v}" for k, v in offload_args.items())
        self.offload, self.output_len, self.margins = offload, output_len, margins
        # budget None: the policy's own (topp's cap 4096), else topk --budget's
        policy = {"sparse_policy": "topk"} | ({} if budget is None else {"sparse_budget": budget}) | engine_args
        kw = dict(
            model=model,
            device=device,
            dtype=dtype,
            max_model_len=self.prompt_len + output_len,
            max_num_seqs=self.n,
            **policy,
        )
        # the same selection with and without offload: KV offload's default lag and topp's hold, unless given
        offloaded = EngineConfig.from_kwargs(**kw, kv_offload=True, **offload_args)
        self.label = policy_label(policy | {"sparse_budget": offloaded.sparse_config.sparse_budget})
        kw.setdefault("sparse_lag", offloaded.sparse_config.sparse_lag)
        kw.setdefault("sparse_topp_flat_hold", offloaded.sparse_config.sparse_topp_flat_hold)
        kw.setdefault("async_scheduling", False)  # both sides synchronous unless asked (each step is timed)
        if offload:
            kw |= offload_args | {"kv_offload": True}
            if pool_steps is not None:
                from sparseserve.models.config import ArchConfig
                from sparseserve.models.loader import load_hf_config, resolve_model_dir

                a = ArchConfig.from_hf(load_hf_config(resolve_model_dir(model)))
                sp = offloaded.sparse_config  # the policy's budget and block size where not given
                per_list = sp.sparse_budget // offloaded.cache_config.block_size
                sparse_layers = a.num_layers - sp.sparse_dense_layers
                kw["hbm_cache_blocks"] = max(1, int(pool_steps * self.n * sparse_layers * a.num_kv_heads * per_list))
        # the engine's profiler: each step's schedule, and the decode graphs' GPU time (CUDA graphs only)
        self.log = StepLog(timing=True)
        self.engine = build_engine(self.log, **kw)
        params = SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=2 if margins else None
        )
        for i, p in enumerate(prompts):
            self.engine.add_request(f"r{i}", p, params)
        self.step_s: list[float] = []
        self.tokens: dict[str, list[int]] = {}
        self.top2: dict[str, list[float]] = {}  # request -> per output token: top-1 minus top-2 logprob
        self.max_running, self.total_s = 0, 0.0
        self.graph_events: list = []
        # Where the host's time goes (the caller sets a cProfile.Profile): the timed steps that follow a step in
        # which every request decoded; their wall times then include the profiler's overhead.
        self.host_profile: cProfile.Profile | None = None
        self.profiled_steps = 0
        self.gpu_window: GpuWindow | None = None  # the caller's, as host_profile
        self._decoding = False

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self, timed: bool = True) -> None:
        engine = self.engine
        self.max_running = max(self.max_running, engine.get_stats().num_running)
        prof = self.host_profile if timed and self._decoding else None
        self.log.events.clear()
        ts = time.perf_counter()
        if prof is not None:
            prof.enable()
        outs = engine.step()  # ends in the step's one host sync (the sampled tokens)
        if prof is not None:
            prof.disable()
            self.profiled_steps += 1
        te = time.perf_counter()
        self.total_s += te - ts
        for o in outs:  # deltas: each output holds the tokens new since the last
            for c in o.outputs:
                self.tokens.setdefault(o.request_id, []).extend(c.token_ids)
                for alts in c.logprobs or []:
                    best = sorted((lp.logprob for lp in alts.values()), reverse=True)
                    self.top2.setdefault(o.request_id, []).append(best[0] - best[1] if len(best) > 1 else float("inf"))
        full = self.log.last is not None and self.log.last.pure_decode(self.n)
        if full and timed:
            self.step_s.append(te - ts)
            self.graph_events += [e for e in self.log.events if e[0] == "graph"]
            if self.gpu_window is not None:
                self.gpu_window.full_steps += 1
        self._decoding = full

    def profile(self) -> None:
        """The GPU window's steps, back to back, once it wants them and the last step had every request decoding
        (the caller calls it before each step; nothing otherwise)."""
        w = self.gpu_window
        if w is None or not self._decoding or not w.wants():
            return
        prof = WindowProfile()
        prof.start()
        while w.profiled < w.steps and not self.done:
            self.step(timed=False)
            w.profiled += 1
        w.report = prof.stop(self.engine.model_runner.arch.num_layers)
        w.dense_layers = self.engine.config.sparse_config.sparse_dense_layers

    def result(self) -> dict:
        engine, n, steps = self.engine, self.n, self.step_s
        stats = engine.get_stats(sync=True)
        tokens = max(stats.num_generation_tokens, 1)
        graph = self.log.times_ms("graph", self.graph_events)
        out = {
            "config": self.label + (" + KV offload" + self.offload_note if self.offload else ", all KV in HBM"),
            "batch": n,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "max_running": self.max_running,
            "decode_steps": len(steps),
            "tpot_ms": 1e3 * sum(steps) / len(steps) if steps else None,
            "tpot_median_ms": 1e3 * statistics.median(steps) if steps else None,
            "graph_median_ms": statistics.median(graph) if graph else None,
            "total_s": self.total_s,
            "preemptions": stats.num_preemptions,
            "tokens_attended": (
                stats.sparse_blocks_selected * engine.config.cache_config.block_size / stats.sparse_selections
            )
            if stats.sparse_selections
            else None,
            # the KV the sparse layers attend per output token (per sequence-step), wherever it is read from
            "attended_KB_per_token": stats.sparse_blocks_selected * _head_block_bytes(engine) / tokens / 1e3,
        }
        if self.offload:
            lookups = stats.offload_hbm_hits + stats.offload_hbm_misses
            out.update(
                hbm_hit_ratio=stats.offload_hbm_hits / lookups if lookups else None,
                blocks_loaded=stats.offload_blocks_loaded,
                blocks_filled=stats.offload_blocks_filled,  # from layer-segmented prefills, into free slots
                bypass_reads=stats.offload_bypass_reads,
                h2d_GB=stats.offload_h2d_bytes / 1e9,
                uva_GB=stats.offload_uva_bytes / 1e9,  # bypass reads and topp's candidate keys
                prune_key_reads=stats.offload_prune_key_reads,
                hold_backs=stats.working_set_hold_backs,  # requests the working-set limit paused
                # what crosses PCIe per output token, and as a share of what is attended (topk: about 1 - the
                # hit ratio; topp: its candidates' misses over the kept entries)
                pcie_KB_per_token=(stats.offload_h2d_bytes + stats.offload_uva_bytes) / tokens / 1e3,
                hbm_pool_GiB=stats.offload_hbm_slots * _head_block_bytes(engine) / 2**30,
            )
            if out["attended_KB_per_token"]:
                out["pcie_of_attended"] = out["pcie_KB_per_token"] / out["attended_KB_per_token"]
        if self.host_profile is not None:
            out["host_profile_steps"] = self.profiled_steps
            out["_host_profile"] = self.host_profile
        if self.gpu_window is not None:
            out["gpu_profile"] = self.gpu_window.result()
        out["_tokens"] = [self.tokens[f"r{i}"] for i in range(n)]  # for the side-by-side check; not printed
        if self.margins:
            out["_margins"] = [self.top2.get(f"r{i}", []) for i in range(n)]
        return out


def real_run(
    model: str,
    prompts: list[list[int]],
    output_len: int,
    offload: bool,
    budget: int | None = 1024,
    pool_steps: float | None = None,
    device: str = "auto",
    dtype: str = "auto",
    margins: bool = False,
    host_profile: bool = False,
    gpu_profile: int = 0,
    **engine_args,
) -> dict:
    """One engine alone, run to the end (RealRun; host_profile: a cProfile of its decode steps; gpu_profile: a GPU
    profile of that many of them, GpuWindow)."""
    free_memory()
    run = RealRun(model, prompts, output_len, offload, budget, pool_steps, device, dtype, margins, **engine_args)
    run.host_profile = cProfile.Profile() if host_profile else None
    run.gpu_window = GpuWindow(gpu_profile) if gpu_profile else None
    while not run.done:
        run.profile()
        run.step()
    return run.result()


def real_pair(
    model: str,
    prompts: list[list[int]],
    output_len: int,
    budget: int | None = 1024,
    pool_steps: float | None = None,
    device: str = "auto",
    dtype: str = "auto",
    margins: bool = False,
    block: int | None = None,
    skip: int | None = None,
    host_profile: bool = False,
    gpu_profile: int = 0,
    **engine_args,
) -> tuple[dict, dict]:
    """All KV in HBM and KV offload side by side in one process, both engines alive, stepped in turn `block` steps
    at a time (the first `skip` of each block untimed: under async scheduling a block's first steps overlap the
    other engine's step in flight): a shared machine's slow and fast periods then fall on both alike. Each engine
    gets half of the GPU memory the engine would take alone. block, skip: by default 32 and 2 where either engine
    schedules async, else 1 and 0."""
    free_memory()
    util = engine_args.pop("gpu_memory_utilization", 0.9)
    # The second engine's share counts the first's memory as used (runner: total * utilization - used).
    runs = [
        RealRun(
            model,
            prompts,
            output_len,
            off,
            budget,
            pool_steps,
            device,
            dtype,
            margins,
            gpu_memory_utilization=util * (1 + off) / 2,
            **engine_args,
        )
        for off in (False, True)
    ]
    for run in runs:
        run.host_profile = cProfile.Profile() if host_profile else None
        run.gpu_window = GpuWindow(gpu_profile) if gpu_profile else None
    overlapped = any(r.engine.async_scheduling for r in runs)  # resolved by each engine
    block = (32 if overlapped else 1) if block is None else block
    skip = (2 if overlapped else 0) if skip is None else skip
    while not all(r.done for r in runs):
        for run in runs:
            for i in range(block):
                run.profile()
                if run.done:
                    break
                run.step(timed=i >= skip)
    return runs[0].result(), runs[1].result()


def divergence(
    base_tokens: list[list[int]], base_margins: list[list[float]] | None, other_tokens: list[list[int]]
) -> dict:
    """Where two greedy runs of the same requests part: requests that differ, the first differing position of
    each, and the reference run's top-1 minus top-2 logprob there. A near tie (a margin within the rounding of
    the model's dtype) says the runs parted on rounding, a large margin on a different computation."""
    firsts, at = [], []
    for i, (a, b) in enumerate(zip(base_tokens, other_tokens)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None and len(a) == len(b):
            continue
        k = min(len(a), len(b)) if k is None else k
        firsts.append(k)
        if base_margins is not None and k < len(base_margins[i]):
            at.append(base_margins[i][k])
    return {
        "requests_differing": len(firsts),
        "first_difference_at": sorted(firsts),
        "margin_at_difference": sorted(at) if base_margins is not None else None,
    }


def _flat(rows: list[dict]) -> list[dict]:
    """The rows for a table: the divergence detail (lists) stays in the JSON."""
    return [{k: v for k, v in r.items() if k not in ("divergence", "repeats", "gpu_profile")} for r in rows]


def real_bench(
    model: str,
    batches: list[int],
    prompt_len: int | None,
    output_len: int,
    budget: int | None = 1024,
    pool_steps: float | None = None,
    device: str = "auto",
    dtype: str = "auto",
    margins: bool = False,
    interleave: bool = True,
    repeats: int = 1,
    host_profile: str | None = None,
    gpu_profile: int = 0,
    **engine_args,
) -> list[dict]:
    """Per batch size: topk with every block in HBM and with KV offload, on the same prompts, side by side
    (real_pair; interleave False: one after the other, real_run); the offload row carries its TPOT ratio to the
    HBM-only row. prompt_len None: the model's context less output_len. repeats > 1: the pair runs that many
    times (fresh engines); a row holds the median of each number over the repeats (ratios: of the per-repeat
    ratios) and the repeats themselves (`repeats`): a busy host moves a whole process's times by tens of
    percent. host_profile: a folder for a cProfile of each engine's decode steps (`host_{hbm,offload}_b{batch}_
    r{repeat}.prof`, and a table of the functions taking the most host time a step); the times in the rows then
    include the profiler's overhead. gpu_profile: that many decode steps of each engine under the torch profiler
    (GpuWindow; `gpu_profile` in the rows, and a table of the kernels whose time differs most)."""
    if prompt_len is None:
        from sparseserve.bench.accuracy import model_context

        prompt_len = model_context(model) - output_len
    prompts = real_prompts(model, max(batches), prompt_len)
    if host_profile:
        Path(host_profile).mkdir(parents=True, exist_ok=True)
    rows = []
    for b in batches:
        pairs = [
            _real_compared(
                model,
                prompts[:b],
                output_len,
                budget,
                pool_steps,
                device,
                dtype,
                margins,
                interleave,
                host_profile and str(Path(host_profile) / f"host_{{}}_b{b}_r{r}.prof"),
                gpu_profile,
                **engine_args,
            )
            for r in range(repeats)
        ]
        pair = pairs[0] if repeats == 1 else [_median_row([p[k] for p in pairs]) for k in (0, 1)]
        rows += pair
        print_table(_flat(pair), "")
    return rows


def _real_compared(
    model: str,
    prompts: list[list[int]],
    output_len: int,
    budget: int | None,
    pool_steps: float | None,
    device: str,
    dtype: str,
    margins: bool,
    interleave: bool,
    profile_path: str | None,
    gpu_profile: int = 0,
    **engine_args,
) -> list[dict]:
    """One HBM / offload pair of real_bench, the offload row with its ratios and the token check; profile_path:
    where each engine's host profile goes ({} = hbm / offload)."""
    if interleave:
        pair = list(
            real_pair(
                model,
                prompts,
                output_len,
                budget,
                pool_steps,
                device,
                dtype,
                margins,
                host_profile=bool(profile_path),
                gpu_profile=gpu_profile,
                **engine_args,
            )
        )
    else:
        pair = [
            real_run(
                model,
                prompts,
                output_len,
                off,
                budget,
                pool_steps,
                device,
                dtype,
                margins,
                host_profile=bool(profile_path),
                gpu_profile=gpu_profile,
                **engine_args,
            )
            for off in (False, True)
        ]
    for row, name in zip(pair, ("hbm", "offload")):
        prof = row.pop("_host_profile", None)
        if prof is not None:
            prof.dump_stats(profile_path.format(name))
            print_table(
                host_profile_table(pstats.Stats(prof), row["host_profile_steps"]),
                f"{name}, batch {len(prompts)}: host time a decode step under cProfile",
            )
    base, off = pair
    if base.get("gpu_profile") and off.get("gpu_profile"):
        print_table(
            kernel_diff_table(base["gpu_profile"], off["gpu_profile"]),
            f"batch {len(prompts)}: GPU time a decode step (critical path, us), the kernels that differ most",
        )
        layers = layer_table(base["gpu_profile"], off["gpu_profile"])
        if layers:
            print_table(layers, f"batch {len(prompts)}: GPU time a decoder layer (us, start to start, median step)")
    off["tpot_vs_hbm"] = off["tpot_ms"] / base["tpot_ms"] if off["tpot_ms"] and base["tpot_ms"] else None
    if off["tpot_median_ms"] and base["tpot_median_ms"]:
        off["median_vs_hbm"] = off["tpot_median_ms"] / base["tpot_median_ms"]
    if off["graph_median_ms"] and base["graph_median_ms"]:
        off["graph_vs_hbm"] = off["graph_median_ms"] / base["graph_median_ms"]
    # KV offload changes where blocks are read from, never a token.
    base_tokens, off_tokens = base.pop("_tokens"), off.pop("_tokens")
    off["same_tokens"] = base_tokens == off_tokens
    base_margins = base.pop("_margins", None)
    off.pop("_margins", None)
    if not off["same_tokens"]:
        off["divergence"] = divergence(base_tokens, base_margins, off_tokens)
        print(f"batch {len(prompts)}: tokens differ: {off['divergence']}")
    return pair


def kernel_diff_table(hbm: dict, offload: dict, top: int = 15) -> list[dict]:
    """GpuWindow results of the two engines side by side: the GPU's busy time a step, then the kernels whose
    critical-path time a step differs most (offload minus HBM)."""
    rows = [{"kernel": "(GPU busy)", "hbm_us": 1e3 * hbm["gpu_busy_ms"], "offload_us": 1e3 * offload["gpu_busy_ms"]}]
    a, b = hbm["kernel_us"], offload["kernel_us"]
    names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0.0) - a.get(n, 0.0)))[:top]
    rows += [{"kernel": n[:70], "hbm_us": a.get(n, 0.0), "offload_us": b.get(n, 0.0)} for n in names]
    for r in rows:
        r["diff_us"] = r["offload_us"] - r["hbm_us"]
    return rows


def layer_table(hbm: dict, offload: dict) -> list[dict]:
    """GpuWindow results side by side by decoder layer position (bench/gpu_trace.py layer_times): each dense layer
    and the first sparse one (the lag's plan of the step runs beside them), then the other sparse layers' mean
    (the last layer is not measured). [] without both engines' layer times."""
    a, b = hbm.get("layer_us"), offload.get("layer_us")
    if not a or not b or len(a) != len(b):
        return []
    first = min(offload.get("dense_layers", 0) + 1, len(a))
    rows = [{"layers": f"layer {i}", "hbm_us": a[i], "offload_us": b[i]} for i in range(first)]
    if first < len(a):
        n = len(a) - first
        rows.append(
            {
                "layers": f"layers {first}-{len(a) - 1}, mean",
                "hbm_us": sum(a[first:]) / n,
                "offload_us": sum(b[first:]) / n,
            }
        )
    for r in rows:
        r["diff_us"] = r["offload_us"] - r["hbm_us"]
    return rows


def host_profile_table(stats: pstats.Stats, steps: int, top: int = 15) -> list[dict]:
    """The engine's functions with the most cumulative host time a step (microseconds; the profiler inflates
    Python calls, so compare rows of one run, not with unprofiled times)."""
    rows = [
        {
            "function": f"{file.rsplit('sparseserve/', 1)[-1]}:{line}({name})",
            "calls_per_step": nc / steps,
            "self_us": 1e6 * tt / steps,
            "cumulative_us": 1e6 * ct / steps,
        }
        for (file, line, name), (_, nc, tt, ct, _) in stats.stats.items()
        if "sparseserve" in file
    ]
    return sorted(rows, key=lambda r: -r["cumulative_us"])[:top] if steps else []


def _median_row(runs: list[dict]) -> dict:
    """One row for several repeats of a run: the median of each number that differs between them, the first
    run's other fields (the token check: all repeats must agree), every repeat under `repeats`."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and any(r.get(k) != v for r in runs):
            vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
            out[k] = statistics.median(vals) if len(vals) == len(runs) else None
    if "same_tokens" in out:
        out["same_tokens"] = all(r["same_tokens"] for r in runs)
    out["repeats"] = runs
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from sparseserve.bench.accuracy import parse_engine_args

    p.add_argument("--transfers", action="store_true", help="FlashH2D / FlashD2H against their contrasts")
    p.add_argument("--prefill", metavar="MODEL", help="32K prefill with and without FlashD2H saving")
    p.add_argument("--capacity", metavar="MODEL", help="concurrency and decode throughput, dense vs offload")
    p.add_argument("--dense-requests", default="4,5,8", help="request counts for dense (--capacity)")
    p.add_argument("--offload-requests", default="20,24", help="request counts for offload (--capacity)")
    p.add_argument("--profile", action="store_true", help="kernel table of one decode graph replay (--capacity)")
    p.add_argument("--reuse", default="1", help="sparse_reuse values for offload (--capacity)")
    p.add_argument(
        "--working-set-control",
        default=None,
        help="working-set-aware batch control of the offload runs: on, off (turned off inside the engine: the "
        "thrashing contrast), or on,off for both (--capacity; default: on)",
    )
    p.add_argument("--gpu-memory-gb", type=float, default=40.0, help="GPU memory cap (--capacity)")
    p.add_argument("--host-kv-gb", type=float, default=100.0, help="host KV store size (--capacity)")
    p.add_argument("--real", metavar="MODEL", help="KV offload on a real model (e.g. smollm2) vs all KV in HBM")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="request counts (--real)")
    p.add_argument(
        "--budget", type=int, default=None, help="sparse_budget (--real; default: topk's 1024, a --policy's own)"
    )
    p.add_argument(
        "--policy",
        default=None,
        metavar="SPEC",
        help="--real: the selection instead of topk --budget, as the accuracy benchmark names it, e.g. "
        "topp:sparse_budget=4096,sparse_top_p=0.95,block_size=16,logical_page_size=8 (--engine-arg overrides it)",
    )
    p.add_argument(
        "--pool-steps",
        type=float,
        default=None,
        help="HBM pool in decode steps' selections of the batch (--real; default: the engine's, one)",
    )
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (--real)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine argument (repeatable), e.g. sparse_reuse=4: of both sides with --real, of the "
        "offload runs with --capacity",
    )
    p.add_argument(
        "--offload-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--real: engine argument of the offload side only (repeatable), e.g. segment_decode_steps=0 with "
        "prefill_layer_segment=64, so that every prompt is prefilled before the first request ends",
    )
    p.add_argument("--dtype", default=None, help="model dtype (--real; default: bfloat16 on a GPU, else auto)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens (default: 32768; --real: the model's context less --output-len)",
    )
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--margins",
        action="store_true",
        help="--real: where the two runs' greedy tokens part, the top-1 minus top-2 logprob of the "
        "all-in-HBM run there (a near tie: rounding; TPOT then includes computing the logprobs)",
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--real: both engines alive in one process, stepped in turn (default), or one after the other",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="--real: runs of each pair (fresh engines); the table holds each number's median",
    )
    p.add_argument(
        "--host-profile",
        metavar="DIR",
        default=None,
        help="--real: a cProfile of each engine's decode steps into DIR, and a table of where the host's "
        "time goes (the rows' times then include the profiler's overhead)",
    )
    p.add_argument(
        "--gpu-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="--real: torch-profile STEPS warm full-batch decode steps of each engine (left out of TPOT) and print "
        "the kernels whose GPU time differs most and each decoder layer's GPU time (the later rows' host times "
        "include the profiler's overhead)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    if not on_gpu and (args.transfers or args.prefill or args.capacity):
        raise SystemExit("the offload benchmarks need a CUDA GPU (--real also runs on CPU)")
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
    }
    if args.real:
        policy = real_policy(args.policy, args.budget, args.engine_arg)
        if args.offload_arg:
            policy["offload_engine_args"] = parse_engine_args(args.offload_arg)
        rows = real_bench(
            args.real,
            [int(b) for b in args.batches.split(",") if b],
            args.prompt_len,
            args.output_len,
            None,  # the budget: in the policy
            args.pool_steps,
            args.device,
            args.dtype or ("bfloat16" if on_gpu else "auto"),
            args.margins,
            args.interleave,
            args.repeats,
            args.host_profile,
            args.gpu_profile,
            **policy,
        )
        result["real"] = rows
        print_table(
            _flat(rows),
            f"{args.real}: all KV in HBM vs KV offload; TPOT = decode time "
            f"per output token (steps where every request decodes)",
        )
    if args.transfers:
        result["h2d"] = h2d_bench()
        print_table(result["h2d"], "Host -> HBM, 2048 random 16 KB head blocks")
        result["d2h"] = d2h_bench()
        print_table(result["d2h"], "HBM -> host store, one layer of a 32K prefill (8 KV heads, D=128)")
    if args.prefill:
        result["prefill"] = prefill_bench(args.prefill, args.prompt_len or 32768)
        print_table(
            result["prefill"], f"Prefill of one {args.prompt_len or 32768}-token prompt, saving to the host store"
        )
    if args.capacity:
        rows = []
        controls = (
            [None]
            if args.working_set_control is None
            else [{"on": True, "off": False}[c] for c in args.working_set_control.split(",")]
        )
        runs = [(False, n, 1, None) for n in args.dense_requests.split(",") if n] + [
            (True, n, r, c)
            for n in args.offload_requests.split(",")
            if n
            for r in args.reuse.split(",")
            for c in controls
        ]
        for offload, n, r, c in runs:
            rows.append(
                capacity_run(
                    args.capacity,
                    int(n),
                    args.gpu_memory_gb,
                    args.output_len,
                    args.prompt_len or 32768,
                    offload,
                    args.host_kv_gb,
                    int(r),
                    args.profile,
                    c,
                    **parse_engine_args(args.engine_arg),
                )
            )
            print_table(rows[-1:], "")
        result["capacity"] = rows
        best = {c: max((r["decode_tok_s"] or 0) for r in rows if r["config"] == c) for c in {r["config"] for r in rows}}
        print_table(
            rows,
            f"{args.prompt_len or 32768}-token prompts, {args.output_len} out, GPU memory capped at "
            f"{args.gpu_memory_gb:g} GB; best decode tok/s: {best}",
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
