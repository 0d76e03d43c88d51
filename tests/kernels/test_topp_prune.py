"""kernels/topp_prune.py (topp's select-then-prune) against its torch references, on random inputs. Without CUDA
the kernels run under the Triton interpreter on small shapes."""

from __future__ import annotations

import pytest
import torch

from sparseserve.kernels.block_score import select_blocks_ref
from sparseserve.kernels.sparse_decode import kv_rows_aligned
from sparseserve.kernels.topp_prune import (
    block_lse_ref,
    block_lse_triton,
    prune_lists_triton,
    prune_ref,
    topp_prune_ref,
    topp_prune_triton,
)
from tests.kernel_utils import DEVICE as DEV
from tests.kernel_utils import TOL, rel_err
from tests.kernels.test_sparse_kernels import offload_inputs


def params(cap: int, bs: int, top_p: float, reuse: int = 1, per_head: bool = False) -> dict:
    return dict(cap=cap, block_size=bs, sink=1, local=2, top_p=top_p, reuse=reuse, short_dense=True, per_head=per_head)


def batch(lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, sharp: float):
    """Decode queries (times `sharp`: peaked attention, so that pruning has something to choose), a
    cache of shuffled blocks and block tables; seq_len 0 is a padding row."""
    width = max(-(-n // bs) for n in lens) + 1
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    ids = torch.randperm(num_blocks, dtype=torch.int32)
    tables = torch.randint(0, num_blocks, (len(lens), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        tables[b, :nb] = ids[start : start + nb]
        start += nb
    q = (sharp * torch.randn(len(lens), hq, d)).to(dtype)
    cache = torch.randn(num_blocks, hkv, 2, bs, d).to(dtype)
    return q.to(DEV), cache.to(DEV), tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def empty_state(nslots: int, hkv: int, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selection state with no lists yet: (sel, counter, stats)."""
    return (
        torch.full((nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
        torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
        torch.zeros(2, dtype=torch.int64, device=DEV),
    )


def candidates(
    seq_lens: torch.Tensor, slots: torch.Tensor, state, streaming: torch.Tensor, p: dict, scores: torch.Tensor
) -> None:
    """The first stage, as the engine runs it: topk over bound scores [B, Hq, MB] fills the lists."""
    bs = p["block_size"]
    past_end = torch.arange(scores.shape[-1], device=DEV)[None, None] >= -(-seq_lens[:, None, None] // bs)
    select_blocks_ref(
        scores.masked_fill(past_end, float("-inf")),
        seq_lens,
        slots,
        *state,
        streaming,
        block_size=bs,
        cap=p["cap"],
        sink=p["sink"],
        local=p["local"],
        reuse=p["reuse"],
    )


def random_scores(seq_lens: torch.Tensor, hq: int, bs: int) -> torch.Tensor:
    return 3 * torch.randn(len(seq_lens), hq, int(seq_lens.max() + bs - 1) // bs, device=DEV)


LENS = [40 * 16, 3 * 16, 0, 17 * 16 + 3, 25 * 16 + 1]  # long rows, one that fits the cap, padding, partial blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "hq,hkv,d,bs",
    [
        (8, 2, 32, 16),
        (6, 2, 16, 8),
        (4, 4, 64, 32),
        pytest.param(9, 3, 64, 16, id="group3-9q3kv"),
        pytest.param(15, 3, 32, 8, id="group5-15q3kv"),
        pytest.param(7, 1, 32, 16, id="group7-7q1kv"),
    ],
)
def test_block_lse(dtype, hq, hkv, d, bs):
    """Per query head log-sum-exp of q.k over each listed block's valid tokens, on the rows that prune."""
    torch.manual_seed(0)
    lens = [n * bs // 16 for n in LENS]
    q, cache, tables, seq_lens = batch(lens, hq, hkv, d, bs, dtype, sharp=1.0)
    p = params(7, bs, 0.9)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    state = (
        torch.full((6, hkv, p["cap"]), -1, dtype=torch.int32, device=DEV),
        torch.zeros(6, hkv, dtype=torch.int32, device=DEV),
        torch.zeros(2, dtype=torch.int64, device=DEV),
    )
    candidates(
        seq_lens, slots, state, torch.zeros(hkv, dtype=torch.bool, device=DEV), p, random_scores(seq_lens, hq, bs)
    )
    sel = state[0]
    out = block_lse_triton(q, cache, tables, seq_lens, slots, sel, state[1], local=2, scale=d**-0.5)
    ref = block_lse_ref(q, cache, tables, seq_lens, sel[slots.long()], d**-0.5)
    rows = [b for b, n in enumerate(lens) if -(-n // bs) > p["cap"]]  # the others keep every block: not written
    assert len(rows) == 3
    listed = (sel[slots.long()][rows] >= 0).repeat_interleave(hq // hkv, 1)
    assert torch.isinf(ref[rows][~listed]).all() and torch.isfinite(ref[rows][listed]).all()
    assert rel_err(out[rows][listed], ref[rows][listed]) < TOL[dtype]
    assert torch.equal(out[rows][~listed], ref[rows][~listed])


PRUNE_CASES = [
    (0.5, False, 8, 4),
    (0.8, False, 8, 4),
    (0.95, False, 8, 4),
    (1.0, False, 8, 4),
    (0.8, True, 8, 4),
    pytest.param(0.8, False, 9, 3, id="group3-9q3kv"),
    pytest.param(0.8, True, 9, 3, id="group3-9q3kv-per-head"),
    pytest.param(0.8, False, 15, 3, id="group5-15q3kv"),
    pytest.param(0.8, False, 7, 1, id="group7-7q1kv"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "search", [{"sort": False}, {"sort": False, "ways": 16}, {"sort": True}], ids=["ways4", "ways16", "sort"]
)
@pytest.mark.parametrize("top_p,per_head,hq,hkv", PRUNE_CASES)
def test_prune_lists(top_p, per_head, hq, hkv, search):
    """Given the same lse, the kernel's lists equal prune_ref's, order included, over reuse steps; stats[0]
    loses exactly the dropped entries; whichever search finds the threshold (rounds of 4, of 16, or a sort)."""
    torch.manual_seed(1)
    bs, cap, nslots = 16, 9, 6
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    streaming = torch.arange(hkv, device=DEV) == 1  # KV head 1 (if any) streams
    p = params(cap, bs, top_p, reuse=2, per_head=per_head)
    state = empty_state(nslots, hkv, cap)
    pruned_any = kept_any = False
    for step in range(3):
        candidates(seq_lens, slots, state, streaming, p, random_scores(seq_lens, hq, bs))
        before = [t.clone() for t in state]
        lse = 4 * torch.randn(len(LENS), hq, cap, device=DEV)  # peaked masses; -1 entries are ignored
        prune_lists_triton(lse, seq_lens, slots, *state, **{k: v for k, v in p.items() if k != "cap"}, **search)
        sel, counter, stats = before
        due = (seq_lens > 0)[:, None] & ((counter[slots.long()] - 1) % p["reuse"] == 0)
        lists = sel[slots.long()]
        pruned = prune_ref(lse, lists, seq_lens, block_size=bs, sink=1, local=2, top_p=top_p, per_head=per_head)
        want = torch.where(due[..., None], pruned, lists)
        assert torch.equal(state[0][slots.long()], want), step
        assert torch.equal(state[1], counter)
        assert int(state[2][0]) == int(stats[0]) - int(((lists >= 0).sum(-1) - (want >= 0).sum(-1)).sum())
        assert torch.equal(state[2][1], stats[1])
        n_listed, n_kept = (lists >= 0).sum(-1), (want >= 0).sum(-1)
        pruned_any |= bool((n_kept < n_listed).any())
        kept_any |= bool((due & (n_kept > 3)).any())  # a candidate past sink + 2 local kept
    assert pruned_any == (top_p < 1.0) and kept_any
    # The streaming head's lists hold only sink + local, the short row all its 3 blocks: nothing pruned.
    if hkv > 1:
        assert sorted(state[0][4, 1].tolist()) == [-1] * (cap - 3) + [0, 38, 39]
    assert sorted(state[0][0, 0].tolist()) == [-1] * (cap - 3) + [0, 1, 2]


@pytest.mark.parametrize("search", [{}, {"sort": False}], ids=["default", "ways4"])
def test_prune_lists_of_256_blocks(search):
    """The engine's lists under topp with blocks of 16 at a cap of 4096 tokens (256 entries; the default search
    sorts them, SORT_MAX_CAP): the kernel's lists equal prune_ref's, whichever search."""
    torch.manual_seed(2)
    bs, cap, hq, hkv = 16, 256, 4, 2
    seq_lens = torch.tensor([300 * bs + 5, 0, 280 * bs], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1, 0, 2], dtype=torch.int32, device=DEV)
    p = params(cap, bs, 0.95)
    state = empty_state(3, hkv, cap)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    candidates(seq_lens, slots, state, streaming, p, random_scores(seq_lens, hq, bs))
    lists = state[0][slots.long()].clone()
    lse = torch.randn(3, hq, cap, device=DEV)  # mildly peaked: the 0.95 threshold falls inside the list
    prune_lists_triton(lse, seq_lens, slots, *state, **{k: v for k, v in p.items() if k != "cap"}, **search)
    want = prune_ref(lse, lists, seq_lens, block_size=bs, sink=1, local=2, top_p=0.95)
    got = state[0][slots.long()]
    assert torch.equal(got[seq_lens > 0], want[seq_lens > 0])
    kept = (got[0] >= 0).sum(-1)
    assert ((kept > 3) & (kept < (lists[0] >= 0).sum(-1))).all()  # pruned, and not down to the forced entries


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize(
    "top_p,reuse,per_head,hq,hkv",
    [
        (0.6, 1, False, 8, 2),
        (0.9, 3, False, 8, 2),
        (0.7, 1, True, 8, 2),
        pytest.param(0.6, 1, False, 9, 3, id="group3-9q3kv"),
        pytest.param(0.9, 2, False, 15, 3, id="group5-15q3kv"),
        pytest.param(0.6, 1, False, 7, 1, id="group7-7q1kv"),
    ],
)
def test_topp_prune_vs_reference(dtype, top_p, reuse, per_head, hq, hkv):
    """Both kernels together against topp_prune_ref on fresh candidate lists, over reuse steps."""
    torch.manual_seed(2)
    d, bs, cap, nslots = 32, 16, 8, 6
    q, cache, tables, seq_lens = batch(LENS, hq, hkv, d, bs, dtype, sharp=3.0)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    p = params(cap, bs, top_p, reuse=reuse, per_head=per_head)
    kw = dict(sink=1, local=2, top_p=top_p, reuse=reuse, per_head=per_head, scale=d**-0.5)
    states = [
        (
            torch.full((nslots, hkv, cap), -1, dtype=torch.int32, device=DEV),
            torch.zeros(nslots, hkv, dtype=torch.int32, device=DEV),
            torch.zeros(2, dtype=torch.int64, device=DEV),
        )
        for _ in range(2)
    ]
    live, n_listed = seq_lens > 0, 0
    for step in range(4):
        q = 3 * torch.randn_like(q)
        scores = random_scores(seq_lens, hq, bs)
        for state in states:  # the same candidates for both
            candidates(seq_lens, slots, state, streaming, p, scores)
        n_cand = int(states[0][2][0])
        topp_prune_ref(q, cache, tables, seq_lens, slots, *states[0], **kw)
        topp_prune_triton(q, cache, tables, seq_lens, slots, *states[1], **kw)
        for a, b in zip(*states):
            assert torch.equal(a, b), step
        if step % reuse == 0:  # something pruned; the counter reports exactly what the new lists hold
            assert int(states[1][2][0]) < n_cand
            assert int(states[1][2][0]) - n_listed == int((states[1][0][slots[live].long()] >= 0).sum())
        else:
            assert int(states[1][2][0]) == n_listed
        n_listed = int(states[1][2][0])


@pytest.mark.parametrize("into_rows", [False, True], ids=["in_place", "into_rows"])
def test_topp_prune_keeps_flat_lists_whole(into_rows, hq=8, hkv=2):
    """Lists the first stage flagged flat stay whole (in place, or copied whole into out rows); the others are
    pruned as without flags; both kernels equal the reference."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    d, bs, cap, nslots, top_p = 32, 16, 8, 6, 0.6
    q, cache, tables, seq_lens = batch(LENS, hq, hkv, d, bs, torch.float32, sharp=3.0)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    state = empty_state(nslots, hkv, cap)
    candidates(
        seq_lens,
        slots,
        state,
        torch.zeros(hkv, dtype=torch.bool, device=DEV),
        params(cap, bs, top_p),
        random_scores(seq_lens, hq, bs),
    )
    flat = torch.zeros(nslots, hkv, dtype=torch.int8, device=DEV)
    flat[4, 0] = flat[2, 1] = flat[1] = 1  # rows 0 (head 0), 3 (head 1) and 4 (both)
    kw = dict(sink=1, local=2, top_p=top_p, scale=d**-0.5)
    unflagged = tuple(t.clone() for t in state)
    topp_prune_ref(q, cache, tables, seq_lens, slots, *unflagged, **kw)
    results = []
    for fn in (topp_prune_ref, topp_prune_triton):
        sel, counter, stats = (t.clone() for t in state)
        out = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int32, device=DEV) if into_rows else None
        fn(q, cache, tables, seq_lens, slots, sel, counter, stats, out=out, flat=flat, **kw)
        results.append((sel if out is None else out, stats))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    got = results[0][0] if into_rows else results[0][0][slots.long()]
    whole, pruned = state[0][slots.long()], unflagged[0][slots.long()]
    flagged = flat[slots.long()] != 0
    live = (seq_lens > 0)[:, None].expand_as(flagged)
    assert torch.equal(got[flagged & live], whole[flagged & live])
    assert torch.equal(got[~flagged & live], pruned[~flagged & live])
    assert not torch.equal(whole[flagged & live], pruned[flagged & live])  # the flags kept what a prune drops


OFFLOAD_CASE = (32, 16, 8, 0.6)  # head_dim, block size, cap (blocks), top_p


def offload_case(hq: int, hkv: int, seed: int):
    """Candidates over LENS (OFFLOAD_CASE) and their pool view as offload_inputs spreads them (pool slots, host
    rows), the device cache poisoned before each window: (q, cache, tables, seq_lens, slots, state, offload)."""
    torch.manual_seed(seed)
    d, bs, cap, top_p = OFFLOAD_CASE
    q, cache, tables, seq_lens = batch(LENS, hq, hkv, d, bs, torch.float32, sharp=3.0)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    p = params(cap, bs, top_p)
    state = empty_state(6, hkv, cap)
    candidates(
        seq_lens, slots, state, torch.zeros(hkv, dtype=torch.bool, device=DEV), p, random_scores(seq_lens, hq, bs)
    )
    offload, _, poisoned = offload_inputs(cache, tables, seq_lens, state[0][slots.long()], p["local"])
    return q, poisoned, tables, seq_lens, slots, state, offload


@pytest.mark.slow
@pytest.mark.parametrize(
    "hq,hkv",
    [
        (8, 2),
        pytest.param(9, 3, id="group3-9q3kv"),
        pytest.param(15, 3, id="group5-15q3kv"),
        pytest.param(7, 1, id="group7-7q1kv"),
    ],
)
@pytest.mark.parametrize("aligned", [True, False])
def test_topp_prune_offload(hq, hkv, aligned):
    """Under KV offload the candidates' keys come through the HBM pool view (pool slots, host rows for bypass
    reads) and the device cache before each local window is poisoned: both kernels equal topp_prune_ref; also
    with the cache one element off 16 bytes, which the lse kernel must read without the aligned loads."""
    q, poisoned, tables, seq_lens, slots, state, offload = offload_case(hq, hkv, seed=3)
    if not aligned:
        buf = torch.empty(poisoned.numel() + 1, dtype=poisoned.dtype, device=DEV)
        poisoned = buf[1:].view_as(poisoned).copy_(poisoned)
    assert kv_rows_aligned(poisoned, *offload[:2]) == aligned
    d, bs, cap, top_p = OFFLOAD_CASE
    kw = dict(sink=1, local=2, top_p=top_p, scale=d**-0.5, offload=offload)
    states = [tuple(t.clone() for t in state) for _ in range(2)]
    reads = [torch.full((1,), 5, dtype=torch.int64, device=DEV) for _ in range(2)]
    topp_prune_ref(q, poisoned, tables, seq_lens, slots, *states[0], host_reads=reads[0], **kw)
    topp_prune_triton(q, poisoned, tables, seq_lens, slots, *states[1], host_reads=reads[1], **kw)
    for a, b in zip(*states):
        assert torch.equal(a, b)
    assert int(states[1][2][0]) < int(state[2][0])  # something was pruned
    # the keys read from the host: listed full blocks before the window, not in the pool, of lists over the cap
    lists, expected = state[0][slots.long()], 5
    for b, n in enumerate(seq_lens.tolist()):
        nb = -(-n // bs)
        if n and nb > cap:
            listed = (lists[b] >= 0) & (lists[b] < nb - 2)
            expected += int((listed & (offload[2][b] < 0)).sum())
    assert expected > 5 and reads[0].item() == reads[1].item() == expected


@pytest.mark.parametrize("hq,hkv,per_head", [(8, 2, False), pytest.param(9, 3, True, id="group3-each")])
def test_topp_prune_into_rows(hq, hkv, per_head):
    """Lagged topp: the prune writes row b's result to out[b] (a padding row: -1), leaves the candidates as they
    are and counts what it keeps; both kernels equal the reference, and equal the in-place prune's lists."""
    torch.manual_seed(4)
    d, bs, cap, nslots, top_p = 32, 16, 8, 6, 0.7
    q, cache, tables, seq_lens = batch(LENS, hq, hkv, d, bs, torch.float32, sharp=3.0)
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32, device=DEV)
    p = params(cap, bs, top_p, per_head=per_head)
    state = empty_state(nslots, hkv, cap)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    candidates(seq_lens, slots, state, streaming, p, random_scores(seq_lens, hq, bs))
    kw = dict(sink=1, local=2, top_p=top_p, scale=d**-0.5, per_head=per_head)
    in_place = tuple(t.clone() for t in state)
    topp_prune_ref(q, cache, tables, seq_lens, slots, *in_place, **kw)
    live = seq_lens > 0
    outs = []
    for fn in (topp_prune_ref, topp_prune_triton):
        sel, counter, _ = (t.clone() for t in state)
        stats = torch.zeros(2, dtype=torch.int64, device=DEV)
        out = torch.full((len(LENS) + 1, hkv, cap), 7, dtype=torch.int32, device=DEV)  # one spare row
        fn(q, cache, tables, seq_lens, slots, sel, counter, stats, out=out, **kw)
        assert torch.equal(sel, state[0])  # the candidates stay
        assert (out[: len(LENS)][~live] == -1).all() and (out[len(LENS)] == 7).all()
        assert torch.equal(out[: len(LENS)][live], in_place[0][slots.long()][live])
        assert int(stats[0]) == int((out[: len(LENS)] >= 0).sum()) and int(stats[1]) == int(live.sum()) * hkv
        outs.append((out, stats))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert int(outs[0][1][0]) < int((state[0][slots.long()][live] >= 0).sum())  # something was pruned


def assert_view_follows(lists, pruned, view, out_view) -> None:
    """out_view [B, Hkv, cap] holds, at each kept entry's position in pruned, the view (loc) at its position in
    lists, then -1."""
    for b in range(lists.shape[0]):
        for h in range(lists.shape[1]):
            kept = pruned[b, h][pruned[b, h] >= 0].tolist()
            old = [lists[b, h].tolist().index(j) for j in kept]
            assert out_view[b, h, : len(kept)].tolist() == view[b, h, old].tolist()
            assert (out_view[b, h, len(kept) :] == -1).all()


@pytest.mark.parametrize("reuse", [1, 2])
def test_topp_prune_in_place_with_the_candidates_view(reuse, hq=8, hkv=2):
    """topp under KV offload without the lag: the prune shrinks the lists in place and writes the kept entries'
    view by decode row, so the attention needs no lookup after it; a list the prune skips (not due under
    sparse_reuse, within the cap, a padding row) stays as it is and gets its whole view. Both kernels equal the
    reference, and out_view[b] holds, at each kept entry's new position, the view at its old one."""
    q, poisoned, tables, seq_lens, slots, state, (pool, host, loc) = offload_case(hq, hkv, seed=7)
    d, bs, cap, top_p = OFFLOAD_CASE
    if reuse > 1:  # rows due this step (the counter counts selections), but row 0 (slot 4): it keeps its list
        state[1].fill_(1)
        state[1][4] = 2
    lists = state[0][slots.long()]
    outs = []
    for fn in (topp_prune_ref, topp_prune_triton):
        sel, counter, stats = (t.clone() for t in state)
        out_view = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int64, device=DEV)
        fn(
            q, poisoned, tables, seq_lens, slots, sel, counter, stats,
            sink=1, local=2, top_p=top_p, scale=d**-0.5, reuse=reuse, offload=(pool, host, loc),
            out_view=out_view,
        )  # fmt: skip
        outs.append((sel, out_view, stats))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    sel, out_loc = outs[0][:2]
    pruned = sel[slots.long()]
    assert int((pruned >= 0).sum()) < int((lists >= 0).sum())  # something was pruned
    if reuse > 1:
        assert torch.equal(pruned[0], lists[0])
    assert_view_follows(lists, pruned, loc, out_loc)


@pytest.mark.parametrize("view_by_slot", [False, True], ids=["by_row", "by_slot"])
def test_topp_prune_into_rows_with_the_candidates_view(view_by_slot, hq=8, hkv=2):
    """Lagged topp under KV offload: the candidates' keys come through their pool view (by decode row, or by
    state slot as a lagged plan keeps it), and the prune writes each kept entry's view (pool slot or host row)
    next to it in out_view, so the attention reads the pruned lists without a second lookup; both kernels equal
    the reference, and out_view[b] holds, at each kept entry's new position, the view at its old one."""
    q, poisoned, tables, seq_lens, slots, state, (pool, host, loc) = offload_case(hq, hkv, seed=5)
    d, bs, cap, top_p = OFFLOAD_CASE
    nslots, lists = state[0].shape[0], state[0][slots.long()]
    view = loc
    if view_by_slot:  # rows of other slots hold garbage the prune must not read
        view = torch.randint(0, 99, (nslots, hkv, cap), device=DEV)
        view[slots.long()] = loc
    outs = []
    for fn in (topp_prune_ref, topp_prune_triton):
        sel, counter, stats = (t.clone() for t in state)
        out = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int32, device=DEV)
        out_view = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int64, device=DEV)
        reads = torch.zeros(1, dtype=torch.int64, device=DEV)
        fn(
            q, poisoned, tables, seq_lens, slots, sel, counter, stats,
            sink=1, local=2, top_p=top_p, scale=d**-0.5, offload=(pool, host, view), host_reads=reads,
            out=out, view_by_slot=view_by_slot, out_view=out_view,
        )  # fmt: skip
        assert torch.equal(sel, state[0])  # the candidates stay
        outs.append((out, out_view, stats, reads))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    out, out_loc = outs[0][:2]
    assert int((out >= 0).sum()) < int((lists[seq_lens > 0] >= 0).sum())  # something was pruned
    assert_view_follows(lists, out, loc, out_loc)
    assert int(outs[0][3]) > 0  # keys of bypassed candidates came from the host


def test_topp_prune_into_read_rows_counts_the_host_reads_it_keeps(hq=8, hkv=2):
    """Prefetching reads: the prune writes row b's kept list into out[out_rows[b]] (a padding row, slot -1,
    nowhere), the candidates stay, the kept entries' view goes by decode row, and host_attended counts the kept
    entries before the window the attention will read from the host; both kernels equal the reference, and
    equal the in-place prune's lists."""
    q, poisoned, tables, seq_lens, slots, state, (pool, host, loc) = offload_case(hq, hkv, seed=9)
    d, bs, cap, top_p = OFFLOAD_CASE
    live = seq_lens > 0
    slots = torch.where(live, slots, -1).to(torch.int32)  # (write rows: -1 for padding rows)
    out_rows = (torch.arange(len(LENS), device=DEV) * 2 + 1).to(torch.int32)  # every other row of out
    kw = dict(sink=1, local=2, top_p=top_p, scale=d**-0.5, offload=(pool, host, loc))
    in_place = tuple(t.clone() for t in state)
    topp_prune_ref(q, poisoned, tables, seq_lens, slots.clamp_min(0), *in_place, **kw)
    outs = []
    for fn in (topp_prune_ref, topp_prune_triton):
        sel, counter, stats = (t.clone() for t in state)
        out = torch.full((2 * len(LENS), hkv, cap), 7, dtype=torch.int32, device=DEV)
        out_view = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int64, device=DEV)
        attended = torch.zeros(1, dtype=torch.int64, device=DEV)
        fn(
            q, poisoned, tables, seq_lens, slots, sel, counter, stats, **kw,
            out=out, out_rows=out_rows, out_view=out_view, host_attended=attended,
        )  # fmt: skip
        assert torch.equal(sel, state[0])  # the candidates stay
        assert (out[0::2] == 7).all() and (out[out_rows[~live].long()] == 7).all()  # nothing else written
        assert torch.equal(out[out_rows[live].long()], in_place[0][slots[live].long()])
        outs.append((out, out_view, stats, attended))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    pruned = outs[0][0][out_rows.long()]
    assert int((pruned[live] >= 0).sum()) < int((state[0][slots[live].long()] >= 0).sum())  # something was pruned
    lists = torch.where(live[:, None, None], state[0][slots.clamp_min(0).long()], -1)
    pruned = torch.where(live[:, None, None], pruned, -1)
    assert_view_follows(lists, pruned, loc, outs[0][1])
    nb = (seq_lens.long() + bs - 1) // bs
    before_window = (pruned >= 0) & (pruned < (nb - 2)[:, None, None])
    expected = int((before_window & (outs[0][1] < 0)).sum())
    assert expected > 0 and int(outs[0][3]) == expected


@pytest.mark.parametrize("hq,hkv", [(8, 2), pytest.param(9, 3, id="group3-9q3kv")])
def test_topp_prune_looks_the_candidates_up_itself(hq, hkv):
    """Prefetching reads (`lookup`): the candidates' view is not given but found, each listed entry's key from
    the token tables and its slot in the pool's `resident` (half the keys are in the pool, the rest read from
    the host), by the lse kernel for every row (a padding row and one within the cap, which the prune skips,
    included); the prune counts what was found and not. The Triton path equals the reference, which looks up
    with pool_lookup_ref first: the view written, the kept lists and their view, and every count."""
    from sparseserve.kernels.pool_plan import ListLayout, ListLookup, pool_lookup_ref

    torch.manual_seed(13)
    d, bs, cap, top_p = OFFLOAD_CASE
    q, cache, tables, seq_lens = batch(LENS, hq, hkv, d, bs, torch.float32, sharp=3.0)
    live = seq_lens > 0
    slots = torch.tensor([4, 0, -1, 2, 1], dtype=torch.int32, device=DEV)  # write rows; -1: the padding row
    state = empty_state(6, hkv, cap)
    candidates(
        seq_lens,
        slots.clamp_min(0),
        state,
        torch.zeros(hkv, dtype=torch.bool, device=DEV),
        params(cap, bs, top_p),
        random_scores(seq_lens, hq, bs),
    )
    state[0][2].fill_(-1)  # (slot 2 was the padding row's stand-in)
    num_blocks = tables.shape[0] * tables.shape[1]
    tokens = torch.randperm(num_blocks, device=DEV).view_as(tables).to(torch.int32)  # host rows (token blocks)
    lay = ListLayout(1, num_blocks, hkv, 2, bs)
    num_keys = 2 * (num_blocks + 1) * hkv
    host = torch.randn(num_keys + 1, 2, bs, d, device=DEV)
    resident = torch.full((num_keys + 1,), -1, dtype=torch.int64, device=DEV)
    pooled = torch.randperm(num_keys, device=DEV)[: num_keys // 2]
    resident[pooled] = torch.randperm(len(pooled), device=DEV)
    pool = torch.randn(len(pooled) + 1, 2, bs, d, device=DEV)
    pool[resident[pooled]] = host[pooled]
    poisoned = cache.clone()
    for b, nb in enumerate(((seq_lens + bs - 1) // bs).tolist()):
        poisoned[tables[b, : max(0, nb - 2)].long()] = float("nan")
    out_rows = (torch.arange(len(LENS), device=DEV) * 2 + 1).to(torch.int32)
    outs = []
    for fn in (topp_prune_ref, topp_prune_triton):
        sel, counter, stats = (t.clone() for t in state)
        view = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int64, device=DEV)
        out = torch.full((2 * len(LENS), hkv, cap), 7, dtype=torch.int32, device=DEV)
        out_view = torch.full((len(LENS), hkv, cap), 7, dtype=torch.int64, device=DEV)
        counts = torch.zeros(5, dtype=torch.int64, device=DEV)  # found, not found, attended from host, key reads
        fn(
            q, poisoned, tables, seq_lens, slots, sel, counter, stats, sink=1, local=2, top_p=top_p,
            scale=d**-0.5, offload=(pool, host, view), host_reads=counts[3:4], out=out, out_rows=out_rows,
            out_view=out_view, host_attended=counts[2:3], lookup=ListLookup(tokens, lay, resident, counts[:2]),
        )  # fmt: skip
        assert torch.equal(sel, state[0])  # the candidates stay
        outs.append((view, out, out_view, stats, counts))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    found = torch.zeros(2, dtype=torch.int64, device=DEV)
    want = pool_lookup_ref(state[0], slots, tokens, seq_lens, lay, resident, found)
    assert torch.equal(outs[0][0], want)
    counts = outs[0][-1].tolist()
    assert counts[:2] == found.tolist() and min(counts[:4]) > 0  # in the pool and not; kept and read from host
    pruned = outs[0][1][out_rows.long()]
    assert int((pruned[live] >= 0).sum()) < int((state[0][slots[live].long()] >= 0).sum())  # something was pruned
