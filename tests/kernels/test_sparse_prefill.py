"""Sparse prefill (kernels/sparse_prefill.py) and SALE's selection pass (kernels/sale_select.py): the Triton kernels
against their torch references on ragged batches of chunks. Without CUDA the kernels run under the Triton
interpreter on tiny shapes; the GPU-only tests add bf16 and longer contexts.
"""

from __future__ import annotations

import pytest
import torch

from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.paged_prefill import PrefillConfig, paged_prefill, paged_prefill_ref, paged_prefill_triton
from sparseserve.kernels.sale_select import (
    TileSelectConfig,
    pow2_exponent_ref,
    quantize_keys_ref,
    quantize_qk_ref,
    quantize_qk_triton,
    sale_select,
    select_tiles_ref,
    select_tiles_triton,
)
from sparseserve.kernels.sparse_prefill import (
    SparsePrefillConfig,
    TileLayout,
    sparse_prefill,
    sparse_prefill_ref,
    tile_classes,
    tile_lists,
)
from tests.kernel_utils import DEVICE as DEV
from tests.kernel_utils import TOL, gpu_only, rel_err

# (prefix already in the cache, chunk length): a first chunk, chunks starting mid-block after a cached prefix,
# a one-token chunk, and a chunk whose context spans several middle tiles.
CHUNKS = [(0, 40), (37, 20), (5, 1), (118, 33)]
MARGIN = 1e-3  # log2 units: selection decisions closer to their boundary than this may differ


