"""Greedy outputs and prompt logits against transformers on the same weights (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.request import Sequence
from tests.conftest import VARIANTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU the Triton backend runs, in float32
KV = dict(kv_cache_memory=1 << 28)  # several engines live in one test process
PROMPT_LENS = (3, 17, 41, 70)
MAX_TOKENS = 12


def prompts_for(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None
    model.to(DEVICE)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=DEVICE),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=1,
        )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(hf_models, variant):
    path, hf = hf_models[variant]
    prompts = prompts_for()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert all(len(set(e)) > 3 for e in expected), "degenerate reference outputs make a weak test"
    # All prompts batched together; block_size 16 so prompts span several partially filled blocks.
    llm = LLM(str(path), device=DEVICE, dtype="float32", block_size=16, max_model_len=256, **KV)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert llm.llm_engine.allocator.num_used == 0


@pytest.mark.slow
def test_chunked_prefill_and_preemption_match_transformers(hf_models):
    path, hf = hf_models["qwen2-gqa-bias"]
    prompts = prompts_for(1)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # Token budget smaller than the prompts: every long prompt is prefilled in chunks, mixed with decodes.
    llm = LLM(
        str(path), device=DEVICE, dtype="float32", block_size=16, max_model_len=128, max_num_batched_tokens=16, **KV
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    # A pool of 8 blocks (128 tokens) cannot hold all four requests at once: preemption by recompute (admission
    # by what fits now, so that the admission estimate does not prevent it).
    llm = LLM(
        str(path),
        device=DEVICE,
        dtype="float32",
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=8,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    engine = llm.llm_engine
    assert engine.get_stats().num_preemptions > 0
    assert engine.allocator.num_used == 0
    engine.allocator.check()


def engine_prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Runs one prefill through the model runner and returns logits for every prompt position."""
    engine = llm.llm_engine
    seq = Sequence(10**9, "probe", 0, prompt, GREEDY)
    seq.block_table = engine.allocator.allocate(-(-len(prompt) // engine.config.cache_config.block_size))
    runner = engine.model_runner
    batch = runner.prepare([(seq, len(prompt))])
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
        logits = runner.model.compute_logits(hidden)
    engine.allocator.free(seq.block_table)
    return logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logits_match_transformers(hf_models, variant):
    path, hf = hf_models[variant]
    prompt = prompts_for(2)[-1]
    with torch.no_grad():
        ref = hf.to(DEVICE)(torch.tensor([prompt], device=DEVICE)).logits[0].float()
    llm = LLM(str(path), device=DEVICE, dtype="float32", block_size=16, max_model_len=256, **KV)
    got = engine_prompt_logits(llm, prompt)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative error {rel:.2e}"


def test_sharded_checkpoint_loads_like_single_file(hf_models, tmp_path):
    path, hf = hf_models["llama-mha-d64-untied"]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="200KB")
    for f in path.glob("tokenizer*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = prompts_for(3)[1]
    single = LLM(str(path), device=DEVICE, dtype="float32", block_size=16, max_model_len=256, **KV)
    sharded = LLM(str(tmp_path), device=DEVICE, dtype="float32", block_size=16, max_model_len=256, **KV)
    assert torch.equal(engine_prompt_logits(single, prompt), engine_prompt_logits(sharded, prompt))


def test_reference_attention_in_query_chunks(hf_models, monkeypatch):
    """The torch reference bounds its score memory by attending in query chunks: still exact."""
    from sparseserve.kernels import paged_prefill

    monkeypatch.setattr(paged_prefill, "_REF_SCORE_ELEMENTS", 4096)  # forces chunks of a few queries
    path, hf = hf_models["qwen3-qknorm-d128"]
    prompt = prompts_for(4)[-1]
    with torch.no_grad():
        ref = hf.to("cpu")(torch.tensor([prompt])).logits[0].float()
    llm = LLM(
        str(path), device="cpu", dtype="float32", block_size=16, max_model_len=256, attention_backend="torch", **KV
    )
    got = engine_prompt_logits(llm, prompt)
    assert (got - ref).norm() / ref.norm() < 1e-4
