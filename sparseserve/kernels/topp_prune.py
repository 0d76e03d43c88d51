"""topp's second stage: Twilight's select-then-prune at block granularity.

The first stage (kernels/block_score.py, topk over the key bounds) fills each due list with
the forced blocks and the top candidates. Here:
  1. block lse, program (sequence, KV head, tile of entries): per listed block and query head,
     the log-sum-exp of scale * q.k over its valid tokens (its real mass). Reads only K.
  2. prune, program (sequence, KV head): per query head the softmax of those lse over the list
     (forced entries included), averaged over the group (per_head: each head, union kept);
     keeps the forced entries and the candidates of mass >= t, for the largest t at which they
     reach p (ties at t kept; all when the total stays below p), compacts the list in place and
     takes the dropped entries off stats[0]. A sort up to SORT_MAX_CAP blocks, else a bit-pattern
     search. With `out` (lagged selection: the candidates stay, a step's query prunes them for
     itself) row b's result goes to out[b] instead (out_rows, prefetching reads: to out[out_rows[b]],
     padding rows nowhere), padding rows get -1, and the prune counts what it keeps (stats[0] +=
     kept, stats[1] += 1 per live list): the candidates' selection counted nothing. `out_view` (either
     way): each kept entry's pool view (its loc: slot, or -(host row + 1)) at its new position by decode row, so the
     attention reads the pruned lists without a second pool lookup. `lookup` (prefetching reads): the
     candidates' view is not given; kernel 1 looks each entry up in the pool itself and writes it.
Both skip padding rows, rows that fit the cap and, with reuse, lists kept this step, so the
grid follows shapes only (capturable). Under KV offload keys are read through the pool view
(`offload`, as in kernels/sparse_decode.py; `view_by_slot`: its rows by state slot, as lagged
plans keep them, instead of by decode row).
"""

from __future__ import annotations

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.pdl import pdl_wait, use_pdl
from sparseserve.kernels.pool_plan import ListLookup, pool_lookup_ref
from sparseserve.kernels.sparse_decode import kv_rows_aligned, listed_rows, offload_context_ref

MAX_PRUNE_CAP = 4096  # one prune program holds a list in registers
SORT_MAX_CAP = 256  # the prune's default search: a sort up to lists this long, rounds of 4 above (docs/sparse.md)


def prune_target(top_p: float) -> float:
    """p = 1 keeps every candidate (no float total can be trusted to reach 1)."""
    return top_p if top_p < 1.0 else float("inf")


# ---- references ----


def block_lse_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lists: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """float32 [B, Hq, cap]: per query head, log-sum-exp of scale * q.k over the valid tokens of
    each block of lists [B, Hkv, cap]; -inf for -1 entries. kv_cache: [NB, Hkv, 2, bs, D]."""
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
    s = s.masked_fill(~valid[:, :, None], float("-inf"))  # also hides unwritten (NaN?) memory
    return torch.logsumexp(s, -1).reshape(batch, num_q_heads, cap)


def compact_ref(values: torch.Tensor, keep: torch.Tensor, fill: int = -1) -> torch.Tensor:
    """values' kept entries (keep: the same shape) moved to the front of the last dim, in order, then fill."""
    cap = values.shape[-1]
    out = torch.full((*values.shape[:-1], cap + 1), fill, dtype=values.dtype, device=values.device)
    out.scatter_(-1, torch.where(keep, keep.long().cumsum(-1) - 1, cap), values)  # column cap: the dropped
    return out[..., :cap]


def prune_ref(lse: torch.Tensor, lists: torch.Tensor, seq_lens: torch.Tensor, **kw) -> torch.Tensor:
    """The pruned lists [B, Hkv, cap] from the blocks' lse [B, Hq, cap] (module docstring,
    step 2): the kept entries in list order, then -1. kw: prune_keep_ref's."""
    return compact_ref(lists, prune_keep_ref(lse, lists, seq_lens, **kw))


