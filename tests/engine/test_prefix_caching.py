"""Automatic prefix caching through the engine (CPU): a repeated 4K-token prompt computes only its last block,
a different cache_salt shares nothing, and caching never changes a token: greedy outputs with caching on
equal those with caching off over random schedules of requests sharing prefixes at random lengths, with
chunked prefill and forced preemption, for dense attention, topk, topp and KV offload, while the block
accounting (reference counts, free + evictable + in use == total, cached blocks never overwritten) holds
after every step."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.config import EngineConfig
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from tests.conftest import make_hf_model
from tests.kernel_utils import gpu_only
from tests.schedules import CachedBlockContents, drive_random_schedule, held_blocks, shared_prefix_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
NO_RESERVE = dict(init_new_token_ratio=0.0, min_new_token_ratio=0.0)  # greedy admission: preemptions happen


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("long-llama")
    make_hf_model(
        path,
        "LlamaConfig",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_size=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    return path


def test_flag_and_defaults():
    assert EngineConfig().cache_config.enable_prefix_caching is True  # on by default, like vLLM
    for argv, want in (([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
        args = build_parser(["generate"]).parse_args(["generate", *argv])
        assert engine_kwargs_from_args(args)["enable_prefix_caching"] is want
    assert EngineConfig.from_kwargs(enable_prefix_caching=False).cache_config.enable_prefix_caching is False


def test_repeated_4k_prompt_computes_only_its_last_block_and_salt_isolates(long_model_dir):
    llm = LLM(
        str(long_model_dir),
        device="cpu",
        dtype="float32",
        block_size=32,
        max_model_len=4200,
        max_num_batched_tokens=2048,
    )
    engine = llm.llm_engine
    prompt = torch.randint(10, 4000, (4096,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(request: dict) -> tuple[list[int], int | None, dict]:
        before = engine.get_stats()
        out = llm.generate([request], GREEDY, use_tqdm=False)[0]
        after = engine.get_stats()
        delta = {
            k: getattr(after, k) - getattr(before, k)
            for k in ("num_prompt_tokens", "prefix_cache_queries", "prefix_cache_hits")
        }
        return out.outputs[0].token_ids, out.num_cached_tokens, delta

    first, cached, d1 = run({"prompt_token_ids": prompt})
    assert cached == 0
    assert d1 == {"num_prompt_tokens": 4096, "prefix_cache_queries": 4096, "prefix_cache_hits": 0}
    second, cached, d2 = run({"prompt_token_ids": prompt})
    assert cached == 4064
    # 128 full blocks; the last is recomputed (a request always computes its last token): 32 tokens
    assert d2 == {"num_prompt_tokens": 32, "prefix_cache_queries": 4096, "prefix_cache_hits": 4064}
    assert second == first
    salted, cached, d3 = run({"prompt_token_ids": prompt, "cache_salt": "tenant-a"})
    assert cached == 0
    assert d3 == {"num_prompt_tokens": 4096, "prefix_cache_queries": 4096, "prefix_cache_hits": 0}
    assert salted == first
    _, _, d4 = run({"prompt_token_ids": prompt, "cache_salt": "tenant-a"})
    assert d4["num_prompt_tokens"] == 32 and d4["prefix_cache_hits"] == 4064
    _, _, d5 = run({"prompt_token_ids": prompt[:2000] + [7] + prompt[2001:]})  # shares the blocks before 2000
    assert d5["prefix_cache_hits"] == 2000 // 32 * 32 and d5["num_prompt_tokens"] == 4096 - 2000 // 32 * 32
    stats = engine.get_stats()
    assert stats.prefix_cache_blocks > 0 and stats.num_blocks_used == 0
    engine.allocator.check()
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt[:10], "cache_salt": ""}], GREEDY, use_tqdm=False)
    assert engine.reset_prefix_cache() == stats.prefix_cache_blocks and engine.get_stats().prefix_cache_blocks == 0


def test_caching_off_shares_nothing(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    prompt = list(range(100, 180))
    llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_prompt_tokens == 3 * 80 and stats.prefix_cache_hits == 0 and stats.prefix_cache_blocks == 0


def assert_same_tokens(on: dict, off: dict, aborted: set[str]) -> None:
    """Requests never aborted finish in both runs with equal tokens; an aborted one (stopped at a step the runs
    reach at different points of its generation) has, in each run, a prefix of the other's tokens."""
    for rid in on.keys() | off.keys():
        if rid not in aborted:
            assert on[rid][0] and off[rid][0] and on[rid][1] == off[rid][1], rid
        elif rid in on and rid in off:
            assert all(x[: len(y)] == y[: len(x)] for x, y in zip(on[rid][1], off[rid][1])), rid
    assert len(on.keys() - aborted) > 5


