"""Triton attention kernels against their torch references (store_kv, paged decode, paged prefill).

Without CUDA the kernels run on the CPU under the Triton interpreter (small shapes, CI); with CUDA the
same tests run on the GPU, plus larger shapes and a CUDA-graph replay check.
"""

from __future__ import annotations

import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata, attend_paged
from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.paged_decode import MERGE_TILE, DecodeConfig, paged_decode_ref, paged_decode_triton, split_plan
from sparseserve.kernels.paged_prefill import PrefillConfig, paged_prefill_ref, paged_prefill_triton
from sparseserve.kernels.store_kv import store_kv_ref, store_kv_triton
from tests.kernel_utils import ATTN_DTYPES, DEVICE, TOL, gpu_only, rel_err


def paged_attention_ref(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of every query token over its whole context, each one on its own, in float64: an
    independent check of the references and kernels (slow; small shapes only)."""
    out = torch.zeros_like(q, dtype=torch.float64)
    bs, hkv = cache.shape[3], cache.shape[1]
    group = q.shape[1] // hkv
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, n in enumerate(lens):
        ql = qsl[b + 1] - qsl[b]
        if n == 0:
            continue
        blocks = meta.block_tables[b, : -(-n // bs)].long()
        kv = cache[blocks].double().permute(2, 1, 0, 3, 4).reshape(2, hkv, -1, cache.shape[-1])[:, :, :n]
        k, v = kv[0].repeat_interleave(group, 0), kv[1].repeat_interleave(group, 0)
        for i in range(ql):
            pos = n - ql + i
            s = torch.einsum("hd,hkd->hk", q[qsl[b] + i].double(), k[:, : pos + 1]) * scale
            out[qsl[b] + i] = torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v[:, : pos + 1])
    return out.to(q.dtype)


def make_batch(
    decode_lens: list[int],
    prefills: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    slack: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random cache, queries and metadata: decodes of the given context lengths (0 = padding), then
    prefill chunks (prefix_len, q_len). Block ids are shuffled, table entries past a sequence's end
    are random valid ids (the kernels must not read them), max_seq_len exceeds the longest by `slack`."""
    seq_lens = decode_lens + [p + n for p, n in prefills]
    q_lens = [1] * len(decode_lens) + [n for _, n in prefills]
    max_seq_len = max(seq_lens) + slack
    width = -(-max_seq_len // bs)
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 3
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), dtype=torch.int32)
    ids = torch.randperm(num_blocks, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[start : start + n]
        start += n
    slots = []
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        for pos in range(n - ql, n):
            slots.append(int(tables[b, pos // bs]) * bs + pos % bs if pos >= 0 else -1)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        num_decodes=len(decode_lens),
        max_query_len=max(q_lens),
        max_seq_len=max_seq_len,
    )
    cache = torch.randn(num_blocks, hkv, 2, bs, d, device=DEVICE).to(dtype)
    q = torch.randn(len(slots), hq, d, device=DEVICE).to(dtype)
    return q, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,d,bs", [(2, 64, 16), (3, 48, 32), pytest.param(5, 64, 16, id="group-5kv")])
def test_store_kv(dtype, hkv, d, bs):
    torch.manual_seed(1)
    num_blocks, t = 6, 13
    slots = torch.randperm(num_blocks * bs, device=DEVICE)[:t]
    slots[[0, 5, 12]] = -1  # CUDA-graph padding rows
    # k and v as views into one projection output, as a fused QKV matmul leaves them.
    kv = torch.randn(t, 2 * hkv + 1, d, device=DEVICE).to(dtype)
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    ref = torch.randn(num_blocks, hkv, 2, bs, d, device=DEVICE).to(dtype)
    out = ref.clone()
    store_kv_ref(k, v, ref, slots)
    store_kv_triton(k, v, out, slots)
    assert torch.equal(out, ref)


DECODE_CASES = [  # (hq, hkv, d, bs, config)
    (4, 4, 64, 16, DecodeConfig(tile_n=16, target_programs=64)),  # MHA, many splits
    (8, 2, 64, 32, DecodeConfig(tile_n=16, target_programs=40)),  # GQA, tiles of half a block
    (6, 2, 32, 16, DecodeConfig(tile_n=32, target_programs=1)),  # group of 3, one split, 2 blocks a tile
    (8, 2, 64, 16, None),  # default launch plan
]
# GQA groups that are not powers of two (SmolLM2-135M: 9 query / 3 KV heads), padded to BLOCK_G rows in the kernel.
ODD_GROUP_DECODE_CASES = [
    pytest.param(9, 3, 64, 16, DecodeConfig(tile_n=16, target_programs=24), id="group3-9q3kv"),
    pytest.param(15, 3, 32, 16, DecodeConfig(tile_n=32, target_programs=1), id="group5-15q3kv"),
    pytest.param(7, 1, 64, 16, None, id="group7-7q1kv"),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs,config", DECODE_CASES + ODD_GROUP_DECODE_CASES)
def test_paged_decode(dtype, hq, hkv, d, bs, config):
    torch.manual_seed(2)
    lens = [0, 1, bs - 1, bs, 3 * bs + 5, 150]
    q, cache, meta = make_batch(lens, [], hq, hkv, d, bs, dtype, slack=2 * bs + 3)
    ref = paged_attention_ref(q, cache, meta, d**-0.5)
    torch_ref = paged_decode_ref(q, cache, meta.block_tables, meta.seq_lens, d**-0.5, meta.max_seq_len)
    assert rel_err(torch_ref, ref) < TOL[dtype]
    out = torch.full_like(q, float("nan"))
    paged_decode_triton(q, cache, meta.block_tables, meta.seq_lens, d**-0.5, meta.max_seq_len, out=out, config=config)
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[0]) == 0 == torch.count_nonzero(torch_ref[0])  # seq_len 0: zeros
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_paged_decode_merges_many_splits(dtype):
    """More splits than one merge tile (44 splits of 16 tokens: three tiles, the last partly used) and sequences
    that reach only a few of them."""
    torch.manual_seed(3)
    q, cache, meta = make_batch([0, 5, 700, 260], [], 6, 2, 32, 16, dtype, slack=16)
    ref = paged_attention_ref(q, cache, meta, 32**-0.5)
    out = torch.full_like(q, float("nan"))
    config = DecodeConfig(tile_n=16, target_programs=4096)
    assert split_plan(4, 2, meta.max_seq_len, q.device, config)[1] > 2 * MERGE_TILE
    paged_decode_triton(q, cache, meta.block_tables, meta.seq_lens, 32**-0.5, meta.max_seq_len, out=out, config=config)
    assert torch.count_nonzero(out[0]) == 0
    assert rel_err(out, ref) < TOL[dtype]


PREFILL_CASES = [  # (hq, hkv, d, bs, config)
    (4, 4, 64, 16, PrefillConfig(block_m=16, block_n=16)),
    (8, 2, 64, 32, PrefillConfig(block_m=32, block_n=16)),  # 8 queries x 4 heads a program
    (6, 2, 32, 16, PrefillConfig(block_m=32, block_n=32)),  # group of 3: 10 queries, 2 rows idle
]
ODD_GROUP_PREFILL_CASES = [  # rows r = query r // GROUP, head r % GROUP; the rows past BLOCK_Q * GROUP idle
    pytest.param(9, 3, 64, 16, None, id="group3-9q3kv"),  # default plan: 21 queries a program, 1 row idle
    pytest.param(15, 3, 32, 16, PrefillConfig(block_m=32, block_n=16), id="group5-15q3kv"),  # 6 queries, 2 idle
    pytest.param(7, 1, 64, 16, PrefillConfig(block_m=64, block_n=32), id="group7-7q1kv"),  # 9 queries, 1 idle
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs,config", PREFILL_CASES + ODD_GROUP_PREFILL_CASES)
def test_paged_prefill(dtype, hq, hkv, d, bs, config):
    torch.manual_seed(3)
    # A first chunk, chunks after a prefix (aligned or not), and a one-token chunk.
    prefills = [(0, 9), (37, 20), (2 * bs, 1), (3 * bs, 2 * bs + 5)]
    q, cache, meta = make_batch([], prefills, hq, hkv, d, bs, dtype, slack=5)
    ref = paged_attention_ref(q, cache, meta, d**-0.5)
    torch_ref = paged_prefill_ref(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5, meta.max_query_len
    )
    assert rel_err(torch_ref, ref) < TOL[dtype]
    out = torch.full_like(q, float("nan"))
    paged_prefill_triton(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        d**-0.5,
        meta.max_query_len,
        out=out,
        config=config,
    )
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


def test_prefill_ref_query_chunks(monkeypatch):
    """The reference's query chunking (bounded memory for long prompts) does not change its result."""
    import sparseserve.kernels.paged_prefill as pp

    torch.manual_seed(7)
    q, cache, meta = make_batch([], [(0, 40), (17, 23)], 4, 2, 16, 8, torch.float32)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25, meta.max_query_len)
    whole = paged_prefill_ref(*args)
    monkeypatch.setattr(pp, "_REF_SCORE_ELEMENTS", 4 * 40 * 3)  # chunks of 3 queries
    assert torch.allclose(paged_prefill_ref(*args), whole, atol=1e-6)


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), pytest.param(9, 3, id="group3-9q3kv")])
def test_backend_mixed_batch(dtype, hq, hkv):
    """Decodes (one of them padding) then prefill chunks, store_kv included, against TorchBackend."""
    torch.manual_seed(4)
    d, bs = 64, 16
    q, cache, meta = make_batch([40, 0, 17], [(0, 12), (21, 30), (33, 1)], hq, hkv, d, bs, dtype, slack=7)
    k = torch.randn(q.shape[0], hkv, d, device=DEVICE).to(dtype)
    v = torch.randn_like(k)
    ref_cache = cache.clone()
    with forced("torch"):
        store_kv_ref(k, v, ref_cache, meta.slot_mapping)
        ref = attend_paged(q, ref_cache, meta, d**-0.5)
    with forced("triton"):
        store_kv_triton(k, v, cache, meta.slot_mapping)
        out = attend_paged(q, cache, meta, d**-0.5)
    assert torch.equal(cache, ref_cache)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