def prune_keep_ref(
    lse: torch.Tensor,
    lists: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    sink: int,
    local: int,
    top_p: float,
    short_dense: bool = True,
    per_head: bool = False,
) -> torch.Tensor:
    """bool [B, Hkv, cap]: the entries of lists the prune keeps (prune_ref's before compaction)."""
    batch, num_kv_heads, cap = lists.shape
    listed = lists >= 0
    logits = lse.view(batch, num_kv_heads, -1, cap).masked_fill(~listed[:, :, None], float("-inf"))
    mass = torch.softmax(logits, -1).nan_to_num(0.0)  # [B, Hkv, G, cap]; padding rows are all -inf
    mass = mass if per_head else mass.mean(2, keepdim=True)
    nb = ((seq_lens.long() + block_size - 1) // block_size)[:, None, None]
    forced = listed & ((lists < sink) | (lists >= nb - local) | ((nb <= cap) & short_dense))
    forced, cand = forced[:, :, None], (listed & ~forced)[:, :, None]
    target = prune_target(top_p)
    vals = torch.where(cand, mass, -1.0).sort(-1, descending=True).values
    reach = (mass * forced).sum(-1, keepdim=True) + vals.clamp_min(0).cumsum(-1) >= target
    first = torch.where(reach & (vals >= 0), torch.arange(cap, device=lists.device), cap).amin(-1, keepdim=True)
    forced_reach = (mass * forced).sum(-1, keepdim=True) >= target
    threshold = torch.where(
        forced_reach, float("inf"), torch.where(first < cap, vals.gather(-1, first.clamp_max(cap - 1)), 0.0)
    )
    return (forced | (cand & (mass >= threshold))).any(2)


def topp_prune_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    *,
    sink: int,
    local: int,
    top_p: float,
    scale: float,
    reuse: int = 1,
    short_dense: bool = True,
    per_head: bool = False,
    offload: tuple | None = None,
    host_reads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    view_by_slot: bool = False,
    out_view: torch.Tensor | None = None,
    flat: torch.Tensor | None = None,
    host_attended: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    lookup: ListLookup | None = None,
) -> None:
    """Right after the first stage wrote lists into sel [S, Hkv, cap] for the decode rows q
    [B, Hq, D]: prunes in place the lists recomputed this step (counter - 1 a multiple of R:
    the first stage already counted the step); stats[0] -= dropped entries. offload: as for
    kernels/sparse_decode.py; host_reads (int64 [1]) += the entries of the pruned lists whose keys
    it read from the host (not in the pool). out (int32 [>= B, Hkv, cap]): row b's list pruned (or
    kept whole when the prune skips it; -1 for padding rows) into out[b], sel untouched, stats[0] +=
    kept entries and stats[1] += live lists (module docstring). view_by_slot: offload's loc
    rows by state slot. out_view (with offload: int64 loc [>= B, Hkv, cap]): row b's kept entries'
    loc at their positions in out[b] (in place: in row b's list), then -1. The trap (in place):
    lists are compact (the selection's and the prune's are), so a skipped list is its own compaction.
    flat (int8 [S, Hkv], the first stage's: kernels/block_score.py): lists flagged there stay whole.
    host_attended (with out_view, int64 [1]) += kept entries before the local window that the attention
    will read from the host (loc < 0). out_rows (int [B], with out): row b's list goes to out[out_rows[b]]
    instead, padding rows' nowhere (prefetching reads: into the lists' read rows). lookup (with out_view,
    prefetching reads): offload's loc [B, Hkv, cap] is not given but written: the lists' view by
    decode row as pool_lookup_ref finds it (its statistics to lookup.stats), which the Triton path does in
    its lse kernel."""
    block_size = kv_cache.shape[3]
    if lookup is not None:
        offload[2].copy_(
            pool_lookup_ref(sel, slots, lookup.tables, seq_lens, lookup.layout, lookup.resident, lookup.stats)
        )
    slots = slots.long()
    if offload is not None and view_by_slot:  # the reference reads the view by decode row
        offload = (*offload[:2], offload[2][slots])
    live = (seq_lens > 0)[:, None].expand(-1, sel.shape[1])
    due = live & ((counter[slots] - 1) % reuse == 0) if reuse > 1 else live
    if flat is not None:
        due = due & (flat[slots] == 0)
    lists = sel[slots]
    if offload is not None:  # every block a list may keep, as [B * MB] logical blocks
        if host_reads is not None:
            nb = (seq_lens.long() + block_size - 1) // block_size
            runs = due & ~((nb <= sel.shape[-1]) & short_dense)[:, None]  # the kernel's _skip
            host_reads += (listed_rows(lists, seq_lens, local, block_size) & (offload[2] < 0) & runs[..., None]).sum()
        ctx = offload_context_ref(kv_cache, block_tables, seq_lens, lists, local, offload)
        kv_cache = ctx.flatten(0, 1)
        block_tables = torch.arange(kv_cache.shape[0], device=q.device).view(ctx.shape[:2])
    lse = block_lse_ref(q, kv_cache, block_tables, seq_lens, lists, scale)
    keep = prune_keep_ref(
        lse,
        lists,
        seq_lens,
        block_size=block_size,
        sink=sink,
        local=local,
        top_p=top_p,
        short_dense=short_dense,
        per_head=per_head,
    )
    keep = torch.where(due[..., None], keep, lists >= 0)  # a list the prune skips stays whole
    result = compact_ref(lists, keep)
    if out_view is not None:
        out_view[: len(slots)] = compact_ref(offload[2], keep & live[..., None])
        if host_attended is not None:
            kept = keep & live[..., None] & listed_rows(lists, seq_lens, local, block_size)
            host_attended += (kept & (offload[2] < 0)).sum()
    if out is None:
        sel[slots] = result
        stats[0] -= ((lists >= 0).sum(-1) - (result >= 0).sum(-1)).sum()
        return
    if out_rows is not None:
        on = seq_lens > 0
        out[out_rows.long()[on]] = result[on]
    else:
        out[: len(slots)] = torch.where(live[..., None], result, -1)
    stats[0] += ((result >= 0) & live[..., None]).sum()
    stats[1] += live.sum()


