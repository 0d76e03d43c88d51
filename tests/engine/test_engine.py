"""Bad input is refused clearly and loses nothing; the KV pool's accounting holds over random schedules."""

from __future__ import annotations

import random

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.kvcache.blocks import BlockAllocator
from tests.schedules import drive_random_schedule, held_blocks


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", block_size=16, max_model_len=128)


@pytest.mark.parametrize(
    "make_call, message",
    [
        (lambda llm: llm.generate([""]), "empty"),
        (lambda llm: llm.generate([[]]), "empty"),
        (lambda llm: llm.generate([list(range(10, 10 + 200))]), "max_model_len"),
        (lambda llm: llm.generate(["ok", [99999]]), "token ids"),
        (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=-3)), "max_tokens"),
        (lambda llm: llm.generate(["hi"], SamplingParams(top_p=0.0)), "top_p"),
        (lambda llm: llm.generate(["hi"], SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate(["hi"], SamplingParams(temperature=-1.0)), "temperature"),
        (lambda llm: llm.generate(["hi"], SamplingParams(n=0)), "n must"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_working(llm, make_call, message):
    with pytest.raises(ValueError, match=message):
        make_call(llm)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.allocator.num_used == 0
    out = llm.generate(["still working"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_model_arguments(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"), device="cpu")
    cfg = (tiny_model_dir / "config.json").read_text()
    (tmp_path / "config.json").write_text(cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(cfg.replace('"hidden_act": "silu"', '"hidden_act": "gelu"'))
    with pytest.raises(ValueError, match="hidden_act"):
        LLM(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_model_dir), device="cpu", dtype="int8")
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tiny_model_dir), device="cpu", not_an_option=1)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_dir), device="cpu", max_model_len=64, block_size=16, num_gpu_blocks_override=2)


def test_allocator_detects_double_free():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    a.free(blocks[:1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(blocks[:1])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        a.allocate(3)
    a.check()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pool_accounting_over_random_schedules(tiny_model_dir, seed):
    """Random arrivals, aborts and steps with a pool small enough to preempt: after every step the
    blocks held by sequences are exactly the allocator's used set, and at the end everything is free."""
    rng = random.Random(seed)
    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=96,
        num_gpu_blocks_override=10,
        max_num_batched_tokens=rng.choice([16, 48, 96]),
        max_num_seqs=6,
    )
    engine = llm.llm_engine
    live = drive_random_schedule(engine, rng, steps=40, max_new=30, after_step=lambda _: held_blocks(engine))
    engine.abort_request(live[: len(live) // 2])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.allocator.num_used == 0 and not engine.scheduler.running and not engine.scheduler.waiting
    engine.allocator.check()