@gpu_only
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,bs,d",
    [(32, 8, 32, 128), (32, 32, 16, 128), (28, 4, 64, 128), pytest.param(9, 3, 32, 64, id="group3-smollm2")],
)
def test_large_shapes_gpu(dtype, hq, hkv, bs, d):
    torch.manual_seed(5)
    decode_lens = [0, 1, 4099, 777, 2 * bs, 8191]
    q, cache, meta = make_batch(decode_lens, [(3000, 517), (0, 1024), (bs, 1)], hq, hkv, d, bs, dtype, slack=100)
    with forced("torch"):
        ref = attend_paged(q, cache, meta, d**-0.5)
    out = attend_paged(q, cache, meta, d**-0.5)
    nd = meta.num_decodes
    assert torch.isfinite(out).all()
    assert rel_err(out[:nd], ref[:nd]) < TOL[dtype]
    assert rel_err(out[nd:], ref[nd:]) < TOL[dtype]


@gpu_only
def test_decode_cuda_graph_replay():
    """One capture at a max_seq_len bound; replays with new seq_lens/tables must match the reference."""
    torch.manual_seed(6)
    hq, hkv, d, bs, batch, bound = 32, 8, 128, 32, 4, 4096
    q, cache, meta = make_batch([bound] * batch, [], hq, hkv, d, bs, torch.bfloat16)
    attend_paged(q, cache, meta, d**-0.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_paged(q, cache, meta, d**-0.5)
    for lens in ([4096, 1, 0, 2000], [33, 4000, 64, 1025]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        meta.block_tables.copy_(meta.block_tables[torch.randperm(batch, device=DEVICE)])
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        with forced("torch"):
            ref = attend_paged(q, cache, meta, d**-0.5)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2
