"""Sparse decode's selection: block scores against the key metadata, the selection lists, and
the lagged selection's list rows (docs/architecture.md, principles 3 and 6).

Scoring: a page bounds q.k by q+ . kmax + q- . kmin over its int8 codes times its scale
(kernels/key_meta.py); a block scores the max over its pages. Each query head's scaled bounds
are softmax-normalised into estimated attention masses, averaged over the KV group: one
selection per KV head.

Selection of one (sequence, KV head) over its blocks 0..nb-1:
  forced: the first `sink`, the last `local`, and all of them when nb <= cap and short_dense;
  topk (top_p None): the k = cap - #forced best other blocks;
  top_p:  the fewest best others that bring the mass (forced included) to p, at most k (the
          topp policy selects topk here and prunes on real keys: kernels/topp_prune.py);
  flat:   (topp) where the others' estimated masses are flat (flat_share_ref >= flat_share) the
          list is flagged; if on such masses cap blocks cannot reach flat_mass either, it takes
          flat_cap blocks (flat_rows_ref);
  streaming heads pick no other block.
Stickiness b > 0 (hysteresis): a block of the row's previous list (`prev` row of sel) ranks by its
mass times 1 + b (the mass target counts true masses), so lists change only where the masses do.
A list is `cap` logical block indices (block-table positions), its entries first, then -1 padding (the
sparse kernels skip a padding tail: every writer keeps this order). With reuse R a
(slot, KV head) recomputes its list every R-th decode step (counter [S, Hkv]); the sparse
kernel always adds the current local window. With a flat hold H (topp, R = 1) a list flagged flat
stays for the next H steps of its (state slot, KV head): the counter counts them down, the held
row's selection and scoring return at once (docs/sparse.md, "Holding flat lists").

Grids follow shapes and host-side bounds only; programs with nothing to do (past the end,
padding rows, slot -1, reused pairs) return at once, so a decode step is capturable.
Design notes: docs/sparse.md, "Kernel notes".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.pdl import pdl_wait, use_pdl

MAX_SELECT_BLOCKS = 16384  # one selection program holds a row of block scores in registers


@dataclass(frozen=True)
class ScoreConfig:
    """The scoring launch; defaults from sweeps (docs/sparse.md, "Kernel notes")."""

    rows: int = 128  # metadata rows (blocks x pages) of a tile: two [G, D] x [D, rows] dots
    num_warps: int = 4
    num_stages: int = 2  # software pipelining of the tile loop
    tiles: int = 2  # tiles a program loops over (fewer when the context is short)


@dataclass(frozen=True)
class SelectConfig:
    ways: int = 2  # thresholds tested per search round (a power of two)
    num_warps: int = 0  # 0: by the row length (8 at 4096 blocks)


def mass_target(top_p: float | None) -> float:
    """What selection stops at: topk (None) never stops on mass, so a target above any total."""
    return 2.0 if top_p is None else top_p


# ---- references ----


def block_scores_ref(
    q: torch.Tensor,
    codes: torch.Tensor,
    page_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_blocks: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D] decode queries; codes [NB + 1, Hkv, 2, P, D], page_scale [NB + 1, Hkv, P]:
    one layer's key metadata. Returns float32 [B, Hq, max_blocks]: scale * the block's bound,
    -inf past the sequence's end."""
    batch, num_q_heads, _ = q.shape
    _, num_kv_heads, _, pages, _ = codes.shape
    group = num_q_heads // num_kv_heads
    tables = block_tables[:, :max_blocks].long()
    page_codes = codes[tables].float()  # [B, MB, Hkv, 2, P, D]
    scales = page_scale[tables].permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, MB, P]
    qg = q.float().view(batch, num_kv_heads, group, -1)
    dots = torch.einsum("bhgd,bnhpd->bhgnp", qg.clamp_min(0), page_codes[:, :, :, 1]) + torch.einsum(
        "bhgd,bnhpd->bhgnp", qg.clamp_max(0), page_codes[:, :, :, 0]
    )
    bound = dots * (scales * scale)  # the kernel's order: scale applied per page, before the max
    page_start = torch.arange(max_blocks * pages, device=q.device).view(max_blocks, pages) * (block_size // pages)
    valid = page_start[None] < seq_lens.long()[:, None, None]  # [B, MB, P]
    bound = bound.masked_fill(~valid[:, None, None], float("-inf")).amax(-1)
    return bound.reshape(batch, num_q_heads, max_blocks)


def block_masses(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hkv, MB]: each block's estimated softmax mass, averaged over the KV group."""
    batch, num_q_heads, mb = scores.shape
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of padding sequences are all -inf
    return probs.view(batch, num_kv_heads, num_q_heads // num_kv_heads, mb).mean(2)


def forced_blocks(
    seq_lens: torch.Tensor,
    max_blocks: int,
    *,
    block_size: int,
    cap: int,
    sink: int,
    local: int,
    short_dense: bool,
    ahead: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, forced) masks [B, MB]: blocks inside the context, and those always selected. ahead:
    the list serves the step `ahead` tokens later (lagged selection: 1), whose local window it forces."""
    nb = (seq_lens.long() + block_size - 1) // block_size
    nb_read = (seq_lens.long() + ahead + block_size - 1) // block_size
    j = torch.arange(max_blocks, device=seq_lens.device)[None]
    valid = j < nb[:, None]
    forced = valid & ((j < sink) | (j >= nb_read[:, None] - local) | ((nb[:, None] <= cap) & short_dense))
    return valid, forced


def select_ref(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    streaming: torch.Tensor,
    *,
    block_size: int,
    cap: int,
    sink: int,
    local: int,
    short_dense: bool = True,
    top_p: float | None = None,
    prev: torch.Tensor | None = None,
    stickiness: float = 0.0,
    ahead: int = 0,
    short: torch.Tensor | None = None,
    flat_cap: int = 0,
) -> torch.Tensor:
    """The selection lists [B, Hkv, cap] (int32, -1 padded): forced blocks first, then the chosen
    ones, each in block order. streaming: bool [Hkv]; prev: [B, Hkv, cap] the previous lists
    (with stickiness > 0); ahead: forced_blocks'; short: bool [B, Hkv] (flat_rows_ref), lists that
    take flat_cap blocks."""
    batch, _, mb = scores.shape
    hkv = streaming.numel()
    r = block_masses(scores, hkv)
    valid, forced, cand = candidates_ref(
        seq_lens,
        streaming,
        mb,
        block_size=block_size,
        cap=cap,
        sink=sink,
        local=local,
        short_dense=short_dense,
        ahead=ahead,
    )
    n_forced = forced.sum(-1, keepdim=True)
    row_cap = torch.full_like(n_forced, cap) if short is None else torch.where(short, flat_cap, cap)[..., None]
    fmass = (r * forced).sum(-1, keepdim=True)
    ranked = r
    if stickiness > 0 and prev is not None:
        listed = torch.zeros(batch, hkv, mb + 1, dtype=torch.bool, device=scores.device)
        listed.scatter_(-1, torch.where(prev >= 0, prev.long(), mb).clamp(0, mb), True)
        ranked = torch.where(listed[..., :mb], r * (1 + stickiness), r)
    vals, order = torch.where(cand, ranked, -1.0).sort(dim=-1, descending=True, stable=True)
    mass = torch.where(vals >= 0, r.gather(-1, order), 0.0)
    rank = torch.arange(mb, device=scores.device)
    mass_before = mass.cumsum(-1) - mass
    take = (vals >= 0) & (rank < row_cap - n_forced) & (fmass + mass_before < mass_target(top_p))
    chosen = torch.zeros_like(cand).scatter(-1, order, take)
    pos = torch.where(forced, forced.cumsum(-1) - 1, n_forced + chosen.cumsum(-1) - 1)
    keep = (forced | chosen) & (pos < row_cap)
    out = torch.full((batch, hkv, cap + 1), -1, dtype=torch.int32, device=scores.device)
    blocks = torch.arange(mb, dtype=torch.int32, device=scores.device).expand(batch, hkv, mb)
    out.scatter_(-1, torch.where(keep, pos, cap).clamp_max(cap), blocks)  # column cap: the dropped
    out[..., cap] = -1
    return out[..., :cap]


def candidates_ref(
    seq_lens: torch.Tensor, streaming: torch.Tensor, max_blocks: int, **kw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid, forced, candidates) bool [B, Hkv, MB]: forced_blocks' masks (kw: its keywords) by KV head,
    and the blocks selection chooses among (valid, not forced, not of a streaming head)."""
    valid, forced = forced_blocks(seq_lens, max_blocks, **kw)
    shape = (seq_lens.shape[0], streaming.numel(), max_blocks)
    valid, forced = valid[:, None].expand(shape), forced[:, None].expand(shape)
    return valid, forced, valid & ~forced & ~streaming[None, :, None]


def flat_share_ref(r: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """float32 [B, Hkv]: how flat the estimated masses r [B, Hkv, MB] of each row's candidates (cand)
    are: the share of their mass under their mean (sum of min(m, mean) / sum of m); 0 without mass.
    On a list of the best of them it tracks what a top-p prune keeps (docs/sparse.md, "When topp
    prunes")."""
    m = torch.where(cand, r, 0.0)
    total = m.sum(-1)
    mean = total / cand.sum(-1).clamp_min(1)
    below = torch.minimum(m, mean[..., None]).sum(-1)
    return torch.where(total > 0, below / torch.where(total > 0, total, 1.0), 0.0)


def flat_rows_ref(
    scores: torch.Tensor, seq_lens: torch.Tensor, streaming: torch.Tensor, *, flat_share: float, flat_mass: float, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat, short) bool [B, Hkv]: the rows whose candidates' estimated masses are flat (flat_share_ref
    >= flat_share > 0; a row without candidates, as one within the cap, is not), and those of them whose
    cap cannot reach flat_mass on equal masses (fewer candidates fit than there are, and the forced
    mass plus the fitting share of the candidates' < flat_mass): they take flat_cap. kw: candidates_ref's."""
    _, forced, cand = candidates_ref(seq_lens, streaming, scores.shape[-1], **kw)
    r = block_masses(scores, streaming.numel())
    flat = flat_share_ref(r, cand) >= flat_share
    n_cand, fit = cand.sum(-1), kw["cap"] - forced.sum(-1)
    reach = (r * forced).sum(-1) + (r * cand).sum(-1) * fit / n_cand.clamp_min(1)
    return flat, flat & (fit < n_cand) & (reach < flat_mass)


def select_blocks_ref(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    streaming: torch.Tensor,
    *,
    block_size: int,
    cap: int,
    sink: int,
    local: int,
    reuse: int = 1,
    short_dense: bool = True,
    top_p: float | None = None,
    stickiness: float = 0.0,
    prev_slots: torch.Tensor | None = None,
    ahead: int = 0,
    flat: torch.Tensor | None = None,
    flat_share: float = 1.0,
    flat_mass: float = 1.0,
    flat_cap: int = 0,
    flat_count: torch.Tensor | None = None,
    hold: int = 0,
    hold_rows: int | None = None,
) -> None:
    """Writes new lists into sel [S, Hkv, cap] at the rows' state slots, for the (slot, KV head)
    pairs due a recomputation (all without reuse); counter [S, Hkv] counts decode steps; stats
    int64 [2] += (blocks selected, selections). Padding rows and slot -1 change nothing.
    prev_slots: the sel rows holding each row's previous lists (None: its own slot; -1: none);
    ahead: 1 when the lists serve the next step (forced_blocks). flat (int8 [S, Hkv], with each new
    list): 1 where the row is flat (flat_rows_ref, with flat_mass; its short rows take flat_cap blocks);
    flat_count (int64 [1]; [2] with hold) += the new lists flagged (and the lists held; stats count a held list
    as a selection of its length).
    hold (with flat, reuse 1): a list flagged flat in one of the first hold_rows rows (None: all; the decodes,
    whose next steps hold it) is held for the next `hold` selections of its counter row, slot mod
    counter.shape[0] (lag rows: two lists a slot): counter = hold, else 0; a held row (counter > 0) keeps
    the list in sel at its slot (the caller keeps it there), is flagged flat again, counter -= 1."""
    rows = (seq_lens > 0) & (slots >= 0)  # slot -1 (lag: a reused step): none
    if hold:
        assert flat is not None and reuse == 1 and flat_count is not None and flat_count.numel() >= 2
        decode = torch.arange(len(slots), device=slots.device) < (len(slots) if hold_rows is None else hold_rows)
        crow = slots[rows].long().remainder(counter.shape[0])  # counter rows
        held = decode[rows][:, None] & (counter[crow] > 0)
    prev = None
    if stickiness > 0:
        at = (slots if prev_slots is None else prev_slots)[rows].long()
        prev = torch.where((at >= 0)[:, None, None], sel[at.clamp_min(0)], -1)
    kw = dict(block_size=block_size, cap=cap, sink=sink, local=local, short_dense=short_dense, ahead=ahead)
    flags = short = None
    if flat is not None:
        flags, short = flat_rows_ref(
            scores[rows], seq_lens[rows], streaming, flat_share=flat_share, flat_mass=flat_mass, **kw
        )
    lists = select_ref(
        scores[rows],
        seq_lens[rows],
        streaming,
        block_size=block_size,
        cap=cap,
        sink=sink,
        local=local,
        short_dense=short_dense,
        top_p=top_p,
        prev=prev,
        stickiness=stickiness,
        ahead=ahead,
        short=short,
        flat_cap=flat_cap,
    )
    slots = slots[rows].long()
    # without reuse every row (the lag's slots index two list rows a slot: no counter row)
    due = counter[slots] % reuse == 0 if reuse > 1 else torch.ones_like(lists[..., 0], dtype=torch.bool)
    if hold:  # a held row's list stays, flagged flat again
        due = ~held
        counter[crow] = torch.where(held, counter[crow] - 1, (flags & decode[rows][:, None]).to(counter.dtype) * hold)
        flat_count[1] += held.sum()
    sel[slots] = torch.where(due[..., None], lists, sel[slots])
    if flags is not None:
        flat[slots] = torch.where(due, flags.to(flat.dtype), 1 if hold else flat[slots])
        if flat_count is not None:
            flat_count[:1] += (flags & due).sum()
    if reuse > 1:
        counter[slots] += 1
    # a held list counts as a selection of its length (the counters' mean is what a step attends)
    stats[0] += (sel[slots] >= 0).sum() if hold else ((lists >= 0).sum(-1) * due).sum()
    stats[1] += due.numel() if hold else due.sum()


def score_and_select_ref(
    q: torch.Tensor,
    codes: torch.Tensor,
    page_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    streaming: torch.Tensor,
    *,
    max_blocks: int,
    scale: float,
    block_size: int,
    cap: int,
    sink: int,
    local: int,
    reuse: int = 1,
    short_dense: bool = True,
    top_p: float | None = None,
    width: int = 0,
    stickiness: float = 0.0,
    prev_slots: torch.Tensor | None = None,
    ahead: int = 0,
    flat: torch.Tensor | None = None,
    flat_share: float = 1.0,
    flat_mass: float = 1.0,
    flat_cap: int = 0,
    flat_count: torch.Tensor | None = None,
    hold: int = 0,
    hold_rows: int | None = None,
) -> None:
    """Scores then selects for the decode rows q [B, Hq, D] into sel (select_blocks_ref).
    max_blocks: host-side bound of the contexts in blocks; width: the launch's size hint only."""
    scores = block_scores_ref(q, codes, page_scale, block_tables, seq_lens, max_blocks, block_size, scale)
    select_blocks_ref(
        scores,
        seq_lens,
        slots,
        sel,
        counter,
        stats,
        streaming,
        block_size=block_size,
        cap=cap,
        sink=sink,
        local=local,
        reuse=reuse,
        short_dense=short_dense,
        top_p=top_p,
        stickiness=stickiness,
        prev_slots=prev_slots,
        ahead=ahead,
        flat=flat,
        flat_share=flat_share,
        flat_mass=flat_mass,
        flat_cap=flat_cap,
        flat_count=flat_count,
        hold=hold,
        hold_rows=hold_rows,
    )


def step_slots_ref(
    seq_lens: torch.Tensor, slots: torch.Tensor, num_decodes: int, reuse: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lagged selection: the list rows a step's rows read and write. Slot x keeps two lists, rows
    x and x + num_slots. A selection at context s goes to x + num_slots * ((s // R + 1) % 2); a
    decode at context s reads the latest one below s: x + num_slots * (((s - 1) // R + 1) % 2).
    Decodes select at multiples of R, prefill chunks at every chunk's end. Returns (read, write)
    int32 [B]; write -1: no selection (or a padding row)."""
    s = seq_lens.long()
    read = slots.long() + num_slots * (torch.div(s - 1, reuse, rounding_mode="floor") + 1).remainder(2)
    decode = torch.arange(s.numel(), device=s.device) < num_decodes
    due = (s > 0) & (~decode | (s % reuse == 0))
    write = torch.where(due, slots.long() + num_slots * ((s // reuse + 1) % 2), -1)
    return read.to(torch.int32), write.to(torch.int32)


# ---- dispatchers ----


def score_and_select(
    q: torch.Tensor,
    codes: torch.Tensor,
    page_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    streaming: torch.Tensor,
    **kw,
) -> None:
    """score_and_select_ref's contract."""
    if q.shape[0] == 0:
        return
    fn = score_and_select_triton if use_triton(q) else score_and_select_ref
    fn(q, codes, page_scale, block_tables, seq_lens, slots, sel, counter, stats, streaming, **kw)


def step_slots(
    seq_lens: torch.Tensor, slots: torch.Tensor, num_decodes: int, reuse: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """step_slots_ref's contract."""
    fn = step_slots_triton if use_triton(seq_lens) else step_slots_ref
    return fn(seq_lens, slots, num_decodes, reuse, num_slots)


# ---- Triton ----


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(
    do_not_specialize=["stride_sb", "stride_sh", "stride_tb", "max_blocks", "blocks_per_split", "hold_rows"],
    do_not_specialize_on_alignment=["table_ptr", "seq_lens_ptr", "slots_ptr"],
)
def _score_kernel(
    q_ptr,
    codes_ptr,
    page_scale_ptr,
    table_ptr,
    seq_lens_ptr,
    slots_ptr,
    counter_ptr,
    scores_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_sb,
    stride_sh,
    stride_tb,
    stride_cs,
    max_blocks,
    blocks_per_split,
    hold_rows,
    num_counters,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGES: tl.constexpr,
    CAP: tl.constexpr,
    REUSE: tl.constexpr,
    HOLD: tl.constexpr,
    SHORT_DENSE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence, KV head, split of blocks_per_split blocks): scores[b, h, n] for the
    GROUP query heads (reference: block_scores_ref). The int8 codes enter the dots in q's dtype
    (exact up to 127 in bf16/fp16); the split's tiles of BLOCK_N are software-pipelined."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n_start = tl.program_id(2) * blocks_per_split
    # Whether this program has work: step inputs and an earlier step's reuse counter, read
    # before pdl_wait (kernels/pdl.py), so a reused step's programs exit on release.
    seq_len = tl.load(seq_lens_ptr + b)
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # past the end; every block selected anyway; or no selection (slot -1: lag, reused step)
    idle = (n_start >= nb) | ((nb <= CAP) & SHORT_DENSE) | (slot < 0)
    if REUSE > 1:
        idle = idle | (tl.load(counter_ptr + slot * stride_cs + kvh, mask=slot >= 0, other=0) % REUSE != 0)
    if HOLD:  # a held flat list (select_blocks_ref)
        held_at = counter_ptr + (tl.maximum(slot, 0) % num_counters) * stride_cs + kvh
        idle = idle | (tl.load(held_at, mask=(slot >= 0) & (b < hold_rows), other=0) > 0)
    pdl_wait(PDL)
    if idle:
        return
    n_end = tl.minimum(n_start + blocks_per_split, nb)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=(g < GROUP)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pos = tl.maximum(q, 0.0).to(q_ptr.dtype.element_ty)
    q_neg = tl.minimum(q, 0.0).to(q_ptr.dtype.element_ty)
    # Rows: BLOCK_N blocks x PAGES pages; a page's min then max codes sit stride_mm apart.
    r = tl.arange(0, BLOCK_N * PAGES)
    page = r % PAGES
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    codes_head = codes_ptr + kvh * stride_mh + page * HEAD_DIM
    page_scale_head = page_scale_ptr + kvh * stride_sh + page
    score_row = scores_ptr + (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * max_blocks
    for n0 in tl.range(n_start, n_end, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + r // PAGES
        valid = (n < n_end) & ((n * BLOCK_SIZE + page * (BLOCK_SIZE // PAGES)) < seq_len)
        blk = tl.load(table_row + n, mask=valid, other=0).to(tl.int64)
        ptrs = codes_head[:, None] + (blk * stride_mb)[:, None] + dims[None, :]
        kmask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        cmin = tl.load(ptrs, mask=kmask, other=0).to(q_ptr.dtype.element_ty)
        cmax = tl.load(ptrs + stride_mm, mask=kmask, other=0).to(q_ptr.dtype.element_ty)
        row_scale = tl.load(page_scale_head + blk * stride_sb, mask=valid, other=0.0) * scale
        s = tl.dot(q_pos, tl.trans(cmax), input_precision=DOT_PREC) + tl.dot(
            q_neg, tl.trans(cmin), input_precision=DOT_PREC
        )
        s = tl.where(valid[None, :], s * row_scale[None, :], float("-inf"))
        if PAGES > 1:
            s = tl.max(tl.reshape(s, (BLOCK_G, BLOCK_N, PAGES)), 2)
        nn = n0 + tl.arange(0, BLOCK_N)
        tl.store(score_row[:, None] + nn[None, :], s, mask=(g < GROUP)[:, None] & (nn < n_end)[None, :])


@triton.jit
def _search(bits2, r2, lo, hi, c_lo, k, fmass, mass_target, w, WAYS: tl.constexpr, MASS: tl.constexpr):
    """Rounds of WAYS thresholds in [lo, hi) over the bit patterns bits2 [1, N] (c_lo of them >= lo)
    until at most one lies there: (lo, hi) around the largest t at which >= k of them, or (MASS) of
    mass r2 with fmass >= mass_target, lie at or above t."""
    c_hi = c_lo * 0
    while (c_lo - c_hi > 1) & (hi - lo > 1):
        gap = tl.cdiv(hi - lo, WAYS + 1)
        th = lo + (w + 1) * gap
        inside = th < hi
        ge = bits2 >= th[:, None]  # [WAYS, N]
        cnt = tl.sum(ge.to(tl.int32), 1)
        ok = cnt >= k
        if MASS:
            ok = ok | (fmass + tl.sum(tl.where(ge, r2, 0.0), 1) >= mass_target)
        ok = ok & inside  # monotone in t: the passing thresholds are a prefix
        fail = inside & (ok == 0)
        n_ok = tl.sum(ok.to(tl.int32), 0)
        c_lo = tl.min(tl.where(ok, cnt, c_lo), 0)
        c_hi = tl.max(tl.where(fail, cnt, c_hi), 0)
        hi = tl.minimum(lo + (n_ok + 1) * gap, hi)
        lo = lo + n_ok * gap
    return lo, hi


@triton.jit(
    do_not_specialize=["max_blocks", "ahead", "flat_cap", "hold_rows"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "slots_ptr"],
)
def _select_kernel(
    scores_ptr,
    seq_lens_ptr,
    slots_ptr,
    prev_slots_ptr,
    listed_ptr,
    sel_ptr,
    counter_ptr,
    stats_ptr,
    streaming_ptr,
    flat_ptr,
    flat_count_ptr,
    mass_target,
    sticky_factor,
    flat_share,
    flat_mass,
    flat_cap,
    max_blocks,
    ahead,
    stride_ss,
    stride_cs,
    hold_rows,
    num_counters,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAP: tl.constexpr,
    SINK: tl.constexpr,
    LOCAL: tl.constexpr,
    REUSE: tl.constexpr,
    HOLD: tl.constexpr,
    SHORT_DENSE: tl.constexpr,
    MASS: tl.constexpr,
    WAYS: tl.constexpr,
    NB_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    STICKY: tl.constexpr,
    CAP_PAD: tl.constexpr,
    FLAT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence, KV head): the selection list (reference: select_blocks_ref).
    STICKY: the previous list's blocks are marked in this program's row of `listed` (zeroed by
    the caller) and rank by their mass times sticky_factor. FLAT: flat_ptr[slot, kvh] = whether the
    candidates' estimated masses are flat (counted in flat_count_ptr), and a short one (flat_rows_ref)
    takes flat_cap blocks. HOLD (> 0, with FLAT): a flat list of a row below hold_rows is held HOLD
    steps (its counter row: slot mod num_counters; select_blocks_ref).

    No sort: a search over the masses' bit patterns (non-negative floats order like their bits)
    finds the largest threshold t at which the candidates >= t number k = the row's cap - #forced or
    (MASS) reach the target mass; each round tests WAYS thresholds in [lo, hi) and it stops once at
    most one candidate lies there; it starts at the least candidate. A row flagged flat searches by
    count alone (one reduction a round) and, only where the mass passes at that t, by count and mass
    above it. Candidates above t, then ties at t, follow the forced blocks, in block order
    (docs/sparse.md, "Kernel notes").
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)  # step inputs, own counter: before pdl_wait
    slot = tl.load(slots_ptr + b).to(tl.int64)
    selects = (seq_len > 0) & (slot >= 0)  # slot -1: no selection this step (sparse_lag)
    if REUSE > 1:
        step = tl.load(counter_ptr + slot * stride_cs + kvh, mask=selects, other=0)
    if HOLD > 0:
        held_at = counter_ptr + (tl.maximum(slot, 0) % num_counters) * stride_cs + kvh
        may_hold = selects & (b < hold_rows)
        left = tl.load(held_at, mask=may_hold, other=0)
    pdl_wait(PDL)
    if REUSE > 1 or HOLD > 0:
        # The trap: a program's threads each read its counter, and below they write it back. Without the
        # barrier a warp can read another's write, return where the others go on, and the reductions past
        # that point read a half program (garbage lists, a misaligned access: docs/sparse.md, "Kernel notes").
        tl.debug_barrier()
    if not selects:
        return
    if REUSE > 1:
        tl.store(counter_ptr + slot * stride_cs + kvh, step + 1)  # after the wait: scoring reads it
        if step % REUSE != 0:
            return
    if HOLD > 0:
        if left > 0:  # held: the list stays, flagged flat again (after the wait: scoring read the counter)
            tl.store(held_at, left - 1)
            tl.store(flat_ptr + slot * tl.num_programs(1) + kvh, tl.full([], 1, tl.int8))
            tl.atomic_add(flat_count_ptr + 1, 1)
            # counted as a selection of its length: the counters' mean is what a step attends
            c = tl.arange(0, CAP_PAD)
            kept = tl.load(sel_ptr + slot * stride_ss + kvh * CAP + c, mask=c < CAP, other=-1)
            tl.atomic_add(stats_ptr, tl.sum((kept >= 0).to(tl.int64), 0))
            tl.atomic_add(stats_ptr + 1, 1)
            return
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    j = tl.arange(0, NB_PAD)
    valid = j < nb
    # Forced blocks are [0, sink_end) and [local_start, nb): ranked in closed form, no scan needed.
    all_forced = (nb <= CAP) & SHORT_DENSE
    sink_end = tl.where(all_forced, nb, tl.minimum(nb, SINK))
    # the local window of the step the list serves (ahead: the next one, under lagged selection)
    local_start = tl.maximum(tl.minimum(tl.cdiv(seq_len + ahead, BLOCK_SIZE) - LOCAL, nb), sink_end)
    forced = valid & ((j < sink_end) | (j >= local_start))
    n_forced = sink_end + nb - local_start
    chosen_hi = j < 0  # all false
    chosen_eq = j < 0
    r = tl.zeros([NB_PAD], tl.float32)
    row_cap = CAP + nb * 0
    is_flat = nb < 0
    if (nb > CAP) | (not SHORT_DENSE):
        # Estimated mass: mean over the group's query heads of each head's softmax over the blocks,
        # HEADS rows of scores at a time ([HEADS, NB_PAD]: two reductions for all of them).
        h = tl.arange(0, HEADS)
        for g0 in tl.static_range(0, GROUP, HEADS):
            live = g0 + h < GROUP
            row = (b * tl.num_programs(1) * GROUP + kvh * GROUP + g0 + h).to(tl.int64) * max_blocks
            s = tl.load(
                scores_ptr + row[:, None] + j[None, :], mask=live[:, None] & valid[None, :], other=float("-inf")
            )
            # rows past the group: exp(-inf) = 0
            e = tl.exp(s - tl.where(live, tl.max(s, 1), 0.0)[:, None])
            prob = e * (1.0 / tl.where(live, tl.sum(e, 1), 1.0))[:, None]  # a division a row
            # a head with an inf or NaN score has no softmax: it adds nothing (block_masses), and no NaN
            # reaches the search (a NaN's bit pattern + 1, its bound, can overflow)
            r += tl.sum(tl.where(prob == prob, prob, 0.0), 0)
        r = r / GROUP
        cand = valid & (forced == 0) & (tl.load(streaming_ptr + kvh) == 0)
        ranked = r
        if STICKY:
            prev_slot = tl.load(prev_slots_ptr + b).to(tl.int64)  # -1: no previous list
            c = tl.arange(0, CAP_PAD)
            prev = tl.load(sel_ptr + tl.maximum(prev_slot, 0) * stride_ss + kvh * CAP + c, mask=c < CAP, other=-1)
            prev = tl.where(prev_slot >= 0, prev, -1)
            mark = listed_ptr + (b * tl.num_programs(1) + kvh).to(tl.int64) * NB_PAD
            tl.store(mark + prev, tl.full([CAP_PAD], 1, tl.int8), mask=(prev >= 0) & (prev < nb))
            tl.debug_barrier()  # this program's scatter, then its gather
            ranked = tl.where(tl.load(mark + j) != 0, r * sticky_factor, r)
        bits = tl.where(cand, ranked.to(tl.int32, bitcast=True), -1)  # non-candidates: below all
        fmass = 0.0
        if MASS or FLAT:
            fmass = tl.sum(tl.where(forced, r, 0.0), 0)
        if FLAT:  # flat candidates out of the cap's reach: the list takes flat_cap blocks
            cm = tl.where(cand, r, 0.0)
            cmass = tl.sum(cm, 0)
            n_cand = tl.sum(cand.to(tl.int32), 0)
            below = tl.sum(tl.minimum(cm, cmass / tl.maximum(n_cand, 1)), 0)
            is_flat = (cmass > 0) & (below >= flat_share * cmass)
            fit = CAP - n_forced
            reach = fmass + cmass * fit.to(tl.float32) / tl.maximum(n_cand, 1)
            row_cap = tl.where(is_flat & (fit < n_cand) & (reach < flat_mass), flat_cap, CAP)
        k = row_cap - n_forced
        # A flat row's estimated mass rarely binds: it searches by count alone first.
        mass_now = is_flat == 0
        top_ok = (k <= 0) | (mass_now & (fmass >= mass_target))  # t above every candidate passes: none chosen
        hi = tl.max(bits, 0) + 1
        lo = tl.where(top_ok, hi, tl.minimum(tl.min(tl.where(cand, bits, 0x7FFFFFFF), 0), hi))
        if FLAT:
            n_all = n_cand
        else:
            n_all = tl.sum(cand.to(tl.int32), 0)
        c_lo = tl.where(top_ok, 0, n_all)  # candidates >= lo, and >= hi
        w = tl.arange(0, WAYS)
        bits2 = bits[None, :]
        r2 = r[None, :]
        if MASS:
            if mass_now:
                lo, hi_t = _search(bits2, r2, lo, hi, c_lo, k, fmass, mass_target, w, WAYS=WAYS, MASS=True)
            else:
                lo, hi_t = _search(bits2, r2, lo, hi, c_lo, k, fmass, mass_target, w, WAYS=WAYS, MASS=False)
        else:
            lo, hi_t = _search(bits2, r2, lo, hi, c_lo, k, fmass, mass_target, w, WAYS=WAYS, MASS=False)
        # At most one candidate in [lo, hi) (or hi = lo + 1): t is it, or lo.
        t = tl.maximum(lo, tl.max(tl.where(bits < hi_t, bits, -1), 0))
        if MASS:
            if mass_now == 0:  # counted alone: above t only the mass passes; search there if it passes at t
                if fmass + tl.sum(tl.where(bits >= t, r, 0.0), 0) >= mass_target:
                    lo = tl.where(fmass >= mass_target, hi, t)  # the forced blocks' mass alone: none chosen
                    c_lo = tl.sum((bits >= lo).to(tl.int32), 0)
                    lo, hi = _search(bits2, r2, lo, hi, c_lo, k, fmass, mass_target, w, WAYS=WAYS, MASS=True)
                    t = tl.maximum(lo, tl.max(tl.where(bits < hi, bits, -1), 0))
        chosen_hi = cand & (bits > t)
        chosen_eq = cand & (bits == t)
    # One scan ranks both chosen sets: chosen_hi in the low 16 bits, chosen_eq in the high ones
    # (NB_PAD <= MAX_SELECT_BLOCKS < 2**15).
    packed = chosen_hi.to(tl.int32) + chosen_eq.to(tl.int32) * 65536
    rank = tl.cumsum(packed, 0)
    total = tl.sum(packed, 0)
    n_hi = total & 0xFFFF
    pos = tl.where(
        forced,
        tl.where(j < sink_end, j, sink_end + j - local_start),
        tl.where(chosen_hi, n_forced + (rank & 0xFFFF) - 1, n_forced + n_hi + (rank >> 16) - 1),
    )
    keep = ((forced.to(tl.int32) + packed) != 0) & (pos < row_cap)
    count = tl.minimum(n_forced + n_hi + (total >> 16), row_cap)
    row = sel_ptr + slot * stride_ss + kvh * CAP
    tl.store(row + pos, j, mask=keep)
    tl.store(row + j, tl.full([NB_PAD], -1, tl.int32), mask=(j >= count) & (j < CAP))
    if FLAT:  # unscored rows (all forced): not flat
        tl.store(flat_ptr + slot * tl.num_programs(1) + kvh, is_flat.to(tl.int8))
        tl.atomic_add(flat_count_ptr, 1, mask=is_flat)
        if HOLD > 0:
            tl.store(held_at, tl.where(is_flat & may_hold, HOLD, 0))
    tl.atomic_add(stats_ptr, count.to(tl.int64))
    tl.atomic_add(stats_ptr + 1, 1)


def block_scores_triton(
    q: torch.Tensor,
    codes: torch.Tensor,
    page_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    counter: torch.Tensor,
    *,
    max_blocks: int,
    block_size: int,
    cap: int,
    reuse: int,
    short_dense: bool,
    scale: float,
    config: ScoreConfig | None = None,
    hold: int = 0,
    hold_rows: int | None = None,
) -> torch.Tensor:
    """float32 [B, Hq, max_blocks] (block_scores_ref), written only where selection reads it:
    rows over cap blocks that recompute this step (not held: select_blocks_ref), blocks inside the context."""
    batch, num_q_heads, head_dim = q.shape
    _, hkv, _, pages, _ = codes.shape
    assert counter.stride(1) == 1 and codes.stride(-1) == 1 and codes.stride(-2) == head_dim
    assert page_scale.stride(-1) == 1
    scores = torch.empty(batch, num_q_heads, max_blocks, dtype=torch.float32, device=q.device)
    config = config or ScoreConfig()
    block_n = max(1, config.rows // pages)
    per_split = block_n * max(1, min(config.tiles, triton.cdiv(max_blocks, block_n)))
    group = num_q_heads // hkv
    pdl = use_pdl(q.device)
    _score_kernel[(batch, hkv, triton.cdiv(max_blocks, per_split))](
        q,
        codes,
        page_scale,
        block_tables,
        seq_lens,
        slots,
        counter,
        scores,
        scale,
        q.stride(0),
        q.stride(1),
        codes.stride(0),
        codes.stride(1),
        codes.stride(2),
        page_scale.stride(0),
        page_scale.stride(1),
        block_tables.stride(0),
        counter.stride(0),
        max_blocks,
        per_split,
        batch if hold_rows is None else hold_rows,
        counter.shape[0],
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PAGES=pages,
        CAP=cap,
        REUSE=reuse,
        HOLD=hold > 0,
        SHORT_DENSE=short_dense,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return scores


def select_blocks_triton(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    streaming: torch.Tensor,
    *,
    block_size: int,
    cap: int,
    sink: int,
    local: int,
    reuse: int = 1,
    short_dense: bool = True,
    top_p: float | None = None,
    config: SelectConfig | None = None,
    width: int = 0,
    stickiness: float = 0.0,
    prev_slots: torch.Tensor | None = None,
    ahead: int = 0,
    flat: torch.Tensor | None = None,
    flat_share: float = 1.0,
    flat_mass: float = 1.0,
    flat_cap: int = 0,
    flat_count: torch.Tensor | None = None,
    hold: int = 0,
    hold_rows: int | None = None,
) -> None:
    """select_blocks_ref's contract. width: blocks the launch is sized for when more than the
    scores' (the model's longest context), so one compiled variant serves every step."""
    config = config or SelectConfig()
    batch, num_q_heads, max_blocks = scores.shape
    hkv = sel.shape[1]
    if max_blocks > MAX_SELECT_BLOCKS:
        raise ValueError(
            f"sparse selection handles up to {MAX_SELECT_BLOCKS} blocks per sequence, got "
            f"{max_blocks}: raise block_size or lower max_model_len"
        )
    assert sel.shape[-1] == cap and sel.stride(2) == 1 and counter.stride(1) == 1
    assert flat is None or (flat.shape == sel.shape[:2] and flat.is_contiguous())
    assert not hold or (flat is not None and reuse == 1 and flat_count is not None and flat_count.numel() >= 2)
    if flat is not None and flat_count is None:  # the count goes nowhere
        flat_count = torch.zeros(1, dtype=torch.int64, device=scores.device)
    nb_pad = max(triton.next_power_of_2(max(max_blocks, width)), triton.next_power_of_2(cap), 16)
    pdl = use_pdl(scores.device)
    sticky = stickiness > 0
    # the marks of the previous lists (a memset in a captured step)
    listed = torch.zeros(batch * hkv * nb_pad if sticky else 1, dtype=torch.int8, device=scores.device)
    _select_kernel[(batch, hkv)](
        scores,
        seq_lens,
        slots,
        slots if prev_slots is None else prev_slots,
        listed,
        sel,
        counter,
        stats,
        streaming.view(torch.uint8),
        stats if flat is None else flat,
        stats if flat_count is None else flat_count,
        mass_target(top_p),
        1.0 + stickiness,
        flat_share,
        flat_mass,
        flat_cap,
        max_blocks,
        ahead,
        sel.stride(0),
        counter.stride(0),
        batch if hold_rows is None else hold_rows,
        counter.shape[0],
        GROUP=num_q_heads // hkv,
        BLOCK_SIZE=block_size,
        CAP=cap,
        SINK=sink,
        LOCAL=local,
        REUSE=reuse,
        HOLD=hold,
        SHORT_DENSE=short_dense,
        MASS=top_p is not None,
        WAYS=config.ways,
        NB_PAD=nb_pad,
        HEADS=min(triton.next_power_of_2(num_q_heads // hkv), max(1, 16384 // nb_pad)),
        STICKY=sticky,
        CAP_PAD=triton.next_power_of_2(cap),
        FLAT=flat is not None,
        num_warps=config.num_warps or min(16, max(4, nb_pad // 512)),
        PDL=pdl,
        launch_pdl=pdl,
    )


def score_and_select_triton(
    q: torch.Tensor,
    codes: torch.Tensor,
    page_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    streaming: torch.Tensor,
    *,
    max_blocks: int,
    scale: float,
    block_size: int,
    cap: int,
    sink: int,
    local: int,
    reuse: int = 1,
    short_dense: bool = True,
    top_p: float | None = None,
    width: int = 0,
    stickiness: float = 0.0,
    prev_slots: torch.Tensor | None = None,
    ahead: int = 0,
    flat: torch.Tensor | None = None,
    flat_share: float = 1.0,
    flat_mass: float = 1.0,
    flat_cap: int = 0,
    flat_count: torch.Tensor | None = None,
    hold: int = 0,
    hold_rows: int | None = None,
) -> None:
    scores = block_scores_triton(
        q,
        codes,
        page_scale,
        block_tables,
        seq_lens,
        slots,
        counter,
        max_blocks=max_blocks,
        block_size=block_size,
        cap=cap,
        reuse=reuse,
        short_dense=short_dense,
        scale=scale,
        hold=hold,
        hold_rows=hold_rows,
    )
    select_blocks_triton(
        scores,
        seq_lens,
        slots,
        sel,
        counter,
        stats,
        streaming,
        block_size=block_size,
        cap=cap,
        sink=sink,
        local=local,
        reuse=reuse,
        short_dense=short_dense,
        top_p=top_p,
        width=width,
        stickiness=stickiness,
        prev_slots=prev_slots,
        ahead=ahead,
        flat=flat,
        flat_share=flat_share,
        flat_mass=flat_mass,
        flat_cap=flat_cap,
        flat_count=flat_count,
        hold=hold,
        hold_rows=hold_rows,
    )


# The batch and its decodes follow the step: not specialized on, one BLOCK for every batch.
@triton.jit(do_not_specialize=["batch", "num_decodes"])
def _step_slots_kernel(
    seq_lens_ptr, slots_ptr, read_ptr, write_ptr, batch, num_decodes, reuse, num_slots, BLOCK: tl.constexpr
):
    """The list rows each sequence reads and writes this step (step_slots_ref)."""
    for start in range(0, batch, BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < batch
        s = tl.load(seq_lens_ptr + i, mask=m, other=0)
        x = tl.load(slots_ptr + i, mask=m, other=0)
        prev = tl.where(s > 0, (s - 1) // reuse, -1)  # floor((s - 1) / R); // truncates
        tl.store(read_ptr + i, x + num_slots * ((prev + 1) % 2), mask=m)
        due = (s > 0) & ((i >= num_decodes) | (s % reuse == 0))
        tl.store(write_ptr + i, tl.where(due, x + num_slots * ((s // reuse + 1) % 2), -1), mask=m)


def step_slots_triton(
    seq_lens: torch.Tensor, slots: torch.Tensor, num_decodes: int, reuse: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """step_slots_ref's contract, one launch a step."""
    batch = seq_lens.numel()
    read = torch.empty(batch, dtype=torch.int32, device=seq_lens.device)
    write = torch.empty_like(read)
    if batch:
        _step_slots_kernel[(1,)](
            seq_lens, slots, read, write, batch, num_decodes, reuse, num_slots, BLOCK=256, num_warps=1
        )
    return read, write
