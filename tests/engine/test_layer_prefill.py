"""Layer-segmented prefill under KV offload (engine/layer_prefill.py): config and refusals, the planner's segment
costs, the device reserve it frees, and the engine: the same greedy tokens as chunked prefill (dense and sparse
layers, one layer or as many as the budget allows per step, several requests mixing with decodes), the first
token's logprobs equal to transformers', and random schedules with preemptions and aborts in the middle of a
prefill: the same tokens, no block leaked, the host store equal to the device cache for every full block."""

from __future__ import annotations

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.config import PREFILL_LAYER_SEGMENT, EngineConfig, OffloadConfig
from sparseserve.engine.layer_prefill import LayerPrefill
from sparseserve.engine.request import Sequence
from sparseserve.engine.scheduler import Preempt, Scheduler, SchedulerOutput, SegmentPlanner
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from sparseserve.kvcache.host import host_block_bytes
from sparseserve.kvcache.offload import OffloadCache
from sparseserve.metrics import ServerMetrics, parse_metrics
from tests.conftest import make_hf_model
from tests.engine.sched_utils import LastSchedule
from tests.schedules import check_pool, held_blocks

BS = 8
SPARSE = dict(
    block_size=BS,
    sparse_policy="topk",
    sparse_budget=4 * BS,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
    sparse_dense_context=0,
)
COMMON = dict(
    device="cpu",
    dtype="float32",
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    kv_offload=True,  # lags by default: a chunked or layer-segmented prefill's last chunk selects the first lists
    **SPARSE,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    """A 4-layer GQA Llama (segments of 1, 2 or 3 layers are all possible)."""
    path = tmp_path_factory.mktemp("llama4")
    hf = make_hf_model(
        path,
        "LlamaConfig",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_size=128,
        tie_word_embeddings=False,
        num_hidden_layers=4,
    )
    return path, hf


def prompts(lengths=(120, 75, 30, 200)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]


def test_config_flags_and_refusals():
    cfg = EngineConfig.from_kwargs(kv_offload=True, layer_segmented_prefill=True, prefill_layer_segment=2, **SPARSE)
    assert cfg.offload_config.layer_segmented_prefill and cfg.offload_config.prefill_layer_segment == 2
    assert OffloadConfig().layer_segmented_prefill is None  # the default depends on the model (below)
    assert OffloadConfig().segment_layers == PREFILL_LAYER_SEGMENT == 4 and cfg.offload_config.segment_layers == 2
    args = build_parser(["generate"]).parse_args(
        [
            "generate",
            "--kv-offload",
            "--sparse-policy",
            "topk",
            "--layer-segmented-prefill",
            "--prefill-layer-segment",
            "3",
        ]
    )
    kw = engine_kwargs_from_args(args)
    assert kw["layer_segmented_prefill"] is True and kw["prefill_layer_segment"] == 3
    with pytest.raises(ValueError, match="layer_segmented_prefill needs kv_offload"):
        EngineConfig.from_kwargs(layer_segmented_prefill=True, **SPARSE)
    with pytest.raises(ValueError, match="prefill_layer_segment must be >= 1"):
        EngineConfig.from_kwargs(kv_offload=True, layer_segmented_prefill=True, prefill_layer_segment=0, **SPARSE)
    # under tensor parallelism too (tests/distributed/test_tensor_parallel.py)
    EngineConfig.from_kwargs(kv_offload=True, layer_segmented_prefill=True, tensor_parallel_size=2, **SPARSE)


def test_default_where_it_saves_device_memory(model4, tmp_path):
    """Its default: on under KV offload where the device memory it needs (scratch, hidden states, one step's short
    prompts and a window) is at most chunked prefill's whole-prompt reserve: off on model4 (4 layers: a token's
    scratch and hidden states take as much as its K/V), on with 8 layers; an explicit choice stays; off without KV
    offload; the engine resolves it before the runner and the scheduler read it."""
    oc = OffloadConfig(kv_offload=True)
    assert oc.resolve_layer_segments(segmented_bytes=1, chunked_bytes=2).layer_segmented_prefill is True
    assert oc.resolve_layer_segments(segmented_bytes=3, chunked_bytes=2).layer_segmented_prefill is False
    explicit = OffloadConfig(kv_offload=True, layer_segmented_prefill=False)
    assert explicit.resolve_layer_segments(segmented_bytes=1, chunked_bytes=2).layer_segmented_prefill is False
    assert OffloadConfig().resolve_layer_segments(segmented_bytes=1, chunked_bytes=2).layer_segmented_prefill is False
    model8 = tmp_path / "llama8"
    shapes = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_size=128, tie_word_embeddings=False)
    make_hf_model(model8, "LlamaConfig", num_hidden_layers=8, **shapes)
    for path, on in ((model4[0], False), (model8, True)):
        engine = LLM(str(path), **COMMON).llm_engine
        assert engine.config.offload_config.layer_segmented_prefill is on
        assert (engine.model_runner.layer_prefill is not None) is on and (engine.scheduler.segments is not None) is on
    with pytest.raises(ValueError, match="prefill_layer_segment needs layer_segmented_prefill .* would not save"):
        LLM(str(model4[0]), **COMMON, prefill_layer_segment=2)