def make_chunks(chunks, hq, hkv, d, bs, dtype, seed=0):
    """Random cache in shuffled blocks (table entries past a sequence's end point at other sequences' blocks),
    queries, and the step's tensors: (q, cache, tables, seq_lens, query_start_loc, max_query_len, max_seq_len)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in chunks]
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 2
    width = max(need) + 1
    ids = torch.randperm(num_blocks, generator=g, dtype=torch.int32)
    tables = torch.randint(0, num_blocks, (len(chunks), width), generator=g, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[start : start + n]
        start += n
    q_lens = [n for _, n in chunks]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cache = torch.randn(num_blocks, hkv, 2, bs, d, generator=g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    return (
        q.to(DEV, dtype),
        cache.to(DEV, dtype),
        tables.to(DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        qsl.to(DEV),
        max(q_lens),
        max(seq_lens),
    )


def dense_ref(q, cache, tables, seq_lens, qsl, max_q, max_s, scale):
    return paged_prefill_ref(q, cache, tables, seq_lens, qsl, scale, max_q)


@pytest.fixture
def triton_backends():
    with forced("triton"):
        yield


# (hq, hkv, d, bs, layout, config, dtype): groups of 1, 3 and 4; a query tile served by two programs (group 4:
# 8 queries a program, 16 a tile); key tiles of two 16-key steps.
ATTN_CASES = [
    (4, 4, 64, 16, TileLayout(q_tile=16, k_tile=16, sink=1, local=1), SparsePrefillConfig(16, 16, 4, 2), torch.float32),
    (6, 2, 64, 32, TileLayout(q_tile=16, k_tile=32, sink=1, local=1), SparsePrefillConfig(64, 16, 4, 2), torch.float16),
    (
        8,
        2,
        128,
        16,
        TileLayout(q_tile=16, k_tile=16, sink=2, local=1),
        SparsePrefillConfig(32, 16, 4, 2),
        torch.float32,
    ),
    # groups that are not powers of two: GROUP_PAD rows a query, the padding heads masked
    pytest.param(
        9,
        3,
        64,
        16,
        TileLayout(q_tile=16, k_tile=16, sink=1, local=1),
        SparsePrefillConfig(32, 16, 4, 2),
        torch.float32,
        id="group3-9q3kv",
    ),
    pytest.param(
        15,
        3,
        32,
        16,
        TileLayout(q_tile=16, k_tile=32, sink=1, local=1),
        SparsePrefillConfig(64, 16, 4, 2),
        torch.float16,
        id="group5-15q3kv",
    ),
    pytest.param(
        7, 1, 64, 16, TileLayout(q_tile=16, k_tile=16, sink=1, local=1), None, torch.float32, id="group7-7q1kv"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv,d,bs,layout,config,dtype", ATTN_CASES)
def test_sparse_prefill_kernel(triton_backends, hq, hkv, d, bs, layout, config, dtype):
    """Random tile masks and a streaming head: the kernel equals the reference; the mask matters (the output
    differs from dense attention), and the reference itself is dense attention when every tile is allowed."""
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks(CHUNKS, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    n_qt, n_kt = layout.num_q_tiles(max_q), layout.num_k_tiles(max_s)
    mask = torch.rand(len(CHUNKS), hkv, n_qt, n_kt, generator=torch.Generator().manual_seed(1)) < 0.4
    index, count = tile_lists(mask.to(DEV), seq_lens, qsl, layout)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    streaming[-1] = True
    args = (q, cache, tables, seq_lens, qsl, scale, max_q, max_s, layout)
    ref = sparse_prefill_ref(*args, index, count, streaming)
    out = sparse_prefill(*args, index, count, streaming, out=torch.full_like(q, float("nan")), config=config)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    dense = dense_ref(*args[:5], max_q, max_s, scale)
    assert rel_err(ref, dense) > 0.05  # the tiles left out carry weight
    # every tile: the reference equals dense (float32 math in both; fp16 outputs may round one ulp apart)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(sparse_prefill_ref(*args), dense, atol=tol, rtol=tol)


def test_tile_lists_and_classes():
    """tile_lists keeps exactly the mask's middle tiles, ascending; forced and middle tiles partition the causal
    tiles of every query tile."""
    layout = TileLayout(q_tile=16, k_tile=16, sink=1, local=1)
    _, _, _, seq_lens, qsl, max_q, max_s = make_chunks(CHUNKS, 2, 1, 16, 16, torch.float32)
    n_qt, n_kt = layout.num_q_tiles(max_q), layout.num_k_tiles(max_s)
    forced, middle = tile_classes(seq_lens, qsl, n_qt, n_kt, layout)
    assert not (forced & middle).any()
    for b, (prefix, n) in enumerate(CHUNKS):
        for t in range(n_qt):
            first, last = prefix + t * 16, min(prefix + t * 16 + 16, prefix + n) - 1
            causal = (
                torch.arange(n_kt, device=DEV) <= last // 16
                if t * 16 < n
                else torch.zeros(n_kt, dtype=torch.bool, device=DEV)
            )
            assert torch.equal(forced[b, t] | middle[b, t], causal)
            if t * 16 < n:
                assert forced[b, t, 0] and forced[b, t, first // 16 : last // 16 + 1].all()
    mask = torch.rand(len(CHUNKS), 2, n_qt, n_kt, generator=torch.Generator().manual_seed(3)) < 0.5
    index, count = tile_lists(mask.to(DEV), seq_lens, qsl, layout)
    keep = mask.to(DEV) & middle[:, None]
    assert torch.equal(count, keep.sum(-1, dtype=torch.int32))
    for b, h, t in zip(*torch.nonzero(count).T.tolist()):
        assert index[b, h, t, : count[b, h, t]].tolist() == torch.nonzero(keep[b, h, t]).flatten().tolist()


@pytest.mark.parametrize(
    "hq,hkv",
    [(6, 2), pytest.param(15, 3, id="group5-15q3kv", marks=pytest.mark.slow), pytest.param(7, 1, id="group7-7q1kv")],
)
def test_quantize_kernel(triton_backends, hq, hkv):
    """Stage 1: the kernels' fp8 codes equal the reference's (the rounding helper against torch's e4m3 cast),
    scales and the mean term agree to float32 rounding, and the estimate is q.k up to a per-row constant."""
    layout = TileLayout(q_tile=16, k_tile=16)
    group = hq // hkv
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks(CHUNKS, hq, hkv, 64, 16, torch.float32, seed=4)
    q = q * torch.linspace(0.1, 8.0, 64, device=DEV) + 3.0  # uneven channels and a shared offset
    ref = quantize_qk_ref(q, cache, tables, seq_lens, qsl, max_s, layout)
    # 64-row query programs over chunks of 1-40 queries: rows past a chunk's end must not be written.
    got = quantize_qk_triton(q, cache, tables, seq_lens, qsl, max_q, max_s, layout, TileSelectConfig(quant_tok=64))
    valid = torch.arange(ref.k_scale.shape[-1], device=DEV)[None, :] < seq_lens[:, None]
    for name in ("q_code", "k_code"):
        a, b = getattr(ref, name).float(), getattr(got, name).float()
        # Means summed in another order may move a value across a rounding boundary: one code in a thousand.
        assert (a != b).float().mean() < 1e-3, name
    torch.testing.assert_close(got.q_scale, ref.q_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.k_scale, ref.k_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.qmk, ref.qmk, rtol=1e-4, atol=1e-4)
    past = ~valid[:, None].expand_as(got.k_scale)
    assert (got.k_code.float()[past] == 0).all() and (got.k_scale[past] == 1).all()
    assert (got.qmk[~valid[:, None].expand_as(got.qmk)] == 0).all()  # every query head
    # est_ij - q_i.k_j is constant along each row, up to the e4m3 rounding of the codes (rms).
    b, t0, n = 3, int(qsl[3]), CHUNKS[3][1]
    keys = cache[tables[b, : -(-int(seq_lens[b]) // 16)].long(), :, 0].permute(1, 0, 2, 3).reshape(hkv, -1, 64)
    keys = keys[:, : int(seq_lens[b])].repeat_interleave(group, 0)  # [Hq, L, D]
    exact = torch.einsum("thd,hjd->htj", q[t0 : t0 + n], keys)
    codes = torch.einsum(
        "thd,hjd->htj",
        ref.q_code[t0 : t0 + n].float(),
        ref.k_code[b].float().repeat_interleave(group, 0)[:, : int(seq_lens[b])],
    )
    est = (
        codes
        * ref.k_scale[b].repeat_interleave(group, 0)[:, None, : int(seq_lens[b])]
        * ref.q_scale[t0 : t0 + n].T[:, :, None]
        + ref.qmk[b][:, None, : int(seq_lens[b])]
    )
    diff = est - exact
    spread = (diff - diff.mean(-1, keepdim=True)).pow(2).mean().sqrt()  # e4m3: a few % of each code
    assert spread < 0.05 * exact.std(), (spread, exact.std())


def test_key_groups_keep_each_keys_own_codes():
    """Keys quantized at their group's shared power-of-two scale dequantize to exactly what each key's own
    power-of-two scale gives, but for elements below e4m3's normal range (which move by at most half of its
    smallest step): the shared scale changes no rounding that matters."""
    torch.manual_seed(7)
    b, h, length, d, group_rows = 2, 3, 96, 64, 32
    kt = torch.randn(b, h, length, d) * torch.exp2(torch.randint(-4, 5, (b, h, length, 1)).float())
    kt[:, :, 5] = 0.0  # a zero row: never a group's largest
    valid = torch.arange(length)[None, :] < torch.tensor([[90], [96]])
    kt = torch.where(valid[:, None, :, None], kt, 0.0)
    code, scale = quantize_keys_ref(kt, valid, group_rows)
    e = pow2_exponent_ref(kt.abs().amax(-1)).clamp_min(-126)[..., None].float()
    own = (kt / torch.exp2(e)).to(torch.float8_e4m3fn).float() * torch.exp2(e)  # each key at its own scale
    assert (own.abs().amax(-1) <= 448 * torch.exp2(e[..., 0])).all()
    shared = code.float() * scale[..., None]
    assert (scale[:, :, :group_rows] == scale[:, :, :1]).all()  # one scale a group
    normal = (own / scale[..., None]).abs() >= 2.0**-6  # the key's own code, shifted: still a normal e4m3
    assert normal.float().mean() > 0.9
    assert torch.equal(shared[normal], own[normal])
    assert ((shared - own).abs() <= 2.0**-10 * scale[..., None])[~normal].all()
    assert (code.float()[~valid[:, None].expand(b, h, length)] == 0).all()


def test_quantize_with_tables_as_wide_as_the_context(triton_backends):
    """Block tables cover max_seq_len, not the key tiles rounded up past it (what the engine passes): the codes
    equal those from wider tables (the reference bit for bit; the kernel, whose per-sequence means are reduced
    in splits that follow the table's width, up to float rounding; on CUDA the reference's own reductions too, as
    torch picks its reduction order by shape)."""
    layout = TileLayout(q_tile=16, k_tile=64)
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks([(50, 20), (0, 40)], 4, 2, 32, 16, torch.float32)
    narrow = tables[:, : -(-max_s // 16)]  # 5 blocks: 80 positions, the key tiles 128
    for exact, quantize in (
        (True, lambda t: quantize_qk_ref(q, cache, t, seq_lens, qsl, max_s, layout)),
        (False, lambda t: quantize_qk_triton(q, cache, t.contiguous(), seq_lens, qsl, max_q, max_s, layout)),
    ):
        for got, want in zip(quantize(narrow), quantize(tables)):
            if exact and got.device.type == "cpu":
                assert torch.equal(got.float(), want.float())
            elif got.dtype.itemsize == 1:  # fp8 codes: a rounding may move one code a step
                assert (got.float() != want.float()).float().mean() < 1e-2
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)


SELECT_CASES = [  # (hq, hkv, d, bs, layout)
    (4, 4, 64, 16, TileLayout(q_tile=16, k_tile=16, sink=1, local=1)),
    (8, 2, 128, 32, TileLayout(q_tile=16, k_tile=16, sink=1, local=2)),
    pytest.param(9, 3, 64, 16, TileLayout(q_tile=16, k_tile=16, sink=1, local=1), id="group3-9q3kv"),
    pytest.param(10, 2, 32, 16, TileLayout(q_tile=16, k_tile=16, sink=1, local=2), id="group5-10q2kv"),
]


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv,d,bs,layout", SELECT_CASES)
def test_select_kernel(triton_backends, hq, hkv, d, bs, layout):
    """Stage 2 on the same codes: the kernel's mask equals the reference's wherever the decision is further than
    MARGIN from its threshold (and the lists and counts with it); threshold 0 keeps every tile, a large one only
    the forced tiles, per-head middle values something between; a streaming head keeps only forced tiles."""
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks(CHUNKS, hq, hkv, d, bs, torch.float32, seed=5)
    scale = d**-0.5
    codes = quantize_qk_ref(q, cache, tables, seq_lens, qsl, max_s, layout)
    n_qt, n_kt = layout.num_q_tiles(max_q), layout.num_k_tiles(max_s)
    forced, middle = tile_classes(seq_lens, qsl, n_qt, n_kt, layout)
    streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
    streaming[0] = True
    mids = torch.tensor([0.2, 0.3, 0.5, 0.3, 0.25, 0.4, 0.3, 0.5] * 2, device=DEV)[:hq]
    densities = {}
    # The default launch and another (one key tile a step), alternating over the cases.
    config = TileSelectConfig() if hq % 4 == 0 else TileSelectConfig(chunk=1, num_warps=4)
    for name, thr in (("zero", torch.zeros(hq, device=DEV)), ("mid", mids), ("large", torch.full((hq,), 1e4))):
        args = (codes, seq_lens, qsl, scale, max_q, max_s, layout, thr, streaming)
        mask_r, index_r, count_r, margin = select_tiles_ref(*args, with_margin=True)
        mask, index, count = select_tiles_triton(*args, config=config)
        near = torch.isfinite(margin) & (margin.abs() < MARGIN)
        assert near.float().mean() < 0.02
        assert torch.equal(mask[~near], mask_r[~near])
        if not near.any():
            assert torch.equal(count, count_r)
            used = torch.arange(n_kt, device=DEV) < count[..., None]
            assert torch.equal(index[used], index_r[used])
        assert torch.equal(mask[:, 0].bool(), forced)  # the streaming head
        others = mask[:, 1:].bool()
        assert not (others & ~(forced | middle)[:, None]).any()
        densities[name] = (others & middle[:, None]).sum().item() / (middle.sum().item() * (hkv - 1))
    assert densities["zero"] == 1.0 and densities["large"] == 0.0
    assert 0.05 < densities["mid"] < 0.95, densities


def test_relative_score_picks_the_heavy_tile():
    """The reference's semantics on a planted pattern: a query tile whose queries align with one far key tile
    keeps that tile at thresholds where it keeps almost nothing else."""
    layout = TileLayout(q_tile=16, k_tile=16, sink=1, local=1)
    hq, hkv, d, bs = 2, 1, 64, 16
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks([(160, 16)], hq, hkv, d, bs, torch.float32, seed=6)
    u = torch.randn(d, device=DEV)
    u /= u.norm()
    q[:] = 0.25 * q + 2 * u  # every query leans towards u; the random keys' logits spread by ~0.3
    far_block = int(tables[0, 3])  # key tile 3 (tokens 48..63): the needle, ~5 logits above the rest
    cache[far_block, :, 0] += 20 * u
    for thr in (0.3, 1.0):
        mask, _, _ = sale_select(
            q, cache, tables, seq_lens, qsl, d**-0.5, max_q, max_s, layout, torch.full((hq,), thr, device=DEV)
        )
        _, middle = tile_classes(seq_lens, qsl, 1, layout.num_k_tiles(max_s), layout)
        kept = torch.nonzero(mask[0, 0, 0].bool() & middle[0, 0]).flatten().tolist()
        assert kept == [3], (thr, kept)


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv", [(8, 2), pytest.param(9, 3, id="group3-9q3kv")])
def test_dense_when_threshold_zero(triton_backends, hq, hkv):
    """Threshold 0: the selection keeps every tile and sparse prefill equals dense prefill (the paged prefill
    kernel and the reference), with and without the lists."""
    d, bs = 64, 16
    layout = TileLayout(q_tile=16, k_tile=32, sink=1, local=1)
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks(CHUNKS, hq, hkv, d, bs, torch.float32, seed=7)
    scale = d**-0.5
    mask, index, count = sale_select(
        q,
        cache,
        tables,
        seq_lens,
        qsl,
        scale,
        max_q,
        max_s,
        layout,
        torch.zeros(hq, device=DEV),
        config=TileSelectConfig(quant_tok=64),
    )
    forced, middle = tile_classes(seq_lens, qsl, mask.shape[2], mask.shape[3], layout)
    assert torch.equal(mask.bool(), (forced | middle)[:, None].expand_as(mask))
    args = (q, cache, tables, seq_lens, qsl, scale, max_q, max_s, layout)
    cfg = SparsePrefillConfig(64, 32, 4, 2)
    sparse = sparse_prefill(*args, index, count, config=cfg)
    dense = paged_prefill_triton(
        q, cache, tables, seq_lens, qsl, scale, max_q, config=PrefillConfig(block_m=64, block_n=32)
    )
    ref = dense_ref(*args[:5], max_q, max_s, scale)
    assert rel_err(sparse, ref) < TOL[torch.float32]
    assert rel_err(sparse, dense) < TOL[torch.float32]
    assert rel_err(sparse_prefill(*args, config=cfg), ref) < TOL[torch.float32]


def test_streaming_heads_see_only_sink_and_local(triton_backends):
    """A streaming head's queries attend exactly the sink tiles and the keys from their tile's local window on,
    checked against attention with that token mask written out here."""
    hq, hkv, d, bs = 4, 2, 64, 16
    layout = TileLayout(q_tile=16, k_tile=16, sink=1, local=1)
    chunks = [(118, 33), (0, 40)]
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks(chunks, hq, hkv, d, bs, torch.float32, seed=8)
    scale = d**-0.5
    streaming = torch.tensor([True, False], device=DEV)
    out = sparse_prefill(
        q,
        cache,
        tables,
        seq_lens,
        qsl,
        scale,
        max_q,
        max_s,
        layout,
        streaming=streaming,
        config=SparsePrefillConfig(32, 16, 4, 2),
    )
    full = dense_ref(q, cache, tables, seq_lens, qsl, max_q, max_s, scale)
    assert rel_err(out[:, 2:], full[:, 2:]) < TOL[torch.float32]  # the other KV head stays dense
    for b, (prefix, n) in enumerate(chunks):
        ctx = prefix + n
        kv = cache[tables[b, : -(-ctx // bs)].long(), 0]  # KV head 0: [blocks, 2, bs, D]
        k, v = (kv[:, i].reshape(-1, d)[:ctx] for i in (0, 1))
        for i in range(n):
            pos = prefix + i
            lo = max((prefix + i // 16 * 16) // 16 - 1, 0)  # local window of the query's tile
            keys = torch.arange(ctx, device=DEV)
            seen = ((keys < 16 * min(1, lo)) | (keys >= 16 * lo)) & (keys <= pos)
            for h in (0, 1):
                s = (k @ q[int(qsl[b]) + i, h]) * scale
                p = torch.softmax(s.masked_fill(~seen, float("-inf")), 0)
                torch.testing.assert_close(out[int(qsl[b]) + i, h], p @ v, atol=1e-5, rtol=1e-4)


def test_bad_inputs():
    with pytest.raises(ValueError, match="power of two"):
        TileLayout(q_tile=24)
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks([(0, 5)], 4, 2, 16, 16, torch.float32)
    layout = TileLayout(q_tile=16, k_tile=16)
    with pytest.raises(ValueError, match="thresholds"):
        sale_select(q, cache, tables, seq_lens, qsl, 0.25, max_q, max_s, layout, torch.zeros(2))
    with pytest.raises(ValueError, match="together"):
        sparse_prefill(
            q,
            cache,
            tables,
            seq_lens,
            qsl,
            0.25,
            max_q,
            max_s,
            layout,
            kv_index=torch.zeros(1, 2, 1, 1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="do not match"):
        sparse_prefill(
            q,
            cache,
            tables,
            seq_lens,
            qsl,
            0.25,
            max_q,
            max_s,
            layout,
            torch.zeros(1, 1, 1, 1, dtype=torch.int32),
            torch.zeros(1, 1, 1, dtype=torch.int32),
        )


@gpu_only
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 4, 128), pytest.param(9, 3, 64, id="group3-smollm2")])
def test_gpu_long_chunks_bf16(hq, hkv, d):
    """bf16 on the GPU at realistic tiles (64 x 64, default configs): selection kernel vs reference on the same
    codes, sparse attention vs reference on its lists, and threshold 0 against the dense prefill kernel."""
    bs = 32
    layout = TileLayout()
    chunks = [(0, 1500), (2048, 1024), (333, 700)]
    q, cache, tables, seq_lens, qsl, max_q, max_s = make_chunks(chunks, hq, hkv, d, bs, torch.bfloat16, seed=9)
    scale = d**-0.5
    codes_ref = quantize_qk_ref(q, cache, tables, seq_lens, qsl, max_s, layout)
    codes = quantize_qk_triton(q, cache, tables, seq_lens, qsl, max_q, max_s, layout)
    for got, ref in ((codes.q_code, codes_ref.q_code), (codes.k_code, codes_ref.k_code)):
        assert (got.float() != ref.float()).float().mean() < 1e-3
    thr = torch.logspace(-3, 0, hq, device=DEV)
    args = (codes_ref, seq_lens, qsl, scale, max_q, max_s, layout, thr)
    mask_r, _, _, margin = select_tiles_ref(*args, with_margin=True)
    mask, index, count = select_tiles_triton(*args)
    near = torch.isfinite(margin) & (margin.abs() < 1e-2)  # the fp8 dot accumulates in another order
    assert torch.equal(mask[~near], mask_r[~near])
    out = sparse_prefill(q, cache, tables, seq_lens, qsl, scale, max_q, max_s, layout, index, count)
    ref = sparse_prefill_ref(q, cache, tables, seq_lens, qsl, scale, max_q, max_s, layout, index, count)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    _, index0, count0 = sale_select(
        q, cache, tables, seq_lens, qsl, scale, max_q, max_s, layout, torch.zeros(hq, device=DEV)
    )
    sparse = sparse_prefill(q, cache, tables, seq_lens, qsl, scale, max_q, max_s, layout, index0, count0)
    dense = paged_prefill(q, cache, tables, seq_lens, qsl, scale, max_q)
    assert rel_err(sparse, dense) < TOL[torch.bfloat16]
