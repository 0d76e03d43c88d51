"""Sparse-decode Triton kernels (kernels/key_meta.py, kernels/block_score.py, kernels/sparse_decode.py) against
their torch references. Without CUDA they run under the Triton interpreter on small shapes; with CUDA the same
tests run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata
from sparseserve.kernels.block_score import (
    ScoreConfig,
    SelectConfig,
    block_masses,
    block_scores_ref,
    block_scores_triton,
    score_and_select_triton,
    select_blocks_ref,
    select_blocks_triton,
    select_ref,
    candidates_ref,
    flat_rows_ref,
    flat_share_ref,
    step_slots_ref,
    step_slots_triton,
)
from sparseserve.kernels.key_meta import (
    quantize_key_meta,
    rebuild_key_meta,
    store_kv_key_meta_ref,
    store_kv_key_meta_triton,
    update_key_meta_ref,
)
from sparseserve.kernels.paged_decode import MERGE_TILE
from sparseserve.kernels.sparse_decode import (
    FAST_CONFIG,
    SparseDecodeConfig,
    kv_rows_aligned,
    read_listed_ref,
    sparse_decode_ref,
    sparse_decode_triton,
    split_plan,
    tma_capable,
)
from sparseserve.kernels.store_kv import store_kv_ref
from sparseserve.kvcache.metadata import allocate_key_meta
from tests.kernel_utils import ATTN_DTYPES as DTYPES
from tests.kernel_utils import DEVICE as DEV
from tests.kernel_utils import TOL, gpu_only, rel_err


def decode_batch(lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, slack: int = 0):
    """Random cache (shuffled blocks), decode queries and metadata; seq_len 0 = padding row."""
    width = -(-(max(lens) + slack) // bs)
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    ids = torch.randperm(num_blocks, dtype=torch.int32)
    tables = torch.randint(0, num_blocks, (len(lens), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        tables[b, : -(-n // bs)] = ids[start : start - (-n // bs)]
        start += -(-n // bs)
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(lens),), -1, dtype=torch.int64, device=DEV),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_tables=tables.to(DEV),
        num_decodes=len(lens),
        max_query_len=1,
        max_seq_len=max(lens) + slack,
    )
    cache = torch.randn(num_blocks, hkv, 2, bs, d, device=DEV).to(dtype)
    return torch.randn(len(lens), hq, d, device=DEV).to(dtype), cache, meta


def params(policy: str, cap: int, bs: int, reuse: int = 1, top_p: float = 0.9, sink: int = 1, local: int = 2) -> dict:
    """The selection kernels' keyword arguments (topk: no mass target)."""
    return dict(
        block_size=bs,
        cap=cap,
        sink=sink,
        local=local,
        reuse=reuse,
        short_dense=True,
        top_p=top_p if policy == "topp" else None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs,page,hkv", [(16, 16, 2), (16, 4, 2), pytest.param(16, 4, 3, id="group-3kv")])
def test_update_key_meta(bs, page, hkv, dtype):
    """Prefill chunks (one starting mid-page), decodes and padding: the fused store + metadata kernel writes the
    cache and the reference's codes and scales bit for bit (the step's slots hold other keys before, so a
    kernel reading this step's rows back from the cache would be caught), and the reference quantizes min/max
    over each page's written tokens."""
    torch.manual_seed(0)
    d, nblocks = 32, 12
    cache = torch.randn(nblocks, hkv, 2, bs, d, device=DEV).to(dtype)
    owner = torch.randperm(nblocks)
    seqs = [(owner[:5].tolist(), 0, 37), (owner[5:8].tolist(), 21, 44), (owner[8:10].tolist(), 17, 18)]
    slots = [-1]
    for table, start, end in seqs:
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
    slots.append(-1)
    slot_mapping = torch.tensor(slots, device=DEV)
    k, v = (torch.randn(len(slots), hkv, d, device=DEV).to(dtype) for _ in range(2))
    ref, out = (allocate_key_meta(1, nblocks, hkv, bs, page, d, DEV)[0] for _ in range(2))
    got = cache.clone()
    store_kv_ref(k, v, cache, slot_mapping)
    update_key_meta_ref(cache, ref.codes, ref.scale, slot_mapping, page)
    store_kv_key_meta_triton(k, v, got, out.codes, out.scale, slot_mapping, page)
    assert torch.equal(got, cache)
    assert torch.equal(out.codes[:nblocks], ref.codes[:nblocks])
    assert torch.equal(out.scale[:nblocks], ref.scale[:nblocks])
    for table, start, end in seqs:
        for p0 in range(start // page * page, end, page):
            blk, off = table[p0 // bs], p0 % bs
            keys = cache[blk, :, 0, off : off + min(page, end - p0)]
            codes, scale = quantize_key_meta(keys.amin(1), keys.amax(1))
            assert torch.equal(ref.codes[blk, :, :, off // page], codes)
            assert torch.equal(ref.scale[blk, :, off // page], scale)


@pytest.mark.parametrize("hkv", [2, 3])
def test_store_kv_key_meta_writes_decode_blocks_through(hkv):
    """KV offload: decode tokens (the first num_write) that complete a block copy it whole (every head, K and V)
    to the host row of their meta slot, in the store + metadata kernel; decodes that complete nothing, padding
    and the prefill tokens after them (FlashD2H's) write nothing; the cache, metadata, host store and counter
    equal the reference's."""
    torch.manual_seed(4)
    bs, page, d, nblocks, rows = 8, 4, 16, 10, 12
    cache = torch.randn(nblocks, hkv, 2, bs, d, device=DEV)
    perm = torch.randperm(rows)[:nblocks].to(DEV)  # device block -> host row (the meta slots' blocks)
    # decodes: ends block 3, mid block 5, padding, ends block 7; then a prefill chunk that ends block 1
    slots = torch.tensor([3 * bs + bs - 1, 5 * bs + 2, -1, 7 * bs + bs - 1] + list(range(bs, 2 * bs)), device=DEV)
    meta_slots = torch.where(slots >= 0, perm[slots.clamp_min(0) // bs] * bs + slots % bs, -1)
    k, v = (torch.randn(slots.numel(), hkv, d, device=DEV) for _ in range(2))
    host_kw = dict(pin_memory=True) if DEV.type == "cuda" else {}
    outs = []
    for fn in (store_kv_key_meta_ref, store_kv_key_meta_triton):
        got = cache.clone()
        meta = allocate_key_meta(1, rows, hkv, bs, page, d, DEV)[0]  # indexed by host row
        host = torch.zeros(rows + 1, hkv, 2, bs, d, **host_kw)
        count = torch.zeros((), dtype=torch.int64, device=DEV)
        fn(k, v, got, meta.codes, meta.scale, slots, page, meta_slots, host, 4, count)
        # (the reference's trash rows aside)
        outs.append((got, meta.codes[:rows], meta.scale[:rows], host[:rows], count))
    for ref, out in zip(*outs):
        assert torch.equal(out.cpu(), ref.cpu())
    host, count = outs[1][3], outs[1][4]
    written = perm[[3, 7]].tolist()
    assert count.item() == 2 and torch.equal(host[written], outs[1][0][[3, 7]].cpu())
    assert not host[[r for r in range(rows) if r not in written]].any()


def as_step(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [NB * bs, Hkv, D] of a cache's every slot in order (a prefill of all of it)."""
    return tuple(cache[:, :, i].transpose(1, 2).flatten(0, 1) for i in range(2))


def test_key_meta_brackets_keys():
    """codes_min * scale <= min and codes_max * scale >= max of each page's keys up to float32 rounding (so
    the score stays an upper bound of q.k), at most one code step (scale) away, for keys of magnitudes
    1e-33 (below AMAX_FLOOR) to 1e30, a page with one large channel among tiny ones, and an all-zero page;
    the fused store + metadata kernel writes the reference's codes and scales bit for bit on all of them."""
    torch.manual_seed(8)
    bs, page, hkv, d = 8, 4, 2, 16
    magnitude = torch.tensor([1e-33, 1e-20, 1e-3, 1.0, 1e3, 1e30])  # one per block
    cache = torch.randn(magnitude.numel(), hkv, 2, bs, d) * magnitude[:, None, None, None, None]
    cache[2, 1, 0, :page, 3] *= 1e20
    cache[3, 0, 0, page:] = 0.0
    cache = cache.to(DEV)
    nblocks = cache.shape[0]
    slot_mapping = torch.arange(nblocks * bs, device=DEV)
    ref, out = (allocate_key_meta(1, nblocks, hkv, bs, page, d, DEV)[0] for _ in range(2))
    update_key_meta_ref(cache, ref.codes, ref.scale, slot_mapping, page)
    store_kv_key_meta_triton(*as_step(cache), torch.zeros_like(cache), out.codes, out.scale, slot_mapping, page)
    assert torch.equal(out.codes[:nblocks], ref.codes[:nblocks])
    assert torch.equal(out.scale[:nblocks], ref.scale[:nblocks])
    pages = cache[:, :, 0].double().view(nblocks, hkv, bs // page, page, d)
    kmin, kmax = pages.amin(3), pages.amax(3)  # [NB, Hkv, P, D]
    scale = ref.scale[:nblocks, :, :, None].double()
    lo, hi = ref.codes[:nblocks, :, 0].double() * scale, ref.codes[:nblocks, :, 1].double() * scale
    slack = 2**-21 * torch.maximum(kmin.abs(), kmax.abs())  # a few float32 roundings
    assert (lo <= kmin + slack).all() and (hi >= kmax - slack).all()
    assert (kmin - lo <= scale + slack).all() and (hi - kmax <= scale + slack).all()
    assert not ref.codes[3, 0, :, 1].any() and torch.isfinite(ref.scale).all()


def scored_batch(lens, hq, hkv, d, bs, page, dtype, slack=0):
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, dtype, slack)
    key_meta = allocate_key_meta(1, cache.shape[0], hkv, bs, page, d, DEV)
    rebuild_key_meta(cache[None], key_meta.codes, key_meta.scale, page)
    return q, cache, meta, key_meta[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,bs,page,config",
    [
        (8, 2, 16, 16, None),
        (6, 2, 16, 4, None),
        (4, 4, 32, 32, None),
        # several pipelined tiles a program, several splits a row
        (8, 2, 16, 16, ScoreConfig(rows=16, tiles=3)),
        (6, 2, 16, 4, ScoreConfig(rows=16, tiles=2, num_stages=2)),
        # groups that are not powers of two: rows past GROUP masked
        pytest.param(9, 3, 16, 16, None, id="group3-9q3kv"),
        pytest.param(15, 3, 16, 4, ScoreConfig(rows=16, tiles=2), id="group5-15q3kv"),
        pytest.param(7, 1, 16, 16, None, id="group7-7q1kv"),
    ],
)
def test_block_scores(dtype, hq, hkv, bs, page, config):
    torch.manual_seed(1)
    d, cap = 32, 4
    lens = [0, 3 * bs, 9 * bs + 5, 20 * bs - 1]
    q, _, meta, key_meta = scored_batch(lens, hq, hkv, d, bs, page, dtype, slack=bs + 3)
    mb = -(-meta.max_seq_len // bs)
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    counter = torch.zeros(len(lens), hkv, dtype=torch.int32, device=DEV)
    out = block_scores_triton(
        q,
        key_meta.codes,
        key_meta.scale,
        meta.block_tables,
        meta.seq_lens,
        slots,
        counter,
        max_blocks=mb,
        block_size=bs,
        cap=cap,
        reuse=1,
        short_dense=True,
        scale=d**-0.5,
        config=config,
    )
    ref = block_scores_ref(q, key_meta.codes, key_meta.scale, meta.block_tables, meta.seq_lens, mb, bs, d**-0.5)
    for b, n in enumerate(lens):  # written where selection reads: rows with more than cap blocks
        nb = -(-n // bs)
        if nb > cap:
            assert rel_err(out[b, :, :nb], ref[b, :, :nb]) < TOL[dtype]
            assert torch.isinf(ref[b, :, nb:]).all()


SELECT_HEADS = [(8, 4), pytest.param(9, 3, id="group3-9q3kv"), pytest.param(7, 1, id="group7-7q1kv")]


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv", SELECT_HEADS)
@pytest.mark.parametrize("policy,top_p,ways", [("topk", 1.0, 2), ("topk", 1.0, 8), ("topp", 0.5, 4), ("topp", 0.9, 4)])
def test_select_blocks(policy, top_p, ways, hq, hkv):
    """Lists from the bit-pattern binary search equal the sort-based reference, over reuse steps, with
    a streaming head and rows that fit the cap (all blocks) or are padding."""
    torch.manual_seed(2)
    bs, cap, nslots = 16, 6, 6
    lens = [40 * bs, 3 * bs, 0, 17 * bs + 3, 64 * bs]
    p = params(policy, cap, bs, reuse=2, top_p=top_p)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    streaming = torch.arange(hkv, device=DEV) == 1  # KV head 1 (if any) streams
    state = [
        (
            torch.full((nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(3)
    ]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for step in range(3):
        # Sharp random scores: distinct masses; -inf past each row's end, as scoring leaves them.
        scores = 4 * torch.randn(len(lens), hq, 64, device=DEV)
        past_end = torch.arange(64, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs)
        scores.masked_fill_(past_end, float("-inf"))
        select_blocks_ref(scores, seq_lens, slots, *state[0], streaming, **p)
        select_blocks_triton(scores, seq_lens, slots, *state[1], streaming, **p, config=SelectConfig(ways=ways))
        # launched wider than the scores (the engine's one size for every step): the same lists
        select_blocks_triton(
            scores, seq_lens, slots, *state[2], streaming, **p, config=SelectConfig(ways=ways), width=300
        )
        for other in state[1:]:
            for a, b in zip(state[0], other):
                assert torch.equal(
                    a.sort(-1).values if a.dim() == 3 else a, b.sort(-1).values if b.dim() == 3 else b
                ), step
    sel = state[0][0]
    assert sorted(sel[0, 0].tolist()) == [-1, -1, -1, 0, 1, 2]  # 3 blocks <= cap: all of them
    if hkv > 1:
        assert sorted(sel[4, 1].tolist()) == [-1, -1, -1, 0, 38, 39]  # streaming head: sink + local only


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_select_blocks_heads_without_softmax(bad, hq=6, hkv=2):
    """A query head with an inf or NaN score has no softmax: it adds no mass (block_masses), in the kernel as in
    the reference (before, its NaN masses outranked every block, and the search's bound, the top bit pattern + 1,
    can overflow), and the lists stay inside the context, on fresh random scores over steps with sticky lists."""
    torch.manual_seed(11)
    bs, cap, nslots, mb = 16, 8, 4, 48
    lens = [40 * bs, 3 * bs, 0, 47 * bs + 5]
    p = dict(params("topk", cap, bs), stickiness=1.0)
    slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    state = [
        (
            torch.full((nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(2)
    ]
    past_end = torch.arange(mb, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs)
    for step in range(3):
        scores = 4 * torch.randn(len(lens), hq, mb, device=DEV)
        scores[0, 1, 5] = bad  # one head of KV head 0's group
        scores[3, 3:, 7 + step] = bad  # every head of KV head 1's group: no mass at all (forced blocks, then ties)
        scores.masked_fill_(past_end, float("-inf"))
        select_blocks_ref(scores, seq_lens, slots, *state[0], streaming, **p)
        select_blocks_triton(scores, seq_lens, slots, *state[1], streaming, **p, width=200)
        for a, b in zip(*state):  # the same blocks (ties at the threshold follow the others)
            assert torch.equal(a.sort(-1).values if a.dim() == 3 else a, b.sort(-1).values if b.dim() == 3 else b), step
        nb = -(-seq_lens.long() // bs)
        assert (state[1][0][slots.long()] < nb[:, None, None]).all()


@pytest.mark.parametrize("policy,top_p", [("topk", 1.0), ("topp", 0.7)])
@pytest.mark.parametrize("lagged", [False, True])
def test_select_blocks_sticky(policy, top_p, lagged, hq=6, hkv=2):
    """Stickiness: the kernel equals the reference over steps whose lists feed the next selection (from
    the row's own slot, or with lag from another row or none, forcing the next step's window), on fresh
    random masses; a context at a block's end (40 blocks) is where the next step's window moves."""
    torch.manual_seed(5)
    bs, cap, nslots, mb = 16, 8, 4, 48
    lens = [40 * bs, 3 * bs, 0, 47 * bs + 5]
    p = params(policy, cap, bs, top_p=top_p) | dict(stickiness=1.5, ahead=int(lagged))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    slots = torch.tensor([3, 0, 1, 2], dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    state = [
        (
            torch.full((2 * nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(2)
    ]
    for step in range(4):
        # lag: write one row of the slot, stick to the other (the row the step attends)
        write = slots + nslots * (step % 2) if lagged else slots
        prev = None
        if lagged:  # row 1: a prompt chunk's end, with no previous list (-1)
            prev = torch.where(torch.arange(4, device=DEV) == 1, -1, slots + nslots * ((step + 1) % 2)).int()
        scores = 3 * torch.randn(len(lens), hq, mb, device=DEV)
        scores.masked_fill_(torch.arange(mb, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs), -torch.inf)
        select_blocks_ref(scores, seq_lens, write, *state[0], streaming, **p, prev_slots=prev)
        select_blocks_triton(scores, seq_lens, write, *state[1], streaming, **p, prev_slots=prev)
        for a, b in zip(state[0], state[1]):
            assert torch.equal(a.sort(-1).values if a.dim() == 3 else a, b.sort(-1).values if b.dim() == 3 else b), step


@pytest.mark.parametrize("policy", ["topk", "topp"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), pytest.param(9, 3, id="group3-9q3kv")])
def test_select_flags_flat_lists(hq, hkv, policy):
    """With each new list the selection flags whether the estimated masses it chose among are flat
    (flat_share_ref >= the share), and a flagged list whose cap cannot reach flat_mass on them takes flat_cap
    blocks: near-constant scores are flat, peaked ones are not, a context within the cap (never scored) is not;
    9 flat blocks, 8 of which fit (0.89 of their mass), keep the cap; a reused step keeps the flags and lists;
    kernel and reference agree over steps. topp (p 0.5): a flat row searches by count first, and where the
    mass binds there (the 9 flat blocks: 3 forced, 2 chosen reach 0.5) by mass above it."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    bs, cap, flat_cap, nslots, mb = 16, 8, 5, 6, 64
    lens = [40 * bs, 3 * bs, 0, 47 * bs + 5, 64 * bs, 9 * bs]
    p = params(policy, cap, bs, reuse=2, top_p=0.5) | dict(flat_share=0.75, flat_mass=0.85, flat_cap=flat_cap)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    slots = torch.tensor([4, 0, 5, 2, 1, 3], dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    states = [
        (
            torch.full((nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
            torch.full((nslots, hkv), 7, dtype=torch.int8, device=DEV),  # 7: not written
            torch.zeros(1, dtype=torch.int64, device=DEV),  # lists flagged so far
        )
        for _ in range(2)
    ]
    flagged = 0
    for step in range(3):
        scores = 4 * torch.randn(len(lens), hq, mb, device=DEV)
        scores[:, :, 10] += 30.0  # peaked: one block holds nearly all the mass
        scores[0] = 0.01 * torch.randn(hq, mb, device=DEV)  # flat
        scores[5] = 0.01 * torch.randn(hq, mb, device=DEV)  # flat, and nearly within the cap
        scores[1] = 0.0  # flat, but within the cap
        scores[3, : hq // hkv] = 0.01 * torch.randn(hq // hkv, mb, device=DEV)  # row 3: KV head 0 flat
        scores.masked_fill_(torch.arange(mb, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs), -torch.inf)
        for fn, (sel, counter, stats, flat, count) in zip((select_blocks_ref, select_blocks_triton), states):
            fn(scores, seq_lens, slots, sel, counter, stats, streaming, **p, flat=flat, flat_count=count)
        for a, b in zip(states[0], states[1]):
            assert torch.equal(a.sort(-1).values if a.dim() == 3 else a, b.sort(-1).values if b.dim() == 3 else b)
        flat = states[1][3]
        if step != 1:  # reuse 2: step 1 selects nothing
            flagged += int((flat[slots[seq_lens > 0].long()] == 1).sum())
        assert int(states[1][4]) == flagged
        sizes = (states[1][0] >= 0).sum(-1)
        if step == 0 and policy == "topp":
            # slot 1 (peaked): the mass binds at block 10; slot 3 (9 flat blocks, flagged): after the count's
            # search, the mass's above it (3 forced + 2); slot 0 (3 blocks): all of them
            assert sizes[1].tolist() == [4] * hkv and sizes[3].tolist() == [5] * hkv and flat[3].tolist() == [1] * hkv
            assert sizes[0].tolist() == [3] * hkv
            first = (flat.clone(), states[1][0].clone())
        elif step == 0:
            assert flat[4].tolist() == [1] * hkv and flat[0].tolist() == [0] * hkv and flat[5].tolist() == [7] * hkv
            assert flat[2].tolist() == [1] + [0] * (hkv - 1) and flat[1].tolist() == [0] * hkv
            # flat lists take flat_cap blocks, the others over the cap take cap; row 1 (3 blocks) all of them
            assert sizes[4].tolist() == [flat_cap] * hkv and sizes[2].tolist() == [flat_cap] + [cap] * (hkv - 1)
            assert sizes[1].tolist() == [cap] * hkv and sizes[0].tolist() == [3] * hkv
            assert flat[3].tolist() == [1] * hkv and sizes[3].tolist() == [cap] * hkv
            first = (flat.clone(), states[1][0].clone())
        elif step == 1:  # reuse 2: no list recomputed, the flags and lists stay
            assert torch.equal(flat, first[0]) and torch.equal(states[1][0], first[1])
    kw = dict(block_size=bs, cap=cap, sink=1, local=2, short_dense=True)
    _, _, cand = candidates_ref(seq_lens, streaming, mb, **kw)
    share = flat_share_ref(block_masses(scores, hkv), cand)
    assert share.shape == (len(lens), hkv) and ((share >= 0) & (share <= 1 + 1e-6)).all()
    flags, short = flat_rows_ref(scores, seq_lens, streaming, flat_share=0.75, flat_mass=0.85, **kw)
    assert torch.equal(flags, share >= 0.75) and torch.equal(short, flags & (seq_lens > 9 * bs)[:, None])


def test_select_holds_flat_lists():
    """Flat hold 2 over lag rows (two list rows a slot, counters by slot): a list flagged flat in a decode row
    (below hold_rows) is kept for its slot's next two selections, whichever of its rows they write (the caller
    keeps it there: copied here as the prune's out rows would), flagged flat again, counted apart; neither
    scored nor selected, so even changed scores leave it; a peaked list and a flat one in the chunk row (at
    hold_rows) are never held; the third selection is fresh. Kernel (scores too: a held row's stay unwritten)
    and reference agree at every step."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    bs, cap, flat_cap, nslots, mb, hq, hkv, hold = 16, 8, 5, 4, 48, 4, 2, 2
    lens = [40 * bs, 44 * bs, 0, 30 * bs]  # row 3: a prompt's chunk (hold_rows 3)
    p = params("topp", cap, bs, top_p=0.5) | dict(flat_share=0.75, flat_mass=0.85, flat_cap=flat_cap)
    p |= dict(stickiness=1.0)  # sticking to the kept lists in place, as prefetching reads do
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    base = torch.tensor([2, 0, 1, 3], dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    states = [
        (
            torch.full((2 * nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
            torch.zeros(2 * nslots, hkv, dtype=torch.int8, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),  # new flat lists, held lists
        )
        for _ in range(2)
    ]
    held_total = 0
    for step in range(4):
        write = base + nslots * (step % 2)
        read = base + nslots * ((step + 1) % 2)
        scores = 4 * torch.randn(len(lens), hq, mb, device=DEV)
        scores[:, :, 10 + step] += 30.0  # peaked, at a block that moves each step
        scores[0] = 0.01 * torch.randn(hq, mb, device=DEV)  # flat
        scores[3] = 0.01 * torch.randn(hq, mb, device=DEV)  # flat, a chunk's
        scores[1, : hq // hkv] = 0.01 * torch.randn(hq // hkv, mb, device=DEV)  # row 1: KV head 0 flat
        scores.masked_fill_(torch.arange(mb, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs), -torch.inf)
        for state in states:  # the kept lists sit where the next selection writes (prefetching reads' prune)
            state[0][write.long()] = state[0][read.long()]
        before = states[1][0][write.long()].clone()
        sel_kw = dict(p, hold=hold, hold_rows=3, prev_slots=write)
        select_blocks_ref(
            scores, seq_lens, write, *states[0][:3], streaming, flat=states[0][3], flat_count=states[0][4], **sel_kw
        )
        q = torch.randn(len(lens), hq, 32, device=DEV)
        codes = torch.randint(-127, 128, (mb, hkv, 2, 1, 32), dtype=torch.int8, device=DEV)
        tables = torch.arange(mb, dtype=torch.int32, device=DEV).expand(len(lens), -1).contiguous()
        page_scale = torch.rand(mb, hkv, 1, device=DEV) + 0.5
        score_kw = dict(max_blocks=mb, block_size=bs, scale=0.1)
        hold_kw = dict(cap=cap, reuse=1, short_dense=True, hold=hold, hold_rows=3)
        got = block_scores_triton(q, codes, page_scale, tables, seq_lens, write, states[1][1], **score_kw, **hold_kw)
        want = block_scores_ref(q, codes, page_scale, tables, seq_lens, **score_kw)
        held = states[1][1][base.long()] > 0  # before this step's selection: by row
        held[2:] = False  # the padding row; the chunk row (at hold_rows) is never held
        assert held.any() == (step in (1, 2))
        scored = (~held).repeat_interleave(hq // hkv, 1)[:, :, None] & (want > -torch.inf)
        assert torch.allclose(got[scored], want[scored], rtol=1e-4, atol=1e-4)
        for b, h in held.nonzero().tolist():  # a held row's programs return at once: its scores stay unwritten
            heads = slice(h * (hq // hkv), (h + 1) * (hq // hkv))
            assert not torch.allclose(got[b, heads, : lens[b] // bs], want[b, heads, : lens[b] // bs])
        select_blocks_triton(
            scores, seq_lens, write, *states[1][:3], streaming, flat=states[1][3], flat_count=states[1][4], **sel_kw
        )
        for a, b in zip(states[0], states[1]):
            assert torch.equal(a.sort(-1).values if a.dim() == 3 else a, b.sort(-1).values if b.dim() == 3 else b)
        sel, counter, _, flat, count = states[1]
        w = write.long()
        held_total += int(held.sum())
        assert int(count[1]) == held_total
        if step == 0:  # row 0 flat, both heads; row 1 KV head 0; the chunk row and the peaked ones not held
            assert counter[2].tolist() == [hold] * hkv and counter[0].tolist() == [hold, 0]
            assert counter[3].tolist() == [0] * hkv and flat[w[3]].tolist() == [1] * hkv
        elif step in (1, 2):  # held: list and flag as they were, whatever the scores
            assert held[0].tolist() == [True] * hkv and held[1].tolist() == [True, False]
            assert torch.equal(sel[w[0]], before[0]) and torch.equal(sel[w[1], 0], before[1, 0])
            assert flat[w[0]].tolist() == [1] * hkv and flat[w[1], 0] == 1
            assert counter[2].tolist() == [hold - step] * hkv
        else:  # fresh again, and held again after it
            assert not held.any() and counter[2].tolist() == [hold] * hkv
    assert held_total == 2 * 3  # rows 0 (two heads) and 1 (one), two steps each


def test_select_ahead_forces_the_next_steps_window():
    """A lagged list (ahead=1) forces the local window of the step that reads it: at a context that ends a
    block the window moves on by one, so the block it leaves is no longer forced and competes by its mass
    (block 18 loses to block 9), and one more chosen block fits; inside a block nothing changes."""
    bs, cap = 16, 5  # sink 1 + local 2 + 2 chosen
    scores = torch.zeros(1, 1, 21)
    scores[0, 0, 5], scores[0, 0, 7], scores[0, 0, 9], scores[0, 0, 18] = 3.0, 2.0, 1.0, 0.5
    kw = params("topk", cap, bs)
    kw.pop("reuse")
    streaming = torch.tensor([False])
    end = torch.tensor([20 * bs], dtype=torch.int32)  # blocks 0..19 full: the next token opens block 20
    assert select_ref(scores, end, streaming, **kw)[0, 0].tolist() == [0, 18, 19, 5, 7]
    assert select_ref(scores, end, streaming, **kw, ahead=1)[0, 0].tolist() == [0, 19, 5, 7, 9]
    inside = torch.tensor([20 * bs + 3], dtype=torch.int32)
    assert torch.equal(
        select_ref(scores, inside, streaming, **kw), select_ref(scores, inside, streaming, **kw, ahead=1)
    )


def test_select_sticky_keeps_the_previous_list():
    """A block of the previous list outranks any new one whose mass is less than 1 + stickiness times its
    own; without stickiness the lists follow the masses alone."""
    bs, cap = 16, 5  # sink 1 + local 2 + 2 chosen
    seq_lens = torch.tensor([20 * bs], dtype=torch.int32)
    scores = torch.zeros(1, 1, 20)
    scores[0, 0, 5] = scores[0, 0, 6] = 2.0  # the best two now
    scores[0, 0, 9] = scores[0, 0, 12] = 1.6  # listed before, exp(0.4) = 1.49x less mass
    prev = torch.tensor([[[0, 9, 12, 18, 19]]], dtype=torch.int32)
    kw = params("topk", cap, bs) | dict(prev=prev)
    kw.pop("reuse")
    streaming = torch.zeros(1, dtype=torch.bool)

    def chosen(stickiness: float) -> list[int]:
        lists = select_ref(scores, seq_lens, streaming, **kw, stickiness=stickiness)
        return sorted(set(lists[0, 0].tolist()) - {0, 18, 19})

    assert chosen(0.0) == [5, 6]
    assert chosen(0.4) == [5, 6]  # 1.4 < 1.49: the new blocks win
    assert chosen(0.6) == [9, 12]


@pytest.mark.slow
@pytest.mark.parametrize(
    "hq,hkv", [(6, 2), pytest.param(10, 2, id="group5-10q2kv"), pytest.param(7, 1, id="group7-7q1kv")]
)
@pytest.mark.parametrize(
    "policy,top_p,sink,local,ways,tied",
    [
        ("topk", 1.0, 1, 2, 4, True),
        ("topk", 1.0, 3, 4, 2, True),
        ("topp", 0.6, 1, 2, 1, False),
        ("topp", 0.05, 1, 2, 8, False),
        ("topp", 0.9, 3, 4, 4, False),
    ],
)
def test_select_blocks_edges(policy, top_p, sink, local, ways, tied, hq, hkv):
    """The early-stopping search against the reference: masses with many exact ties (topk: coarse
    scores, constant rows; topp fills ties at its threshold up to the cap, the reference stops at p, so
    topp gets distinct masses), forced blocks that carry the target mass (topp 0.05) or fill the cap
    (sink 3 + local 4 > cap 6), one threshold a round (ways=1), long and short rows."""
    torch.manual_seed(6)
    bs, cap = 16, 6
    lens = [200 * bs, 7 * bs, 31 * bs + 1, 64 * bs, 6 * bs, 100 * bs]
    p = params(policy, cap, bs, top_p=top_p, sink=sink, local=local)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    if tied:
        scores = torch.randint(-2, 3, (len(lens), hq, 256), device=DEV).float()
        scores[1] = 0.0  # one mass for every block
        scores[5, :, ::2] = 3.0
    else:
        scores = 4 * torch.randn(len(lens), hq, 256, device=DEV)
    past_end = torch.arange(256, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs)
    scores.masked_fill_(past_end, float("-inf"))
    state = [
        (
            torch.full((len(lens), hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(len(lens), hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(2)
    ]
    select_blocks_ref(scores, seq_lens, slots, *state[0], streaming, **p)
    select_blocks_triton(scores, seq_lens, slots, *state[1], streaming, **p, config=SelectConfig(ways=ways))
    assert torch.equal(state[0][0].sort(-1).values, state[1][0].sort(-1).values)
    assert torch.equal(state[0][2], state[1][2])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["topk", "topp"])
def test_select_blocks_wide_rows_group3(policy):
    """Rows of more than 4096 blocks: the selection kernel takes the group's score rows two at a time (HEADS = 2),
    so with a group of 3 its second pass has one live row and one past the group (masked)."""
    torch.manual_seed(10)
    hq, hkv, bs, cap, mb = 9, 3, 16, 8, 5000
    lens = [mb * bs, 3000 * bs + 5, 0, 4100 * bs]
    p = params(policy, cap, bs, top_p=0.5)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    # a few sharp peaks a head, so topp stops on mass well before the cap
    scores = torch.randn(len(lens), hq, mb, device=DEV)
    scores.scatter_(-1, torch.randint(0, 3000, (len(lens), hq, 4), device=DEV), 12.0)
    scores.masked_fill_(torch.arange(mb, device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs), float("-inf"))
    state = [
        (
            torch.full((len(lens), hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(len(lens), hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(2)
    ]
    select_blocks_ref(scores, seq_lens, slots, *state[0], streaming, **p)
    select_blocks_triton(scores, seq_lens, slots, *state[1], streaming, **p)
    assert torch.equal(state[0][0].sort(-1).values, state[1][0].sort(-1).values)
    assert torch.equal(state[0][2], state[1][2])


@pytest.mark.parametrize(
    "hq,hkv",
    [(8, 2), pytest.param(9, 3, id="group3-9q3kv", marks=pytest.mark.slow), pytest.param(7, 1, id="group7-7q1kv")],
)
@pytest.mark.parametrize("policy", ["topk", "topp"])
def test_score_and_select(policy, hq, hkv):
    """Scoring then selection (the engine's Triton path) equal the references over reuse steps: lists,
    reuse counters and stats, with padding, short and long rows, pages and a streaming head."""
    torch.manual_seed(7)
    d, bs, page = 32, 16, 8
    lens = [40 * bs + 3, 0, 5 * bs, 70 * bs, 33 * bs - 1]
    q, _, meta, key_meta = scored_batch(lens, hq, hkv, d, bs, page, torch.float32)
    mb = -(-meta.max_seq_len // bs)
    p = params(policy, 6, bs, reuse=2)
    slots = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32, device=DEV)
    streaming = torch.arange(hkv, device=DEV) == 1  # KV head 1 (if any) streams
    state = [
        (
            torch.full((5, hkv, 6), -1, dtype=torch.int32, device=DEV),
            torch.zeros(5, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(2)
    ]
    for step in range(3):
        q = torch.randn_like(q)
        scores = block_scores_ref(q, key_meta.codes, key_meta.scale, meta.block_tables, meta.seq_lens, mb, bs, d**-0.5)
        select_blocks_ref(scores, meta.seq_lens, slots, *state[0], streaming, **p)
        score_and_select_triton(
            q,
            key_meta.codes,
            key_meta.scale,
            meta.block_tables,
            meta.seq_lens,
            slots,
            *state[1],
            streaming,
            max_blocks=mb,
            scale=d**-0.5,
            **p,
        )
        assert torch.equal(state[0][0].sort(-1).values, state[1][0].sort(-1).values), step
        assert torch.equal(state[0][1], state[1][1]) and torch.equal(state[0][2], state[1][2]), step


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,bs,config",
    [
        (8, 2, 64, 16, SparseDecodeConfig(tile_n=32, target_programs=24)),
        (6, 2, 32, 16, SparseDecodeConfig(tile_n=16, target_programs=1)),
        (8, 2, 64, 16, SparseDecodeConfig(tile_n=16, num_stages=3, tiles=2)),
        (8, 2, 64, 16, SparseDecodeConfig(tile_n=32, tiles=2, num_stages=3, tma=True)),
        (6, 2, 32, 16, SparseDecodeConfig(tile_n=16, tiles=1, tma=True)),
        (4, 4, 64, 32, None),
        # groups that are not powers of two, plain and TMA kernels
        pytest.param(9, 3, 64, 16, SparseDecodeConfig(tile_n=32, target_programs=24), id="group3-9q3kv"),
        pytest.param(9, 3, 64, 16, SparseDecodeConfig(tile_n=32, tiles=2, tma=True), id="group3-9q3kv-tma"),
        pytest.param(15, 3, 32, 16, SparseDecodeConfig(tile_n=16, tiles=1, tma=True), id="group5-15q3kv-tma"),
        pytest.param(7, 1, 64, 16, None, id="group7-7q1kv"),
    ],
)
def test_sparse_decode(dtype, hq, hkv, d, bs, config):
    """Random lists with padding, entries inside the local window, and a padding row (tma: the TMA gather)."""
    torch.manual_seed(3)
    lens = [0, 1, 5 * bs, 13 * bs + 7, 9 * bs + 1]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, dtype, slack=2 * bs)
    cap = 5
    sel = random_lists(lens, hkv, bs, cap)
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, sel, slots, 2, d**-0.5)
    if config is not None and config.tma:  # the TMA kernel runs, not the fallback
        per_split = split_plan(len(lens), hkv, cap + 2, max(1, config.tile_n // bs), q.device, config)[0]
        assert tma_capable(cache, None) and per_split & (per_split - 1) == 0
    out = torch.full_like(q, float("nan"))
    sparse_decode_triton(q, cache, meta.block_tables, meta.seq_lens, sel, slots, 2, d**-0.5, out=out, config=config)
    assert torch.isfinite(out).all() and torch.count_nonzero(out[0]) == 0
    assert rel_err(out, ref) < TOL[dtype]


def random_lists(lens: list[int], hkv: int, bs: int, cap: int) -> torch.Tensor:
    """[B + 1, Hkv, cap] lists of 0..cap distinct blocks of each row (entries in the window too), -1 padded."""
    sel = torch.full((len(lens) + 1, hkv, cap), -1, dtype=torch.int32, device=DEV)
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        for h in range(hkv):
            pick = torch.randperm(max(nb, 1))[: torch.randint(0, cap + 1, ()).item()]
            sel[b, h, : pick.numel()] = pick.to(torch.int32)
    return sel


def offload_inputs(cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, sel: torch.Tensor, local: int):
    """Listed K/V (fresh random data) spread over pool slots and host rows (loc -(row + 1): bypass); every block before
    a window poisoned in the device cache. Returns (offload tuple, listed_kv, poisoned cache)."""
    batch, hkv, cap = sel.shape
    bs, d = cache.shape[3], cache.shape[4]
    listed_kv = torch.randn(batch, hkv, cap, 2, bs, d, device=DEV).to(cache.dtype)
    n = batch * hkv * cap
    loc, key = torch.randperm(n, device=DEV), torch.randperm(n, device=DEV)
    bypass = torch.rand(n, device=DEV) < 0.5
    loc[bypass] = -1 - key[bypass]
    pool, host = torch.zeros_like(listed_kv).view(n, 2, bs, d), torch.zeros_like(listed_kv).view(n, 2, bs, d)
    pool[loc[~bypass]] = listed_kv.view(n, 2, bs, d)[~bypass]
    host[key[bypass]] = listed_kv.view(n, 2, bs, d)[bypass]
    poisoned = cache.clone()
    for b, nb in enumerate(((seq_lens + bs - 1) // bs).tolist()):
        poisoned[tables[b, : max(0, nb - local)].long()] = float("nan")
    return (pool, host, loc.view(batch, hkv, cap)), listed_kv, poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_decode_view_by_slot(dtype, hq=6, hkv=2):
    """A lagged read's view follows the lists' rows (the slots), not the batch rows: the kernel and the
    reference read the same blocks as the batch-ordered view of the same lists (other rows: never read)."""
    torch.manual_seed(11)
    d, bs, cap, local, rows = 32, 16, 5, 2, 7
    lens = [5 * bs, 13 * bs + 7, 9 * bs + 1]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, dtype, slack=2 * bs)
    listed = random_lists(lens, hkv, bs, cap)[: len(lens)]
    (pool, host, loc), _, cache = offload_inputs(cache, meta.block_tables, meta.seq_lens, listed, local)
    slots = torch.tensor([5, 0, 3], dtype=torch.int32, device=DEV)
    sel = torch.full((rows, hkv, cap), -1, dtype=torch.int32, device=DEV)
    sel[slots.long()] = listed
    loc_s = torch.full((rows + 1, hkv, cap), 10**9, dtype=torch.int64, device=DEV)  # out of range if read
    loc_s[slots.long()] = loc
    args = (q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, d**-0.5)
    by_row = sparse_decode_ref(*args, offload=(pool, host, loc))
    assert torch.isfinite(by_row).all()
    assert torch.equal(sparse_decode_ref(*args, offload=(pool, host, loc_s), view_by_slot=True), by_row)
    out = sparse_decode_triton(
        *args, offload=(pool, host, loc_s), view_by_slot=True, config=SparseDecodeConfig(tile_n=32)
    )
    assert rel_err(out, by_row) < TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offload", [False, True, "misaligned"])
@pytest.mark.parametrize("tile_n,tiles,splits", [(16, 1, 7), (32, 2, 2), (32, 1, 4), (128, 0, 1)])
def test_sparse_decode_splits(dtype, offload, tile_n, tiles, splits, hq=6, hkv=2):
    """The split kernel and its merge match the reference over several splits (and one), offloaded (listed
    blocks from pool slots or host rows, the device cache before the window poisoned; "misaligned": the cache
    one element off 16 bytes, which the kernel must read without its aligned loads) or not. The splits share a
    row's entries up to its last listed one and its window, however full the list (a tile holds both), and a
    hole before the last entry is skipped, not taken for the list's end."""
    torch.manual_seed(9)
    d, bs, cap, local = 32, 16, 5, 2
    lens = [0, 1, 5 * bs, 13 * bs + 7, 9 * bs + 1]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, dtype, slack=2 * bs)
    sel = random_lists(lens, hkv, bs, cap)[: len(lens)]
    sel[3, 0] = torch.randperm(12, device=DEV)[:cap].to(torch.int32)
    sel[3, 0, 1] = -1
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    kw = {}
    if offload:
        kw["offload"], listed_kv, cache = offload_inputs(cache, meta.block_tables, meta.seq_lens, sel, local)
        assert torch.equal(read_listed_ref(kw["offload"]), listed_kv)  # the view serves the listed blocks
        if offload == "misaligned":
            cache = torch.empty(cache.numel() + 1, dtype=dtype, device=DEV)[1:].view_as(cache).copy_(cache)
        assert kv_rows_aligned(cache, *kw["offload"][:2]) == (offload is True)
    ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, d**-0.5, **kw)
    if offload:  # the poisoned blocks before the window were never read
        assert torch.isfinite(ref).all()
    config = SparseDecodeConfig(tile_n=tile_n, tiles=tiles, target_programs=1)
    assert split_plan(len(lens), hkv, cap + local, max(1, tile_n // bs), q.device, config)[1] == splits
    out = torch.full_like(q, float("nan"))
    sparse_decode_triton(
        q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, d**-0.5, out=out, config=config, **kw
    )
    assert torch.isfinite(out).all() and torch.count_nonzero(out[0]) == 0
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("view_by_slot", [False, True])
@pytest.mark.parametrize("hq,hkv", [(6, 2), pytest.param(9, 3, id="group3-9q3kv")])
def test_sparse_decode_offload_tma(dtype, view_by_slot, hq, hkv):
    """The TMA kernel under offload: listed blocks through a descriptor over the pool, bypass reads from their
    host rows by pointer, the window from the cache (before it poisoned); several splits; equal to the reference
    and to the pointer kernel (a lagged read's view by slot too: other rows of the view are never read)."""
    torch.manual_seed(17)
    d, bs, cap, local = 32, 16, 6, 2
    lens = [0, 1, 5 * bs, 13 * bs + 7, 9 * bs + 1]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, dtype, slack=2 * bs)
    sel = random_lists(lens, hkv, bs, cap)[: len(lens)]
    offload, _, cache = offload_inputs(cache, meta.block_tables, meta.seq_lens, sel, local)
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    args = (q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, d**-0.5)
    ref = sparse_decode_ref(*args, offload=offload)
    assert torch.isfinite(ref).all()
    kw = dict(offload=offload)
    if view_by_slot:  # rows by slot, the batch in another order, one spare row of the view never read
        order = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32, device=DEV)
        pool, host, loc = offload
        loc_s = torch.full((len(lens) + 1, hkv, cap), 10**9, dtype=loc.dtype, device=DEV)
        sel_s = torch.full((len(lens) + 1, hkv, cap), -1, dtype=torch.int32, device=DEV)
        loc_s[order.long()], sel_s[order.long()] = loc, sel
        args = (q, cache, meta.block_tables, meta.seq_lens, sel_s, order, local, d**-0.5)
        kw = dict(offload=(pool, host, loc_s), view_by_slot=True)
    config = SparseDecodeConfig(tile_n=32, tiles=2, num_stages=3, tma=True)
    assert tma_capable(cache, kw["offload"])
    outs = []
    for cfg in (config, SparseDecodeConfig(tile_n=32, tiles=2)):
        out = torch.full_like(q, float("nan"))
        outs.append(sparse_decode_triton(*args, out=out, config=cfg, **kw))
    assert torch.isfinite(outs[0]).all() and torch.count_nonzero(outs[0][0]) == 0
    assert rel_err(outs[0], ref) < TOL[dtype] and rel_err(outs[0], outs[1]) < TOL[dtype]


def test_sparse_decode_merges_many_splits(hq=6, hkv=2):
    """More splits than two merge tiles (one list entry a split, 43 splits, the last tile partly used), rows that
    list fewer entries than there are splits (their empty splits carry no weight), and a padding row."""
    torch.manual_seed(13)
    d, bs, cap, local = 32, 16, 41, 2
    lens = [0, 50 * bs + 3, 47 * bs, 20 * bs + 9]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, torch.float32, slack=2 * bs)
    sel = random_lists(lens, hkv, bs, cap)[: len(lens)]
    sel[1, 0] = torch.randperm(48, device=DEV)[:cap].to(torch.int32)  # a full list: every split has an entry
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, d**-0.5)
    config = SparseDecodeConfig(tile_n=bs, tiles=1, target_programs=1)
    assert split_plan(len(lens), hkv, cap + local, 1, q.device, config)[1] > 2 * MERGE_TILE
    out = torch.full_like(q, float("nan"))
    sparse_decode_triton(q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, d**-0.5, out=out, config=config)
    assert torch.isfinite(out).all() and torch.count_nonzero(out[0]) == 0
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize(
    "hq,hkv",
    [
        pytest.param(9, 3, id="group3-9q3kv"),
        pytest.param(15, 3, id="group5-15q3kv"),
        pytest.param(7, 1, id="group7-7q1kv"),
    ],
)
def test_sparse_decode_splits_odd_groups(hq, hkv, offload):
    """Groups that are not powers of two through the split kernel, several splits and the merge, with the
    offloaded reads (pool slots, host rows) and without."""
    test_sparse_decode_splits(torch.float32, offload, 32, 2, 2, hq=hq, hkv=hkv)


@gpu_only
@pytest.mark.parametrize("offload", [False, True])
def test_large_decode_group3_gpu(offload):
    """SmolLM2-135M's attention shape (9 query / 3 KV heads, D=64) in bf16 at 8K contexts: the scores against
    their reference, and the sparse kernel on the lists the selection kernel left against the reference, with the
    default launch config (the TMA gather on Hopper, offloaded or not) and the pointer gather (offloaded: through
    pool slots and host rows, the device cache before each window poisoned)."""
    torch.manual_seed(11)
    hq, hkv, d, bs, cap, local = 9, 3, 64, 32, 64, 2
    lens = [8192, 5000, 0, 8000 - 7]
    q, cache, meta, key_meta = scored_batch(lens, hq, hkv, d, bs, bs, torch.bfloat16)
    mb, scale = -(-meta.max_seq_len // bs), d**-0.5
    slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    sel = torch.full((len(lens), hkv, cap), -1, dtype=torch.int32, device=DEV)
    counter = torch.zeros(len(lens), hkv, dtype=torch.int32, device=DEV)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    scores = block_scores_triton(
        q,
        key_meta.codes,
        key_meta.scale,
        meta.block_tables,
        meta.seq_lens,
        slots,
        counter,
        max_blocks=mb,
        block_size=bs,
        cap=cap,
        reuse=1,
        short_dense=True,
        scale=scale,
    )
    ref = block_scores_ref(q, key_meta.codes, key_meta.scale, meta.block_tables, meta.seq_lens, mb, bs, scale)
    for b, n in enumerate(lens):
        if -(-n // bs) > cap:
            assert rel_err(scores[b, :, : -(-n // bs)], ref[b, :, : -(-n // bs)]) < TOL[torch.bfloat16], b
    score_and_select_triton(
        q,
        key_meta.codes,
        key_meta.scale,
        meta.block_tables,
        meta.seq_lens,
        slots,
        sel,
        counter,
        stats,
        torch.zeros(hkv, dtype=torch.bool, device=DEV),
        max_blocks=mb,
        scale=scale,
        **params("topk", cap, bs, local=local),
    )
    assert ((sel[[0, 1, 3]] >= 0).sum(-1) == cap).all()  # every long row fills its budget
    kw = {}
    if offload:
        kw["offload"], _, cache = offload_inputs(cache, meta.block_tables, meta.seq_lens, sel, local)
    assert tma_capable(cache, kw.get("offload"))  # so the default is the TMA gather
    ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, scale, **kw)
    args = (q, cache, meta.block_tables, meta.seq_lens, sel, slots, local, scale)
    for config in (None, FAST_CONFIG):  # the default, then the pointer gather (where TMA does not apply)
        out = torch.full_like(q, float("nan"))
        sparse_decode_triton(*args, out=out, config=config, **kw)
        assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.bfloat16], config


def test_step_slots():
    """Lagged selection's read and write rows: the Triton kernel equals step_slots_ref, and the rule itself: a decode
    reads the row its latest earlier selection (every R-th context, or the prefill's end) wrote, never the row
    being written."""
    for reuse in (1, 2, 3):
        lens = torch.tensor([0, 1, 5, 6, 7, 8, 9, 12, 30, 31], dtype=torch.int32, device=DEV)
        slots = torch.randperm(16, device=DEV)[: lens.numel()].to(torch.int32)
        read, write = step_slots_ref(lens, slots, 7, reuse, 16)
        got = step_slots_triton(lens, slots, 7, reuse, 16)
        assert torch.equal(got[0], read) and torch.equal(got[1], write)
        lens = torch.randint(0, 100, (300,), dtype=torch.int32, device=DEV)  # more rows than the kernel's block
        slots = torch.randperm(512, device=DEV)[:300].to(torch.int32)
        got = step_slots_triton(lens, slots, 200, reuse, 512)
        assert all(torch.equal(a, b) for a, b in zip(got, step_slots_ref(lens, slots, 200, reuse, 512)))
        for s in range(1, 40):  # one sequence in slot 3, prefilled to 1..39 tokens, then 12 decodes
            one = torch.tensor([3], dtype=torch.int32, device=DEV)
            row = int(step_slots_ref(torch.tensor([s], device=DEV), one, 0, reuse, 16)[1])  # the prefill's end
            for n in range(s + 1, s + 13):
                r, w = (int(x) for x in step_slots_ref(torch.tensor([n], device=DEV), one, 1, reuse, 16))
                assert r == row and w != r and (w >= 0) == (n % reuse == 0) and r % 16 == 3
                row = w if w >= 0 else row