def test_segment_planner():
    """A segment of k layers over T tokens costs ceil(T * k / layers); it takes as many layers as the budget
    left allows (at most prefill_layer_segment), at least one when the scheduler says it runs alone (beside
    nothing but decodes), none otherwise."""
    plan = SegmentPlanner(num_layers=4, min_context=32)
    seq = Sequence(0, "r", 0, list(range(100)), GREEDY)
    assert plan.wants(seq) and not plan.wants(Sequence(1, "r", 0, list(range(32)), GREEDY))
    seq.num_computed_tokens = 99  # a paused decode resumes as a decode
    assert not plan.wants(seq)
    seg = plan.segment(seq, 100, 0, 32, alone=True)
    assert (seg.start, seg.end, seg.cost) == (0, 1, 25)
    assert plan.segment(seq, 40, 1, 32, alone=True).end == 4  # 3 layers x 40 tokens = 30 <= 32
    assert plan.segment(seq, 200, 2, 32, alone=False) is None  # one layer (50) exceeds what is left
    seg = plan.segment(seq, 200, 2, 32, alone=True)
    assert (seg.start, seg.end, seg.cost) == (2, 3, 50)  # never starves
    capped = SegmentPlanner(num_layers=4, min_context=32, max_layers=2)
    assert capped.segment(seq, 10, 0, 32, alone=True).end == 2
    # the cap holds beside decoding requests only: alone a prefill takes what the budget allows
    assert capped.segment(seq, 10, 0, 32, alone=True, decodes=False).end == 4
    assert capped.segment(seq, 50, 1, 32, alone=True, decodes=False).end == 3  # the budget: 2 layers of 50 tokens


