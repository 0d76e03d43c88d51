"""KV offload on the CPU (DESIGN.md principles 4, 5, 7): config and flags, the HBM pool's lookup and
victim choice on hand-built cases and random requests, the offloaded decode reference, the device block
map (the device KV cache holds only the working set), and the engine: offload on == offload off token
for token under the same sparse policy (also with a pool so small that nearly every step evicts, and a
device block space so small that sequences wait for it), with the accounting of token blocks, device
blocks and pool slots checked over random schedules."""

from __future__ import annotations

import os
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.config import EngineConfig
from sparseserve.engine.request import Sequence
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.flash_h2d import flash_h2d
from sparseserve.kernels.pool_plan import view_loc
from sparseserve.kernels.sparse_decode import read_listed_ref, sparse_decode_ref
from sparseserve.kvcache.device_space import DeviceBlockMap, StaleBlocks
from sparseserve.kvcache.host import HostKVStore
from sparseserve.kvcache.layout import WORKING_SET_LISTS, GiB, OffloadLayout
from sparseserve.kvcache.pool import HBMPool
from sparseserve.metrics import ServerMetrics, parse_metrics
from tests.engine.sched_utils import LastSchedule
from tests.kernel_utils import DEVICE
from tests.schedules import check_pool, drive_random_schedule, held_blocks
from tests.conftest import offload_lag

BS = 8
COMMON = dict(device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
SPARSE = dict(
    block_size=BS,
    sparse_policy="topk",
    sparse_budget=4 * BS,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
    sparse_dense_context=0,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (120, 75, 30)]


def test_config_flags_and_refusals(tiny_model_dir):
    cfg = EngineConfig.from_kwargs(kv_offload=True, host_kv_memory=1 << 20, hbm_cache_blocks=64, **SPARSE)
    assert cfg.offload_config.kv_offload and cfg.offload_config.hbm_cache_blocks == 64
    args = build_parser(["generate"]).parse_args(
        [
            "generate",
            "--kv-offload",
            "--host-kv-memory",
            "1048576",
            "--hbm-cache-blocks",
            "32",
            "--sparse-policy",
            "topk",
        ]
    )
    kw = engine_kwargs_from_args(args)
    assert kw["kv_offload"] is True and kw["host_kv_memory"] == 1 << 20 and kw["hbm_cache_blocks"] == 32
    with pytest.raises(ValueError, match="sparse decode policy"):
        EngineConfig.from_kwargs(kv_offload=True)
    with pytest.raises(ValueError, match="available memory"):
        EngineConfig.from_kwargs(kv_offload=True, host_kv_memory=1 << 60, **SPARSE)
    for bad in (dict(hbm_cache_blocks=0), dict(host_kv_memory=0)):
        with pytest.raises(ValueError):
            EngineConfig.from_kwargs(kv_offload=True, **SPARSE, **bad)
    # prefetching reads: topp not lagged under KV offload only
    topp = {**SPARSE, "sparse_policy": "topp"}
    assert EngineConfig.from_kwargs(kv_offload=True, offload_prefetch=True, **topp).prefetches
    assert not EngineConfig.from_kwargs(kv_offload=True, **topp).prefetches  # (off by default)
    for bad in (dict(kv_offload=True, **SPARSE), dict(kv_offload=True, sparse_lag=1, **topp), dict(**topp)):
        with pytest.raises(ValueError, match="offload_prefetch needs"):
            EngineConfig.from_kwargs(offload_prefetch=True, **bad)
    # A host store too small for one max_model_len sequence is refused when the engine starts.
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_dir), **COMMON, kv_offload=True, host_kv_memory=4096, **SPARSE)


def test_host_capacity_bounds_admission(tiny_model_dir):
    """host_kv_memory smaller than the device KV memory: the engine has only the host store's blocks (the
    scheduler admits and preempts against them) and still completes every request."""
    block_bytes = 2 * 2 * 2 * BS * 128 * 4  # layers x KV heads x (K, V) x tokens x head_dim x float32
    llm = LLM(
        str(tiny_model_dir),
        **{**COMMON, "max_model_len": 160},
        kv_offload=True,
        host_kv_memory=24 * block_bytes + block_bytes // 2,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        **SPARSE,
    )  # greedy admission: preempts
    engine = llm.llm_engine
    offload = engine.model_runner.offload
    assert engine.allocator.num_blocks == 24 == offload.num_device_blocks  # never more device blocks
    assert offload.host.data.shape[1] == 25 == engine.model_runner.kv_caches[-1].shape[0]  # + trash
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)  # prompts + outputs need 32 blocks
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_blocks_used == 0 and stats.offload_host_blocks == 24


def make_pool(
    num_slots: int,
    ways: int,
    blocks: int = 8,
    layers: int = 1,
    hkv: int = 1,
    device: torch.device = torch.device("cpu"),
) -> HBMPool:
    return HBMPool(layers, blocks, hkv, 2, 4, num_slots, torch.float32, device, ways=ways)


