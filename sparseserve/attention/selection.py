"""Block scoring and selection policies for sparse decode: the torch reference (CPU path, and what
kernels/block_score.py is tested against).

Scoring (DESIGN.md principle 6): the bound of q.k over a page is sum_d max(q_d kmax_d, q_d kmin_d)
= q+ . kmax + q- . kmin (q+ = max(q, 0), q- = min(q, 0)): two dot products. A block scores the max
over its pages. Per query head the scaled bounds are softmax-normalised into an estimate of each
block's attention mass; the estimates are averaged over the query heads of a KV group, so each KV
head gets one selection that serves its whole group (principle 3).

Selection of one (sequence, KV head), over the blocks 0..nb-1 of its context:
  forced: the first `sink` blocks, the last `local` blocks, and every block when nb <= cap (unless
          short_dense is off: then short contexts go through scoring and selection too);
  topk:   the k = cap - #forced best other blocks;
  topp:   the fewest best other blocks that bring the estimated mass (forced included) to p, at most k;
  streaming heads pick no other block.
The result is a list of `cap` logical block indices (positions in the block table), padded with -1.
With reuse R, a (sequence slot, KV head) recomputes its list every R-th decode step and keeps it
otherwise; the sparse kernel always adds the current local window, so tokens that arrive while a
list is reused are attended.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionParams:
    policy: str          # "topk" or "topp"
    cap: int             # list length in blocks (the budget)
    sink: int            # blocks
    local: int           # blocks, >= 1
    top_p: float
    reuse: int
    block_size: int
    page_size: int
    short_dense: bool = True  # a context of at most cap blocks selects all of them without scoring

    @property
    def mass_target(self) -> float:
        """topk never stops on mass: a target above any total."""
        return self.top_p if self.policy == "topp" else 2.0


def block_scores_ref(q: torch.Tensor, key_meta: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     max_blocks: int, block_size: int, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] decode queries; key_meta: one layer [NB + 1, Hkv, 2, P, D].

    Returns float32 [B, Hq, max_blocks]: scale * (block's bound), -inf past the sequence's end."""
    batch, num_q_heads, _ = q.shape
    _, num_kv_heads, _, pages, _ = key_meta.shape
    group = num_q_heads // num_kv_heads
    tables = block_tables[:, :max_blocks].long()
    meta = key_meta[tables].float()  # [B, MB, Hkv, 2, P, D]
    qg = q.float().view(batch, num_kv_heads, group, -1)
    bound = (torch.einsum("bhgd,bnhpd->bhgnp", qg.clamp_min(0), meta[:, :, :, 1])
             + torch.einsum("bhgd,bnhpd->bhgnp", qg.clamp_max(0), meta[:, :, :, 0]))
    page_start = torch.arange(max_blocks * pages, device=q.device).view(max_blocks, pages) * (block_size // pages)
    valid = page_start[None] < seq_lens.long()[:, None, None]  # [B, MB, P]
    bound = bound.masked_fill(~valid[:, None, None], float("-inf")).amax(-1)
    return (bound * scale).reshape(batch, num_q_heads, max_blocks)


def block_masses(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Estimated softmax mass of each block per query head, averaged over the KV group: [B, Hkv, MB]."""
    batch, num_q_heads, mb = scores.shape
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of padding sequences are all -inf
    return probs.view(batch, num_kv_heads, num_q_heads // num_kv_heads, mb).mean(2)


def forced_blocks(seq_lens: torch.Tensor, max_blocks: int, p: SelectionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, forced) masks [B, MB]: blocks inside the context, and those always selected."""
    nb = (seq_lens.long() + p.block_size - 1) // p.block_size
    j = torch.arange(max_blocks, device=seq_lens.device)[None]
    valid = j < nb[:, None]
    forced = valid & ((j < p.sink) | (j >= nb[:, None] - p.local) | ((nb[:, None] <= p.cap) & p.short_dense))
    return valid, forced


def select_ref(scores: torch.Tensor, seq_lens: torch.Tensor, streaming: torch.Tensor, p: SelectionParams
               ) -> torch.Tensor:
    """The selection lists [B, Hkv, cap] (int32, -1 padded): forced blocks first, then the chosen
    ones, each in block order. streaming: bool [Hkv]."""
    batch, _, mb = scores.shape
    hkv = streaming.numel()
    r = block_masses(scores, hkv)
    valid, forced = forced_blocks(seq_lens, mb, p)
    forced = forced[:, None].expand(batch, hkv, mb)
    cand = valid[:, None] & ~forced & ~streaming[None, :, None]
    n_forced = forced.sum(-1, keepdim=True)
    fmass = (r * forced).sum(-1, keepdim=True)
    vals, order = torch.where(cand, r, -1.0).sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(mb, device=scores.device)
    mass_before = vals.clamp_min(0).cumsum(-1) - vals.clamp_min(0)
    take = (vals >= 0) & (rank < p.cap - n_forced) & (fmass + mass_before < p.mass_target)
    chosen = torch.zeros_like(cand).scatter(-1, order, take)
    pos = torch.where(forced, forced.cumsum(-1) - 1, n_forced + chosen.cumsum(-1) - 1)
    keep = forced | chosen
    out = torch.full((batch, hkv, p.cap + 1), -1, dtype=torch.int32, device=scores.device)
    blocks = torch.arange(mb, dtype=torch.int32, device=scores.device).expand(batch, hkv, mb)
    out.scatter_(-1, torch.where(keep, pos, p.cap).clamp_max(p.cap), blocks)  # column cap: the dropped
    out[..., p.cap] = -1
    return out[..., : p.cap]


def update_selection_ref(scores: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, sel: torch.Tensor,
                         counter: torch.Tensor, stats: torch.Tensor, streaming: torch.Tensor,
                         p: SelectionParams) -> None:
    """Writes the new lists into sel [S, Hkv, cap] at the rows' state slots, for the (slot, KV head)
    pairs due a recomputation (every step without reuse); counter [S, Hkv] counts decode steps;
    stats [2] (int64) accumulates (blocks selected, selections). Padding rows (seq_len 0) change nothing."""
    lists = select_ref(scores, seq_lens, streaming, p)
    live = (seq_lens > 0)[:, None].expand(-1, sel.shape[1])
    slots = slots.long()
    due = live & (counter[slots] % p.reuse == 0) if p.reuse > 1 else live
    sel[slots] = torch.where(due[..., None], lists, sel[slots])
    if p.reuse > 1:
        counter[slots] += live.to(counter.dtype)
    stats[0] += ((lists >= 0).sum(-1) * due).sum()
    stats[1] += due.sum()


def attended_blocks(sel_rows: torch.Tensor, seq_lens: torch.Tensor, local: int, block_size: int,
                    max_blocks: int) -> torch.Tensor:
    """bool [B, Hkv, MB]: the blocks the sparse kernel attends, from the lists sel_rows [B, Hkv, cap]:
    listed blocks before the current local window, plus that window (it moves as tokens arrive)."""
    nb = (seq_lens.long() + block_size - 1) // block_size
    local_start = (nb - local).clamp_min(0)
    j = torch.arange(max_blocks, device=seq_lens.device)[None]
    window = (j >= local_start[:, None]) & (j < nb[:, None])
    listed = (sel_rows >= 0) & (sel_rows < local_start[:, None, None])
    idx = torch.where(listed, sel_rows.long(), max_blocks).clamp_max(max_blocks)
    mask = torch.zeros(*sel_rows.shape[:2], max_blocks + 1, dtype=torch.bool, device=sel_rows.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :max_blocks] | window[:, None]