def test_segments_longer_with_nothing_decoding(model4):
    """prefill_layer_segment=1: a prompt prefilling while nothing else runs takes as many layers a step as the
    budget allows; beside a decoding request, one."""
    llm = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=True, prefill_layer_segment=1, profiler=LastSchedule())
    engine = llm.llm_engine
    engine.add_request("long", list(range(1, 41)), GREEDY)  # 40 tokens: a layer costs 10 of the budget of 32
    engine.step()
    assert [(s.start, s.end) for s in engine.profiler.out.segments] == [(0, 3)]
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("short", list(range(1, 11)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()  # prefills whole, then decodes
    engine.add_request("long2", list(range(2, 42)), GREEDY)
    spans = []
    while engine.has_unfinished_requests():
        engine.step()
        spans += [(s.start, s.end) for s in engine.profiler.out.segments]
    assert spans[:4] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def segment_schedule(model_dir, longs: int, short_tokens: int, **kw) -> tuple[str, dict]:
    """One-layer segments: a short request decoding, then `longs` long prompts at once. Returns each step's
    segments ("long0:0-1", comma-joined) or "D" for a step without one, space-joined, and the tokens."""
    llm = LLM(
        str(model_dir), **COMMON, layer_segmented_prefill=True, prefill_layer_segment=1, profiler=LastSchedule(), **kw
    )
    engine = llm.llm_engine
    engine.add_request(
        "short", list(range(1, 11)), SamplingParams(temperature=0.0, max_tokens=short_tokens, ignore_eos=True)
    )
    engine.step()
    for i in range(longs):
        engine.add_request(f"long{i}", list(range(2 + i, 42 + i)), GREEDY)
    pattern, tokens = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] = o.outputs[0].token_ids
        segs = engine.profiler.out.segments
        pattern.append(",".join(f"{s.seq.request_id}:{s.start}-{s.end}" for s in segs) or "D")
    return " ".join(pattern), tokens


def test_decode_steps_between_segments(model4):
    """segment_decode_steps=2: a segment that ran beside a decoding request is followed by two steps of its
    decodes alone; without decodes the segments run back to back. The tokens are the same as without."""
    outs = {}
    for steps in (0, 2):
        pattern, outs[steps] = segment_schedule(model4[0], 1, 30, segment_decode_steps=steps)
        if steps:  # four layers, two decode steps after each
            assert pattern.startswith("long0:0-1 D D long0:1-2 D D long0:2-3 D D long0:3-4"), pattern
        else:
            assert pattern.startswith("long0:0-1 long0:1-2 long0:2-3 long0:3-4"), pattern
    assert outs[0] == outs[2]
    with pytest.raises(ValueError, match="segment_decode_steps"):
        LLM(str(model4[0]), **COMMON, segment_decode_steps=-1)


def test_burst_unpaced(model4):
    """More prompts waiting than segment_pacing_max_waiting and than the requests decoding: the layer-by-layer
    prefill takes the step's whole budget (3 of 4 layers here) with no decode steps after; once the queue is that
    short, the cap of one layer and the two decode steps return (with 0 too: one waits, one decodes). The tokens
    are the same as with pacing."""
    outs = {}
    for max_waiting in (0, 1, 8):
        pattern, outs[max_waiting] = segment_schedule(
            model4[0], 3, 40, segment_decode_steps=2, segment_pacing_max_waiting=max_waiting
        )
        paced = "long1:0-1 D D long1:1-2 D D long1:2-3 D D long1:3-4 D D"
        first = "long0:0-3 long0:3-4" if max_waiting < 8 else "long0:0-1 D D long0:1-2 D D long0:2-3 D D long0:3-4 D D"
        assert pattern.startswith(f"{first} {paced}"), pattern
    assert outs[0] == outs[1] == outs[8]
    with pytest.raises(ValueError, match="segment_pacing_max_waiting"):
        LLM(str(model4[0]), **COMMON, segment_pacing_max_waiting=-1)


def test_reserve_freed_for_the_pool():
    """With layer-segmented prefill the device block cache keeps no whole max_model_len prefill: its blocks go
    to the HBM pool, and a device cache smaller than one max_model_len sequence is allowed."""

    def build(on: bool, budget: int | None = 15 << 20, device_blocks: int | None = None, **kw) -> OffloadCache:
        return OffloadCache.build(
            OffloadConfig(kv_offload=True, host_kv_memory=4 * 1024 * 4096, layer_segmented_prefill=on, **kw),
            num_layers=4,
            num_kv_heads=2,
            head_dim=32,
            block_size=BS,
            dtype=torch.float32,
            device=torch.device("cpu"),
            dense_layers=1,
            local_blocks=2,
            cap=4,
            metadata_block_bytes=256,
            max_model_len=1024,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            budget=budget,
            device_blocks=device_blocks,
        )

    off, on = build(False).layout, build(True).layout
    seq_blocks = 1024 // BS
    assert off.device_blocks - on.device_blocks == seq_blocks
    assert (on.pool_slots - off.pool_slots) * on.head_block_bytes > (seq_blocks - 1) * on.device_block_bytes
    # prompts above layer_segment_min_tokens (16 < the step's 64) go layer by layer: the device cache keeps
    # room for 16 prefill tokens, not 64, and the pool gets the rest
    low = build(True, layer_segment_min_tokens=16).layout
    assert on.device_blocks - low.device_blocks == (64 - 16) // BS and low.pool_slots > on.pool_slots
    assert build(False, layer_segment_min_tokens=16).layout == off  # only with layer-segmented prefill
    small = 64 // BS + 2 + 1  # one step's prefill and a window
    assert build(True, None, small).layout.device_blocks == small
    with pytest.raises(ValueError, match="device block cache needs at least"):
        build(False, None, small)


def test_buffers_in_the_device_split(model4):
    """Its buffers (two layers' scratch K/V, the prompt's hidden states) are what the KV budget gave up for them
    (LayerPrefill.device_bytes), reported beside the offload's split in the stats and on /metrics."""
    engine = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=True).llm_engine
    runner, a = engine.model_runner, engine.model_runner.arch
    want = LayerPrefill.device_bytes(
        num_kv_heads=runner.num_kv_heads,
        head_dim=a.head_dim,
        hidden_size=a.hidden_size,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        dtype=runner.dtype,
    )
    stats = engine.get_stats()
    assert stats.offload_hbm_bytes_buffers == runner.layer_prefill.nbytes == want > 0
    metrics = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
    assert metrics["sparseserve:offload_hbm_bytes_buffers"] == want
    assert metrics["sparseserve:offload_hbm_bytes_pool"] == stats.offload_hbm_bytes_pool > 0
    chunked = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=False).llm_engine.get_stats()
    assert chunked.offload_hbm_bytes_buffers == 0


