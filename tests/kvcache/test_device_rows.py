"""Device rows under KV offload (kvcache/device_space.py DeviceRowMap): the dense layers' KV and the key
metadata of the running sequences' token blocks only, shared by the sequences holding a block, saved to the
block's host row when another block needs the row of one no running sequence holds, and restored when a block
with computed tokens maps again."""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.device_space import DeviceRowMap
from tests.kvcache.test_offload import BS, COMMON, SPARSE
from tests.conftest import offload_lag


class Seq:
    def __init__(self, seq_id: int, table: list[int], computed: int = 0, tokens: int = 0) -> None:
        self.seq_id, self.block_table, self.num_computed_tokens = seq_id, table, computed
        self.num_tokens = tokens or computed + 1


def test_rows_shared_idle_saved_restored():
    rows = DeviceRowMap(num_rows=6, block_size=BS, token_blocks=20)
    a = Seq(1, [10, 11, 12], computed=0, tokens=20)
    assert rows.can_admit(a, []) and rows.can_map(a, 20)
    rows.map(a, blocks_needed(20, BS))
    changes, saves, restores = rows.take()
    assert sorted(b for b, _ in changes) == [10, 11, 12] and not saves and not restores  # nothing computed yet
    a.num_computed_tokens = 20
    b = Seq(2, [10, 11, 13], computed=16, tokens=24)  # a prefix hit on a's first two blocks
    assert rows.can_map(b, 8)  # one new row (block 13): 3 free
    rows.map(b, 3)
    changes, saves, restores = rows.take()
    assert [bk for bk, _ in changes] == [13] and not restores  # 10, 11 shared (their rows are live)
    assert len(rows.holders) == 4 and rows.num_available == 2
    row12 = rows.row_of[12]
    rows.release(a)  # a leaves: 10, 11 stay (b holds them); 12's row stays with it, idle: nothing moves
    assert rows.take() == ([], [], []) and rows.idle == {12: (row12, True)} and rows.num_available == 3
    rows.release(b)  # b pauses after 16 computed tokens: idle too, nothing saved
    assert rows.take() == ([], [], []) and rows.num_available == 6
    rows.map(b, 3)  # b resumes at once: it takes its idle rows back as they are
    assert rows.take() == ([], [], []) and list(rows.idle) == [12]
    rows.release(b)
    c = Seq(3, [0, 1, 2, 3, 4], computed=0, tokens=5 * BS)  # needs 5 rows: 2 free, then the least recently
    assert rows.can_admit(c, [])  # released idle ones: 12 (a's), 10 and 11 (b's, computed) are saved
    rows.map(c, 5)
    changes, saves, restores = rows.take()
    assert sorted(bk for bk, _ in saves) == [10, 11, 12] and not restores
    assert {bk for bk, r in changes if r == -1} == {10, 11, 12} and list(rows.idle) == [13]
    rows.release(c)
    rows.take()
    rows.map(b, 3)  # b resumes: 10 and 11 come back from their host rows (13 has nothing to restore)
    changes, saves, restores = rows.take()
    assert sorted(bk for bk, _ in restores) == [10, 11] and not saves
    rows.release(b)
    rows.map(c, 5)  # c takes 10's and 11's rows back (saved first)
    changes, saves, restores = rows.take()
    assert sorted(bk for bk, _ in saves) == [10, 11]
    rows.release(c)
    rows.map(b, 3)  # b resumes (10 and 11 from the host again) but leaves before its restores ran; c takes
    rows.release(b)  # those rows again: the pending restores are dropped, not saved back (the host rows hold
    rows.map(c, 5)  # the contents)
    rows.map(Seq(4, [5], computed=0, tokens=2), 1)
    changes, saves, restores = rows.take()
    assert not restores and not {10, 11} & {bk for bk, _ in saves}
    rows.forget([5])  # a held block is not touched by forget; an idle one's row is freed
    rows.release(c)
    rows.forget([0, 1])
    assert 0 not in rows.idle and 1 not in rows.idle and rows.allocator.num_free == 2
    assert not rows.holders or list(rows.holders.values()) == [1]
    rows.allocator.check()


def test_rows_admission_and_growth():
    rows = DeviceRowMap(num_rows=5, block_size=BS, token_blocks=20)
    a = Seq(1, [0, 1], computed=0, tokens=12)
    assert rows.can_admit(a, [])
    rows.map(a, 2)
    big = Seq(2, [], computed=0, tokens=4 * BS)  # its prompt and first decode need 5 rows: 3 free
    assert not rows.can_admit(big, [a]) and rows.can_admit(Seq(3, [], tokens=2 * BS), [a])
    a.num_computed_tokens, a.num_tokens = 16, 17  # a decodes into a third block: one more row
    assert rows.can_map(a, 1)
    a.block_table.append(2)
    rows.map(a, 3)
    assert rows.allocator.num_used == 3
    rows.release(a)  # idle rows count as available: they are taken (saved first) when needed
    assert rows.can_admit(big, [])
    assert DeviceRowMap(2, BS, token_blocks=2).can_admit(big, [a])  # a row per token block: never short


