"""Tensor parallelism without processes: how heads split, each parallel layer's shards (loaded from full
checkpoint tensors) against the unsplit layer, the clean refusals, and the offload plan that keeps every rank's
offload cache identical."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparseserve import LLM
from sparseserve.config import EngineConfig, OffloadConfig, SchedulerConfig
from sparseserve.distributed import launch
from sparseserve.distributed.group import TPGroup, get_tp_group
from sparseserve.distributed.utils import shard_heads
from sparseserve.engine.parallel import SeqView, StepMessage
from sparseserve.engine.request import Sequence
from sparseserve.engine.scheduler import Preempt, SchedulerOutput
from sparseserve.engine.step_inputs import StepInputs
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.kvcache.device_space import DeviceBlockMap, OffloadSpace
from sparseserve.kvcache.offload import OffloadCache
from sparseserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sparseserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sparseserve.sampling_params import SamplingParams
from tests.engine.sched_utils import make_scheduler


@dataclass(frozen=True)
class OneRank(TPGroup):
    """One rank of a group, alone in this process: collectives return the rank's own part (the tests combine
    the ranks' parts themselves)."""

    def all_reduce(self, x):
        return x

    def gather(self, x, dim=-1):
        return x


def ranks(tp: int) -> list[OneRank]:
    return [OneRank(rank=r, world_size=tp) for r in range(tp)]


@pytest.mark.parametrize(
    "hq, hkv, tp", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (4, 4, 2), (6, 3, 3), (8, 1, 4), (12, 2, 4), (4, 2, 1)]
)
def test_head_shards_cover_every_head_with_its_own_kv_head(hq, hkv, tp):
    group = hq // hkv
    out: list[int] = []
    for r in range(tp):
        h = shard_heads(hq, hkv, tp, r)
        attended = range(h.q_start, h.q_start + h.num_heads)
        kv = range(h.kv_start, h.kv_start + h.num_kv_heads)
        assert h.num_kv_heads == max(hkv // tp, 1) and h.out_heads == hq // tp
        assert {q // group for q in attended} == set(kv)  # whole groups of exactly the rank's KV heads
        out += list(attended)[h.out_offset : h.out_offset + h.out_heads]
    assert out == list(range(hq))  # o_proj's input: every head once, in order


@pytest.mark.parametrize(
    "hq, hkv, tp, match",
    [(2, 2, 4, "attention heads"), (4, 2, 3, "attention heads"), (12, 3, 2, "KV heads"), (12, 3, 4, "KV heads")],
)
def test_head_split_refusals(hq, hkv, tp, match):
    with pytest.raises(ValueError, match=match):
        shard_heads(hq, hkv, tp)


@pytest.mark.parametrize("hq, hkv, tp", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (6, 3, 3)])
def test_qkv_shards_match_the_full_projection(hq, hkv, tp):
    torch.manual_seed(0)
    hidden, d = 16, 4
    w = [torch.randn(h * d, hidden) for h in (hq, hkv, hkv)]
    b = [torch.randn(h * d) for h in (hq, hkv, hkv)]
    x = torch.randn(5, hidden)
    full = [F.linear(x, wi, bi).view(5, -1, d) for wi, bi in zip(w, b)]
    for g in ranks(tp):
        layer = QKVParallelLinear(hidden, d, hq, hkv, bias=True, tp=g)
        for i in range(3):
            layer.weight.weight_loader(layer.weight, w[i], i)
            layer.bias.weight_loader(layer.bias, b[i], i)
        h = layer.heads
        q, k, v = layer(x).split([h.num_heads * d, h.num_kv_heads * d, h.num_kv_heads * d], dim=-1)
        torch.testing.assert_close(q.view(5, -1, d), full[0][:, h.q_start : h.q_start + h.num_heads])
        torch.testing.assert_close(k.view(5, -1, d), full[1][:, h.kv_start : h.kv_start + h.num_kv_heads])
        torch.testing.assert_close(v.view(5, -1, d), full[2][:, h.kv_start : h.kv_start + h.num_kv_heads])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mlp_shards_sum_to_the_full_mlp(tp):
    """gate_up column-parallel, down row-parallel (bias added once): the ranks' partial outputs sum to the
    unsplit MLP's."""
    torch.manual_seed(1)
    hidden, inter = 8, 16
    wg, wu, wd = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    bd = torch.randn(hidden)
    x = torch.randn(3, hidden)
    want = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd, bd)
    total = torch.zeros_like(want)
    for g in ranks(tp):
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp=g)
        gate_up.weight.weight_loader(gate_up.weight, wg, 0)
        gate_up.weight.weight_loader(gate_up.weight, wu, 1)
        down = RowParallelLinear(inter, hidden, bias=True, tp=g)
        down.weight.weight_loader(down.weight, wd)
        down.bias.weight_loader(down.bias, bd)
        gu = gate_up(x)
        n = inter // tp
        total += down(F.silu(gu[:, :n]) * gu[:, n:])
    torch.testing.assert_close(total, want)