def test_pool_hand_built_lru():
    """One set of 4 ways: misses take free slots, then the least recently used slots the step does not
    use; hits are never evicted; a miss finding no evictable way is a bypass; freed blocks drop out."""
    pool = make_pool(4, 4)
    k = lambda blocks: pool.keys(0, torch.tensor([blocks]))[0]  # noqa: E731  (Hkv = 1)
    loc, load = pool.plan(k([0, 1, 2, -1]))
    assert loc.tolist() == [0, 1, 2, -1] and load.tolist() == [0, 1, 2, -1]
    loc, load = pool.plan(k([0, 3, 4]))  # 0 hits slot 0; 3 takes free slot 3; 4 evicts LRU block 1 (slot 1)
    assert loc.tolist() == [0, 3, 1] and load.tolist() == [-1, 3, 1]
    loc, load = pool.plan(k([5, 6, 7, 0, 3]))  # hits 0, 3; misses: slot 2 (used at t0), slot 1 (t1), bypass
    assert loc.tolist() == [2, 1, -1, 0, 3] and load.tolist() == [2, 1, -1, -1, -1]
    assert pool.stats.tolist() == [3, 7, 1, 3]  # hits, loads, bypass reads, layer steps
    pool.check()
    pool.invalidate([0, 6])  # block 0 (slot 0) and 6 (slot 1) freed: a re-allocated 0 must miss
    assert pool.resident[k([0, 6])].tolist() == [-1, -1]
    loc, load = pool.plan(k([0]))
    assert load.tolist() == [0]  # a freed slot (the first of two), not one holding a live block
    pool.check()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_pool_fill_takes_free_slots_only_as_first_victims(impl):
    """A free_only plan (OffloadCache.fill) installs misses into free slots only, evicting nothing; mark_unused
    stamps those slots older than any use, so the next plan's misses take them before slots a request used
    (torch and Triton plans)."""
    pool = make_pool(4, 4, device=DEVICE if impl == "triton" else torch.device("cpu"))
    k = lambda blocks: pool.keys(0, torch.tensor([blocks], device=pool.resident.device))[0]  # noqa: E731
    with forced(impl):
        pool.plan(k([0, 1]))
        pool.plan(k([1, 0]))  # slots 0 and 1 used twice
        loc, load = pool.plan(k([2, 3, 4, 0]), free_only=True)  # 2, 3: the free slots; 4: none left; 0 hits
        assert load.tolist() == [2, 3, -1, -1] and loc.tolist() == [2, 3, -1, 0]
        pool.mark_unused(load)
        assert pool.last_use[:4].tolist() == [2, 1, 0, 0] and pool.last_use[pool.trash_slot].item() == -1
        loc, load = pool.plan(k([5, 6]))  # the filled slots, not the used ones
        assert sorted(load.tolist()) == [2, 3]
        loc, load = pool.plan(k([7]), free_only=True)  # no free slot: nothing evicted
        assert load.tolist() == [-1] and (pool.resident[k([0, 1, 5, 6])] >= 0).all() and pool.resident[k([7])] < 0
    pool.check()


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pool_random_requests(seed, impl):
    """Random requests of several layers and KV heads: every read returns the host's data, no slot is
    loaded that the step also hits or loads twice, and the residency invariants hold (torch and Triton
    plans)."""
    g = torch.Generator().manual_seed(seed)
    layers, blocks, hkv, bs, d = 3, 12, 2, 2, 4
    host = HostKVStore(layers, blocks, hkv, bs, d, torch.float32, pin=impl == "triton" and DEVICE.type == "cuda")
    host.data.copy_(torch.randn(host.data.shape, generator=g))
    for slots, ways in ((6, 2), (16, 8), (64, 4)):
        pool = make_pool(slots, ways, blocks, layers, hkv, DEVICE if impl == "triton" else torch.device("cpu"))
        for step in range(40):
            layer = step % layers
            req = torch.stack([torch.randperm(blocks + 3, generator=g)[:5] - 3 for _ in range(hkv)])  # -1.. padding
            req = req.clamp_min(-1)
            key = pool.keys(layer, req.to(pool.resident.device)).reshape(-1)
            with forced(impl):
                loc, load = pool.plan(key)
                flash_h2d(host.flat(), pool.slots, key, load)
            need = key != pool.trash_key
            used = loc[loc >= 0]
            assert used.numel() == used.unique().numel()
            assert not ((loc >= 0) & ~need).any() and not ((load >= 0) & (load != loc)).any()
            got = read_listed_ref((pool.slots, host.flat(), view_loc(loc, key)))
            assert torch.equal(got[need].cpu(), host.flat()[key[need].cpu()])
            pool.check()
            if step % 7 == 6:
                pool.invalidate(random.Random(step).sample(range(blocks), 3))
                pool.check()
        assert pool.stats[1] > pool.num_slots  # slots were reused (evictions)


def test_offload_decode_reference_reads_only_the_window_from_the_device():
    """The offloaded decode reads listed blocks from the given K/V only: with every block outside the
    local window poisoned in the device cache it equals the plain reference on the clean cache."""
    torch.manual_seed(0)
    b, hq, hkv, d, bs, nblocks, local = 3, 4, 2, 16, 4, 20, 2
    cache = torch.randn(nblocks, hkv, 2, bs, d)
    tables = torch.stack([torch.randperm(nblocks)[:6] for _ in range(b)]).int()
    seq_lens = torch.tensor([22, 13, 0], dtype=torch.int32)  # 6, 4 blocks; a padding row
    sel = torch.tensor([[[0, 2, 4, -1], [1, 3, 5, 0]], [[0, 1, 2, 3], [2, -1, -1, -1]], [[-1] * 4] * 2]).int()
    q = torch.randn(b, hq, d)
    slots = torch.arange(b)
    ref = sparse_decode_ref(q, cache, tables, seq_lens, sel, slots, local, d**-0.5)
    listed_kv = torch.stack(
        [torch.stack([cache[tables[i, sel[i, h].clamp_min(0).long()].long(), h] for h in range(hkv)]) for i in range(b)]
    )  # [B, Hkv, cap, 2, bs, D]
    # half the entries from pool slots, half straight from host rows (loc -(row + 1))
    n = listed_kv[:, :, :, 0, 0, 0].numel()
    key = torch.randperm(n).view(sel.shape)
    loc = torch.arange(n).view(sel.shape)
    loc[:, :, ::2] = -1 - key[:, :, ::2]
    host = torch.zeros(n, 2, bs, d)
    host[key.flatten()] = listed_kv.reshape(n, 2, bs, d)
    offload = (listed_kv.reshape(n, 2, bs, d).clone(), host, loc)
    offload[0][loc[loc < 0].new_tensor(list(range(0, n, 2)))] = float("nan")  # slots the bypass entries never read
    poisoned = cache.clone()
    nb = (seq_lens + bs - 1) // bs
    for i in range(b):
        for j in range(max(0, int(nb[i]) - local)):
            poisoned[tables[i, j].long()] = float("nan")
    out = sparse_decode_ref(q, poisoned, tables, seq_lens, sel, slots, local, d**-0.5, offload=offload)
    assert torch.equal(out, ref)