def drive(llm, reqs: list[list[int]], params: SamplingParams, check=None) -> tuple[list[list[int]], list]:
    """All requests at once, stepped to the end; returns their tokens and every step's schedule."""
    engine = llm.llm_engine
    for i, p in enumerate(reqs):
        engine.add_request(str(i), p, params)
    outs, schedules = {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        schedules.append(engine.profiler.out)
        if check is not None:
            check(engine)
    return [outs[str(i)] for i in range(len(reqs))], schedules


def check_segmented(engine) -> None:
    """Accounting after a step; a prefill in progress holds only its first decode's window on the device and
    the host store equals the device cache for every full block the device holds."""
    held_blocks(engine)
    offload = engine.model_runner.offload
    check_pool(offload)
    sched, dm = engine.scheduler, engine.scheduler.kv.device_space.map
    assert len(sched.segments.layers_done) <= 1
    # a prefill's copies go unfenced exactly while it is in progress (its rows are no one else's until then)
    assert offload.host.layer_d2h.held == (engine.model_runner.layer_prefill.current is not None)
    offload.sync()
    sparse = torch.stack(engine.model_runner.kv_caches[offload.dense_layers :])
    for seq in sched.running:
        start, blocks = dm.range_of(seq)
        if seq.seq_id in sched.segments.layers_done:
            assert (start, start + len(blocks)) == dm.window(seq) and len(blocks) <= dm.local_blocks
            continue
        full = range(start, min(seq.num_computed_tokens // BS, start + len(blocks)))
        dev = [blocks[j - start] for j in full]
        assert torch.equal(
            offload.host.data[offload.dense_layers :, [seq.block_table[j] for j in full]], sparse[:, dev].cpu()
        )


@pytest.mark.parametrize(
    "dense_layers, segment",
    [pytest.param(0, None, marks=pytest.mark.slow), (1, 1), pytest.param(2, 3, marks=pytest.mark.slow)],
)
def test_layer_segmented_equals_chunked(model4, dense_layers, segment, monkeypatch):
    """Prompts longer than one step's budget (and one shorter), several at once: the same greedy tokens as
    chunked prefill with KV offload and its lagged selection (the last chunk selects the first decode's lists, so
    no decode selects its own: no step's eager fix); segments ran beside decodes, one prefill at a time, each
    holding only its window on the device; the layer-progress gauges show on /metrics; nothing leaks."""
    kw = dict(COMMON, sparse_dense_layers=dense_layers)
    base, _ = drive(LLM(str(model4[0]), **kw, profiler=LastSchedule()), prompts(), GREEDY)
    llm = LLM(
        str(model4[0]), **kw, layer_segmented_prefill=True, prefill_layer_segment=segment, profiler=LastSchedule()
    )
    engine = llm.llm_engine
    backend = engine.model_runner.attn_backend
    assert backend.params.lag
    step_inputs, fixes = backend.step_inputs, []
    monkeypatch.setattr(
        backend, "step_inputs", lambda *a: fixes.append("fix_select" in (out := step_inputs(*a))) or out
    )
    seen_progress = []

    def check(engine):
        check_segmented(engine)
        stats = engine.get_stats()
        if stats.layer_prefills_running:
            seen_progress.append(stats.layer_prefill_layers_done)
            m = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
            assert m["sparseserve:layer_prefill_layers_done"] == stats.layer_prefill_layers_done
            assert m["sparseserve:layer_prefills_running"] == 1

    got, schedules = drive(llm, prompts(), GREEDY, check)
    assert got == base
    assert fixes and not any(fixes)
    segs = [seg for s in schedules for seg in s.segments]
    assert {seg.seq.prompt_token_ids.__len__() for seg in segs} == {120, 75, 200}  # 30 tokens: chunked
    assert any(s.segments and any(n == 1 for _, n in s.scheduled) for s in schedules)  # beside decodes
    assert all(seg.end - seg.start <= (segment or 4) for seg in segs)
    # over the budget only one layer beside nothing but decodes (a layer cannot be split)
    assert all(
        seg.cost + sum(n for _, n in s.scheduled) <= 32
        or (s.segments == [seg] and seg.end - seg.start == 1 and all(n == 1 for _, n in s.scheduled))
        for s in schedules
        for seg in s.segments
    )
    assert seen_progress and max(seen_progress) > 0
    stats = engine.get_stats(sync=True)
    assert stats.num_blocks_used == 0 == stats.offload_device_blocks_used and stats.layer_prefills_running == 0
    assert stats.num_prompt_tokens == sum(map(len, prompts()))


def test_short_prompts_pass_one_waiting_for_the_layer_by_layer_prefill(model4):
    """While a prompt prefills layer by layer, a short prompt (prefilled whole) behind a second long one is admitted
    at once; the long one starts as soon as the first has ended and a step's budget has room for its segment (the
    running short prompt's chunk comes first); the same greedy tokens as chunked prefill."""
    reqs = prompts((120, 75, 30))
    base, _ = drive(LLM(str(model4[0]), **COMMON, profiler=LastSchedule()), reqs, GREEDY)
    llm = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=True, profiler=LastSchedule())
    got, schedules = drive(llm, reqs, GREEDY, check_segmented)
    assert got == base

    def steps(n, what):
        return [i for i, s in enumerate(schedules) if any(len(x.prompt_token_ids) == n for x in what(s))]

    segments, chunks = (lambda s: [g.seq for g in s.segments]), (lambda s: [q for q, _ in s.scheduled])
    first, free = steps(75, segments)[0], steps(120, segments)[-1] + 1
    assert steps(30, chunks)[0] < free <= first
    cost = schedules[first].segments[0].cost
    assert all(sum(n for _, n in schedules[i].scheduled) + cost > 32 for i in range(free, first))


def first_decode_stats(engine, prompt: list[int]):
    """One request prefilled to its first token, then its first decode: the stats after each."""
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while not any(o.outputs[0].token_ids for o in engine.step()):  # the prefill, to its first token
        pass
    before = engine.get_stats(sync=True)
    engine.step()  # the first decode
    return before, engine.get_stats(sync=True)


def test_first_lists_go_into_the_pool_from_the_prefill(model4):
    """Under lagged selection a layer-segmented prefill puts the lists it selects for the first decode into the
    HBM pool from each layer's scratch: that decode loads none of its head blocks from the host (the tokens equal
    chunked prefill's: test_layer_segmented_equals_chunked). The prompt's other head blocks before the window go
    into the (roomy) pool's free slots too, counted apart."""
    llm = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=True, prefill_layer_segment=1)
    before, after = first_decode_stats(llm.llm_engine, prompts()[3])
    assert before.offload_blocks_seeded > 0 and before.offload_layer_steps == 0
    assert before.offload_blocks_filled > 0 and after.offload_blocks_filled == before.offload_blocks_filled
    assert after.offload_layer_steps > 0
    assert after.offload_blocks_loaded == 0 and after.offload_bypass_reads == 0
    assert after.offload_hbm_hits >= before.offload_blocks_seeded  # every listed block, each layer and head


TOPP = dict(sparse_policy="topp", sparse_budget=8 * BS, sparse_top_p=0.7, sparse_topp_flat_share=1.0)


@pytest.mark.slow
def test_prefetching_reads_after_a_layer_segmented_prefill(model4):
    """topp with prefetching reads (KV offload, not lagged): layer-segmented and chunked prefill give the tokens
    of topp without offload; a segmented prefill's last chunk selects the first decode's candidates, which go into
    the pool from the scratch with the rest of the prompt (free slots of a roomy pool), so that decode's prefetch
    loads nothing and its own candidates are all found."""
    reqs = prompts()
    plain = {**COMMON, **TOPP, "kv_offload": False}
    base, _ = drive(LLM(str(model4[0]), **plain, profiler=LastSchedule()), reqs, GREEDY)
    for segmented in (False, True):
        kw = {**COMMON, **TOPP, "offload_prefetch": True, "layer_segmented_prefill": segmented}
        llm = LLM(str(model4[0]), **kw, profiler=LastSchedule())
        assert llm.llm_engine.model_runner.attn_backend.params.prefetch
        got, _ = drive(llm, reqs, GREEDY, check_segmented if segmented else None)
        assert got == base, f"layer-segmented {segmented}"
    before, after = first_decode_stats(LLM(str(model4[0]), **kw, prefill_layer_segment=1).llm_engine, reqs[3])
    assert before.offload_blocks_seeded > 0 and after.offload_blocks_loaded == 0
    assert before.offload_blocks_filled > 0 and after.offload_hbm_hits > 0 == after.offload_hbm_misses


def test_segment_threshold_below_the_budget(model4):
    """layer_segment_min_tokens below the step's budget: a 30-token prompt (over 24, under the budget of 32)
    goes layer by layer too; the same greedy tokens as chunked prefill; refused below 1."""
    base, _ = drive(LLM(str(model4[0]), **COMMON, profiler=LastSchedule()), prompts(), GREEDY)
    llm = LLM(
        str(model4[0]), **COMMON, layer_segmented_prefill=True, layer_segment_min_tokens=24, profiler=LastSchedule()
    )
    got, schedules = drive(llm, prompts(), GREEDY, check_segmented)
    assert got == base
    assert {len(seg.seq.prompt_token_ids) for s in schedules for seg in s.segments} == {120, 75, 30, 200}
    assert llm.llm_engine.get_stats(sync=True).num_blocks_used == 0
    with pytest.raises(ValueError, match="layer_segment_min_tokens must be >= 1"):
        OffloadConfig(kv_offload=True, layer_segmented_prefill=True, layer_segment_min_tokens=0)


@pytest.mark.slow
def test_sparse_prefill_per_layer(model4):
    """SALE's sparse prefill inside the segments: a 450-token prompt alone (so the chunk boundaries are those of
    chunked prefill) selects the same tiles (counters) and gives the same tokens."""
    kw = dict(
        COMMON,
        max_model_len=512,
        max_num_batched_tokens=128,
        sparse_prefill="sale",
        sparse_prefill_threshold=1.0,
        sparse_prefill_min_len=200,
    )
    runs = []
    for on in (False, True):
        llm = LLM(
            str(model4[0]),
            **kw,
            layer_segmented_prefill=on,
            prefill_layer_segment=2 if on else None,
            profiler=LastSchedule(),
        )
        tokens, schedules = drive(llm, prompts((450,)), GREEDY)
        assert any(s.segments for s in schedules) == on
        runs.append((tokens, llm.llm_engine.get_stats(sync=True)))
    (base, off), (got, on) = runs
    assert got == base
    assert 0 < on.prefill_tiles_computed == off.prefill_tiles_computed < on.prefill_tiles_dense
    assert on.prefill_tiles_dense == off.prefill_tiles_dense


def test_first_token_logprobs_match_transformers(model4):
    """A 150-token prompt prefilled one layer per step (after a 40-token prefix-cache hit, restored layer by
    layer from the host store): the first token's top logprobs equal transformers' on the same weights."""
    path, hf = model4
    llm = LLM(str(path), **COMMON, layer_segmented_prefill=True, prefill_layer_segment=1, profiler=LastSchedule())
    p = prompts((150,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), dim=-1)
    for prompt, expect in ((p, ref), (p[:40] + p[:110], None)):  # the second shares 5 blocks with the first
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        if expect is None:
            assert out.num_cached_tokens == 40
            with torch.no_grad():
                expect = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        lps = out.outputs[0].logprobs[0]
        assert out.outputs[0].token_ids[0] == int(expect.argmax())
        for tid, lp in lps.items():
            assert abs(lp.logprob - float(expect[tid])) < 1e-4, (tid, lp.logprob, float(expect[tid]))


def test_layer_copies_take_runs_of_rows(model4):
    """Prompts one after another until the host store reuses evicted cached blocks: each finished layer still
    leaves in a run or two of host rows (allocations are ascending; evicted blocks come tail first)."""
    llm = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=True)
    host = llm.llm_engine.model_runner.offload.host
    g = torch.Generator().manual_seed(4)
    for _ in range(7):  # 7 x 25 blocks through a store of 128
        llm.generate([torch.randint(10, 2000, (200,), generator=g).tolist()], GREEDY, use_tqdm=False)
    d2h = host.layer_d2h
    submits = d2h.blocks_written // 25  # a layer of one prompt each
    assert llm.llm_engine.get_stats().offload_host_blocks == 128 and submits == 7 * 4
    assert d2h.num_copies <= 2 * submits, d2h.num_copies