@pytest.mark.parametrize("vocab, tp", [(10, 1), (10, 2), (10, 4), (7, 3)])
def test_vocab_shards(vocab, tp):
    """Embedding rows split (the last rank padded): the ranks' lookups sum to the full one; the LM head's
    shards, concatenated and trimmed, are the full logits."""
    torch.manual_seed(2)
    w = torch.randn(vocab, 6)
    ids = torch.tensor([0, vocab - 1, 3, 5, 1, 6])
    hidden = torch.randn(4, 6)
    emb_sum, logits = torch.zeros(len(ids), 6), []
    for g in ranks(tp):
        emb = VocabParallelEmbedding(vocab, 6, tp=g)
        emb.weight.weight_loader(emb.weight, w)
        emb_sum += emb(ids)
        head = ParallelLMHead(vocab, 6, tp=g)
        head.weight.weight_loader(head.weight, w)
        logits.append(head(hidden))  # OneRank's gather: the rank's own columns
    torch.testing.assert_close(emb_sum, F.embedding(ids, w))
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], F.linear(hidden, w))


def test_shard_loading_checks_the_checkpoint_shape():
    layer = RowParallelLinear(8, 4, tp=OneRank(rank=1, world_size=2))
    with pytest.raises(ValueError, match=r"has shape \(4, 6\), expected \(4, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(4, 6))


def test_one_rank_is_no_process_group(tiny_model_dir):
    import torch.distributed as dist

    LLM(str(tiny_model_dir), device="cpu", max_model_len=128, tensor_parallel_size=1)
    assert get_tp_group().world_size == 1 and not dist.is_initialized()


def test_refusals_before_any_process_starts(hf_models, monkeypatch):
    cfg = EngineConfig.from_kwargs(tensor_parallel_size=2)
    assert cfg.parallel_config.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"attention heads \(2\) is not divisible by tensor_parallel_size \(4\)"):
        LLM(str(hf_models["llama-mha-d64-untied"][0]), device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(str(hf_models["qwen2-gqa-bias"][0]), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"attention heads \(9\) is not divisible by tensor_parallel_size \(2\)"):
        LLM(str(hf_models["llama-gqa3-d64-tied"][0]), device="cpu", tensor_parallel_size=2)
    for var in launch.TORCHRUN_VARS:
        monkeypatch.setenv(var, "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4, but tensor_parallel_size=2"):
        LLM(str(hf_models["qwen2-gqa-bias"][0]), device="cpu", tensor_parallel_size=2)


def test_device_refusals(monkeypatch):
    """NCCL missing and fewer visible GPUs than ranks are refused by name (checked with a faked CUDA build)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="needs NCCL"):
        launch.check_devices(2, "cuda", 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs on this host, but 1 are visible"):
        launch.check_devices(2, "cuda", 2)
    launch.check_devices(2, "cpu", 2)  # gloo


def _offload_cache() -> OffloadCache:
    return OffloadCache.build(
        OffloadConfig(kv_offload=True, host_kv_memory=40 * 256, hbm_cache_blocks=12),
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        dense_layers=0,
        local_blocks=2,
        cap=3,
        metadata_block_bytes=64,
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        budget=None,
        device_blocks=16,
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_the_offload_plan_keeps_ranks_identical(seed):
    """A scheduler drives KV offload's device space (arrivals, chunked prefill, decode windows moving,
    hold-backs with tail saves, restores, finishes); rank 0's offload cache and a worker's, each executing the
    step's plan (the worker's after a pickling round trip, as the step message travels), end every step with
    the same ranges, host store and device cache, their step inputs over the step's sequences (the worker's
    as SeqViews, whose block tables travel as the entries added since the sequence's last step) are equal,
    and their ranges are the scheduler's."""
    import pickle

    from sparseserve.engine.parallel import HeldTables, SentTables

    rng = random.Random(seed)
    rank0, worker = _offload_cache(), _offload_cache()
    g = torch.Generator().manual_seed(seed)
    for cache in (rank0, worker):  # the same contents, so saves and restores must agree
        g.manual_seed(seed)
        cache.sparse_cache.copy_(torch.randn(cache.sparse_cache.shape, generator=g))
        cache.host.data.copy_(torch.randn(cache.host.data.shape, generator=g))
    space = OffloadSpace(DeviceBlockMap(rank0.num_device_blocks, 2, 4, rank0.num_token_blocks), 4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    sched = make_scheduler(cfg, BlockAllocator(rank0.num_token_blocks), 4, space, min_chunk=2)
    inputs0, inputs1 = StepInputs(4, torch.device("cpu"), rank0), StepInputs(4, torch.device("cpu"), worker)
    saves = restores = 0
    sent, held = SentTables(), HeldTables()
    deltas = 0  # views that carried part of their table
    for step in range(80):
        if rng.random() < 0.35:
            s = Sequence(
                step,
                f"r{step}",
                0,
                [rng.randrange(100) for _ in range(rng.randint(2, 40))],
                SamplingParams(max_tokens=rng.randint(1, 12)),
            )
            sched.add(s)
        out = sched.schedule()
        if not out.is_empty:
            plan = out.offload
            saves, restores = saves + len(plan.saves), restores + len(plan.restores)
            views = pickle.loads(pickle.dumps(StepMessage([], [(sent.view(q, n), n) for q, n in out.scheduled], plan)))
            deltas += sum(v.table_start > 0 for v, _ in views.scheduled)
            for v, _ in views.scheduled:
                held.complete(v)
            for cache, inputs, msg in ((rank0, inputs0, plan), (worker, inputs1, views.plan)):
                cache.begin_step(msg)
                inputs.note_plan(msg)
            a, b = inputs0.build(out.scheduled, None)[0], inputs1.build(views.scheduled, None)[0]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert rank0.ranges == worker.ranges == space.map.ranges
            assert torch.equal(rank0.host.data, worker.host.data)
            assert torch.equal(rank0.sparse_cache, worker.sparse_cache)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
                    sent.forget(seq.seq_id)  # the engine's release, on both sides
                    held.forget(seq.seq_id)
        if len(sched.running) > 1 and rng.random() < 0.2:  # as the working-set limit holds back the newest
            victim = sched.running[-1]
            sched.preempt(victim, Preempt.HOLD_BACK, SchedulerOutput())
            sent.forget(victim.seq_id)
            held.forget(victim.seq_id)
    assert saves > 0 and restores > 0 and deltas > 0  # paused with partial tails, resumed; tables in parts


def test_seq_view_reads_like_the_sequence():
    seq = Sequence(3, "r", 0, list(range(50, 90)), SamplingParams())
    seq.block_table = [7, 2, 9]
    seq.num_computed_tokens = 16
    view = SeqView.of(seq, 10)
    assert view.token_ids[16:26] == seq.token_ids[16:26] and view.num_tokens == seq.num_tokens
    assert list(view.block_table) == seq.block_table and view.block_table_array().tolist() == seq.block_table


def test_block_tables_travel_as_what_each_step_added():
    """A step message carries the block table entries added since the sequence's last step (SentTables), the
    worker grows its copy from them (HeldTables) and reads the whole table; a release sends it whole again
    (a recomputed sequence's new blocks), and a step whose entries do not follow what the rank holds fails."""
    import pickle

    from sparseserve.engine.parallel import HeldTables, SentTables

    seq = Sequence(3, "r", 0, list(range(100)), SamplingParams())
    sent, held = SentTables(), HeldTables()

    def step(n: int = 1) -> SeqView:
        view = pickle.loads(pickle.dumps(sent.view(seq, n)))
        held.complete(view)
        return view

    seq.block_table = list(range(40, 60))  # a long context: 20 blocks
    first = sent.view(seq, 1)
    assert first.table_start == 0 and len(first.table) == 20
    held.complete(pickle.loads(pickle.dumps(first)))
    assert len(step().table) == 20 and sent.view(seq, 1).table.size == 0  # no new block: nothing travels
    for b in range(60, 100):  # one block a step, past the buffer's first growth
        seq.block_table.append(b)
        wire = sent.view(seq, 1)
        assert (wire.table_start, wire.table.tolist()) == (b - 40, [b])
        held.complete(view := pickle.loads(pickle.dumps(wire)))
        assert view.block_table_array().tolist() == seq.block_table and view.table_start == 0
    sent.forget(3), held.forget(3)  # released (e.g. preempted to recompute): new blocks, sent whole
    seq.block_table = [7, 8]
    assert step().block_table_array().tolist() == [7, 8]
    seq.block_table = [7]
    with pytest.raises(RuntimeError, match="sequence 3: its block table shrank without a release"):
        sent.view(seq, 1)
    with pytest.raises(RuntimeError, match="sequence 4: a step sent its block table from entry 5, this rank holds 0"):
        HeldTables().complete(SeqView(4, 0, 1, [1], np.zeros(1, dtype=np.int32), 5))


def test_segment_view_reads_like_the_sequence():
    """A layer-segmented prefill's first segment carries the uncomputed tokens and the block table (what
    engine/layer_prefill.py reads); a later one only the ids and counts, and reading more of it raises."""
    import pickle

    from sparseserve.engine.parallel import SegmentView
    from sparseserve.engine.scheduler.segments import LayerSegment

    seq = Sequence(3, "r", 0, list(range(4000, 4100)), SamplingParams())
    seq.block_table = [7, 2, 9, 4, 11, 5, 8, 1, 3, 6, 10, 12, 0]
    seq.num_computed_tokens = 40  # a prefix-cache hit
    first = pickle.loads(pickle.dumps(SegmentView.segment(LayerSegment(seq, 0, 2, 30))))
    view = first.seq
    assert (first.start, first.end, first.cost) == (0, 2, 30)
    assert (view.seq_id, view.num_computed_tokens, view.num_tokens) == (3, 40, 100)
    assert list(view.token_ids[40:100]) == seq.token_ids[40:100]
    assert list(view.block_table[:13]) == seq.block_table
    later = SegmentView.segment(LayerSegment(seq, 2, 3, 15))
    assert later.seq.seq_id == 3 and len(pickle.dumps(later)) < len(pickle.dumps(first)) - 200
    with pytest.raises(RuntimeError, match="sequence 3: its token ids came with its first segment only"):
        later.seq.token_ids[40:100]
    with pytest.raises(RuntimeError, match="its block table came with its first segment only"):
        later.seq.block_table


def test_driver_refuses_runner_methods_that_would_run_on_rank_0_alone():
    from sparseserve.engine.parallel import TPDriver

    class Runner:
        arch = "the model"

        def prepare(self, scheduled):
            return scheduled

    driver = TPDriver.__new__(TPDriver)  # no process group: only the attribute forwarding is under test
    driver.runner = Runner()
    assert driver.arch == "the model"
    with pytest.raises(AttributeError, match="ModelRunner.prepare is not available under tensor parallelism"):
        driver.prepare
