"""Writes a Hugging Face model directory with a real architecture's config and random weights
(bf16 safetensors, sharded with an index), for benchmarks: both our engine and transformers load it.

    python scripts/make_random_model.py --preset llama-3.1-8b --out /tmp/llama8b
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from sparseserve.models.loader import DEFAULT_MODEL_DIR

PRESETS = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         bos_token_id=128000, eos_token_id=128001),
    # SmolLM2-135M's shapes (the real model of the GGUF tests): group size 3, tied embeddings.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", choices=list(PRESETS), default="llama-3.1-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="No weights (for load_format='dummy').")
    args = ap.parse_args()
    if (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} exists; remove it first")
    config = LlamaConfig(**PRESETS[args.preset], dtype="bfloat16", architectures=["LlamaForCausalLM"])
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEFAULT_MODEL_DIR / f).exists():
            shutil.copy(DEFAULT_MODEL_DIR / f, args.out / f)  # ids past its vocab decode to nothing
    if args.config_only:
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    c = config
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads

    def rand(*shape, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    # Residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2's init): without it a deep random
    # network is chaotic and bf16 rounding alone moves its logits by several percent.
    out_std = 0.02 / (2 * c.num_hidden_layers) ** 0.5

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weight_map: dict[str, str] = {}
    total = 0
    layers_per_shard = 8
    shards = [list(range(i, min(i + layers_per_shard, c.num_hidden_layers)))
              for i in range(0, c.num_hidden_layers, layers_per_shard)]
    for s, layer_ids in enumerate(shards):
        tensors = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = rand(c.vocab_size, c.hidden_size)
        for i in layer_ids:
            p = f"model.layers.{i}."
            tensors.update({
                p + "self_attn.q_proj.weight": rand(c.hidden_size, c.hidden_size),
                p + "self_attn.k_proj.weight": rand(kv, c.hidden_size),
                p + "self_attn.v_proj.weight": rand(kv, c.hidden_size),
                p + "self_attn.o_proj.weight": rand(c.hidden_size, c.hidden_size, std=out_std),
                p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size, std=out_std),
                p + "input_layernorm.weight": ones(c.hidden_size),
                p + "post_attention_layernorm.weight": ones(c.hidden_size)})
        if s == len(shards) - 1:
            tensors["model.norm.weight"] = ones(c.hidden_size)
            if not c.tie_word_embeddings:
                tensors["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, args.out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    print(f"wrote {args.out} ({args.preset}, random weights)")


if __name__ == "__main__":
    main()
