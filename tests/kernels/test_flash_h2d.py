"""FlashH2D and the write-through (kernels/flash_h2d.py) against their torch references, FlashD2H, and the sparse
decode path reading through HBM pool slots against the one without offload (TRITON_INTERPRET on CPU, small
shapes)."""

from __future__ import annotations

import pytest
import torch

from sparseserve.attention.sparse import SparseStepMeta
from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.flash_h2d import flash_h2d_ref, flash_h2d_triton, write_through_ref, write_through_triton
from sparseserve.kernels.key_meta import rebuild_key_meta
from sparseserve.kernels.sparse_decode import listed_rows, sparse_decode_ref
from sparseserve.kvcache.host import HostKVStore, LayerD2H
from sparseserve.kvcache.layout import OffloadLayout
from tests.conftest import offload_lag
from sparseserve.kvcache.offload import OffloadCache, OffloadStep
from sparseserve.kvcache.pool import HBMPool
from tests.attention.test_sparse_backend import sparse_backend, with_slots
from tests.kernel_utils import DEVICE, ON_GPU, gpu_only, rel_err
from tests.kernels.test_sparse_kernels import decode_batch


def offload_cache(host: HostKVStore, pool: HBMPool, num_blocks: int, local: int = 2) -> OffloadCache:
    """An offload cache around a given store and pool for a one-layer backend test: every layer sparse, the
    device cache the test's own (its step addressing is the token addressing)."""
    bs, d = host.block_size, host.data.shape[-1]
    layout = OffloadLayout(
        num_blocks, num_blocks, num_blocks, pool.num_slots, 0, 0, 0, 2 * bs * d * host.data.element_size()
    )
    cache = OffloadCache(layout, host, pool, [], bs, local, None)
    cache.row_of.copy_(torch.arange(num_blocks + 1))  # device rows = token blocks
    return cache


@pytest.mark.parametrize(
    "dtype, bs, d, hkv",
    [(torch.float32, 4, 16, 2), (torch.float16, 8, 64, 2), pytest.param(torch.float32, 8, 64, 3, id="group-3kv")],
)
def test_flash_h2d_matches_gather(dtype, bs, d, hkv):
    torch.manual_seed(0)
    layers, blocks = 2, 6
    host = HostKVStore(layers, blocks, hkv, bs, d, dtype, pin=ON_GPU)
    host.data.copy_(torch.randn(host.data.shape).to(dtype))
    ref = HBMPool(layers, blocks, hkv, bs, d, num_slots=8, dtype=dtype, device=DEVICE, ways=4)
    out = HBMPool(layers, blocks, hkv, bs, d, num_slots=8, dtype=dtype, device=DEVICE, ways=4)
    out.slots.copy_(ref.slots)
    req = torch.tensor([[0, 3, -1], [5, 1, 2], [4, -1, -1]][:hkv], device=DEVICE)  # [Hkv, K] token blocks, -1: none
    key = ref.keys(1, req).reshape(-1)
    loc, load = ref.plan(key)
    assert (load >= 0).sum().item() == (req >= 0).sum().item()  # all misses, all placed (2 sets of 4 ways)
    flash_h2d_ref(host.flat(), ref.slots, key, load)
    flash_h2d_triton(host.flat(), out.slots, key, load)
    n = ref.num_slots
    assert torch.equal(out.slots[:n], ref.slots[:n])
    for k, slot in zip(key.tolist(), loc.tolist()):
        if slot >= 0:
            assert torch.equal(out.slots[slot].cpu(), host.flat()[k])


