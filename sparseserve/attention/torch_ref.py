"""Plain PyTorch reference of paged attention: the CPU path, and what every kernel is tested against."""
from __future__ import annotations

import torch

from sparseserve.attention.backend import AttentionMetadata, PagedAttentionBackend


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] into kv_cache [num_blocks, Hkv, 2, block_size, D] at slot_mapping (-1 skipped)."""
    block_size = kv_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk, off = slots // block_size, slots % block_size
    # Advanced indices separated by a slice put the token dim first: [n, Hkv, D].
    kv_cache[blk, :, 0, off] = k[valid].to(kv_cache.dtype)
    kv_cache[blk, :, 1, off] = v[valid].to(kv_cache.dtype)


def token_positions(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each query token: its sequence index, its index within the chunk, its absolute position."""
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(q_lens.numel(), device=qsl.device), q_lens)
    local = torch.arange(seq_idx.numel(), device=qsl.device) - qsl[seq_idx]
    pos = meta.seq_lens.long()[seq_idx] - q_lens[seq_idx] + local
    return seq_idx, local, pos


_SCORE_ELEMENTS = 1 << 25


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Causal attention of each query token over its sequence's paged context, in float32."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    max_blocks = max(1, -(-meta.max_seq_len // block_size))
    tables = meta.block_tables[:, :max_blocks].long()
    kv = kv_cache[tables].float()  # [B, MB, Hkv, 2, bs, D]
    ctx = max_blocks * block_size
    k = kv[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, ctx, head_dim)
    v = kv[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, ctx, head_dim)
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group, as HF's repeat_kv
    v = v.repeat_interleave(group, dim=1)

    seq_idx, local, pos = token_positions(meta)
    max_q = meta.max_query_len
    qp = q.new_zeros(num_seqs, max_q, num_q_heads, head_dim, dtype=torch.float32)
    qp[seq_idx, local] = q.float()
    pos_pad = torch.full((num_seqs, max_q), -1, dtype=torch.long, device=q.device)
    pos_pad[seq_idx, local] = pos
    # Cache memory past a sequence's end was never written and may hold NaN, and 0 * NaN is NaN.
    unwritten = torch.arange(ctx, device=q.device)[None, :] >= meta.seq_lens.long()[:, None]  # [B, ctx]
    v = v.masked_fill(unwritten[:, None, :, None], 0.0)
    out = torch.empty_like(qp)
    # Query chunks bound the float32 scores [B, Hq, chunk, ctx] to ~128 MB (long prompts on the CPU).
    chunk = max(1, _SCORE_ELEMENTS // (num_seqs * num_q_heads * ctx))
    keys = torch.arange(ctx, device=q.device)
    for q0 in range(0, max_q, chunk):
        rows = slice(q0, q0 + chunk)
        scores = torch.einsum("bqhd,bhkd->bhqk", qp[:, rows], k) * scale
        visible = keys[None, None, :] <= pos_pad[:, rows, None]  # [B, chunk, ctx]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows see nothing
        out[:, rows] = torch.einsum("bhqk,bhkd->bqhd", probs, v)
    return out[seq_idx, local].to(q.dtype)


class TorchBackend(PagedAttentionBackend):
    name = "torch"

    def store_kv(self, k, v, kv_cache, slot_mapping):
        store_kv_ref(k, v, kv_cache, slot_mapping)

    def attend(self, q, kv_cache, meta, scale):
        return paged_attention_ref(q, kv_cache, meta, scale)
