"""bench/steps.py's StepLog as an engine's profiler: each step's schedule read before it runs (prefill rows,
decode rows, segments), and no events where nothing is timed."""

from __future__ import annotations

from types import SimpleNamespace

from sparseserve.bench.steps import Scheduled, StepLog
from sparseserve.engine.engine import LLMEngine
from sparseserve.sampling_params import SamplingParams


def test_the_log_follows_each_steps_schedule(tiny_model_dir):
    log = StepLog(timing=True)
    engine = LLMEngine.from_kwargs(
        log, model=str(tiny_model_dir), device="cpu", max_model_len=128, max_num_batched_tokens=64
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(10, 90)), params)  # 80 tokens: two chunks of at most 64
    engine.add_request("b", list(range(20, 30)), params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(log.last)
    assert seen[0].decodes == 0 and 0 < seen[0].prompt_tokens <= 64 and seen[0].rows >= 1  # the step budget
    assert not seen[0].pure_decode() and seen[-1].pure_decode() and not seen[-1].pure_decode(batch=3)
    assert sum(s.prompt_tokens for s in seen) == 90 and sum(s.decodes for s in seen) == 2 * 3
    assert log.events == [] and log.totals_ms() == {}  # no CUDA: phases are not timed


def test_a_one_token_prompt_chunk_is_no_decode():
    seq = lambda computed, prompt: SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt)  # noqa
    log = StepLog()
    log.on_schedule(SimpleNamespace(scheduled=[(seq(9, 10), 1), (seq(10, 10), 1), (seq(12, 10), 1)], segments=[]))
    assert log.last == Scheduled(decodes=2, rows=3, prompt_tokens=1, segments=0)
    log.on_schedule(SimpleNamespace(scheduled=[(seq(12, 10), 1)], segments=[object()]))
    assert not log.last.pure_decode()  # a layer segment ran beside it