def run_schedule(
    model_dir, seed: int, caching: bool, check: bool, control: bool = True, **kw
) -> tuple[dict, set[str], object]:
    """A random schedule (arrivals of prompts sharing prefixes, aborts, steps) on a KV cache small enough to
    preempt, greedy requests; returns every request's tokens. check: the accounting after every step. control=False:
    KV offload's working-set limit off inside the engine (no configuration does that: the memory preemptions it
    prevents)."""
    rng = random.Random(seed)
    if not caching:
        kw.pop("host_prefix_cache_memory", None)  # the host tier is the prefix cache's
    llm = LLM(
        str(model_dir),
        **{
            "device": "cpu",
            "dtype": "float32",
            "max_model_len": 96,
            "max_num_seqs": 5,
            "max_num_batched_tokens": rng.choice([16, 48]),
            "enable_prefix_caching": caching,
            **NO_RESERVE,
            **kw,
        },
    )
    engine = llm.llm_engine
    if not control:
        engine.scheduler.working_set.ws.enabled = False
    folded: dict = {}  # request id -> its RequestOutput with every delta so far folded in
    aborted: set[str] = set()
    contents = CachedBlockContents(engine)

    def after_step(outs) -> None:
        for out in outs:
            if out.request_id in folded:
                folded[out.request_id].add(out)
            else:
                folded[out.request_id] = out
        if check:
            held_blocks(engine)
            contents.check()
            if engine.model_runner.host_cache is not None:
                engine.model_runner.host_cache.check()

    drive_random_schedule(
        engine,
        rng,
        steps=40,
        max_new=24,
        after_step=after_step,
        greedy=True,
        prompts=shared_prefix_prompts(seed),
        aborted=aborted,
    )
    while engine.has_unfinished_requests():
        after_step(engine.step())
    assert engine.allocator.num_used == 0
    engine.allocator.check()
    if check and caching:
        assert contents.num_checked > 0
    results = {rid: (o.finished, [list(c.token_ids) for c in o.outputs]) for rid, o in folded.items()}
    return results, aborted, engine