def test_offload_layout_split():
    """The issue-7 benchmark's shapes (Llama-3.1-8B, bf16, bs 32, 2 dense layers, 20 x 1032 token blocks, 12.3
    GiB left for the device cache and the pool): the device block cache gets what the scheduler asks for, the
    pool all the rest; explicit sizes win; a tight budget keeps half for the pool down to one sequence."""
    hb, kv_layer, seq, want, tokens = 2 * 32 * 128 * 2, 8 * 2 * 32 * 128 * 2, 1032, 1032 + 20 * 5 + 256, 20640
    dev_bytes = 30 * kv_layer
    row_bytes = 2 * kv_layer + 130_000  # a device row: dense layers + metadata
    fixed = (tokens + 1) * row_bytes + dev_bytes  # a row per token block, the trash rows

    def plan(rest: int | None, **kw) -> OffloadLayout:
        args = dict(
            budget=None if rest is None else fixed + rest,
            device_blocks=None,
            token_blocks=tokens,
            pool_slots=None,
            default_pool_slots=32 * 8 * 20 * 64,
            min_device_blocks=seq,
            want_device_blocks=want,
            num_layers=32,
            dense_layers=2,
            kv_layer_block_bytes=kv_layer,
            meta_block_bytes=130_000,
            head_block_bytes=hb,
        )
        return OffloadLayout.plan(**{**args, **kw})

    rest = int(12.3 * GiB)
    layout = plan(rest)
    assert layout.device_blocks == want and layout.head_block_bytes == hb
    assert 0 <= rest - want * dev_bytes - layout.pool_slots * hb < hb  # the pool takes all the rest
    assert layout.pool_slots * hb > 7 * GiB  # was 5 GiB (at most half, capped at one step's lists)
    assert plan(rest, pool_slots=1000).device_blocks == (rest - 1000 * hb) // dev_bytes  # explicit pool
    assert plan(None, device_blocks=1500).pool_slots == 32 * 8 * 20 * 64  # explicit device cache, no budget
    tight = plan(9 * GiB)  # the wanted device cache (5.1 GiB) is more than half: it gives way to 4.5 GiB
    assert tight.device_blocks == 9 * GiB // 2 // dev_bytes < want and tight.pool_slots * hb > 4.5 * GiB - hb
    assert plan(6 * GiB).device_blocks == seq  # never below one max_model_len sequence
    every = plan(10**6 * GiB)  # the pool stops at every head block of the sparse layers, the device cache
    assert every.pool_slots == tokens * 30 * 8 and every.device_blocks == tokens  # gets the remainder
    with pytest.raises(ValueError, match="one max_model_len sequence"):
        plan(int(3.5 * GiB))
    # Windows per sequence: as many as asked when the pool can serve them all, else only as many sequences as
    # the budget gives a window and one step's lists (64 blocks x 30 layers x 8 heads), never more than asked.
    lists = 30 * 8 * 64
    per_seq = dict(want_device_blocks=want - 20 * 5, seq_window_blocks=5, seq_pool_slots=lists)
    assert plan(rest, **per_seq, max_seqs=20).device_blocks == want
    many = plan(rest, **per_seq, max_seqs=256)
    served = (rest - (want - 100) * dev_bytes) // (5 * dev_bytes + lists * hb)
    assert 20 < served < 256 and many.device_blocks == want - 100 + 5 * served
    assert many.pool_slots >= served * lists
    # Device rows sized by the running sequences: the share of sequences of `seq_rows` blocks beside their
    # working sets (WORKING_SET_LISTS lists) and window, at least `min_rows`; what they leave goes to the pool.
    rows = dict(per_seq, max_seqs=256, min_rows=seq + 1, seq_rows=516)
    free = tokens * row_bytes + rest - (want - 100) * dev_bytes  # less the device cache's fixed part
    shared = plan(rest, **rows)
    assert shared.rows == free * 516 // (516 * row_bytes + WORKING_SET_LISTS * lists * hb + 5 * dev_bytes) < tokens
    assert shared.pool_slots > many.pool_slots  # what the rows leave goes to the pool (and windows)
    assert fixed + rest - dev_bytes - hb < sum(shared.split().values()) <= fixed + rest  # the whole budget
    assert plan(rest, **{**rows, "seq_rows": 10**6}).rows == tokens  # never more rows than token blocks
    assert plan(rest, **{**rows, "seq_rows": 1}).rows == seq + 1  # one max_model_len sequence at least
    split = shared.split()
    assert split["dense_layers"] == (shared.rows + 1) * 2 * kv_layer
    assert split["metadata"] == (shared.rows + 1) * 130_000 and split["pool"] == shared.pool_slots * hb
    assert split["device_block_cache"] == (shared.device_blocks + 1) * dev_bytes


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_stale_blocks_leave_before_a_selection_can_list_them(block_size):
    """Random steps: a block a decode opened leaves the pool within block_size - 2 steps (a selection can list it
    block_size - 1 steps after it was opened), any other block with its own step, and every block leaves once."""
    rng = random.Random(block_size)
    stale, due, left, step, nxt = StaleBlocks(block_size), {}, [], 0, 0
    for _ in range(400):
        step += 1
        new = list(range(nxt, nxt + rng.choice([0, 0, 1, 1, 2, 3])))
        nxt += len(new)
        opened = [b for b in new if rng.random() < 0.8]
        stale.add(new)
        for b in new:
            due[b] = step + max(block_size - 2, 0) if b in opened else step
        for b in stale.take(opened):
            assert step <= due.pop(b), f"block {b} left at step {step}, after its due step"
            left.append(b)
        assert all(step < d for d in due.values()), "a block overstayed its due step"
    left += stale.take_all()
    assert sorted(left) == list(range(nxt))
    # A decode batch opening a block every step launches once per block_size - 1 steps.
    stale, launches = StaleBlocks(block_size), 0
    for b in range(100):
        stale.add([b])
        launches += bool(stale.take([b]))
    assert launches == 100 // max(block_size - 1, 1)


