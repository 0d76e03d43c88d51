"""Block scoring and selection policies for sparse decode: the torch reference (CPU path, and what
kernels/block_score.py is tested against).

Scoring (DESIGN.md principle 6): the bound of q.k over a page is sum_d max(q_d kmax_d, q_d kmin_d)
= q+ . kmax + q- . kmin (q+ = max(q, 0), q- = min(q, 0)): two dot products, over the page's int8 codes
times its scale (kvcache/metadata.py: rounded outward, so still a bound). A block scores the max
over its pages. Per query head the scaled bounds are softmax-normalised into an estimate of each
block's attention mass; the estimates are averaged over the query heads of a KV group, so each KV
head gets one selection that serves its whole group (principle 3).

Selection of one (sequence, KV head), over the blocks 0..nb-1 of its context:
  forced: the first `sink` blocks, the last `local` blocks, and every block when nb <= cap (unless
          short_dense is off: then short contexts go through scoring and selection too);
  topk:   the k = cap - #forced best other blocks;
  topp:   the fewest best other blocks that bring the estimated mass (forced included) to p, at most k;
  streaming heads pick no other block.
(select_ref's topp estimates masses from the bounds alone, which are loose. The engine's topp policy
selects then prunes, as Twilight does: topk over the bounds picks `cap` candidates, then prune_ref
keeps the fewest candidates whose mass, estimated from q.k over each block's real keys, brings the
mass of the list to p. See SelectionParams.candidates and prune_selection_ref.)
The result is a list of `cap` logical block indices (positions in the block table), padded with -1.
With reuse R, a (sequence slot, KV head) recomputes its list every R-th decode step and keeps it
otherwise; the sparse kernel always adds the current local window, so tokens that arrive while a
list is reused are attended. With sparse_lag=1 a step attends the list selected at an earlier step
(step_slots_ref), so its own selection can run beside its attention.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparseserve.kvcache.metadata import KeyMeta


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
    per_head: bool = False    # topp pruning: each query head's mass reaches p (union), not the group's mean

    @property
    def mass_target(self) -> float:
        """topk never stops on mass: a target above any total."""
        return self.top_p if self.policy == "topp" else 2.0

    @property
    def prune_target(self) -> float:
        """topp's pruning target; p = 1 keeps every candidate (no float total can be trusted to reach 1)."""
        return self.top_p if self.top_p < 1.0 else float("inf")

    @property
    def candidates(self) -> "SelectionParams":
        """The first stage of the engine's topp: topk over the bounds fills the `cap` entries with
        candidates, which prune_selection_ref then trims (topk's own stage is the whole selection)."""
        return replace(self, policy="topk") if self.policy == "topp" else self