BS = 8
# A budget covering max_model_len: every decode still goes through scoring, selection (and the pool) but
# selects every block, so the tokens cannot depend on when a block was computed (prefill or decode).
COVERING = dict(
    sparse_budget=12 * BS, sparse_dense_layers=0, sparse_sink_blocks=1, sparse_local_blocks=2, sparse_dense_context=0
)
OFFLOAD_PATH = dict(
    block_size=BS,
    sparse_policy="topk",
    kv_offload=True,
    hbm_cache_blocks=16,
    host_kv_memory=16 * 2 * 2 * 2 * BS * 128 * 4,
    **COVERING,
)
PATHS = {
    "dense": dict(block_size=16, num_gpu_blocks_override=7),
    "topk": dict(block_size=BS, num_gpu_blocks_override=16, sparse_policy="topk", **COVERING),
    # p = 1: the pruning keeps every candidate (with p < 1 a recomputed block's keys, from a prefill instead of
    # the sparse decode that first computed them, would change what is pruned: recompute, not caching, changes
    # tokens; test_sparse_selection_over_shared_blocks has real pruning without preemption)
    "topp": dict(block_size=BS, num_gpu_blocks_override=16, sparse_policy="topp", sparse_top_p=1.0, **COVERING),
    "offload": OFFLOAD_PATH,
    # the host tier: blocks the small device cache evicts (a preempted request's too) are copied back
    "dense+host": dict(block_size=16, num_gpu_blocks_override=7, host_prefix_cache_memory=4 << 20),
    "topk+host": dict(
        block_size=BS, num_gpu_blocks_override=16, sparse_policy="topk", host_prefix_cache_memory=4 << 20, **COVERING
    ),
    # without the working-set limit (inside the engine): the batch outgrows the host store, requests are preempted
    "offload-unlimited": dict(OFFLOAD_PATH, control=False),
    # a device block cache of one max_model_len sequence: prefills wait for it, decodes are paused
    "offload-paused": dict(
        block_size=BS,
        sparse_policy="topk",
        kv_offload=True,
        hbm_cache_blocks=16,
        host_kv_memory=16 * 2 * 2 * 2 * BS * 128 * 4,
        num_gpu_blocks_override=12,
        **COVERING,
    ),
}


@pytest.mark.parametrize("path, seed", [(p, 0) for p in PATHS] + [("dense", 1), ("offload-paused", 1)])
def test_caching_on_equals_off_over_random_schedules(tiny_model_dir, path, seed):
    off, aborted, _ = run_schedule(tiny_model_dir, seed, caching=False, check=False, **PATHS[path])
    on, aborted_on, engine = run_schedule(tiny_model_dir, seed, caching=True, check=True, **PATHS[path])
    assert aborted == aborted_on
    assert_same_tokens(on, off, aborted)
    stats = engine.get_stats(sync=True)
    # KV offload's working-set limit keeps the batch small: requests are held back (paused) instead of preempted
    limited = PATHS[path].get("kv_offload") and PATHS[path].get("control", True)
    assert stats.prefix_cache_hits > 0 and (stats.working_set_hold_backs if limited else stats.num_preemptions) > 0
    assert 0 < stats.prefix_cache_hits <= stats.prefix_cache_queries
    if engine.model_runner.offload is not None:
        engine.model_runner.offload.pool.check()
        assert stats.offload_blocks_restored > 0
    if engine.model_runner.host_cache is not None:
        assert stats.host_prefix_cache_hits > 0 and engine.model_runner.host_cache.num_restored > 0


SELECTIVE = dict(
    block_size=BS,
    sparse_budget=4 * BS,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
    sparse_dense_context=0,
    max_model_len=160,
    max_num_batched_tokens=256,
)