def test_device_block_map_working_set():
    """Prefill steps map every block of the sequence; a decode only its local window (the rest released
    at once, the range only moves forward); a one-token chunk that is not the last token is a prefill."""
    dm = DeviceBlockMap(num_blocks=8, local_blocks=2, block_size=4, token_blocks=32)
    seq = Sequence(0, "r", 0, list(range(13)), GREEDY)  # 13 prompt tokens: 4 blocks
    seq.block_table = list(range(100, 104))
    assert dm.can_map(seq, 8) and dm.num_to_allocate(seq, 8) == 2
    dm.map(seq, 8)
    span = lambda: (dm.range_of(seq)[0], len(dm.range_of(seq)[1]))  # noqa: E731
    assert span() == (0, 2)
    seq.num_computed_tokens = 8
    assert not dm.steady(seq, 1)
    dm.map(seq, 1)  # token 8 of 13: still a prefill, all blocks
    assert span() == (0, 3)
    seq.num_computed_tokens = 9
    assert dm.num_to_allocate(seq, 4) == 1
    dm.map(seq, 4)
    seq.num_computed_tokens = 13
    seq.token_ids.append(7)  # the first decode: window = blocks 2, 3; blocks 0, 1 released
    assert dm.num_to_allocate(seq, 1) == -2 and not dm.steady(seq, 1)
    dm.map(seq, 1)
    assert span() == (2, 2) and dm.allocator.num_used == 2
    for t in range(14, 17):  # token 16 opens block 4: block 2 leaves, net zero
        seq.num_computed_tokens = t
        seq.token_ids.append(7)
        assert dm.num_to_allocate(seq, 1) == 0
        assert dm.steady(seq, 1) == (t < 16)  # decodes within the window's last block map nothing
        dm.map(seq, 1)
    assert span() == (3, 2) and dm.allocator.num_used == 2
    fresh = Sequence(1, "r", 0, list(range(30)), GREEDY)  # 8 blocks: more than the 6 free
    assert not dm.can_admit(fresh, [seq]) and dm.can_admit(Sequence(2, "r", 0, list(range(24)), GREEDY), [seq])
    dm.release(seq)
    assert dm.allocator.num_used == 0 and dm.range_of(seq) == (0, [])
    dm.allocator.check()


def test_device_cache_holds_the_working_set_only(hf_models):
    """A device block cache of 17 blocks (one max_model_len sequence) and a host store of 4 x 17: the device
    cache is smaller than the host store, the four requests decode together although their blocks would
    not fit the device cache whole, prefills wait for device blocks, and the tokens equal offload off."""
    model_dir = hf_models["qwen2-gqa-bias"][0]
    kw = offload_lag(**SPARSE, max_model_len=136)
    p = [x[:100] for x in prompts()] + [prompts()[1][:90]]  # 13 + 10 + 4 + 12 blocks with their outputs
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(str(model_dir), **{**COMMON, **kw}).generate(p, params, use_tqdm=False)]
    llm = LLM(str(model_dir), **{**COMMON, **kw}, kv_offload=True, num_gpu_blocks_override=17)
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    assert runner.kv_caches[-1].shape[0] == 18 and runner.offload.host.data.shape[1] == 4 * 17 + 1  # + trash rows
    for i, prompt in enumerate(p):
        engine.add_request(str(i), prompt, params)
    outs, most, waited = {}, 0, False
    while engine.has_unfinished_requests():
        for o in engine.step():  # deltas: each step's new tokens
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        running = engine.scheduler.running
        held_blocks(engine)
        if len(running) == 4:
            most = max(most, sum(len(s.block_table) for s in running))
        waited |= bool(engine.scheduler.waiting) and engine.allocator.num_free >= 17
    assert most > runner.offload.num_device_blocks  # four at once, more blocks than the device cache has
    assert waited  # a request waited for device blocks while token blocks were free
    assert [outs[str(i)] for i in range(len(p))] == base
    stats = engine.get_stats()
    assert stats.offload_device_blocks == 17 and stats.offload_device_blocks_used == 0 == stats.num_blocks_used
    engine.scheduler.kv.device_space.map.allocator.check()