def test_prompt_logprobs_layer_by_layer(model4):
    """prompt_logprobs of a prompt prefilled one layer per step: every prompt token's logprob and rank equal
    transformers' on the same weights, and equal chunked prefill's (the same entries, top alternatives too)."""
    path, hf = model4
    p = prompts((150,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
    outs = []
    for segmented in (True, False):
        llm = LLM(
            str(path), **COMMON, layer_segmented_prefill=segmented, prefill_layer_segment=1 if segmented else None
        )
        out = llm.generate([p], params, use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            lp = out.prompt_logprobs[j][p[j]]
            assert abs(lp.logprob - float(ref[j - 1, p[j]])) < 1e-4, j
            assert lp.rank == int((ref[j - 1] > ref[j - 1, p[j]]).sum()) + 1
        outs.append(out.prompt_logprobs)
        assert llm.llm_engine.get_stats(sync=True).num_blocks_used == 0
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)


@pytest.mark.parametrize(
    "how", ["pause", pytest.param("recompute", marks=pytest.mark.slow), pytest.param("abort", marks=pytest.mark.slow)]
)
def test_interrupted_mid_prefill(model4, how):
    """The 200-token prompt is preempted (paused: it keeps its token blocks; recomputed: it gives them back) or
    aborted after two of its four layers: a resumed prefill starts again at layer 0 and every token equals
    chunked prefill's; no token block, device block or prefill state is left behind."""
    base, _ = drive(LLM(str(model4[0]), **COMMON, profiler=LastSchedule()), prompts(), GREEDY)
    llm = LLM(str(model4[0]), **COMMON, layer_segmented_prefill=True, prefill_layer_segment=1, profiler=LastSchedule())
    engine, reqs = llm.llm_engine, prompts()
    for i, p in enumerate(reqs):
        engine.add_request(str(i), p, GREEDY)
    sched, outs, interrupted = engine.scheduler, {}, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        check_segmented(engine)
        seq = next((s for s in sched.running if sched.segments.layers_done.get(s.seq_id) == 2), None)
        if interrupted is None and seq is not None and seq.request_id == "3":
            interrupted = seq
            if how == "abort":
                engine.abort_request("3")
            else:  # what Scheduler.schedule does to a victim
                why = Preempt.PAUSE if how == "pause" else Preempt.RECOMPUTE
                sched.preempt(seq, why, SchedulerOutput())
                engine.model_runner.release(seq.seq_id)
                assert bool(seq.block_table) == (how == "pause") and seq.num_computed_tokens == 0
            assert engine.model_runner.layer_prefill.current is None and not sched.segments.layers_done
            assert seq.seq_id not in engine.scheduler.kv.device_space.map.ranges
            check_segmented(engine)
    assert interrupted is not None
    assert [outs.get(str(i)) for i in range(4)] == base[:3] + [None if how == "abort" else base[3]]
    stats = engine.get_stats(sync=True)
    assert stats.num_blocks_used == 0 == stats.offload_device_blocks_used and stats.layer_prefills_running == 0
    assert stats.num_preemptions == (how != "abort")


@pytest.mark.slow
@pytest.mark.parametrize("seed, control", [(2, False), (12, True), (10, True)])
def test_random_schedules_preempt_and_abort_mid_prefill(model4, monkeypatch, seed, control):
    """Random arrivals, aborts and steps with 16 token blocks and 12 device blocks (preemptions), one layer per
    segment: the same greedy tokens as chunked prefill with KV offload (a budget covering max_model_len, so
    every block is selected; an aborted request's tokens agree up to where either run cut it), accounting and
    the host store equal to the device cache after every step; these seeds preempt or abort prefills after
    some of their layers ran (seed 2 with the working-set limit off inside the engine: the preemption it makes
    mid-prefill is one the limit avoids); each has bursts (pacing off: docs/offload.md, "A burst's queue") and
    paced stretches."""
    from sparseserve.engine.engine import LLMEngine
    from sparseserve.engine.scheduler.segments import LayerSegmentedPrefill
    from tests.kvcache.test_offload import random_schedule

    interrupted, aborted, current, bursts = [], set(), [], []
    init, preempt, finish, abort = Scheduler.__init__, Scheduler.preempt, Scheduler.finish, LLMEngine.abort_request
    burst = LayerSegmentedPrefill._burst

    def mid_prefill(sched, seq) -> bool:
        return sched.segments is not None and sched.segments.layers_done.get(seq.seq_id, 0) > 0

    def init_spy(self, *a, **k):
        init(self, *a, **k)
        current[:] = [self]

    def preempt_spy(self, seq, why, out):
        if mid_prefill(self, seq):
            interrupted.append("recompute" if why is Preempt.RECOMPUTE else "pause")
        preempt(self, seq, why, out)

    def finish_spy(self, seq):
        if mid_prefill(self, seq):
            interrupted.append("abort")
        finish(self, seq)

    def abort_spy(self, request_id):
        aborted.add(request_id)
        abort(self, request_id)

    def burst_spy(self, seq=None):
        bursts.append(burst(self, seq))
        return bursts[-1]

    for cls, name, spy in (
        (LayerSegmentedPrefill, "_burst", burst_spy),
        (Scheduler, "__init__", init_spy),
        (Scheduler, "preempt", preempt_spy),
        (Scheduler, "finish", finish_spy),
        (LLMEngine, "abort_request", abort_spy),
    ):
        monkeypatch.setattr(cls, name, spy)
    host = 16 * host_block_bytes(4, 2, BS, 32, torch.float32)  # 16 token blocks
    covering = dict(
        greedy=True,
        sparse_budget=12 * BS,
        kv_offload=True,
        hbm_cache_blocks=16,
        host_kv_memory=host,
        num_gpu_blocks_override=12,
    )
    off, _ = random_schedule(model4[0], seed, check=True, **covering)
    interrupted.clear()
    on, _ = random_schedule(
        model4[0], seed, check=True, layer_segmented_prefill=True, prefill_layer_segment=1, control=control, **covering
    )
    assert interrupted, "no prefill was interrupted after some of its layers"
    assert True in bursts and False in bursts
    assert set(on) | aborted == set(off) | aborted
    for rid in set(on) | set(off):
        a, b = on.get(rid, []), off.get(rid, [])
        if rid not in aborted:
            assert a == b, rid
            continue
        for x, y in zip(a, b):
            assert x[: len(y)] == y[: len(x)], rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton kernels, FlashD2H streams)")
@pytest.mark.parametrize("eager", [True, False])
def test_layer_segmented_on_gpu(model4, eager):
    """On the GPU (Triton kernels, pinned host store, FlashD2H on a side stream, decode CUDA graphs unless eager):
    the same greedy tokens as chunked prefill with several requests mixing with decodes and a prefix-cache hit
    restored layer by layer; the first token's logprobs equal transformers' (CPU, float32)."""
    path, hf = model4
    # synchronous: check_segmented reads the host store after each step
    kw = dict(COMMON, device="cuda", enforce_eager=eager, sparse_dense_layers=1, async_scheduling=False)
    reqs = prompts() + [prompts()[3][:64] + prompts()[0][:100]]
    base, _ = drive(LLM(str(path), **kw, profiler=LastSchedule()), reqs, GREEDY)
    llm = LLM(str(path), **kw, layer_segmented_prefill=True, prefill_layer_segment=1, profiler=LastSchedule())
    got, schedules = drive(llm, reqs, GREEDY, check_segmented)
    assert got == base and any(s.segments for s in schedules)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    out = llm.generate([reqs[0]], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([reqs[0]])).logits[0, -1].float(), dim=-1)
    for tid, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - float(ref[tid])) < 2e-3, (tid, lp.logprob, float(ref[tid]))
    stats = llm.llm_engine.get_stats(sync=True)
    assert stats.num_blocks_used == 0 == stats.offload_device_blocks_used