@pytest.mark.parametrize(
    "block, chunk, per_sm", [(4, 4096, 1.0), (64, 4096, 1.0), (64, 64, 1.0), (4, 4096, 0.25), (512, 4096, 0.25)]
)
def test_flash_h2d_few_loads_among_many_requests(block, chunk, per_sm):
    """A decode step's shape: many requests, few of them loading, some repeats (load -2) and padding; each
    program walks several blocks of requests (block 4), or finds several loads in one block (64), copying
    several head blocks at once, each whole or in chunks (chunk 64: two); a grid of a quarter of the SMs
    (per_sm 0.25, as the loads beside the layers take; block 512: one block holds every request): the slots
    equal the gather's, every repeat reads its key's slot, and a repeat of a key without one keeps its loc."""
    g = torch.Generator().manual_seed(block)
    rows, num_slots, n = 50, 24, 300
    host = torch.randn(rows, 2, 4, 16, generator=g)
    host = host.pin_memory() if ON_GPU else host
    key = torch.randint(0, rows, (n,), generator=g)
    load = torch.full((n,), -1, dtype=torch.int64)
    pos = torch.randperm(n, generator=g)
    load[pos[:num_slots]] = torch.randperm(num_slots, generator=g)  # 24 loads into distinct slots
    load[pos[num_slots : num_slots + 30]] = -2  # repeats
    resident = torch.randint(-1, num_slots, (rows + 1,), generator=g)  # -1: a bypassed key
    slots = torch.randn(num_slots + 1, 2, 4, 16, generator=g)
    want_slots, want_loc = slots.clone(), torch.full((n,), -7, dtype=torch.int64)
    flash_h2d_ref(host, want_slots, key, load)
    rep = (load == -2) & (resident[key] >= 0)
    want_loc[rep] = resident[key[rep]]
    got_slots, loc = slots.to(DEVICE), torch.full((n,), -7, dtype=torch.int64, device=DEVICE)
    flash_h2d_triton(
        host,
        got_slots,
        key.to(DEVICE),
        load.to(DEVICE),
        chunk=chunk,
        repeats=(resident.to(DEVICE), loc),
        block=block,
        programs_per_sm=per_sm,
    )
    assert torch.equal(got_slots.cpu(), want_slots)
    assert torch.equal(loc.cpu(), want_loc)


