"""Prefill-decode interference: the long-prompt limit of a step (long_prefill_token_threshold,
max_long_partial_prefills), on the scheduler alone and on the embedded model (issue 20's mixed step)."""

from __future__ import annotations

import random
import time

import pytest

from sparseserve.config import CPU_LONG_PREFILL_TOKENS, EngineConfig, SchedulerConfig
from sparseserve.kvcache.blocks import BlockAllocator
from tests.engine.sched_utils import LastSchedule, make_scheduler
from tests.engine.test_scheduler import BS, run_step, seq


def scheduler(threshold: int, min_chunk: int = 1, **kw):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, **kw)
    return make_scheduler(
        cfg,
        BlockAllocator(256),
        BS,
        min_chunk=min_chunk,
        long_prefill_token_threshold=cfg.prefill_token_threshold("cpu") if threshold < 0 else threshold,
    )


def chunks(out) -> dict[int, int]:
    return {s.seq_id: n for s, n in out.scheduled}


def test_a_long_prompt_is_limited_alone_and_beside_decodes():
    """vLLM's semantics: the limit holds in every step, so a request arriving behind a long prompt waits one
    limited step, never the whole prompt (issue 41)."""
    sched = scheduler(8)
    lone = seq(0, 20)
    sched.add(lone)
    assert chunks(run_step(sched)) == {0: 8}  # alone: still 8 tokens a step
    short, long_ = seq(1, 5), seq(2, 30)
    sched.add(short)
    sched.add(long_)
    # lone still prefills (one long slot): long_ waits for the slot, short (not long) passes it
    assert chunks(run_step(sched)) == {0: 8, 1: 5}
    assert chunks(run_step(sched)) == {0: 4, 1: 1, 2: 8}  # 4 left of lone: no longer long
    assert chunks(run_step(sched)) == {0: 1, 1: 1, 2: 8}
    assert chunks(run_step(sched)) == {0: 1, 1: 1, 2: 8}
    assert chunks(run_step(sched)) == {0: 1, 1: 1, 2: 6}  # 6 left: no longer long
    assert long_.num_computed_tokens == 30


def test_max_long_partial_prefills_bounds_the_long_prompts_of_a_step():
    for slots, expected in ((1, {0: 1, 1: 8}), (2, {0: 1, 1: 8, 2: 8})):
        sched = scheduler(8, max_long_partial_prefills=slots)
        sched.add(seq(0, 3))
        run_step(sched)
        a, b = seq(1, 30), seq(2, 30)
        sched.add(a)
        sched.add(b)
        assert chunks(run_step(sched)) == expected  # one slot: b waits behind a (FCFS)
        for _ in range(20):
            run_step(sched)
        assert a.num_computed_tokens >= 30 and b.num_computed_tokens >= 30  # nobody starves


def test_a_shorter_prompt_passes_a_long_one_that_waits_for_a_slot():
    sched = scheduler(8)
    sched.add(seq(0, 3))
    run_step(sched)
    a, b, c = seq(1, 30), seq(2, 30), seq(3, 5)
    for s in (a, b, c):
        sched.add(s)
    assert chunks(run_step(sched)) == {0: 1, 1: 8, 3: 5}  # b waits for the long slot, c passes it
    assert list(sched.waiting) == [b]
    while 30 - a.num_computed_tokens > 8:
        assert 2 not in chunks(run_step(sched))
    assert chunks(run_step(sched)) == {0: 1, 1: 6, 3: 1, 2: 8}  # a is no longer long: b gets the slot


def test_the_limit_keeps_two_min_chunks_and_leaves_unchunked_prompts_alone():
    sched = scheduler(1, min_chunk=2)  # a limit below 2 * min_chunk is raised to it
    assert sched.long.threshold == 4
    sched.add(seq(0, 3))
    run_step(sched)
    b = seq(1, 9)
    sched.add(b)
    sizes = []
    while b.num_computed_tokens < 9:
        sizes.append(chunks(run_step(sched))[1])
    assert sizes == [4, 3, 2]  # never a one-token prompt chunk (min_chunk), never more than 4 beside decodes
    cfg = SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=8)
    assert cfg.prefill_token_threshold("cpu") == 0  # an unchunked prompt cannot be split


def test_defaults_and_flags():
    sc = SchedulerConfig()
    assert sc.prefill_token_threshold("cpu") == CPU_LONG_PREFILL_TOKENS and sc.prefill_token_threshold("cuda") == 0
    sc = EngineConfig.from_kwargs(long_prefill_token_threshold="1k", max_long_partial_prefills=2).scheduler_config
    assert sc.prefill_token_threshold("cuda") == 1000 and sc.max_long_partial_prefills == 2
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_long_partial_prefills=0)
    import argparse

    from sparseserve.entrypoints.cli import add_engine_args, engine_kwargs_from_args

    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--long-prefill-token-threshold", "2K", "--max-long-partial-prefills", "3"]
    )
    kw = engine_kwargs_from_args(args)
    assert kw["long_prefill_token_threshold"] == 2048 and kw["max_long_partial_prefills"] == 3


def test_mixed_step_on_the_embedded_model():
    """64 short streams decode, then one 8K-token prompt arrives (max_model_len 16384): every stream gets a token
    in every step meanwhile, each step's prompt chunk stays within the limit, and the prompt is never starved (it
    takes the full limit every step, so it finishes in the fewest steps the limit allows). Its time beside the
    streams against its time alone, and the streams' max inter-token gap, are printed (docs/benchmarks/serving.md), not
    asserted: a unit test holds no timing threshold."""
    from sparseserve import SamplingParams
    from sparseserve.engine.engine import LLMEngine

    engine = LLMEngine.from_kwargs(profiler=LastSchedule(), max_model_len=16384, device="cpu")
    limit = engine.scheduler.long.threshold
    assert limit == CPU_LONG_PREFILL_TOKENS
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:  # fresh tokens each time: no prefix-cache hit shortens a prompt
        return [rng.randrange(10, 4000) for _ in range(n)]

    def prefill(rid: str) -> float:
        engine.add_request(rid, prompt(8192), SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while rid in engine.requests:
            engine.step()
        return time.perf_counter() - t0

    engine.add_request("warmup", prompt(600), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    alone = prefill("alone")

    streams = [f"s{i}" for i in range(64)]
    for rid in streams:
        engine.add_request(rid, prompt(16), SamplingParams(max_tokens=10**4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 64
    engine.add_request("long", prompt(8192), SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = last = time.perf_counter()
    max_gap, steps = 0.0, 0
    while "long" in engine.requests:
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        assert {o.request_id for o in outs} >= set(streams), "a stream got no token in a step"
        chunk = next(n for s, n in engine.profiler.out.scheduled if s.request_id == "long")
        assert chunk <= limit
        max_gap, last = max(max_gap, now - last), now
    mixed = time.perf_counter() - t0
    engine.abort_request(streams)
    print(
        f"\n8K prompt alone {alone:.2f} s; beside 64 decoding streams {mixed:.2f} s ({mixed / alone:.2f}x) in "
        f"{steps} steps; max inter-token gap of the streams {max_gap:.2f} s"
    )
    assert steps == -(-8192 // limit)
    assert engine.allocator.num_used == 0
