"""The engine's warm-up (LLMEngine.warm_up, automatic on CUDA): it runs the step kinds a first request meets
(a prompt longer than a step's budget beside decoding ones: chunked or layer-segmented prefill, mixed steps,
token counts that are multiples of 16 and others),
then leaves nothing behind: no block held or cached, no request, every counter of the statistics at zero, and
the engine's later outputs and counts equal to an engine that never warmed up."""

from __future__ import annotations

import dataclasses

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.engine.stats import EngineStats

SPARSE = dict(
    sparse_policy="topk",
    sparse_budget=64,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=1,
    sparse_dense_context=0,
)
LAYERSEG = dict(SPARSE, kv_offload=True, layer_segmented_prefill=True, prefill_layer_segment=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[(13 * i + 5 * t) % 4000 + 10 for t in range(n)] for i, n in enumerate((20, 70, 45))]


@pytest.mark.parametrize("extra", [{}, dict(async_scheduling=True), LAYERSEG, dict(LAYERSEG, async_scheduling=True)])
def test_warm_up_leaves_nothing_behind(tiny_model_dir, extra):
    kw = dict(device="cpu", dtype="float32", block_size=16, max_model_len=160, max_num_batched_tokens=64, **extra)
    fresh = LLM(str(tiny_model_dir), **kw)
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts(), PARAMS, use_tqdm=False)]
    want_stats = fresh.llm_engine.get_stats(sync=True)

    llm = LLM(str(tiny_model_dir), **kw)
    engine = llm.llm_engine
    seen, chunks_after_prefix = [], []
    execute = engine.model_runner.execute

    def spy(scheduled, segments=(), plan=None, feed=None):
        seen.append(([n for _, n in scheduled], len(segments)))
        chunks_after_prefix.extend(n > 1 and seq.num_computed_tokens > 0 for seq, n in scheduled)
        return execute(scheduled, segments, plan, feed=feed)

    engine.model_runner.execute = spy
    engine.warm_up()
    # the long prompt went through more than one step (chunks or layer segments) beside the short one's decodes
    assert any(1 in ns and (max(ns) > 1 or segs) for ns, segs in seen)
    assert any(chunks_after_prefix)  # a chunk attending to its earlier chunks (with layer segments too)
    if extra.get("kv_offload"):  # the second round's prefix-cache hit was restored from the host store
        assert engine.model_runner.offload.num_restored_blocks > 0
    # steps of token counts that are multiples of 16 and others (Triton's specializations)
    assert {sum(ns) % 16 == 0 for ns, _ in seen if ns} == {True, False}
    assert any(segs for _, segs in seen) == bool(extra.get("layer_segmented_prefill"))
    assert not engine.has_unfinished_requests() and engine.allocator.num_used == 0
    assert engine.allocator.num_cached == 0  # its prompts left the prefix cache
    engine.allocator.check()
    stats = engine.get_stats(sync=True)
    assert all(getattr(stats, n) == 0 for n in EngineStats.COUNTERS), stats
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0

    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
    assert got == want
    stats = engine.get_stats(sync=True)
    for name in (
        "num_prompt_tokens",
        "num_generation_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "sparse_selections",
        "num_preemptions",
    ):
        assert getattr(stats, name) == getattr(want_stats, name), name
    assert stats.num_generation_tokens == 3 * PARAMS.max_tokens


def test_since_subtracts_counters_only():
    start = EngineStats(
        num_running=2, num_blocks_total=100, num_prompt_tokens=50, offload_blocks_loaded=7, working_set_limit=9
    )
    now = dataclasses.replace(start, num_running=1, num_prompt_tokens=80, offload_blocks_loaded=10)
    d = now.since(start)
    assert (d.num_running, d.num_blocks_total, d.working_set_limit) == (1, 100, 9)  # gauges and sizes as they are
    assert (d.num_prompt_tokens, d.offload_blocks_loaded) == (30, 3)