@pytest.mark.parametrize("block, per_sm", [(4, 0.25), (16, 1.0)])
def test_flash_h2d_counted_list(block, per_sm):
    """The loads beside the layers (kvcache/offload.py load_lagged): a compact list whose first `count` entries
    load (a device count); the entries after it, valid-looking loads included, copy nothing. The slots equal
    the reference's, which the count bounds the same way."""
    g = torch.Generator().manual_seed(block)
    rows, num_slots, n, count = 50, 40, 120, 37
    host = torch.randn(rows, 2, 4, 16, generator=g)
    host = host.pin_memory() if ON_GPU else host
    key = torch.randint(0, rows, (n,), generator=g)
    load = torch.randint(0, num_slots, (n,), generator=g)  # past the count: stale entries of any value
    load[:count] = torch.randperm(num_slots, generator=g)[:count]
    slots = torch.randn(num_slots + 1, 2, 4, 16, generator=g)
    want = slots.clone()
    flash_h2d_ref(host, want, key, load, torch.tensor([count], dtype=torch.int32))
    changed = (want != slots).flatten(1).any(1)
    assert torch.equal(changed.nonzero()[:, 0].sort().values, load[:count].sort().values)
    got = slots.to(DEVICE)
    count_dev = torch.tensor([count], dtype=torch.int32, device=DEVICE)
    flash_h2d_triton(host, got, key.to(DEVICE), load.to(DEVICE), block=block, programs_per_sm=per_sm, count=count_dev)
    assert torch.equal(got.cpu(), want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, budget, slots, hq, hkv",
    [("topk", 64, 8, 8, 2), ("topp", 96, 64, 8, 2), pytest.param("topk", 64, 8, 9, 3, id="group3-9q3kv")],
)
def test_sparse_decode_through_pool(policy, budget, slots, hq, hkv):
    """Decode steps through SparseBackend with KV offload on the torch and the Triton path (scoring,
    selection, pool plan, FlashH2D, the sparse kernel reading slots / host rows / the window): both equal
    the backend without offload, although every block outside the local windows is poisoned in the
    device cache of the offload runs. 8 slots: evictions and bypass reads; 64: hits. topp's candidates go
    through the pool, its prune reads their keys there (the host: only what bypasses it), the attention the
    kept entries; topk's lists go through it once."""
    torch.manual_seed(4)
    d, bs = 32, 16
    q, cache, meta = decode_batch([0, 150, 70, 33], hq, hkv, d, bs, torch.float32, slack=bs)
    k, v = torch.randn(meta.num_seqs, hkv, d, device=DEVICE), torch.randn(meta.num_seqs, hkv, d, device=DEVICE)
    lens = meta.seq_lens.tolist()
    meta.slot_mapping = torch.tensor(
        [-1] + [int(meta.block_tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens) if b > 0],
        device=DEVICE,
    )
    poisoned = cache.clone()
    for b, n in enumerate(lens):
        for j in range(max(0, -(-n // bs) - 2)):  # local window: the last 2 blocks
            poisoned[int(meta.block_tables[b, j])] = float("nan")
    outs, stats = [], []
    for impl, offload in (("torch", False), ("torch", True), ("triton", True)):
        # lists shrink: fewer entries read (every list pruned, even where random keys make its estimate flat)
        prune = {"sparse_top_p": 0.5, "sparse_topp_flat_share": 1.0} if policy == "topp" else {}
        backend = sparse_backend(policy, budget, bs, hkv, d, torch.float32, cache.shape[0], **prune)
        c = cache.clone()
        with_slots(meta)
        if offload:
            host = HostKVStore(1, cache.shape[0], hkv, bs, d, torch.float32, pin=ON_GPU, device=DEVICE)
            host.data[0, : cache.shape[0]] = cache.to(host.data.device)  # every block written through before
            pool = HBMPool(1, cache.shape[0], hkv, bs, d, slots, torch.float32, DEVICE, ways=4)
            oc = offload_cache(host, pool, cache.shape[0])
            backend.allocate(cache.shape[0], oc)
            # the test's device cache holds every block under its token id: the same addressing
            meta.backend_meta = SparseStepMeta(
                meta.backend_meta.slots, meta, OffloadStep(meta.slot_mapping, meta.block_tables)
            )
            c = poisoned.clone()
        rebuild_key_meta(cache[None], backend.key_meta.codes, backend.key_meta.scale, bs)
        with forced(impl):
            outs.append([backend.forward(0, q, k, v, c, meta, d**-0.5) for _ in range(3)])
        if offload:
            pool.check()
            stats.append(pool.stats.tolist())
            # the pool saw each step's lists once: topk's whole, topp's candidates before the prune shrank them
            rows = backend.state.sel[0][meta.backend_meta.slots.long()]
            listed = int(listed_rows(rows, meta.seq_lens, backend.params.local, bs).sum())
            assert sum(stats[-1][:3]) == 3 * listed if policy == "topk" else sum(stats[-1][:3]) > 3 * listed
            assert int(oc.prune_key_reads[0]) <= stats[-1][2]  # keys from the host: bypassed candidates only
    for step in range(3):
        assert torch.equal(outs[1][step], outs[0][step])
        assert torch.isfinite(outs[2][step]).all() and rel_err(outs[2][step], outs[0][step]) < 1e-5
    assert stats[0] == stats[1]  # the same plan on both paths
    hits, loads, bypass, _ = stats[0]
    assert loads > 0 and (bypass > 0 if slots == 8 else hits > 0)


@pytest.mark.parametrize("remap", [False, True])
def test_d2h_writer_stores_completed_blocks(remap):
    """FlashD2H (one staged copy per layer, worker threads write rows) stores exactly the blocks that the
    prefill tokens complete, at their host rows (the same ids, or token_slot_mapping's when the device
    cache uses other ids); partial blocks and padding store nothing; decode tokens take the write-through
    kernel; fence waits for the workers. Equal to the write-through reference."""
    torch.manual_seed(2)
    layers, blocks, hkv, bs, d = 2, 6, 2, 4, 8
    cache = torch.randn(layers, blocks, hkv, 2, bs, d, device=DEVICE)
    # decode token completing block 5, then prefill tokens: block 1 whole, block 3 partly, padding, block 0 end.
    slots = torch.tensor([23, 4, 5, 6, 7, 12, 13, -1, 2, 3], device=DEVICE)
    perm = torch.tensor([3, 0, 5, 4, 1, 2], device=DEVICE)  # device block -> host row
    token_slots = torch.where(slots >= 0, perm[slots // bs] * bs + slots % bs, -1) if remap else None
    out = HostKVStore(layers, blocks, hkv, bs, d, torch.float32, pin=ON_GPU, device=DEVICE)
    out.attach_d2h(max_tokens=16, max_seqs=4)
    ref = HostKVStore(layers, blocks, hkv, bs, d, torch.float32, pin=False)
    for layer in range(layers):
        out.store_step(layer, cache[layer], slots, num_decode_tokens=1, num_seqs=4, token_slot_mapping=token_slots)
        write_through_ref(
            cache[layer].cpu(), ref.data[layer], slots.cpu(), None if token_slots is None else token_slots.cpu()
        )
    out.fence()
    assert torch.equal(out.data, ref.data)
    rows = perm[[5, 1, 0]].tolist() if remap else [5, 1, 0]
    assert torch.equal(out.data[:, rows], cache[:, [5, 1, 0]].cpu())
    assert not out.data[:, [r for r in range(blocks) if r not in rows]].any()
    assert out.bytes_written() == 3 * layers * hkv * 2 * bs * d * 4


def test_layer_d2h_writes_runs_of_rows():
    """Layer-segmented prefill's FlashD2H (one copy per run of consecutive host rows, no staging) puts
    each scratch block at its row of the given layer and nothing anywhere else; fence(host=True) makes
    the rows readable on the CPU; the returned event (GPU) orders the scratch's reuse."""
    torch.manual_seed(3)
    layers, blocks, hkv, bs, d = 3, 12, 2, 4, 8
    store = HostKVStore(layers, blocks, hkv, bs, d, torch.float32, pin=ON_GPU, device=DEVICE)
    store.layer_d2h = LayerD2H(store)
    rows = torch.tensor([4, 5, 6, 0, 9, 10, 2])  # runs [4, 7), [0, 1), [9, 11), [2, 3)
    src = torch.randn(len(rows), hkv, 2, bs, d, device=DEVICE)
    event = store.layer_d2h.submit(1, src, rows)
    assert (event is None) == (not ON_GPU)
    assert store.layer_d2h.submit(2, src[:0], rows[:0]) is None  # nothing to write
    store.fence(host=True)
    expect = torch.zeros_like(store.data)
    expect[1, rows] = src.cpu()
    assert torch.equal(store.data, expect)
    assert store.d2h_blocks_written() == len(rows)


@gpu_only
def test_layer_d2h_fence_skipped_while_held():
    """While the prefill that wrote them is in progress (`held`) a step's fence leaves its copies pending; a host
    fence waits for them anyway, and once released the next fence takes them."""
    store = HostKVStore(2, 8, 1, 4, 8, torch.float32, device=DEVICE)
    store.layer_d2h = LayerD2H(store)
    src = torch.randn(3, 1, 2, 4, 8, device=DEVICE)
    store.layer_d2h.submit(0, src, torch.tensor([1, 2, 3]))
    store.layer_d2h.held = True
    store.fence()
    assert store.layer_d2h.last is not None
    store.layer_d2h.held = False
    store.fence()
    assert store.layer_d2h.last is None
    store.layer_d2h.submit(1, src, torch.tensor([4, 5, 6]))
    store.layer_d2h.held = True
    store.fence(host=True)
    assert store.layer_d2h.last is None and torch.equal(store.data[1, 4:7], src.cpu())


def test_flash_h2d_saves_to_the_pinned_host_with_the_kernel(monkeypatch):
    """A save (device rows -> the pinned host store: KV offload's tail and row saves) runs the Triton kernel over
    UVA on a GPU; the reference there went through pageable memory and blocked the host. Exactly the listed rows
    are written; a load of -1 writes nothing."""
    import sparseserve.kernels.flash_h2d as fh

    calls = []
    kernel = fh.flash_h2d_triton
    monkeypatch.setattr(fh, "flash_h2d_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    torch.manual_seed(4)
    src = torch.randn(6, 2, 4, 8, device=DEVICE)
    store = HostKVStore(1, 9, 1, 4, 8, torch.float32, pin=ON_GPU)
    dst = store.flat()
    key = torch.tensor([5, 0, 3, 2], device=DEVICE)
    load = torch.tensor([1, 7, -1, 4], device=DEVICE)
    fh.flash_h2d(src, dst, key, load)
    if ON_GPU:
        torch.cuda.synchronize()
    expect = torch.zeros_like(dst)
    expect[[1, 7, 4]] = src[[5, 0, 2]].cpu()
    assert torch.equal(dst, expect)
    assert len(calls) == int(ON_GPU)


@pytest.mark.parametrize(
    "dtype, hkv", [(torch.float32, 2), (torch.float16, 2), pytest.param(torch.float32, 3, id="group-3kv")]
)
def test_write_through_matches_reference(dtype, hkv):
    """Tokens that complete a block copy that block (all KV heads) to the host store; others, padding
    (-1) and partial blocks copy nothing."""
    torch.manual_seed(1)
    layers, blocks, bs, d = 2, 7, 4, 8
    cache = torch.randn(layers, blocks, hkv, 2, bs, d, device=DEVICE).to(dtype)
    slots = torch.tensor([3, -1, 5, 6, 7, 11, 12, 27, 19], device=DEVICE)  # ends: blocks 0, 1, 2, 6, 4
    ref = HostKVStore(layers, blocks, hkv, bs, d, dtype, pin=False)
    out = HostKVStore(layers, blocks, hkv, bs, d, dtype, pin=ON_GPU)
    with forced("torch"):
        ref.write_through(1, cache[1].cpu(), slots.cpu())
    write_through_triton(cache[1], out.data[1], slots)
    assert torch.equal(out.data[:, :blocks], ref.data[:, :blocks])
    written = sorted({b for b in (0, 1, 2, 6, 4)})
    assert torch.equal(ref.data[1, written], cache[1, written].cpu()) and ref.blocks_written.item() == 5
    assert not ref.data[0].any() and not ref.data[1, [3, 5]].any()


@gpu_only
def test_offload_decode_cuda_graph():
    """The offloaded sparse decode (scoring, selection, pool plan, FlashH2D from the pinned store over UVA, the
    kernel through slots) captured in a CUDA graph and replayed with new queries, against the plain reference on
    the lists it left; the device cache is poisoned outside the local windows, so every listed block must come
    through the pool."""
    torch.manual_seed(5)
    hq, hkv, d, bs, lens = 32, 8, 128, 32, [16384, 9000, 0, 2047]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, torch.bfloat16)
    backend = sparse_backend("topk", 1024, bs, hkv, d, torch.bfloat16, cache.shape[0])
    host = HostKVStore(1, cache.shape[0], hkv, bs, d, torch.bfloat16, pin=True, device=DEVICE)
    assert host.data.is_pinned()
    host.data[0, : cache.shape[0]] = cache.cpu()
    pool = HBMPool(1, cache.shape[0], hkv, bs, d, 256, torch.bfloat16, DEVICE)  # < one step's 3 x 8 x 32 lists
    backend.allocate(cache.shape[0], offload_cache(host, pool, cache.shape[0]))
    rebuild_key_meta(cache[None], backend.key_meta.codes, backend.key_meta.scale, bs)
    poisoned = cache.clone()
    for b, n in enumerate(lens):
        poisoned[meta.block_tables[b, : max(0, -(-n // bs) - 2)].long()] = float("nan")
    sm = SparseStepMeta(with_slots(meta).backend_meta.slots, meta, OffloadStep(meta.slot_mapping, meta.block_tables))
    meta.backend_meta = sm
    backend.attend(0, q, poisoned, meta, d**-0.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(0, q, poisoned, meta, d**-0.5)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, backend.state.sel[0], sm.slots, 2, d**-0.5)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2, step
    pool.check()
    hits, loads, bypass, steps = pool.stats.tolist()
    assert steps == 4 and loads > 0  # the warm-up call and 3 replays (capturing executes nothing)


@gpu_only
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize(
    "policy",
    [
        dict(sparse_lag=0),
        # topp always pruning (sparse_topp_flat_share 1: random weights' lists would be flagged flat, unpruned)
        dict(sparse_policy="topp", sparse_top_p=0.7, sparse_budget=64, sparse_reuse=2, sparse_topp_flat_share=1.0),
        dict(sparse_policy="topp", sparse_top_p=0.7, sparse_budget=64, sparse_lag=1, sparse_topp_flat_share=1.0),
        dict(sparse_policy="topp", sparse_top_p=0.7, sparse_budget=64, sparse_topp_flat_share=1.0, offload_prefetch=1),
        # flat lists flagged and held two steps (the held rows' selection programs return at once), prefetching
        # reads (plain reads refuse a hold)
        dict(sparse_policy="topp", sparse_top_p=0.7, sparse_budget=64, sparse_topp_flat_hold=2, offload_prefetch=1),
        dict(),
    ],
)
def test_engine_offload_equals_no_offload_on_gpu(hf_models, enforce_eager, policy):
    """On the GPU (Triton kernels, pinned store over UVA, CUDA graphs unless eager): offload on == off,
    token for token, under the same sparse policy (topk; topp pruning through the pool, with reuse, and with KV
    offload's default lagged selection, and with prefetching reads (the side stream loads the previous step's
    candidates), flat lists held (prefetching reads); topk lagged: the pool reads the next lists a step
    ahead on the side stream), with a roomy pool and with a 4-slot pool (the working-set limit off: evictions every
    step, bypass reads)."""
    from sparseserve import LLM
    from tests.kvcache.test_offload import GREEDY, SPARSE, prompts

    model_dir = hf_models["qwen2-gqa-bias"][0]
    policy = dict(policy)
    prefetch = policy.pop("offload_prefetch", False)  # the offloaded runs'
    common = offload_lag(  # the base selects as KV offload's default does (it lags with topk)
        {"offload_prefetch": prefetch},
        device="cuda",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory=64 << 20,
        enforce_eager=enforce_eager,
        **{**SPARSE, **policy},
    )

    def tokens(control: bool = True, **kw):
        llm = LLM(str(model_dir), **common, **kw)
        if not control:  # as tests/kvcache/test_offload.py's `run`: else a batch of one fits 4 slots
            llm.llm_engine.scheduler.working_set.ws.enabled = False
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        return outs, llm.llm_engine

    base, _ = tokens()
    for slots in (None, 4):
        got, engine = tokens(control=slots is None, kv_offload=True, hbm_cache_blocks=slots, offload_prefetch=prefetch)
        assert got == base, f"hbm_cache_blocks={slots}"
        stats = engine.get_stats(sync=True)  # the device counters of every step
        assert stats.offload_blocks_loaded > 0 and stats.num_blocks_used == 0
        assert slots is None or stats.offload_bypass_reads > 0
        engine.model_runner.offload.pool.check()
