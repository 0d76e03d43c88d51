"""Builds the embedded default model: a tiny random-weight Llama in Hugging Face format with a
byte-level BPE tokenizer trained on the essays of ../shared/data/haystack.

    python scripts/make_default_model.py [--out sparseserve/models/default]

It stands in until the trained test model of the Accuracy issue replaces it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def train_tokenizer(essays: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    files = sorted(str(p) for p in essays.glob("*.txt"))
    if not files:
        raise SystemExit(f"no essays found in {essays}")
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end|>",
                                   pad_token="<|end_of_text|>", chat_template=CHAT_TEMPLATE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "sparseserve/models/default")
    ap.add_argument("--essays", type=Path, default=ROOT.parent / "shared/data/haystack")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = train_tokenizer(args.essays, args.vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters, vocab {len(tokenizer)}")


if __name__ == "__main__":
    main()
