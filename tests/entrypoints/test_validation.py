"""Input validation with vLLM's behaviour, offline: every error names its parameter and changes nothing."""

from __future__ import annotations

import logging
import math

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.config import EngineConfig, parse_size
from sparseserve.sampling_params import MIN_TEMPERATURE, ParameterError


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(n=True), "n"),
        (dict(n=0), "n"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=[2.0]), "stop_token_ids"),
    ],
)
def test_sampling_params_errors_name_their_param(kwargs, param):
    with pytest.raises(ParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_temperature_edges_follow_vllm(caplog):
    assert SamplingParams(temperature=1e-45).greedy  # below 1e-5: greedy
    assert SamplingParams(temperature=9.9e-6).temperature == 0.0
    with caplog.at_level(logging.WARNING, logger="sparseserve.sampling_params"):
        p = SamplingParams(temperature=1e-3)  # logits / 1e-3 is fine, but 1e-4 flirts with overflow in bf16
    assert p.temperature == MIN_TEMPERATURE and not p.greedy and "below" in caplog.text
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(seed=-(2**63)).seed == -(2**63) and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", block_size=16, max_model_len=64)


@pytest.mark.parametrize(
    "prompts, params, param, needle",
    [
        (["ok", [99999]], None, "prompt", "prompt 1: prompt token ids"),
        (["ok", "fine", [True, 5]], None, "prompt", "prompt 2: a prompt must be"),
        (["ok", [-1]], None, "prompt", "prompt 1:"),
        (["ok"], SamplingParams(stop_token_ids=[4096]), "stop_token_ids", "stop_token_ids must be in [0, 4096)"),
        (["ok", ""], None, "prompt", "prompt 1: the prompt is empty"),
    ],
)
def test_engine_errors_name_param_and_prompt_index(llm, prompts, params, param, needle):
    with pytest.raises(ParameterError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert e.value.param == param and needle in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.allocator.num_used == 0


def test_tiny_temperature_is_greedy_end_to_end(llm):
    greedy = (
        llm.generate(["The key is"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    tiny = (
        llm.generate(
            ["The key is"], SamplingParams(temperature=1e-45, max_tokens=6, ignore_eos=True, seed=3), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert tiny == greedy


def test_max_tokens_cut_by_the_context_warns_and_ends_with_length(llm, caplog):
    prompt = list(range(10, 60))  # 50 tokens of max_model_len 64
    with caplog.at_level(logging.WARNING, logger="sparseserve.engine.engine"):
        out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), use_tqdm=False)[
            0
        ].outputs[0]
    assert "max_tokens=100 is cut to 14 by max_model_len=64" in caplog.text
    assert len(out.token_ids) == 14 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "text, value",
    [
        ("4096", 4096),
        (" 32k ", 32000),
        ("32K", 32768),
        ("1.5k", 1500),
        ("2GiB", 2 * 2**30),
        ("2gib", 2 * 2**30),
        ("1.5G", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("2g", 2 * 10**9),
        ("4e9", 4 * 10**9),
        ("512MiB", 512 * 2**20),
        ("100B", 100),
        ("1T", 2**40),
        (7, 7),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "k", "-1", "1.5.5", "2 GiBs", "3x", "1e", "1,000"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_sizes_and_vllm_names_as_llm_kwargs():
    cfg = EngineConfig.from_kwargs(
        max_model_len="32K", kv_cache_memory_bytes="2GiB", max_num_batched_tokens="4k", host_kv_memory="1.5G"
    )
    assert cfg.model_config.max_model_len == 32768 and cfg.cache_config.kv_cache_memory == 2 * 2**30
    assert cfg.scheduler_config.max_num_batched_tokens == 4000 and cfg.offload_config.host_kv_memory == 3 * 2**29
    assert EngineConfig.from_kwargs(kv_cache_memory=123).cache_config.kv_cache_memory == 123
