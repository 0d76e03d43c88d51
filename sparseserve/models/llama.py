"""Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral) over a paged KV cache.

Parameter names follow transformers' checkpoints, except the packed projections (qkv_proj,
gate_up_proj), which the loader fills from the separate checkpoint tensors.

Under tensor parallelism (docs/tensor_parallel.md) each rank builds its shard: its query and KV
heads, its slice of the MLP's features and of the vocabulary; one all-reduce after o_proj and
one after down_proj. At one rank it is the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from sparseserve.attention.backend import AttentionBackend, AttentionMetadata
from sparseserve.kernels.small_ops import rotary, silu_and_mul
from sparseserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sparseserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sparseserve.layers.norm import RMSNorm
from sparseserve.layers.rotary import RotaryEmbedding
from sparseserve.models.config import ArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx, self.backend = layer_idx, backend
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        # The heads this rank attends with, and its share of the output (fewer when KV heads
        # are replicated).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        h = self.qkv_proj.heads
        self.out_heads = None if h.out_heads == h.num_heads else slice(h.out_offset, h.out_offset + h.out_heads)
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, *rope)
        o = self.backend.forward(self.layer_idx, q, k, v, kv_cache, meta, self.scale)
        if self.out_heads is not None:
            o = o[:, self.out_heads]
        return self.o_proj(o.reshape(o.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual, kv_cache, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)

    def forward(self, input_ids, positions, kv_caches, meta):
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions, x.dtype)
        x, residual = self.forward_layers(range(len(self.layers)), rope, x, residual, kv_caches, meta)
        x, _ = self.norm(x, residual)
        return x

    def forward_layers(
        self, layers: range, rope, x: torch.Tensor, residual: torch.Tensor | None, kv_caches, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers `layers` over (x, residual) (residual None before layer 0);
        kv_caches[i] is layer i's. Layer-segmented prefill (engine/layer_prefill.py) calls it."""
        for i in layers:
            x, residual = self.layers[i](rope, x, residual, kv_caches[i], meta)
        return x, residual


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (packed parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] on rank 0; [N, 0] on the other tensor-parallel ranks."""
        return self.lm_head(hidden)
