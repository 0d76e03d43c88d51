"""The architecture facts the engine needs, from a Hugging Face config; unsupported ones refused."""

from __future__ import annotations

from dataclasses import dataclass

from sparseserve.layers.rotary import SUPPORTED_ROPE_TYPES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def rope_parameters(hf) -> dict:
    """RoPE settings in either spelling: transformers 5's `rope_parameters` dict, or the older
    top-level `rope_theta` beside an optional `rope_scaling` dict (`type` or `rope_type`)."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = getattr(hf, "rope_theta", None) or 10000.0
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf) -> "ArchConfig":
        archs = list(getattr(hf, "architectures", None) or [])
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only silu is supported")
        window = getattr(hf, "sliding_window", None)
        uses_window = getattr(hf, "use_sliding_window", arch == "MistralForCausalLM")
        if window is not None and uses_window:
            raise ValueError(f"unsupported: sliding-window attention (sliding_window={window})")
        rope = rope_parameters(hf)
        rope_type = rope["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if getattr(hf, "partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported: partial_rotary_factor != 1")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=rope,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
        )