@pytest.mark.parametrize("page", [4, 2])
def test_key_meta_update_rows_by_token_block(page):
    """KV offload: keys are read from device blocks, the metadata rows are the token blocks (meta_slots);
    the fused Triton store + update kernel (interpreter on CPU) equals the reference, and both equal metadata
    rebuilt from a cache indexed by token block."""
    from sparseserve.kernels.key_meta import (
        quantize_key_meta,
        rebuild_key_meta,
        store_kv_key_meta_triton,
        update_key_meta_ref,
    )
    from sparseserve.kernels.store_kv import store_kv_ref
    from sparseserve.kvcache.metadata import allocate_key_meta

    torch.manual_seed(2)
    bs, hkv, d, dev_blocks, token_blocks = 4, 2, 8, 3, 6
    cache = torch.randn(dev_blocks, hkv, 2, bs, d, device=DEVICE)
    dev_of = {5: 0, 1: 2, 3: 1}  # token block -> device block
    tokens = [(5, o) for o in range(4)] + [(1, o) for o in range(3)] + [(3, 0)]  # block 1 partial, 3 one token
    slots = torch.tensor([dev_of[b] * bs + o for b, o in tokens] + [-1], device=DEVICE)
    meta_slots = torch.tensor([b * bs + o for b, o in tokens] + [-1], device=DEVICE)
    metas = [allocate_key_meta(1, token_blocks, hkv, bs, page, d, torch.device(DEVICE))[0] for _ in range(2)]
    k, v = (torch.randn(len(slots), hkv, d, device=DEVICE) for _ in range(2))
    got = cache.clone()
    store_kv_ref(k, v, cache, slots)
    update_key_meta_ref(cache, metas[0].codes, metas[0].scale, slots, page, meta_slots)
    store_kv_key_meta_triton(k, v, got, metas[1].codes, metas[1].scale, slots, page, meta_slots)
    assert torch.equal(got, cache)
    for got, want in ((metas[1].codes, metas[0].codes), (metas[1].scale, metas[0].scale)):
        assert torch.equal(got[:token_blocks], want[:token_blocks])  # (row token_blocks: trash)
    full = torch.zeros(token_blocks, hkv, 2, bs, d, device=DEVICE)
    for b, dv in dev_of.items():
        full[b] = cache[dv]
    expect = allocate_key_meta(1, token_blocks, hkv, bs, page, d, torch.device(DEVICE))
    rebuild_key_meta(full[None], expect.codes, expect.scale, page)
    got = metas[0]
    assert torch.equal(got.codes[5], expect.codes[0, 5]) and torch.equal(got.scale[5], expect.scale[0, 5])  # full

    def assert_page(blk: int, pg: int, keys: torch.Tensor) -> None:  # keys [Hkv, n, D]
        codes, scale = quantize_key_meta(keys.amin(1), keys.amax(1))
        assert torch.equal(got.codes[blk, :, :, pg], codes) and torch.equal(got.scale[blk, :, pg], scale)

    keys = cache[2, :, 0, :3]  # partial block 1: its 3 tokens, pages over them
    for pg in range(bs // page):
        assert_page(1, pg, keys[:, pg * page : (pg + 1) * page])
    assert not got.codes[[0, 2, 4]].any() and not got.scale[[0, 2, 4]].any()
    assert_page(3, 0, cache[1, :, 0, :1])


def test_decode_write_through_to_host_rows_apart_from_metadata_rows():
    """KV offload with device rows: the fused store kernel writes the metadata at the token's
    device-row slot (meta_slots) and the block a decode completes to its host row (host_slots);
    the Triton kernel (interpreter on CPU) equals the reference on fresh random inputs."""
    from sparseserve.kernels.key_meta import store_kv_key_meta_ref, store_kv_key_meta_triton
    from sparseserve.kvcache.metadata import allocate_key_meta

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    bs, hkv, d, dev_blocks, rows, host_rows, page = 4, 2, 8, 3, 5, 7, 2
    # three decodes: two complete their blocks (offset bs - 1), one does not; then a prefill token
    dev = [2, 0, 1, 1]
    offs = [bs - 1, bs - 1, 1, 2]
    row = [4, 1, 3, 3]
    host = [6, 2, 5, 5]
    slots = torch.tensor([b * bs + o for b, o in zip(dev, offs)], device=DEVICE)
    meta_slots = torch.tensor([r * bs + o for r, o in zip(row, offs)], device=DEVICE)
    host_slots = torch.tensor([h * bs + o for h, o in zip(host, offs)], device=DEVICE)
    k, v = (torch.randn(len(dev), hkv, d, device=DEVICE) for _ in range(2))
    cache = torch.randn(dev_blocks, hkv, 2, bs, d, device=DEVICE)
    out = []
    for fn in (store_kv_key_meta_ref, store_kv_key_meta_triton):
        c, m = cache.clone(), allocate_key_meta(1, rows, hkv, bs, page, d, torch.device(DEVICE))[0]
        h, count = (
            torch.zeros(host_rows + 1, hkv, 2, bs, d, device=DEVICE),
            torch.zeros((), dtype=torch.int64, device=DEVICE),
        )
        fn(k, v, c, m.codes, m.scale, slots, page, meta_slots, h, 3, count, host_slots)
        out.append((c, m.codes, m.scale, h[:host_rows], count))  # (the last row: the reference's trash)
    for got, want in zip(out[1], out[0]):
        assert torch.equal(got, want)
    c, codes, _, h, count = out[0]
    assert int(count) == 2 and torch.equal(h[6], c[2]) and torch.equal(h[2], c[0])
    assert not h[[0, 1, 3, 4, 5]].any()  # nothing at the metadata rows or the incomplete block's host row
    assert codes[[4, 1, 3]].any() and not codes[[0, 2]].any()  # metadata at the device rows only


TOPP_PRUNES = dict(sparse_policy="topp", sparse_top_p=0.7, sparse_budget=6 * BS, sparse_topp_flat_share=1.0)
TOPP_FLAT = dict(TOPP_PRUNES, sparse_dense_layers=1, sparse_topp_flat_share=0.5)  # random weights: lists flagged


def run(model_dir, control: bool = True, **kw):
    """control=False: KV offload's working-set limit off inside the engine (no configuration does that)."""
    llm = LLM(str(model_dir), **{**COMMON, **kw})
    if not control:
        llm.llm_engine.scheduler.working_set.ws.enabled = False
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        dict(),
        # topp pruning every list (random weights' lists are flat enough to be flagged at the default share)
        dict(TOPP_PRUNES, sparse_reuse=2),
        dict(TOPP_PRUNES, sparse_dense_layers=1),  # not lagged: each layer loads its misses
        dict(TOPP_PRUNES, sparse_dense_layers=1, offload_prefetch=True),  # not lagged, prefetching reads
        dict(TOPP_PRUNES, sparse_dense_layers=1, sparse_lag=1),
        # flat lists flagged, unpruned (not held: the hold's default differs with and without offload), with and
        # without prefetching reads; then held two steps (not selected: prefetching reads, which a hold needs)
        *(dict(TOPP_FLAT, sparse_topp_flat_hold=h, offload_prefetch=p) for h, p in ((0, False), (0, True), (2, True))),
        dict(sparse_dense_layers=1, sparse_stickiness=0),
        dict(sparse_lag=1),
        dict(sparse_lag=1, sparse_dense_layers=1, sparse_stickiness=0),
        dict(sparse_dense_layers=1),  # sticky lists (the default): a paused request's come back with it
        dict(sparse_lag=1, sparse_dense_layers=1),
    ],
)
def test_offload_equals_no_offload(hf_models, policy):
    """Same sparse policy, offload off vs on: identical greedy tokens with a roomy pool, a pool of a few
    sets (evictions) and a pool of 4 slots with the working-set limit off (which would keep a batch of one:
    nearly every step evicts, misses overflow into bypass reads), and a device block space of one
    max_model_len sequence (prompts wait for device blocks). A dense first layer keeps its own full-size
    device cache."""
    model_dir = hf_models["qwen2-gqa-bias"][0]
    policy = dict(policy)
    prefetch = {"offload_prefetch": policy.pop("offload_prefetch", False)}  # the offloaded runs'
    kw = offload_lag(prefetch, **{**SPARSE, **policy, "max_model_len": 136})
    base, _ = run(model_dir, **kw)
    for slots, device_blocks in ((None, None), (24, None), (4, None), (24, 17)):
        got, llm = run(
            model_dir,
            control=slots != 4,
            kv_offload=True,
            hbm_cache_blocks=slots,
            num_gpu_blocks_override=device_blocks,
            **kw,
            **prefetch,
        )
        assert got == base, f"hbm_cache_blocks={slots}, device blocks {device_blocks}"
        runner = llm.llm_engine.model_runner
        dense = policy.get("sparse_dense_layers", 0)
        num_tokens = llm.llm_engine.allocator.num_blocks
        assert len(runner.kv_caches) == 2
        rows = runner.offload.layout.rows
        assert rows == num_tokens  # no budget: a device row per token block
        assert [c.shape[0] == rows + 1 for c in runner.kv_caches] == [True] * dense + [False] * (
            2 - dense
        ) or device_blocks is None  # dense layers: a cache by device row (+ trash)
        if device_blocks is not None:
            assert runner.kv_caches[-1].shape[0] == device_blocks + 1 < runner.offload.host.data.shape[1]
        engine = llm.llm_engine
        stats = engine.get_stats(sync=True)
        assert stats.offload_layer_steps > 0 and stats.offload_blocks_loaded > 0
        assert stats.num_blocks_used == 0 and stats.offload_host_blocks == engine.allocator.num_blocks
        runner.offload.pool.check()
        assert runner.offload.host.blocks_written.item() > 0
        if slots is None:
            assert stats.offload_hbm_hits > stats.offload_blocks_loaded  # selections repeat across steps
        elif slots == 4 or policy.get("sparse_stickiness") == 0:  # (sticky lists may fit 24 slots)
            assert stats.offload_blocks_loaded > stats.offload_hbm_slots  # slots were evicted and reused
        if slots == 4:
            assert stats.offload_bypass_reads > 0
        got_metrics = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
        assert got_metrics["sparseserve:offload_head_blocks_loaded_total"] == stats.offload_blocks_loaded
        assert 0 <= got_metrics["sparseserve:offload_hbm_hit_ratio"] <= 1
        head_block = 2 * BS * 64 * 4  # K and V, head_dim 64, float32
        assert stats.offload_h2d_bytes == stats.offload_blocks_loaded * head_block
        keys = stats.offload_prune_key_reads
        assert stats.offload_uva_bytes == stats.offload_bypass_reads * head_block + keys * head_block // 2
        assert got_metrics["sparseserve:offload_uva_bytes_total"] == stats.offload_uva_bytes
        flat = policy.get("sparse_topp_flat_share", 1.0) < 1.0
        if engine.config.prefetches:
            # the step's candidates not prefetched (a first decode's, the new ones) are read from the host: the
            # prune their keys, the attention the kept ones' K and V
            assert stats.offload_bypass_reads <= stats.offload_hbm_misses and keys <= stats.offload_hbm_misses
            assert stats.offload_bypass_reads > 0 and (keys > 0) != flat
        else:
            # topp's candidates go through the pool before its prune: only those bypassing it (no free way) have
            # their keys read from the host (by a prune: flagged flat lists are not pruned)
            assert stats.offload_hbm_misses == stats.offload_blocks_loaded + stats.offload_bypass_reads
            assert keys <= stats.offload_bypass_reads
            if not flat:
                assert (keys > 0) == (policy.get("sparse_policy") == "topp" and slots == 4)
        if flat:  # the case is what it says: lists were flagged (and held)
            assert stats.sparse_flat_lists > 0
            assert (stats.sparse_held_lists > 0) == bool(policy.get("sparse_topp_flat_hold"))
        assert stats.offload_d2h_bytes == got_metrics["sparseserve:offload_d2h_bytes_total"] > 0


