"""Model directories of a real architecture's shapes, for benchmarks: the config, the embedded model's tokenizer
and, unless --config-only (for load_format='dummy'), random bf16 safetensors that transformers loads too.

    python -m benchmarks.model_dir --preset llama-3.1-8b --out /tmp/llama8b
    python -m benchmarks.model_dir --preset mha7b --embedded-vocab --config-only --out /tmp/mha7b
    python -m benchmarks.model_dir --preset llama-3.1-70b --embedded-vocab --config-only --out /tmp/70b

--embedded-vocab: the embedded tokenizer's vocabulary (4,096) instead of the preset's: a server then decodes
every id (serving benchmarks); without it ids past the tokenizer's vocabulary decode to nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from sparseserve.models.loader import DEFAULT_MODEL_DIR

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_parameters=_LLAMA3_ROPE,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # Llama-2-7B / LWM-7B (the paper's MHA model): 32 KV heads; positions for 32K prompts plus outputs.
    "mha7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # SmolLM2-135M's shapes (the real model of the GGUF tests): group size 3, tied embeddings.
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# Llama-3-8B-262K (the paper's GQA model): Llama-3-8B's shapes with 262,144 positions.
PRESETS["gqa8b"] = dict(
    PRESETS["llama-3.1-8b"],
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
# Llama-3.1-70B: 80 layers, 64 query / 8 KV heads (Llama-3.1-8B's vocabulary, rope and positions); about 141 GB
# of bf16 weights, so one GPU does not hold it: tensor parallelism's serving shape (docs/tensor_parallel.md).
PRESETS["llama-3.1-70b"] = dict(
    PRESETS["llama-3.1-8b"],
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
# gpu_serve_check.sh's SHAPE names
SHAPES = {"8b": "llama-3.1-8b", "mha7b": "mha7b", "gqa8b": "gqa8b", "70b": "llama-3.1-70b"}


def model_config(preset: str, embedded_vocab: bool = False) -> dict[str, Any]:
    """The preset over the embedded model's config keys (transformers' current format)."""
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    vocab = {k: cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    cfg.update(PRESETS[preset], dtype="bfloat16")
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if embedded_vocab:
        cfg.update(vocab)
    return cfg


def make_model_dir(
    out: Path, preset: str = "llama-3.1-8b", *, embedded_vocab: bool = False, weights: bool = False, seed: int = 0
) -> Path:
    """Writes config.json and the tokenizer files (and with `weights` the safetensors) into `out`."""
    cfg = model_config(preset, embedded_vocab)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    files = ["tokenizer.json", "tokenizer_config.json"] + (["generation_config.json"] if embedded_vocab else [])
    for f in files:
        if (DEFAULT_MODEL_DIR / f).exists():
            shutil.copy(DEFAULT_MODEL_DIR / f, out / f)
    if weights:
        _write_weights(out, cfg, seed)
    return out


def _write_weights(out: Path, c: dict[str, Any], seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * c["head_dim"]

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * std).to(torch.bfloat16).cpu()

    # Residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2's init): without it a deep random
    # network is chaotic and bf16 rounding alone moves its logits by several percent.
    out_std = 0.02 / (2 * layers) ** 0.5
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weight_map: dict[str, str] = {}
    total = 0
    shards = [list(range(i, min(i + 8, layers))) for i in range(0, layers, 8)]
    for s, layer_ids in enumerate(shards):
        tensors = {"model.embed_tokens.weight": rand(c["vocab_size"], hidden)} if s == 0 else {}
        for i in layer_ids:
            p = f"model.layers.{i}."
            tensors.update(
                {
                    p + "self_attn.q_proj.weight": rand(hidden, hidden),
                    p + "self_attn.k_proj.weight": rand(kv, hidden),
                    p + "self_attn.v_proj.weight": rand(kv, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, hidden, std=out_std),
                    p + "mlp.gate_proj.weight": rand(inter, hidden),
                    p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter, std=out_std),
                    p + "input_layernorm.weight": ones(hidden),
                    p + "post_attention_layernorm.weight": ones(hidden),
                }
            )
        if s == len(shards) - 1:
            tensors["model.norm.weight"] = ones(hidden)
            if not c["tie_word_embeddings"]:
                tensors["lm_head.weight"] = rand(c["vocab_size"], hidden)
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=list(PRESETS), default="llama-3.1-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="No weights (for load_format='dummy').")
    ap.add_argument("--embedded-vocab", action="store_true", help="The embedded tokenizer's vocabulary.")
    args = ap.parse_args(argv)
    if (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} exists; remove it first")
    make_model_dir(
        args.out, args.preset, embedded_vocab=args.embedded_vocab, weights=not args.config_only, seed=args.seed
    )
    print(f"wrote {args.out} ({args.preset}{', weights' if not args.config_only else ', config only'})")


if __name__ == "__main__":
    main()
