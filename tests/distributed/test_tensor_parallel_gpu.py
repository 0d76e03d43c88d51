"""Tensor parallelism on 2 CUDA GPUs (NCCL, Triton kernels, a CUDA graph of the decode step on each rank): the
tiny models' greedy tokens at tensor_parallel_size=2 equal one GPU's, dense, topk and topk + KV offload, in
float32. Skipped without 2 GPUs; the CPU file (gloo) covers the same logic everywhere."""

from __future__ import annotations

import gc

import pytest
import torch

from sparseserve import LLM
from tests.distributed.test_tensor_parallel import COMMON, CONFIGS, assert_same, generate

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
GPU = dict(COMMON, device="cuda", enforce_eager=False)


@pytest.mark.parametrize("variant", ["llama3-gqa-d128-tied-rope", "qwen3-qknorm-d128", "qwen2-gqa-bias"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_gpus_equal_one(hf_models, variant, config):
    model_dir = hf_models[variant][0]
    ref = LLM(str(model_dir), **GPU, **CONFIGS[config])
    assert ref.llm_engine.model_runner.graphs is not None
    expected = generate(ref)
    del ref  # its memory back before rank 0 sizes its KV cache in this process (engines hold reference cycles)
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(model_dir), **GPU, **CONFIGS[config], tensor_parallel_size=2)
    try:
        assert llm.llm_engine.model_runner.graphs is not None  # rank 0's; every rank captures its own
        assert_same(expected, generate(llm))
    finally:
        llm.llm_engine.model_runner.shutdown()


@pytest.mark.parametrize("config", ["dense", "offload"])
def test_two_gpus_with_async_scheduling_equal_one(hf_models, config):
    """Async scheduling at TP=2 on GPUs: the workers' placeholder tokens come from rank 0's NCCL broadcast of
    its sampled tokens, while the host schedules the next step; the tokens of one synchronous GPU."""
    model_dir = hf_models["llama3-gqa-d128-tied-rope"][0]
    ref = LLM(str(model_dir), **GPU, **CONFIGS[config], async_scheduling=False)
    expected = generate(ref)
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(model_dir), **GPU, **CONFIGS[config], tensor_parallel_size=2, async_scheduling=True)
    try:
        assert_same(expected, generate(llm))
    finally:
        llm.llm_engine.model_runner.shutdown()
