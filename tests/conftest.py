"""Tiny Hugging Face model directories with random weights, one per supported architecture variant."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU under the interpreter; must precede any @triton.jit.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparseserve.config import EngineConfig
from sparseserve.models.loader import DEFAULT_MODEL_DIR

VOCAB = 4096  # the embedded default tokenizer's size, so string prompts work on every test model

# name -> (transformers config class name, config overrides)
VARIANTS = {
    "llama-mha-d64-untied": (
        "LlamaConfig",
        dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, hidden_size=128, tie_word_embeddings=False),
    ),
    "llama3-gqa-d128-tied-rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            hidden_size=192,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-gqa-bias": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=256, tie_word_embeddings=False),
    ),
    "qwen3-qknorm-d128": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128, hidden_size=128, tie_word_embeddings=True),
    ),
    "mistral-gqa": (
        "MistralConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=128,
            head_dim=32,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),
    # SmolLM2-135M's attention shape: 9 query heads over 3 KV heads (a GQA group of 3), head_dim 64, tied embeddings
    "llama-gqa3-d64-tied": (
        "LlamaConfig",
        dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576, tie_word_embeddings=True),
    ),
}


def offload_lag(offload_args: dict | None = None, **kw) -> dict:
    """kw with sparse_lag as KV offload resolves it for these engine options (its default lags with topk): what a
    run without offload needs to select as the offloaded run it is compared with does. offload_args: the
    offloaded run's own (offload_prefetch)."""
    offloaded = EngineConfig.from_kwargs(**{**kw, "kv_offload": True, **(offload_args or {})})
    return {**kw, "sparse_lag": offloaded.sparse_config.sparse_lag}


def make_hf_model(path: Path, config_cls: str, seed: int = 0, **overrides):
    """Saves a random model whose weights are large enough that greedy decoding is not degenerate."""
    import transformers

    cfg = dict(
        vocab_size=VOCAB,
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=5,
        pad_token_id=1,
    )
    cfg.update(overrides)
    config = getattr(transformers, config_cls)(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
        # Small embeddings: with tied weights a large embedding makes the model echo its last token.
        model.get_input_embeddings().weight.normal_(0.0, 0.05 if config.tie_word_embeddings else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEFAULT_MODEL_DIR / f).exists():
            shutil.copy(DEFAULT_MODEL_DIR / f, path / f)
    return model.eval()


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    out = {}
    for name, (cls, overrides) in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, make_hf_model(path, cls, **overrides))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(hf_models) -> Path:
    return hf_models["llama3-gqa-d128-tied-rope"][0]
