"""ArchConfig.from_hf reads RoPE settings in both spellings: transformers 5's `rope_parameters` and the older
top-level `rope_theta` (+ `rope_scaling`), from config.json files and from plain config objects."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sparseserve.layers.rotary import rope_inv_freq
from sparseserve.models.config import ArchConfig
from sparseserve.models.loader import load_hf_config

BASE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    hidden_act="silu",
)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# (old spelling, transformers 5 spelling, what the engine must read from both)
CASES = {
    "default": (
        dict(rope_theta=123456.0),
        dict(rope_parameters={"rope_theta": 123456.0, "rope_type": "default"}),
        {"rope_theta": 123456.0, "rope_type": "default"},
    ),
    "llama3": (
        dict(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3}),
        dict(rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3}),
        {"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3},
    ),
    "linear-type-key": (
        dict(rope_theta=5e4, rope_scaling={"type": "linear", "factor": 2.0}),
        dict(rope_parameters={"rope_theta": 5e4, "rope_type": "linear", "factor": 2.0}),
        {"rope_theta": 5e4, "rope_type": "linear", "factor": 2.0},
    ),
}


def _check(arch: ArchConfig, want: dict) -> None:
    got = {k: v for k, v in arch.rope.items() if k != "type"}
    assert got == want
    head_dim = arch.head_dim
    assert torch.equal(rope_inv_freq(head_dim, arch.rope), rope_inv_freq(head_dim, want))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spelling", ["rope_theta", "rope_parameters"])
def test_rope_spellings_from_config_json(tmp_path, case, spelling):
    old, new, want = CASES[case]
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **(old if spelling == "rope_theta" else new)}))
    _check(ArchConfig.from_hf(load_hf_config(tmp_path)), want)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spelling", ["rope_theta", "rope_parameters"])
def test_rope_spellings_from_plain_objects(case, spelling):
    """Config objects that transformers did not normalise (another library's, or an older transformers')."""
    old, new, want = CASES[case]
    _check(ArchConfig.from_hf(SimpleNamespace(**BASE, **(old if spelling == "rope_theta" else new))), want)


def test_rope_theta_outside_rope_parameters():
    """rope_parameters that only name the scaling take theta from the top-level field, and 10000 without one."""
    hf = SimpleNamespace(**BASE, rope_parameters={"rope_type": "default"}, rope_theta=2e5)
    assert ArchConfig.from_hf(hf).rope == {"rope_type": "default", "rope_theta": 2e5}
    assert ArchConfig.from_hf(SimpleNamespace(**BASE)).rope == {"rope_theta": 10000.0, "rope_type": "default"}


def test_unsupported_rope_type_is_refused():
    hf = SimpleNamespace(**BASE, rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        ArchConfig.from_hf(hf)


def _via_transformers(path) -> ArchConfig:
    from transformers import AutoConfig

    return ArchConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))


@pytest.mark.parametrize("rope", ["rope_theta", "rope_parameters"])
def test_plain_json_path_reads_what_transformers_reads(tmp_path, rope):
    """A fully spelled-out Llama config.json is read without transformers' config classes (load time); the
    architecture and the auto dtype must be what AutoConfig gives, and a config missing one of the keys whose
    default only transformers knows (eos_token_id: LlamaConfig's default is 2) goes through AutoConfig."""
    from sparseserve.models.loader import DEFAULT_MODEL_DIR, resolve_dtype

    plain = load_hf_config(DEFAULT_MODEL_DIR)
    assert isinstance(plain, SimpleNamespace)
    assert ArchConfig.from_hf(plain) == _via_transformers(DEFAULT_MODEL_DIR)
    assert resolve_dtype("auto", plain) == torch.bfloat16
    old, new, _ = CASES["llama3"]
    cfg = {
        **BASE,
        "tie_word_embeddings": False,
        "eos_token_id": [5, 6],
        "dtype": "float16",
        **(dict(rope_theta=5e5) if rope == "rope_theta" else new),
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert isinstance(load_hf_config(tmp_path), SimpleNamespace)
    assert ArchConfig.from_hf(load_hf_config(tmp_path)) == _via_transformers(tmp_path)
    assert resolve_dtype("auto", load_hf_config(tmp_path)) == torch.float16
    del cfg["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fallback = load_hf_config(tmp_path)
    assert not isinstance(fallback, SimpleNamespace) and ArchConfig.from_hf(fallback).eos_token_ids == (2,)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 2, **old}))  # rope_scaling: AutoConfig
    assert not isinstance(load_hf_config(tmp_path), SimpleNamespace)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid model config"):
        load_hf_config(tmp_path)


def test_load_tokenizer_equals_auto_tokenizer(tmp_path):
    """The direct load of a `tokenizers`-backed tokenizer gives what AutoTokenizer gives (class, ids, special
    tokens, chat template); any other tokenizer class still goes through AutoTokenizer."""
    import shutil

    from transformers import AutoTokenizer

    from sparseserve.models.loader import DEFAULT_MODEL_DIR, load_tokenizer

    fast, auto = load_tokenizer(DEFAULT_MODEL_DIR), AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert type(fast) is type(auto)
    text = "The special magic number for Paris is 12345.\n  Äpfel, 東京 and tabs\t!"
    assert fast.encode(text) == auto.encode(text) and fast.decode(fast.encode(text)) == auto.decode(auto.encode(text))
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    assert fast.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2TokenizerFast"}))
    other = load_tokenizer(tmp_path)
    assert type(other) is type(AutoTokenizer.from_pretrained(tmp_path)) and other.encode(text) == auto.encode(text)