@pytest.mark.parametrize(
    "policy",
    [
        dict(sparse_policy="topk"),
        dict(sparse_policy="topk", sparse_lag=1),
        dict(sparse_policy="topk", sparse_reuse=3),
        dict(sparse_policy="topp", sparse_top_p=0.7, sparse_budget=6 * BS),
        dict(sparse_policy="topk", kv_offload=True, hbm_cache_blocks=24),
        dict(sparse_policy="topk", kv_offload=True, num_gpu_blocks_override=21),  # prefills wait for device blocks
    ],
)
def test_sparse_selection_over_shared_blocks(tiny_model_dir, tmp_path, policy, device="cpu"):
    """A budget of 4 blocks of contexts up to 14: selection really chooses, from key metadata of blocks another
    request computed (shared by reference; under KV offload their K/V restored from the host store). Tokens
    equal caching off, with hits ending inside, at and one token before a block's end (a request then computes
    a block and a token: two tokens at least, so its last prompt token is attended in a prefill chunk), lagged
    selection (the first decode of a request with a cached prefix attends what its prefill chunk selected),
    reuse, a streaming head and the device block cache too small for the four requests' prefills at once."""
    import json

    heads = tmp_path / "streaming.json"
    heads.write_text(json.dumps({"streaming_heads": {"1": [1]}}))
    g = torch.Generator().manual_seed(3)
    base = torch.randint(10, 2000, (90,), generator=g).tolist()
    tail = torch.randint(10, 2000, (12,), generator=g).tolist()
    first = [base]
    later = [base[:70] + tail[:10], base + tail[:5], base[:45], base[:81], base[:88] + tail[:1]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(
            str(tiny_model_dir),
            device=device,
            dtype="float32",
            enable_prefix_caching=caching,
            streaming_heads=str(heads),
            **{**SELECTIVE, **policy},
        )
        a = llm.generate(first, params, use_tqdm=False)
        b = llm.generate(later, params, use_tqdm=False)
        outs[caching] = [o.outputs[0].token_ids for o in a + b]
        stats = llm.llm_engine.get_stats(sync=True)
        assert stats.sparse_selections > 0
        if caching:
            # 81 tokens: 10 full blocks, but one token would be left: 9 blocks hit, a block and a token computed
            hits = 64 + 88 + 40 + 72 + 80
            assert [o.num_cached_tokens for o in a + b] == [0, 64, 88, 40, 72, 80]
            assert stats.prefix_cache_hits == hits and stats.num_preemptions == 0
            if policy.get("kv_offload"):
                assert stats.offload_blocks_restored >= hits // BS
        llm = None
        release_gpu_memory()
    assert outs[True] == outs[False]


def release_gpu_memory() -> None:
    """After the last reference to an engine is dropped: its GPU memory back (engines hold reference cycles), so
    the next engine, which sizes its KV cache from the memory left (gpu_memory_utilization), gets it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@gpu_only
@pytest.mark.parametrize("path", ["dense", "topk", "offload", "offload-paused", "dense+host"])
def test_cuda_graphs_caching_on_equals_off(tiny_model_dir, tmp_path, path):
    """On the GPU: Triton kernels, decode steps replayed from CUDA graphs, FlashH2D restores and the host tier's
    UVA copies; caching on equals caching off over a random schedule and over shared prefixes with a selecting
    budget."""
    kw = {**PATHS[path], "device": "cuda", "async_scheduling": False}  # the checks after each step read the host
    # One engine at a time: each sizes its KV cache from the GPU memory the others left.
    off, aborted, engine = run_schedule(tiny_model_dir, 0, caching=False, check=False, **kw)
    engine = None
    release_gpu_memory()
    on, _, engine = run_schedule(tiny_model_dir, 0, caching=True, check=True, **kw)
    assert engine.model_runner.graphs is not None
    assert_same_tokens(on, off, aborted)
    assert engine.get_stats(sync=True).prefix_cache_hits > 0
    engine = None
    release_gpu_memory()
    if path in ("topk", "offload"):
        extra = dict(kv_offload=True, hbm_cache_blocks=24) if path == "offload" else {}
        test_sparse_selection_over_shared_blocks(
            tiny_model_dir, tmp_path, dict(sparse_policy="topk", **extra), device="cuda"
        )


def test_prefix_cache_metrics(tiny_model_dir):
    """The server's Prometheus exposition of the prefix-cache statistics (vLLM's names and meaning)."""
    from sparseserve.metrics import ServerMetrics, parse_metrics

    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=128,
        num_gpu_blocks_override=8,
        host_prefix_cache_memory=1 << 22,
    )
    prompt = list(range(100, 180))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    got = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
    assert got["sparseserve:prefix_cache_queries_total"] == 160 and got["sparseserve:prefix_cache_hits_total"] == 64
    assert got["sparseserve:host_prefix_cache_queries_total"] == 160 - 64
    assert got["sparseserve:host_prefix_cache_hits_total"] == 0
    assert got["sparseserve:prefix_cache_blocks"] == stats.prefix_cache_blocks > 0
    assert got["sparseserve:host_prefix_cache_blocks"] == stats.host_prefix_cache_blocks == 5
    assert got["sparseserve:prefix_cache_evictions_total"] == 0
