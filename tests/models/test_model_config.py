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

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5,
            max_position_embeddings=256, hidden_act="silu")
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# (old spelling, transformers 5 spelling, what the engine must read from both)
CASES = {
    "default": (dict(rope_theta=123456.0),
                dict(rope_parameters={"rope_theta": 123456.0, "rope_type": "default"}),
                {"rope_theta": 123456.0, "rope_type": "default"}),
    "llama3": (dict(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3}),
               dict(rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3}),
               {"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3}),
    "linear-type-key": (dict(rope_theta=5e4, rope_scaling={"type": "linear", "factor": 2.0}),
                        dict(rope_parameters={"rope_theta": 5e4, "rope_type": "linear", "factor": 2.0}),
                        {"rope_theta": 5e4, "rope_type": "linear", "factor": 2.0}),
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