@pytest.mark.parametrize("seed", range(3))
def test_rows_random_walk(seed):
    """Random steps, pauses and releases over shared prefix blocks: a row has as many holders as the running
    sequences mapping its block, restores name only blocks saved earlier, and nothing leaks."""
    rng = random.Random(seed)
    rows = DeviceRowMap(num_rows=40, block_size=BS, token_blocks=100)
    prefix = [90, 91, 92]
    live, paused, saved, nxt, sid = {}, [], set(), 0, 0
    for _ in range(400):
        if live and rng.random() < 0.3:
            s = live.pop(rng.choice(list(live)))
            rows.release(s)
            if rng.random() < 0.5 and s.num_computed_tokens < len(s.block_table) * BS:
                paused.append(s)  # resumes later with what it computed
        else:
            if paused and rng.random() < 0.5:
                s = paused.pop(rng.randrange(len(paused)))
            else:  # a new sequence: the prefix blocks some earlier one computed are a hit
                usable = []
                for b in prefix[: rng.randrange(4)]:
                    if b not in saved and b not in rows.row_of:
                        break
                    usable.append(b)
                s = Seq(sid, usable + list(range(nxt, nxt + 3)), computed=len(usable) * BS)
                sid, nxt = sid + 1, nxt + 3
            n = min(rng.randrange(1, 2 * BS), len(s.block_table) * BS - s.num_computed_tokens)
            if n <= 0 or not rows.can_map(s, n):
                continue
            rows.map(s, blocks_needed(s.num_computed_tokens + n, BS))
            s.num_computed_tokens += n
            live[s.seq_id] = s
        changes, saves, restores = rows.take()
        for b, r in restores:
            assert b in saved and rows.row_of[b] == r
        saved.update(b for b, _ in saves)
        holders = {}
        for s in live.values():
            for b in s.block_table[: rows.mapped[s.seq_id]]:
                holders[rows.row_of[b]] = holders.get(rows.row_of[b], 0) + 1
        assert holders == rows.holders
    for s in list(live.values()):
        rows.release(s)
    assert not rows.holders and rows.num_available == rows.num_rows and saved
    rows.allocator.check()


def test_fewer_rows_than_token_blocks_keeps_the_tokens(hf_models):
    """KV offload with device rows for only part of the host store (a small kv_cache_memory): greedy tokens
    equal sparse decode without offload, float32, with prefix hits on finished requests' blocks (rows saved at
    release, restored at the hit) and a dense first layer; the split is reported; nothing leaks."""
    model_dir = hf_models["qwen2-gqa-bias"][0]
    kw = offload_lag(**{**COMMON, **SPARSE, "dtype": "float32", "max_model_len": 136, "sparse_dense_layers": 1})
    kw["enable_prefix_caching"] = True
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prefix = torch.randint(10, 2000, (64,), generator=g).tolist()
    tail = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (40, 30, 100, 50, 120, 110)]
    # the middle wave's prompts need every row: the prefix's idle rows are taken (saved), the last wave's hits
    # restore them
    waves = [[prefix + tail[0]], [tail[4], tail[5]], [prefix + tail[1], tail[2], prefix + tail[3]]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(**extra) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(model_dir), **kw, **extra)
        return [o.outputs[0].token_ids for w in waves for o in llm.generate(w, params, use_tqdm=False)], llm

    base, _ = run()
    got, llm = run(kv_offload=True, kv_cache_memory=600_000, host_kv_memory=2_000_000)
    assert got == base
    engine = llm.llm_engine
    layout = engine.model_runner.offload.layout
    stats = engine.get_stats(sync=True)
    assert layout.rows < layout.token_blocks == stats.offload_host_blocks
    assert layout.rows <= blocks_needed(120 + 110 + 16, BS)
    assert stats.offload_device_rows == layout.rows and stats.offload_device_rows_used == 0
    assert stats.offload_rows_saved > 0 and stats.offload_rows_restored > 0  # the hits came back from the host
    assert stats.offload_hbm_bytes_dense_layers > 0 and stats.offload_hbm_bytes_metadata > 0
    assert stats.offload_hbm_bytes_pool == layout.pool_slots * layout.head_block_bytes
    assert stats.num_blocks_used == 0
    engine.scheduler.kv.device_space.rows.allocator.check()


def test_each_forward_translates_its_own_rows(hf_models):
    """A CUDA graph's warm-up and capture run the same step metadata; replays refill its inputs in place. The
    row view must be made again by each forward (inside the capture), not kept from an earlier one."""
    llm = LLM(str(hf_models["qwen2-gqa-bias"][0]), **COMMON, **SPARSE, kv_offload=True)
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    engine.add_request("a", list(range(10, 60)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill
    seq = engine.scheduler.running[0]
    batch = runner.prepare([(seq, 1)])
    meta, off = batch.meta, runner.offload
    with torch.inference_mode():
        runner.model(batch.input_ids, batch.positions, runner.kv_caches, meta)
        first = meta.backend_meta.rows.block_tables.clone()
        mapped = off.row_of[seq.block_table].clone()
        off.row_of[seq.block_table] = mapped.flip(0)  # another mapping of the same blocks (a replay's)
        runner.model(batch.input_ids, batch.positions, runner.kv_caches, meta)
    again = meta.backend_meta.rows.block_tables
    assert torch.equal(again, off.row_of[meta.block_tables.long()]) and not torch.equal(again, first)