def test_lagged_views_name_the_host_blocks(hf_models):
    """Lagged selection under offload (on a GPU with CUDA graphs, each step planning its lists of every sparse
    layer on the side stream at its start), a pool of 16 slots (evictions, bypass reads: the working-set limit,
    which would keep the batch within the pool, is off inside the engine): after every step, the view of each
    decode's list names its blocks' host rows, and every pool slot it names holds its host row (the step read the
    right K/V); nothing leaks."""
    model_dir = hf_models["qwen2-gqa-bias"][0]
    llm = LLM(
        str(model_dir),
        **{
            **COMMON,
            **SPARSE,
            "max_model_len": 136,
            "device": DEVICE.type,
            "dtype": "float32",
            "num_gpu_blocks_override": 48,
            "sparse_lag": 1,
            "kv_offload": True,
            "hbm_cache_blocks": 16,
        },
        profiler=LastSchedule(),
    )
    engine = llm.llm_engine
    engine.scheduler.working_set.ws.enabled = False
    off, backend = engine.model_runner.offload, engine.model_runner.attn_backend
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    num_slots, checked = backend.state.num_slots, 0
    while engine.has_unfinished_requests():
        engine.step()
        held = backend.state.held_slots()
        for seq, n in engine.profiler.out.scheduled:
            slot = held.get(seq.seq_id)
            if n != 1 or slot is None:
                continue  # a prefill chunk, or finished
            ctx = seq.num_computed_tokens  # the step's context
            row = slot + num_slots * (ctx % 2)  # the list row the step's decode read (lag, R = 1)
            tables = torch.tensor([seq.block_table], dtype=torch.int32, device=DEVICE)
            lens = torch.tensor([ctx], dtype=torch.int32, device=DEVICE)
            for li in range(off.lag_loc.shape[0]):
                layer = off.dense_layers + li
                loc = off.lag_loc[li, row]
                key = off.keys(layer, tables, lens, backend.state.sel[layer][row][None])[0]
                held_slots = loc >= 0  # else a bypass or none: -(key + 1) (view_loc)
                assert torch.equal(torch.where(held_slots, -1 - key, loc), -1 - key), (seq.seq_id, layer)
                assert torch.equal(off.pool.slots[loc[held_slots]].cpu(), off.host.flat()[key[held_slots].cpu()])
                checked += int(held_slots.sum())
    stats = engine.get_stats(sync=True)
    assert checked > 0 and stats.offload_blocks_loaded > stats.offload_hbm_slots and stats.offload_bypass_reads > 0
    assert stats.num_blocks_used == 0
    off.pool.check()