def topp_prune(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    **kw,
) -> None:
    """topp_prune_ref's contract."""
    if q.shape[0] == 0:
        return
    fn = topp_prune_triton if use_triton(q) else topp_prune_ref
    fn(q, kv_cache, block_tables, seq_lens, slots, sel, counter, stats, **kw)


# ---- Triton ----


@triton.jit
def _skip(
    seq_lens_ptr,
    slots_ptr,
    counter_ptr,
    flat_ptr,
    b,
    kvh,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    CAP: tl.constexpr,
    REUSE: tl.constexpr,
    SHORT_DENSE: tl.constexpr,
    FLAT: tl.constexpr,
):
    """Whether row b's list for kvh stays: a padding row, a context within the cap, a list
    kept this step (recomputed iff (counter - 1) % REUSE == 0: selection already counted it),
    or (FLAT) one its selection flagged flat."""
    seq_len = tl.load(seq_lens_ptr + b)
    skip = (seq_len == 0) | ((tl.cdiv(seq_len, BLOCK_SIZE) <= CAP) & SHORT_DENSE)
    if FLAT:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        row = tl.maximum(slot, 0) * tl.num_programs(1) + kvh
        skip = skip | (tl.load(flat_ptr + row, mask=(seq_len > 0) & (slot >= 0), other=0) != 0)
    if REUSE > 1:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        skip = skip | ((tl.load(counter_ptr + slot * stride_cs + kvh) - 1) % REUSE != 0)
    return skip


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["stride_tb", "stride_kt"])
def _block_lse_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    slots_ptr,
    sel_ptr,
    counter_ptr,
    flat_ptr,
    lse_ptr,
    scale,
    pool_ptr,
    host_ptr,
    loc_ptr,
    reads_ptr,
    tok_ptr,
    resident_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_tb,
    stride_ss,
    stride_cs,
    stride_kt,
    key_base,
    trash_key,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAP: tl.constexpr,
    REUSE: tl.constexpr,
    SHORT_DENSE: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_E: tl.constexpr,
    DOT_PREC: tl.constexpr,
    OFFLOAD: tl.constexpr,
    COUNT_READS: tl.constexpr,
    LOCAL: tl.constexpr,
    VIEW_BY_SLOT: tl.constexpr,
    K_ALIGNED: tl.constexpr,
    LOOKUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """lse[b, kvh * GROUP + g, e] for this program's TILE_E entries (reference: block_lse_ref).
    OFFLOAD: entries before the local window read K as the sparse decode kernel does, and COUNT_READS adds
    to reads_ptr[0] those read from the host. K_ALIGNED (the launcher checks it: kv_rows_aligned): every
    token row's start is 16-byte aligned, so the picked rows load in 16-byte vectors, not 2-byte ones.
    LOOKUP (prefetching reads): the view is this kernel's output, not its input: each entry's key from the
    token table tok_ptr and its slot resident[key], written to loc (the slot, or -(key + 1)) by decode row
    for every row, the rows it skips included (the prune reads the view of every list)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    skip = _skip(
        seq_lens_ptr, slots_ptr, counter_ptr, flat_ptr, b, kvh, stride_cs, BLOCK_SIZE, CAP, REUSE, SHORT_DENSE, FLAT
    )
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t = tl.arange(0, TILE_E * BLOCK_SIZE)  # token t: entry t // BLOCK_SIZE, row t % BLOCK_SIZE
    e = tl.program_id(2) * TILE_E + t // BLOCK_SIZE
    off = t % BLOCK_SIZE
    if LOOKUP:  # (pool_plan.pool_lookup_ref, one lane an entry stores)
        live = (e < CAP) & ((tl.zeros_like(e) + seq_len) > 0) & ((tl.zeros_like(e).to(tl.int64) + slot) >= 0)
        jv = tl.load(sel_ptr + tl.maximum(slot, 0) * stride_ss + kvh * CAP + e, mask=live, other=-1)
        vlisted = (jv >= 0) & (jv < tl.maximum(tl.cdiv(seq_len, BLOCK_SIZE) - LOCAL, 0))
        tok = tl.load(tok_ptr + b.to(tl.int64) * stride_kt + jv, mask=vlisted, other=0).to(tl.int64)
        vkey = tl.where(vlisted, (key_base + tok) * tl.num_programs(1) + kvh, trash_key)
        vloc = tl.load(resident_ptr + vkey, mask=vlisted, other=-1)
        vloc = tl.where(vloc >= 0, vloc, -1 - vkey)  # the host row is the key
        vbase = (b.to(tl.int64) * tl.num_programs(1) + kvh) * CAP
        tl.store(loc_ptr + vbase + e, vloc, mask=(off == 0) & (e < CAP))
    if skip:
        return
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=(g < GROUP)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    j = tl.load(sel_ptr + slot * stride_ss + kvh * CAP + e, mask=e < CAP, other=-1)
    ok = (j >= 0) & (j * BLOCK_SIZE + off < seq_len)
    dmask = (dims < HEAD_DIM)[None, :]
    if OFFLOAD:
        listed = ok & (j < tl.maximum(tl.cdiv(seq_len, BLOCK_SIZE) - LOCAL, 0))
        vrow = b.to(tl.int64)
        if VIEW_BY_SLOT:
            vrow = slot
        lrow = (vrow * tl.num_programs(1) + kvh) * CAP
        if LOOKUP:  # this kernel's own lookup (above)
            pslot = tl.where(listed, vloc, -1)
        else:
            pslot = tl.load(loc_ptr + lrow + e, mask=listed & (e < CAP), other=-1)
        in_cache = ok & ~listed
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + j, mask=in_cache, other=0).to(tl.int64)
        # One pointer per token row (a select, not three masked loads): pool, host (UVA) or cache; K is the
        # first half of a head block.
        k_rows = tl.where(
            listed & (pslot >= 0),
            pool_ptr + tl.maximum(pslot, 0) * (2 * BLOCK_SIZE * HEAD_DIM),
            tl.where(
                listed,
                host_ptr + (-1 - pslot) * (2 * BLOCK_SIZE * HEAD_DIM),
                cache_ptr + blk * stride_cb + kvh * stride_ch,
            ),
        )
        if K_ALIGNED:  # the select loses the bases' alignment (docs/kernels.md, "Design notes")
            k_rows = tl.multiple_of(k_rows, 16)
        k = tl.load((k_rows + off * HEAD_DIM)[:, None] + dims[None, :], mask=ok[:, None] & dmask, other=0.0)
        if COUNT_READS:  # an entry's first token row stands for it; no atomic for none (most programs)
            reads = tl.sum((listed & (pslot < 0) & (off == 0)).to(tl.int64), 0)
            if reads > 0:
                tl.atomic_add(reads_ptr, reads)
    else:
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + j, mask=ok, other=0).to(tl.int64)
        k = tl.load(
            cache_ptr + (blk * stride_cb + kvh * stride_ch + off * HEAD_DIM)[:, None] + dims[None, :],
            mask=ok[:, None] & dmask,
            other=0.0,
        )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale  # [BLOCK_G, TILE_E * BLOCK_SIZE]
    s = tl.reshape(tl.where(ok[None, :], s, float("-inf")), (BLOCK_G, TILE_E, BLOCK_SIZE))
    m = tl.max(s, 2)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty entry: exp gives 0 below, lse -inf
    total = tl.sum(tl.exp(s - m[:, :, None]), 2)
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    ee = tl.program_id(2) * TILE_E + tl.arange(0, TILE_E)
    row = (b * tl.num_programs(1) * GROUP + heads).to(tl.int64) * CAP
    tl.store(lse_ptr + row[:, None] + ee[None, :], lse, mask=(g < GROUP)[:, None] & (ee < CAP)[None, :])


@triton.jit
def _keep_top_p(r, forced, cand, top_p, WAYS: tl.constexpr, ITERS: tl.constexpr):
    """The candidates of mass r >= t, for the largest t at which forced + those reach top_p:
    each round tests WAYS bit patterns (non-negative floats order like them); no sort."""
    fmass = tl.sum(tl.where(forced, r, 0.0), 0)
    bits = r.to(tl.int32, bitcast=True)
    lo = tl.full([], 0, tl.int32)  # stays 0 (every candidate) if no threshold reaches p
    hi = tl.full([], 0x7F800001, tl.int32)  # past +inf: forced alone reach p
    w = tl.arange(0, WAYS)
    for _ in range(ITERS):
        step = tl.cdiv(hi - lo, WAYS)
        th = lo + w * step
        ge = cand[None, :] & (bits[None, :] >= th[:, None])  # [WAYS, CAP_PAD]
        ok = fmass + tl.sum(tl.where(ge, r[None, :], 0.0), 1) >= top_p
        n_ok = tl.sum(((ok & (th < hi)) | (w == 0)).to(tl.int32), 0)  # passes: a prefix
        hi = tl.minimum(lo + n_ok * step, hi)
        lo = lo + (n_ok - 1) * step
    return cand & (bits >= lo)


@triton.jit
def _keep_top_p_sorted(r, forced, cand, top_p, CAP_PAD: tl.constexpr):
    """_keep_top_p's set by prune_ref's route: the candidates sorted by mass, the threshold the first whose
    running sum (after the forced) reaches top_p (one bitonic sort instead of the serial rounds)."""
    fmass = tl.sum(tl.where(forced, r, 0.0), 0)
    vals = tl.sort(tl.where(cand, r, -1.0), descending=True)
    reach = (fmass + tl.cumsum(tl.maximum(vals, 0.0), 0) >= top_p) & (vals >= 0)
    idx = tl.arange(0, CAP_PAD)
    first = tl.min(tl.where(reach, idx, CAP_PAD), 0)
    t = tl.where(first < CAP_PAD, tl.sum(tl.where(idx == first, vals, 0.0), 0), 0.0)
    t = tl.where(fmass >= top_p, float("inf"), t)
    return cand & (r >= t)


@triton.jit
def _keep(r, forced, cand, top_p, WAYS: tl.constexpr, ITERS: tl.constexpr, SORT: tl.constexpr, CAP_PAD: tl.constexpr):
    if SORT:
        keep = _keep_top_p_sorted(r, forced, cand, top_p, CAP_PAD)
    else:
        keep = _keep_top_p(r, forced, cand, top_p, WAYS, ITERS)
    return keep


@triton.jit
def _prune_kernel(
    lse_ptr,
    seq_lens_ptr,
    slots_ptr,
    sel_ptr,
    counter_ptr,
    flat_ptr,
    stats_ptr,
    out_ptr,
    view_loc_ptr,
    out_loc_ptr,
    host_ptr,
    out_rows_ptr,
    lookup_stats_ptr,
    key_reads_ptr,
    top_p,
    stride_ss,
    stride_cs,
    stride_ob,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAP: tl.constexpr,
    SINK: tl.constexpr,
    LOCAL: tl.constexpr,
    REUSE: tl.constexpr,
    SHORT_DENSE: tl.constexpr,
    FLAT: tl.constexpr,
    PER_HEAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    CAP_PAD: tl.constexpr,
    WAYS: tl.constexpr,
    ITERS: tl.constexpr,
    SORT: tl.constexpr,
    OUT: tl.constexpr,
    VIEW: tl.constexpr,
    VIEW_BY_SLOT: tl.constexpr,
    COUNT_HOST: tl.constexpr,
    OUT_ROWS: tl.constexpr,
    COUNT_LOOKUP: tl.constexpr,
    COUNT_KEY_READS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Prunes the list of (b, kvh) in place, or with OUT into out row b (reference: topp_prune_ref); with VIEW
    also the kept entries' view (loc) into out_loc row b (in place: a skipped list's whole).
    COUNT_LOOKUP: the listed entries before the window found in the pool and not go to lookup_stats[0:2]
    (the lse kernel looked them up: a count a list here, not an atomic a tile there); COUNT_KEY_READS
    (with it): those not found of a list the lse read also go to key_reads[0] (the keys it read from the host)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    skip = _skip(
        seq_lens_ptr, slots_ptr, counter_ptr, flat_ptr, b, kvh, stride_cs, BLOCK_SIZE, CAP, REUSE, SHORT_DENSE, FLAT
    )
    if not OUT:
        if not VIEW:
            if skip:
                return
    seq_len = tl.load(seq_lens_ptr + b)
    nb = tl.cdiv(seq_len, BLOCK_SIZE)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    e = tl.arange(0, CAP_PAD)
    sel_row = sel_ptr + slot * stride_ss + kvh * CAP
    j = tl.load(sel_row + e, mask=e < tl.where(seq_len > 0, CAP, 0), other=-1)  # a padding row's slot: any list
    listed = j >= 0
    if VIEW:  # the candidates' view, loaded before the prune needs it (its latency beside the lse's)
        vrow = b.to(tl.int64)
        if VIEW_BY_SLOT:
            vrow = slot
        vrow = (vrow * tl.num_programs(1) + kvh) * CAP
        vloc = tl.load(view_loc_ptr + vrow + e, mask=listed, other=-1)
    forced = listed & ((j < SINK) | (j >= nb - LOCAL))
    cand = listed & ~forced
    # Per query head: softmax over the listed entries; then the group's mean (or each head).
    g = tl.arange(0, BLOCK_G)
    valid = (g < GROUP)[:, None] & listed[None, :]
    lse = tl.load(
        lse_ptr + ((b * tl.num_programs(1) * GROUP + kvh * GROUP + g).to(tl.int64) * CAP)[:, None] + e[None, :],
        mask=valid,
        other=float("-inf"),
    )
    m = tl.max(lse, 1)
    x = tl.where(valid, tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
    z = tl.sum(x, 1)
    probs = x / tl.where(z > 0, z, 1.0)[:, None]  # [BLOCK_G, CAP_PAD]
    keep = forced
    if PER_HEAD:
        for h in tl.static_range(GROUP):
            keep = keep | _keep(
                tl.sum(tl.where(g[:, None] == h, probs, 0.0), 0), forced, cand, top_p, WAYS, ITERS, SORT, CAP_PAD
            )
    else:
        keep = keep | _keep(tl.sum(probs, 0) / GROUP, forced, cand, top_p, WAYS, ITERS, SORT, CAP_PAD)
    if OUT:  # a skipped list (its lse unwritten) is kept whole; the prune counts what it keeps
        keep = tl.where(skip, listed, keep)
        if OUT_ROWS:  # out row out_rows[b]; a padding row (nothing listed) writes nowhere
            orow_b = tl.load(out_rows_ptr + b).to(tl.int64)
            sel_row = out_ptr + tl.maximum(orow_b, 0) * stride_ob + kvh * CAP
        else:
            sel_row = out_ptr + b.to(tl.int64) * stride_ob + kvh * CAP
    elif VIEW:  # in place, a skipped list gets its whole view (lists are compact: it is its own compaction)
        keep = tl.where(skip, listed, keep)
    if VIEW:  # every count in one reduction (each is a round of barriers), 16 bits each: CAP < 2**16
        packed = keep.to(tl.int64)
        before = listed & (j < nb - LOCAL)
        if COUNT_HOST:  # kept entries before the window the attention reads from the host
            packed += (keep & before & (vloc < 0)).to(tl.int64) << 16
        if COUNT_LOOKUP:  # the listed entries before the window found in the pool, and those not
            looked = before & ((tl.zeros([CAP_PAD], tl.int64) + slot) >= 0)
            packed += ((looked & (vloc >= 0)).to(tl.int64) << 32) + ((looked & (vloc < 0)).to(tl.int64) << 48)
        packed = tl.sum(packed, 0)
        count = (packed & 0xFFFF).to(tl.int32)
    else:
        count = tl.sum(keep.to(tl.int32), 0)
    pos = tl.cumsum(keep.to(tl.int32), 0) - 1
    tail = (e >= count) & (e < CAP)
    if VIEW and not OUT:  # ... and is not rewritten (a padding row's slot is another row's)
        none = e < 0
        tl.store(sel_row + pos, j, mask=tl.where(skip, none, keep))
        tl.store(sel_row + e, tl.full([CAP_PAD], -1, tl.int32), mask=tl.where(skip, none, tail))
    elif OUT_ROWS:
        tl.store(sel_row + pos, j, mask=keep)
        live = (tl.zeros([CAP_PAD], tl.int32) + seq_len) > 0
        tl.store(sel_row + e, tl.full([CAP_PAD], -1, tl.int32), mask=tail & live)
    else:
        tl.store(sel_row + pos, j, mask=keep)  # pos <= e: every entry was read before any store
        tl.store(sel_row + e, tl.full([CAP_PAD], -1, tl.int32), mask=tail)
    if VIEW:
        orow = (b.to(tl.int64) * tl.num_programs(1) + kvh) * CAP
        fill = tl.full([CAP_PAD], -1, tl.int64)
        tl.store(out_loc_ptr + orow + pos, vloc, mask=keep)
        tl.store(out_loc_ptr + orow + e, fill, mask=tail)
        if COUNT_HOST:
            host = (packed >> 16) & 0xFFFF
            if host > 0:
                tl.atomic_add(host_ptr, host, sem="relaxed")
        if COUNT_LOOKUP:
            tl.atomic_add(lookup_stats_ptr, (packed >> 32) & 0xFFFF, sem="relaxed")
            missing = (packed >> 48) & 0xFFFF
            if missing > 0:
                tl.atomic_add(lookup_stats_ptr + 1, missing, sem="relaxed")
                if COUNT_KEY_READS:
                    if not skip:
                        tl.atomic_add(key_reads_ptr, missing, sem="relaxed")
    if OUT:
        tl.atomic_add(stats_ptr, count.to(tl.int64))
        tl.atomic_add(stats_ptr + 1, (seq_len > 0).to(tl.int64))
    else:
        tl.atomic_add(stats_ptr, (count - tl.sum(listed.to(tl.int32), 0)).to(tl.int64))


def block_lse_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    *,
    local: int,
    scale: float,
    reuse: int = 1,
    short_dense: bool = True,
    tile_n: int = 128,
    offload: tuple | None = None,
    host_reads: torch.Tensor | None = None,
    view_by_slot: bool = False,
    flat: torch.Tensor | None = None,
    lookup: ListLookup | None = None,
) -> torch.Tensor:
    """float32 [B, Hq, cap]: block_lse_ref of sel[slots], written for the rows that prune; host_reads
    (int64 [1], offload only) += the entries whose keys came from the host; view_by_slot: offload's
    rows by state slot; flat: topp_prune_ref's; lookup: offload's loc is written, not read
    (topp_prune_ref)."""
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    cap = sel.shape[-1]
    assert sel.stride(2) == 1 and counter.stride(1) == 1
    assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim and q.stride(2) == 1
    group = num_q_heads // num_kv_heads
    lse = torch.empty(batch, num_q_heads, cap, dtype=torch.float32, device=q.device)
    if batch == 0:
        return lse
    tile_e = max(1, tile_n // block_size, 16 // block_size)  # tl.dot needs 16 rows
    if offload is not None:
        pool_slots, host_flat, loc = offload
        assert pool_slots.is_contiguous() and host_flat.is_contiguous() and loc.is_contiguous()
        aligned = kv_rows_aligned(kv_cache, pool_slots, host_flat)
    else:
        aligned = False
        pool_slots = host_flat = loc = kv_cache  # unused (OFFLOAD=False)
    if lookup is not None:
        assert offload is not None and not view_by_slot and lookup.tables.stride(1) == 1
        assert loc.shape == (batch, num_kv_heads, cap)
        tok, resident, lay = lookup.tables, lookup.resident, lookup.layout
        key_base, trash_key = lay.layer * (lay.num_blocks + 1), resident.numel() - 1
    else:
        tok = resident = block_tables  # unused (LOOKUP=False)
        key_base = trash_key = 0
    pdl = use_pdl(q.device)
    _block_lse_kernel[(batch, num_kv_heads, triton.cdiv(cap, tile_e))](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        slots,
        sel,
        counter,
        counter if flat is None else flat,
        lse,
        scale,
        pool_slots,
        host_flat,
        loc,
        lse if host_reads is None else host_reads,
        tok,
        resident,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        sel.stride(0),
        counter.stride(0),
        tok.stride(0),
        key_base,
        trash_key,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        CAP=cap,
        REUSE=reuse,
        SHORT_DENSE=short_dense,
        FLAT=flat is not None,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        TILE_E=tile_e,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        OFFLOAD=offload is not None,
        COUNT_READS=offload is not None and host_reads is not None and lookup is None,  # (else the prune counts)
        LOCAL=local,
        VIEW_BY_SLOT=view_by_slot,
        K_ALIGNED=aligned,
        LOOKUP=lookup is not None,
        num_warps=4,
        PDL=pdl,
        launch_pdl=pdl,
    )
    return lse


def prune_lists_triton(
    lse: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    *,
    block_size: int,
    sink: int,
    local: int,
    top_p: float,
    reuse: int = 1,
    short_dense: bool = True,
    per_head: bool = False,
    ways: int = 4,
    sort: bool | None = None,
    out: torch.Tensor | None = None,
    view: torch.Tensor | None = None,
    view_by_slot: bool = False,
    out_view: torch.Tensor | None = None,
    flat: torch.Tensor | None = None,
    host_attended: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    lookup_stats: torch.Tensor | None = None,
    key_reads: torch.Tensor | None = None,
) -> None:
    """Prunes sel[slots] in place from their blocks' lse [B, Hq, cap] (prune_ref); stats[0] -=
    dropped entries. out, out_view, host_attended, out_rows: topp_prune_ref's, from the candidates' view
    (loc; by state slot with view_by_slot); lookup_stats (with out_view): ListLookup.stats; key_reads (with
    lookup_stats): topp_prune_ref's host_reads, which a looked-up list's missing entries are. sort: one
    sort of the masses finds the threshold, else rounds of `ways` thresholds (the same lists; None: a sort up
    to SORT_MAX_CAP; benchmarks/topp_parts.py)."""
    batch, num_q_heads, cap = lse.shape
    if sort is None:
        sort = cap <= SORT_MAX_CAP
    num_kv_heads = sel.shape[1]
    if batch == 0:
        return
    if cap > MAX_PRUNE_CAP:
        raise ValueError(f"topp prunes lists of up to {MAX_PRUNE_CAP} blocks, got {cap}: lower sparse_budget")
    assert cap == sel.shape[-1] and sel.stride(2) == 1 and counter.stride(1) == 1 and lse.is_contiguous()
    if out is not None:
        assert out.shape[0] >= batch and out.shape[1:] == sel.shape[1:] and out.stride(2) == 1
        assert out.stride(1) == cap
    if out_view is not None:
        assert view is not None
        for t in (view, out_view):
            assert t.is_contiguous() and t.shape[1:] == sel.shape[1:] and t.dtype == torch.int64
    loc, out_loc = (view, out_view) if out_view is not None else (sel, sel)  # (unused without VIEW)
    group = num_q_heads // num_kv_heads
    pdl = use_pdl(lse.device)
    _prune_kernel[(batch, num_kv_heads)](
        lse,
        seq_lens,
        slots,
        sel,
        counter,
        counter if flat is None else flat,
        stats,
        sel if out is None else out,
        loc,
        out_loc,
        stats if host_attended is None else host_attended,
        seq_lens if out_rows is None else out_rows,
        stats if lookup_stats is None else lookup_stats,
        stats if key_reads is None else key_reads,
        prune_target(top_p),
        sel.stride(0),
        counter.stride(0),
        0 if out is None else out.stride(0),
        GROUP=group,
        BLOCK_SIZE=block_size,
        CAP=cap,
        SINK=sink,
        LOCAL=local,
        REUSE=reuse,
        SHORT_DENSE=short_dense,
        FLAT=flat is not None,
        PER_HEAD=per_head,
        BLOCK_G=triton.next_power_of_2(group),
        CAP_PAD=max(16, triton.next_power_of_2(cap)),
        WAYS=ways,
        ITERS=-(-31 // (ways.bit_length() - 1)) + 1,
        SORT=sort,
        OUT=out is not None,
        VIEW=out_view is not None,
        VIEW_BY_SLOT=view_by_slot,
        COUNT_HOST=out_view is not None and host_attended is not None,
        OUT_ROWS=out is not None and out_rows is not None,
        COUNT_LOOKUP=out_view is not None and lookup_stats is not None,
        COUNT_KEY_READS=out_view is not None and lookup_stats is not None and key_reads is not None,
        num_warps=4,
        PDL=pdl,
        launch_pdl=pdl,
    )


def topp_prune_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sel: torch.Tensor,
    counter: torch.Tensor,
    stats: torch.Tensor,
    *,
    sink: int,
    local: int,
    top_p: float,
    scale: float,
    reuse: int = 1,
    short_dense: bool = True,
    per_head: bool = False,
    offload: tuple | None = None,
    host_reads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    view_by_slot: bool = False,
    out_view: torch.Tensor | None = None,
    flat: torch.Tensor | None = None,
    host_attended: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    lookup: ListLookup | None = None,
) -> None:
    if flat is not None:
        assert flat.shape == sel.shape[:2] and flat.is_contiguous()
    assert lookup is None or out_view is not None
    lse = block_lse_triton(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        slots,
        sel,
        counter,
        local=local,
        scale=scale,
        reuse=reuse,
        short_dense=short_dense,
        offload=offload,
        host_reads=host_reads,
        view_by_slot=view_by_slot,
        flat=flat,
        lookup=lookup,
    )
    prune_lists_triton(
        lse,
        seq_lens,
        slots,
        sel,
        counter,
        stats,
        block_size=kv_cache.shape[3],
        sink=sink,
        local=local,
        top_p=top_p,
        reuse=reuse,
        short_dense=short_dense,
        per_head=per_head,
        out=out,
        view=None if offload is None else offload[2],
        view_by_slot=view_by_slot,
        out_view=out_view,
        flat=flat,
        host_attended=host_attended,
        out_rows=out_rows,
        lookup_stats=None if lookup is None else lookup.stats,
        key_reads=None if lookup is None else host_reads,
    )