def block_scores_ref(q: torch.Tensor, key_meta: KeyMeta, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     max_blocks: int, block_size: int, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] decode queries; key_meta: one layer's (codes [NB + 1, Hkv, 2, P, D], scale [NB + 1, Hkv, P]).

    Returns float32 [B, Hq, max_blocks]: scale * (block's bound), -inf past the sequence's end."""
    batch, num_q_heads, _ = q.shape
    _, num_kv_heads, _, pages, _ = key_meta.codes.shape
    group = num_q_heads // num_kv_heads
    tables = block_tables[:, :max_blocks].long()
    codes = key_meta.codes[tables].float()  # [B, MB, Hkv, 2, P, D]
    page_scale = key_meta.scale[tables].permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, MB, P]
    qg = q.float().view(batch, num_kv_heads, group, -1)
    dots = (torch.einsum("bhgd,bnhpd->bhgnp", qg.clamp_min(0), codes[:, :, :, 1])
            + torch.einsum("bhgd,bnhpd->bhgnp", qg.clamp_max(0), codes[:, :, :, 0]))
    bound = dots * (page_scale * scale)  # the kernel's order: scale applied per page, before the max
    page_start = torch.arange(max_blocks * pages, device=q.device).view(max_blocks, pages) * (block_size // pages)
    valid = page_start[None] < seq_lens.long()[:, None, None]  # [B, MB, P]
    bound = bound.masked_fill(~valid[:, None, None], float("-inf")).amax(-1)
    return bound.reshape(batch, num_q_heads, max_blocks)


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
    stats [2] (int64) accumulates (blocks selected, selections). Padding rows (seq_len 0) and rows of slot -1
    change nothing."""
    rows = (seq_lens > 0) & (slots >= 0)  # slot -1 (sparse_lag: a reused step) selects nothing
    lists, slots = select_ref(scores[rows], seq_lens[rows], streaming, p), slots[rows].long()
    # without reuse every row (sparse_lag's slots then index two list rows a slot: no counter row)
    due = counter[slots] % p.reuse == 0 if p.reuse > 1 else torch.ones_like(lists[..., 0], dtype=torch.bool)
    sel[slots] = torch.where(due[..., None], lists, sel[slots])
    if p.reuse > 1:
        counter[slots] += 1
    stats[0] += ((lists >= 0).sum(-1) * due).sum()
    stats[1] += due.sum()


def step_slots_ref(seq_lens: torch.Tensor, slots: torch.Tensor, num_decodes: int, reuse: int, num_slots: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_lag=1: where a step's rows read and write their lists. Slot x keeps two lists, in rows x and
    x + num_slots of the selection buffer, so the attention reads one while the next is written beside it.
    A selection made at a context of s tokens (from the query of token s - 1) goes to row
    x + num_slots * ((s // R + 1) % 2); a decode at context s reads the row of the latest selection made at a
    context below s: x + num_slots * (((s - 1) // R + 1) % 2). Decodes select at contexts that are multiples of
    R (reuse); prefill chunks at their end, every chunk, so a request's first decode attends the list of its
    last prompt token. Returns (read, write) int32 [B]; write -1: no selection (or a padding row)."""
    s = seq_lens.long()
    read = slots.long() + num_slots * (torch.div(s - 1, reuse, rounding_mode="floor") + 1).remainder(2)
    decode = torch.arange(s.numel(), device=s.device) < num_decodes
    due = (s > 0) & (~decode | (s % reuse == 0))
    write = torch.where(due, slots.long() + num_slots * ((s // reuse + 1) % 2), -1)
    return read.to(torch.int32), write.to(torch.int32)


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


def block_lse_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  lists: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [B, Hq, cap]: per query head, log-sum-exp of scale * q.k over the valid tokens of each block
    of lists [B, Hkv, cap] (the block's real attention mass, unnormalised, in log space); -inf for -1
    entries. kv_cache: one layer [NB, Hkv, 2, bs, D]. Reference of kernels/topp_prune.py's first kernel."""
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    cap = lists.shape[-1]
    listed = lists >= 0
    blocks = block_tables.long().gather(1, lists.clamp_min(0).long().flatten(1)).view_as(lists)
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    keys = kv_cache[blocks, heads, 0].float()  # [B, Hkv, cap, bs, D]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = torch.einsum("bhgd,bhctd->bhgct", qg, keys) * scale
    token = lists.long()[..., None] * block_size + torch.arange(block_size, device=q.device)
    valid = listed[..., None] & (token < seq_lens.long()[:, None, None, None])  # [B, Hkv, cap, bs]
    s = s.masked_fill(~valid[:, :, None], float("-inf"))  # also hides unwritten (maybe NaN) cache memory
    return torch.logsumexp(s, -1).reshape(batch, num_q_heads, cap)


def prune_ref(lse: torch.Tensor, lists: torch.Tensor, seq_lens: torch.Tensor, p: SelectionParams) -> torch.Tensor:
    """Twilight's top-p pruning of candidate lists [B, Hkv, cap] (forced blocks and candidates, -1 padded).

    Mass of an entry: per query head, the softmax of the blocks' lse [B, Hq, cap] over the listed
    entries (sink and local included, so a head whose mass sits there asks for nothing more), averaged
    over the KV group (p.per_head: each head on its own). Keeps the forced entries and the candidates of
    mass >= t, for the largest t at which forced + those candidates reach p (the fewest best; ties at t
    all kept; every candidate when the total stays below p); per_head keeps the union over the heads.
    Returns the kept entries in list order, then -1."""
    batch, num_kv_heads, cap = lists.shape
    listed = lists >= 0
    logits = lse.view(batch, num_kv_heads, -1, cap).masked_fill(~listed[:, :, None], float("-inf"))
    mass = torch.softmax(logits, -1).nan_to_num(0.0)  # [B, Hkv, G, cap]; padding rows are all -inf
    mass = mass if p.per_head else mass.mean(2, keepdim=True)
    nb = ((seq_lens.long() + p.block_size - 1) // p.block_size)[:, None, None]
    forced = listed & ((lists < p.sink) | (lists >= nb - p.local) | ((nb <= p.cap) & p.short_dense))
    forced, cand = forced[:, :, None], (listed & ~forced)[:, :, None]
    vals = torch.where(cand, mass, -1.0).sort(-1, descending=True).values
    reach = (mass * forced).sum(-1, keepdim=True) + vals.clamp_min(0).cumsum(-1) >= p.prune_target
    first = torch.where(reach & (vals >= 0), torch.arange(cap, device=lists.device), cap).amin(-1, keepdim=True)
    forced_reach = (mass * forced).sum(-1, keepdim=True) >= p.prune_target
    threshold = torch.where(forced_reach, float("inf"),
                            torch.where(first < cap, vals.gather(-1, first.clamp_max(cap - 1)), 0.0))
    keep = (forced | (cand & (mass >= threshold))).any(2)
    out = torch.full((batch, num_kv_heads, cap + 1), -1, dtype=lists.dtype, device=lists.device)
    out.scatter_(-1, torch.where(keep, keep.cumsum(-1) - 1, cap), lists)  # column cap: the dropped
    return out[..., :cap]


def prune_selection_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        slots: torch.Tensor, sel: torch.Tensor, counter: torch.Tensor, stats: torch.Tensor,
                        p: SelectionParams, scale: float) -> None:
    """topp's second stage, right after update_selection_ref(..., p.candidates) wrote candidate lists:
    prunes, in place, the lists recomputed this step (reuse: update_selection_ref has already counted the
    step, so those are the rows whose counter - 1 is a multiple of R) and takes the dropped entries off
    stats[0], so the counters report the blocks attended."""
    slots = slots.long()
    live = (seq_lens > 0)[:, None].expand(-1, sel.shape[1])
    due = live & ((counter[slots] - 1) % p.reuse == 0) if p.reuse > 1 else live
    lists = sel[slots]
    pruned = prune_ref(block_lse_ref(q, kv_cache, block_tables, seq_lens, lists, scale), lists, seq_lens, p)
    sel[slots] = torch.where(due[..., None], pruned, lists)
    stats[0] -= (((lists >= 0).sum(-1) - (pruned >= 0).sum(-1)) * due).sum()