def random_schedule(
    model_dir,
    seed: int,
    check: bool,
    greedy: bool = False,
    triton_plan: bool = False,
    control: bool = True,
    aborted: set[str] | None = None,
    engines: list | None = None,
    **kw,
) -> dict[str, list[list[int]]]:
    """Random arrivals, aborts and steps with a KV pool small enough to preempt; returns every request's
    tokens; with check, after every step: the block, host and HBM accounting, and the host store holding
    every full block of the running sequences (FlashD2H + write-through) exactly as the device cache.
    triton_plan: the HBM pool plans with its Triton kernels (under the interpreter without CUDA).
    control=False: KV offload's working-set limit off inside the engine; aborted: collects the ids aborts named;
    engines: collects the engine."""
    rng = random.Random(seed)
    llm = LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=96,
        max_num_batched_tokens=rng.choice([16, 48]),
        max_num_seqs=4,
        **{**SPARSE, "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0, **kw},
    )  # greedy admission
    engine = llm.llm_engine
    if engines is not None:
        engines.append(engine)
    if not control:
        engine.scheduler.working_set.ws.enabled = False
    results: dict[str, list[list[int]]] = {}
    offload = engine.model_runner.offload
    pool = offload.pool if offload is not None else None
    if triton_plan:  # only the plan on the Triton path (the whole engine under the interpreter is too slow)
        plan = pool.plan

        def triton_pool_plan(key):
            with forced("triton"):
                return plan(key)

        pool.plan = triton_pool_plan

    def collect(outs):  # the engine's outputs are deltas: append each step's new tokens
        for out in outs:
            seqs = results.setdefault(out.request_id, [])
            for c in out.outputs:
                seqs.extend([] for _ in range(c.index + 1 - len(seqs)))
                seqs[c.index].extend(c.token_ids)

    def after_step(outs):
        collect(outs)
        if check:
            held_blocks(engine)
            offload.sync()
            sparse_caches = torch.stack(engine.model_runner.kv_caches[offload.dense_layers :])
            for seq in engine.scheduler.running:  # every full block on the device is in the host store, equal
                segments = engine.scheduler.segments  # a layer-segmented prefill fills its window
                if segments is not None and segments.running(seq):
                    continue  # layer by layer (tests/engine/test_layer_prefill.py)
                start, blocks = offload.range_of(seq.seq_id)
                full = range(start, min(seq.num_computed_tokens // BS, start + len(blocks)))
                dev = [blocks[j - start] for j in full]
                assert torch.equal(offload.host.data[:, [seq.block_table[j] for j in full]], sparse_caches[:, dev])
            check_pool(offload)

    drive_random_schedule(engine, rng, steps=30, max_new=20, after_step=after_step, greedy=greedy, aborted=aborted)
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert engine.allocator.num_used == 0
    if check:
        held_blocks(engine)
        assert engine.scheduler.kv.device_space.map.allocator.num_used == 0
        check_pool(offload)
    return results, engine.scheduler.num_preemptions


HOST_16 = 16 * 2 * 2 * 2 * BS * 128 * 4  # 16 token blocks of the tiny model in the host store


# The engine runs on CPU here, so its Triton plan runs under the interpreter only (on a GPU machine
# kernels/test_pool_plan.py and kernels/test_flash_h2d.py cover the plan on CUDA tensors).
@pytest.mark.slow
@pytest.mark.parametrize(
    "seed, triton_plan, lag",
    [(0, False, 0), (2, False, 1), (3, False, "topp")]
    + ([(1, True, 0)] if os.environ.get("TRITON_INTERPRET") == "1" else []),
)
def test_random_schedules_offload_matches_and_accounts(tiny_model_dir, seed, triton_plan, lag):
    """16 token blocks both ways (host store with offload); with offload first as many device blocks and the
    working-set limit off (the schedule, sampled tokens included, equals offload off), then 12, one
    max_model_len sequence, with the limit: sequences wait for device blocks and working sets, so the
    schedule differs. Greedy requests and a budget covering max_model_len then (a one-token prefill chunk is
    a decode, attended sparsely: with a smaller budget its tokens would depend on the schedule; an aborted
    request got as far as its schedule let it: a prefix); every block still goes through scoring, selection
    and the pool (its torch plan, or its Triton plan). lag: lagged selection, whose next lists the pool reads
    a step ahead (paused sequences resume with fresh state slots, which select and read in their step); "topp":
    topp pruning every list, not lagged, with prefetching reads."""
    extra = TOPP_PRUNES | {"sparse_lag": 0} if lag == "topp" else {"sparse_lag": lag}
    prefetch = {"offload_prefetch": True} if lag == "topp" else {}  # the offloaded runs'
    sampled_offload_matches(tiny_model_dir, seed, extra, triton_plan=triton_plan, **prefetch)
    covering = {**extra, "greedy": True, "sparse_budget": 12 * BS}
    greedy_offload_matches(tiny_model_dir, seed, covering, hbm_cache_blocks=16, triton_plan=triton_plan, **prefetch)


@pytest.mark.slow
def test_random_schedules_hold_flat_lists_under_offload(tiny_model_dir):
    """topp with flat lists held (flagged at a flat share of 0.3 on random weights) under KV offload's prefetching
    reads (plain reads refuse a hold): the random schedule with preemptions, sampled tokens included, equals
    offload off, the accounting holds after every step, and lists were held."""
    extra = TOPP_PRUNES | dict(sparse_lag=0, sparse_topp_flat_share=0.3, sparse_topp_flat_hold=4)
    engine = sampled_offload_matches(tiny_model_dir, 5, extra, offload_prefetch=True)
    assert engine.get_stats(sync=True).sparse_held_lists > 0


def sampled_offload_matches(model_dir, seed: int, extra: dict, **offload_kw):
    """A random schedule (`extra`: both runs' engine options) without KV offload (16 device blocks) and with it (16
    pool slots, the working-set limit off, offload_kw): the same schedule and sampled tokens, preemptions, the
    accounting checked after every step of the offloaded run. Returns its engine."""
    off, _ = random_schedule(model_dir, seed, check=False, num_gpu_blocks_override=16, **extra)
    engines: list = []
    on, preemptions = random_schedule(
        model_dir,
        seed,
        check=True,
        kv_offload=True,
        hbm_cache_blocks=16,
        host_kv_memory=HOST_16,
        control=False,
        engines=engines,
        **extra,
        **offload_kw,
    )
    assert on == off and preemptions > 0
    return engines[0]


def greedy_offload_matches(model_dir, seed: int, covering: dict, **offload_kw):
    """Greedy random schedules (`covering`: random_schedule's arguments of both runs) without KV offload (16 device
    blocks) and with it (12, the working-set limit on, offload_kw): every request's tokens equal, an aborted
    request's up to where either run stopped; the accounting checked after every step of the offloaded run.
    Returns its engine."""
    aborted: set[str] = set()
    engines: list = []
    off, _ = random_schedule(model_dir, seed, check=False, num_gpu_blocks_override=16, **covering)
    on, _ = random_schedule(
        model_dir,
        seed,
        check=True,
        kv_offload=True,
        host_kv_memory=HOST_16,
        num_gpu_blocks_override=12,
        aborted=aborted,
        engines=engines,
        **covering,
        **offload_kw,
    )
    assert set(on) | aborted == set(off) | aborted
    for rid in set(on) | set(off):
        a, b = on.get(rid, []), off.get(rid, [])
        assert a == b or rid in aborted, rid
        assert all(x[: len(y)] == y[: len(x)] for x, y in zip(a, b)), rid
    return engines[0]


def test_stale_blocks_move_with_a_step_only_when_some_leave(tiny_model_dir, monkeypatch):
    """A step's addressing carries the token blocks leaving the pool only when some do (most steps none: nothing
    is uploaded for them); those it carries leave the pool before its kernels (drop_stale), and every block handed
    to a new owner leaves it (random schedule over a small token block space: blocks are reused often)."""
    from sparseserve.attention.sparse import SparseBackend

    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=96,
        max_num_batched_tokens=48,
        max_num_seqs=4,
        **SPARSE,
        kv_offload=True,
        hbm_cache_blocks=16,
        host_kv_memory=HOST_16,
    )
    engine = llm.llm_engine
    offload = engine.model_runner.offload
    handed: list[int] = []
    dropped: list[int] = []
    steps = {"with": 0, "without": 0}
    space = engine.scheduler.kv.device_space
    on_allocate, invalidate = space.on_allocate, offload.pool.invalidate

    def record_allocate(blocks):
        handed.extend(blocks)
        on_allocate(blocks)

    def record_invalidate(blocks):
        dropped.extend(blocks.tolist() if isinstance(blocks, torch.Tensor) else blocks)
        invalidate(blocks)

    monkeypatch.setattr(space, "on_allocate", record_allocate)
    monkeypatch.setattr(offload.pool, "invalidate", record_invalidate)

    prepare = SparseBackend.prepare

    def recording_prepare(self, scheduled, meta, dev):
        before = len(dropped)
        prepare(self, scheduled, meta, dev)
        stale = dev.get("offload_stale")  # uploaded with the step's inputs only when some blocks leave
        assert meta.backend_meta.offload.stale is stale
        if stale is not None:
            assert dropped[before:] == stale.tolist() and stale.numel() > 0
        steps["with" if stale is not None else "without"] += 1

    monkeypatch.setattr(SparseBackend, "prepare", recording_prepare)
    rng = random.Random(3)
    drive_random_schedule(engine, rng, 80, 30, lambda outs: None, greedy=True, aborted=set())
    while engine.has_unfinished_requests():
        engine.step()
    dropped += space._stale.take_all()  # opened by decodes, still waiting for a launch
    assert sorted(dropped) == sorted(handed) and steps["with"] > 3 and steps["without"] > steps["with"]
    check_pool(offload)


@pytest.mark.parametrize(
    "kw",
    [{}, {"layer_segmented_prefill": True, "max_num_batched_tokens": 32}, {"async_scheduling": True}],
    ids=["plain", "layerseg", "async"],
)
def test_one_host_fence_per_step(tiny_model_dir, kw):
    """The offload step has one owner: each step that runs fences the host store exactly once (the runner's
    begin_step of the step's plan), a step with nothing to run not at all; a pool so small that the
    working-set limit pauses sequences, and repeated prompts, so plans carry saves, restores and stale
    blocks."""
    rec = LastSchedule()
    llm = LLM(
        str(tiny_model_dir),
        **{**COMMON, "max_model_len": 160, **kw},
        **SPARSE,
        kv_offload=True,
        hbm_cache_blocks=16,
        num_gpu_blocks_override=24,
        profiler=rec,
    )
    engine = llm.llm_engine
    host = engine.model_runner.offload.host
    for i, p in enumerate(prompts() * 2):
        engine.add_request(str(i), p, GREEDY)
    ran, work = 0, [0, 0, 0]
    while engine.has_unfinished_requests():
        before = host.num_fences
        engine.step()
        assert host.num_fences - before == (not rec.out.is_empty)
        if not rec.out.is_empty:
            ran += 1
            plan = rec.out.offload
            work = [work[0] + len(plan.saves), work[1] + len(plan.restores), work[2] + len(plan.stale)]
    assert ran > 10 and engine.get_stats().num_generation_tokens == 6 * GREEDY.max_tokens
    assert all(work)


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, "topp"])
def test_random_schedules_layer_segmented_fill(tiny_model_dir, lag):
    """Layer-segmented prefill under KV offload puts each prompt's head blocks into the HBM pool's free slots
    (OffloadCache.fill) while a pool of 40 slots (the prompts' head blocks need up to 64) has room at first and
    evicts later: greedy tokens equal offload off (an aborted request's: a prefix), the block, host and pool
    accounting holds after every step, fills and loads both happened (lagged topk; topp with prefetching reads)."""
    extra = TOPP_PRUNES | {"sparse_lag": 0} if lag == "topp" else {"sparse_lag": lag}
    prefetch = {"offload_prefetch": True} if lag == "topp" else {}
    covering = {**extra, "greedy": True, "sparse_budget": 5 * BS}  # lists leave blocks to fill
    segmented = dict(layer_segmented_prefill=True, layer_segment_min_tokens=8)
    engine = greedy_offload_matches(tiny_model_dir, 5, covering, hbm_cache_blocks=40, **segmented, **prefetch)
    stats = engine.get_stats(sync=True)
    assert stats.offload_blocks_filled > 0 and stats.offload_blocks_loaded > 0
