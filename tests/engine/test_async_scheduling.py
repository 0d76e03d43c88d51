"""Async scheduling (engine/overlap.py) gives the tokens of synchronous scheduling: random schedules with
arrivals, aborts, stops (token ids, strings, EOS, length) and preemption, greedy and seeded sampling, dense and
sparse attention; no block leaks; and the overlap really happens (placeholders filled on the device from the
previous step's tokens, tokens of stopped sequences dropped)."""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.overlap import PLACEHOLDER, HostCopies
from sparseserve.layers.sampler import SamplerOutput
from tests.kernel_utils import DEVICE, ON_GPU
from tests.schedules import drive_random_schedule, held_blocks, shared_prefix_prompts

SPARSE = dict(
    sparse_policy="topk",
    sparse_budget=64,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=1,
    sparse_dense_context=0,
)


def random_params(seeded: bool):
    stop_ids = random.Random("stops").sample(range(4096), 400)  # ~1 in 10 tokens stops a request

    def params(rng: random.Random) -> SamplingParams:
        sampled = seeded and rng.random() < 0.6
        return SamplingParams(
            max_tokens=rng.randint(1, 24),
            n=rng.choice([1, 1, 2]),
            ignore_eos=rng.random() < 0.5,
            temperature=1.0 if sampled else 0.0,
            seed=rng.randrange(2**31) if sampled else None,
            stop_token_ids=stop_ids if rng.random() < 0.5 else [],
            stop=["e "] if rng.random() < 0.2 else None,
            logprobs=2 if rng.random() < 0.3 else None,
        )

    return params


class Spy:
    """Counts what the runner saw: steps, placeholder rows filled from the previous step's tokens, rows sampled."""

    def __init__(self, engine) -> None:
        self.steps = self.fills = self.sampled = self.segments = 0
        runner = engine.model_runner
        execute = runner.execute

        def spy(scheduled, segments=(), plan=None, feed=None):
            self.steps += 1
            self.fills += len(feed.rows) if feed is not None else 0
            self.segments += len(segments)
            seqs, out = execute(scheduled, segments, plan, feed=feed)
            self.sampled += len(seqs)
            return seqs, out

        runner.execute = spy


def run(
    tiny_model_dir, seed: int, async_scheduling: bool, seeded: bool = False, device: str = "cpu", control=True, **kw
):
    """control=False: KV offload's working-set limit turned off inside the engine (the preemptions it prevents)."""
    rng = random.Random(seed)
    # max_model_len below the longest prompt + max_tokens: some requests end at the context's end
    kw.setdefault("max_num_batched_tokens", rng.choice([16, 48, 96]))
    llm = LLM(
        str(tiny_model_dir),
        device=device,
        dtype="float32",
        block_size=16,
        max_model_len=72,
        num_gpu_blocks_override=12,
        max_num_seqs=6,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        async_scheduling=async_scheduling,
        **kw,
    )
    engine = llm.llm_engine
    if not control:
        engine.scheduler.working_set.ws.enabled = False
    spy = Spy(engine)
    tokens: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}

    def collect(outs) -> None:
        for o in outs:
            for c in o.outputs:
                assert PLACEHOLDER not in c.token_ids
                tokens.setdefault((o.request_id, c.index), []).extend(c.token_ids)
                assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
                if c.finish_reason is not None:
                    finish[(o.request_id, c.index)] = c.finish_reason
        held_blocks(engine)

    aborted: set[str] = set()
    drive_random_schedule(
        engine,
        rng,
        steps=60,
        max_new=24,
        after_step=collect,
        aborted=aborted,
        prompts=shared_prefix_prompts(seed),
        params=random_params(seeded),
    )
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert engine.allocator.num_used == 0 and not engine.scheduler.running and not engine.scheduler.waiting
    engine.allocator.check()
    return tokens, finish, aborted, spy, engine


def check_same(sync, asyn, same_schedule: bool = True) -> None:
    """same_schedule False: the two may admit requests at other steps (working-set control reads its estimates
    one step later under async scheduling), so an aborted request may have got further in either run: then
    only the tokens both delivered must agree."""
    (t_s, f_s, aborted, _, _), (t_a, f_a, aborted_a, _, _) = sync, asyn
    assert aborted == aborted_a  # the workload depends on the schedule's random state only
    for key in t_s.keys() | t_a.keys():
        a, s = t_a.get(key, []), t_s.get(key, [])
        if key[0] in aborted:  # an abort drops the token still in flight: a prefix of what sync delivered
            n = len(a) if same_schedule else min(len(a), len(s))
            assert a[:n] == s[:n], key
        else:
            assert a == s and f_a[key] == f_s[key], key


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_async_gives_the_tokens_of_sync_over_random_schedules(tiny_model_dir, seed):
    sync = run(tiny_model_dir, seed, False, seeded=seed % 2 == 1)
    asyn = run(tiny_model_dir, seed, True, seeded=seed % 2 == 1)
    check_same(sync, asyn)
    spy_s, spy_a, engine = sync[3], asyn[3], asyn[4]
    assert spy_s.fills == 0 and spy_a.fills > 0  # decode inputs came from the device, not the host
    assert engine.num_generation_tokens < spy_a.sampled  # stopped sequences ran a step whose token was dropped
    assert sum(f == "stop" for f in asyn[1].values()) > 0
    assert engine.scheduler.num_preemptions > 0 or seed % 2 == 1


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: the overlap on a device stream (CUDA graphs, Triton kernels, pinned copies)",
)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("sparse", [False, True, "offload", "layerseg", "offload_lag", "layerseg_lag"])
def test_async_on_cuda(tiny_model_dir, seed, sparse):
    extra = {
        False: {},
        True: SPARSE,
        "offload": SPARSE | OFFLOAD,
        "layerseg": SPARSE | LAYERSEG,
        "offload_lag": SPARSE | OFFLOAD | LAG,
        "layerseg_lag": SPARSE | LAYERSEG | LAG,
    }[sparse]
    kw = dict(device="cuda", seeded=seed == 1, **extra)
    asyn = run(tiny_model_dir, seed, True, **kw)
    check_same(run(tiny_model_dir, seed, False, **kw), asyn)
    assert asyn[3].segments > 0 or sparse != "layerseg"


# A pool smaller than the lists (evictions, bypass reads) and a host store of 12 token blocks (preemptions: pauses)
OFFLOAD = dict(kv_offload=True, hbm_cache_blocks=24, host_kv_memory="768KiB")
# Prompts longer than the step's budget prefill a layer at a time (their FlashD2H copies in flight across steps)
LAYERSEG = dict(OFFLOAD, layer_segmented_prefill=True, prefill_layer_segment=1, max_num_batched_tokens=16)
# Lagged selection: under offload the pool reads the next lists a step ahead, on the side stream (CUDA)
LAG = dict(sparse_lag=1)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        dict(sparse_lag=1),
        dict(sparse_policy="topp", sparse_reuse=3),
        dict(sparse_policy="topp", sparse_lag=1),
        OFFLOAD,
        dict(OFFLOAD, sparse_policy="topp", sparse_reuse=2),
        LAYERSEG,
        dict(LAYERSEG, control=False),
        dict(OFFLOAD, sparse_lag=1),
        dict(LAYERSEG, sparse_lag=1),
    ],
)
def test_async_with_sparse_attention(tiny_model_dir, extra):
    kw = SPARSE | extra
    asyn = run(tiny_model_dir, 4, True, **kw)  # a seed whose schedule holds back or preempts in every offload config
    limited = extra.get("kv_offload") and extra.get("control", True)  # working-set control: estimates a step later
    check_same(run(tiny_model_dir, 4, False, **kw), asyn, same_schedule=not limited)
    if extra.get("kv_offload"):  # the offload paths the overlap must keep ordered were taken
        stats = asyn[4].get_stats(sync=True)
        assert stats.offload_blocks_loaded > 0 and stats.offload_hbm_hits > 0
        assert asyn[3].segments > 0 or not extra.get("layer_segmented_prefill")  # prefills ran layer by layer
        if extra.get("control", True):  # held back while their working sets do not fit, resumed from the host
            assert stats.working_set_hold_backs > 0 and stats.offload_blocks_restored > 0
        else:  # without the limit: preempted (a layer-segmented prefill among them)
            assert stats.num_preemptions > 0 and stats.working_set_hold_backs == 0


def test_generate_and_deltas_one_step_late(tiny_model_dir):
    prompts = [[11, 12, 13, 14, 15] * k for k in (1, 3, 7)]
    params = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0)
    kw = dict(device="cpu", dtype="float32", block_size=16, max_model_len=96)
    want = LLM(str(tiny_model_dir), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    engine = llm.llm_engine
    engine.add_request("x", prompts[0], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token lands with the next call
    assert [len(o.outputs[0].token_ids) for o in engine.step()] == [1]
    assert engine.scheduler.running[0].token_ids[-1] == PLACEHOLDER  # the third token is in flight
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 2 and outs[-1].finished
    # a length stop is known in advance: no step ran for a token past max_tokens
    assert engine.allocator.num_used == 0


def test_refused_where_it_does_not_work_yet(tiny_model_dir):
    from sparseserve.config import EngineConfig

    with pytest.raises(ValueError, match="host_prefix_cache_memory"):
        EngineConfig.from_kwargs(async_scheduling=True, host_prefix_cache_memory="1MiB")
    EngineConfig.from_kwargs(host_prefix_cache_memory="1MiB")  # the default is off without KV offload: no refusal
    EngineConfig.from_kwargs(async_scheduling=False, host_prefix_cache_memory="1MiB")


def test_default_is_on_with_kv_offload_on_cuda():
    """async_scheduling's default (None), resolved for the device: on with KV offload on CUDA, off on CPU and
    without KV offload; an explicit value wins either way."""
    from sparseserve.config import EngineConfig

    sparse = dict(sparse_policy="topk")
    offload = dict(sparse, kv_offload=True)
    assert EngineConfig().scheduler_config.async_scheduling is None
    assert EngineConfig.from_kwargs(**offload).schedules_async("cuda") is True
    assert EngineConfig.from_kwargs(**offload).schedules_async("cpu") is False
    assert EngineConfig.from_kwargs(**sparse).schedules_async("cuda") is False
    assert EngineConfig().schedules_async("cuda") is False
    assert EngineConfig.from_kwargs(**offload, async_scheduling=False).schedules_async("cuda") is False
    assert EngineConfig.from_kwargs(**sparse, async_scheduling=True).schedules_async("cuda") is True
    assert EngineConfig.from_kwargs(async_scheduling=True).schedules_async("cpu") is True


def test_the_server_loop_with_async_scheduling():
    """AsyncLLMEngine (the server's engine thread) over async scheduling: concurrent streams get the tokens of
    synchronous scheduling, an abort mid-stream ends its request, the pool drains."""
    import asyncio

    from sparseserve.engine.async_engine import AsyncLLMEngine
    from sparseserve.engine.engine import LLMEngine

    kw = dict(device="cpu", seed=0, max_model_len=256, num_gpu_blocks_override=512, max_num_seqs=16)
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(async_scheduling=True, **kw))

    async def collect(stream) -> list[int]:
        tokens = []
        async for out in stream:
            tokens += out.outputs[0].token_ids
        return tokens

    async def scenario():
        engine.start()
        victim = await engine.add_request("v", "A long story", SamplingParams(max_tokens=200, ignore_eos=True))
        streams = [await engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        await victim.__anext__()
        victim.abort()  # the client left: the engine drops the request before its next step
        got = await asyncio.gather(*(collect(s) for s in streams))
        await engine.shutdown()
        return got

    assert asyncio.run(scenario()) == want
    assert engine.stats.num_blocks_used == 0 and not engine.engine.has_unfinished_requests()
    assert engine.engine.num_generation_tokens < 200 + 6 * 10  # the victim stopped early


def _sampler_output(g: torch.Generator, rows: int, k: int | None) -> SamplerOutput:
    """A step's sampled outputs on the device: tokens, and with k the logprobs' tensors (k + 1 columns)."""
    tokens = torch.randint(0, 4096, (rows,), generator=g)
    if k is None:
        return SamplerOutput(tokens.to(DEVICE))
    return SamplerOutput(
        tokens.to(DEVICE),
        torch.randn(rows, k + 1, generator=g).to(DEVICE),
        torch.randint(0, 4096, (rows, k + 1), generator=g).to(DEVICE),
        torch.randint(1, 9, (rows,), generator=g).to(DEVICE),
    )


def test_host_copies_reuse_buffers_and_keep_values_until_consumed():
    """In the engine's order (copy step N, then consume step N - 1), over many steps whose batch and logprobs
    change: each step's host copies hold its values when consumed, and a slot's buffers are reused (a steady
    batch allocates nothing after its first steps). On a GPU the device is kept busy, so the host runs ahead of
    the copies; the event of each step says when its copy landed."""
    g = torch.Generator().manual_seed(5)
    copies = HostCopies(pin_memory=ON_GPU)
    pending: tuple[SamplerOutput, SamplerOutput, torch.cuda.Event | None] | None = None
    for step in range(120):
        rows = 32 if step >= 60 else 1 + step % 7  # random shapes first, then a steady batch
        out = _sampler_output(g, rows, 2 if step % 5 == 0 and step < 60 else None)
        if ON_GPU and step % 10 == 0:
            torch.cuda._sleep(5_000_000)
        expected = SamplerOutput(
            *(
                None if t is None else t.cpu()
                for t in (out.token_ids, out.logprobs, out.logprob_token_ids, out.sampled_ranks)
            )
        )
        host, event = copies.copy(out)
        assert (event is not None) == ON_GPU
        if pending is not None:  # the step before lands now, after this one's copy started
            want, got, ev = pending
            if ev is not None:
                ev.synchronize()
            for w, h in zip(
                (want.token_ids, want.logprobs, want.logprob_token_ids, want.sampled_ranks),
                (got.token_ids, got.logprobs, got.logprob_token_ids, got.sampled_ranks),
            ):
                assert (w is None) == (h is None)
                if w is not None:
                    assert h.device.type == "cpu" and h.is_pinned() == ON_GPU and torch.equal(h, w)
        pending = (expected, host, event)
        if step == 70:
            steady = {b.data_ptr() for slot in copies.buffers for b in slot.values()}
    assert {b.data_ptr() for slot in copies.buffers for b in slot.values()} == steady
    assert all(len(slot) <= HostCopies.MAX_BUFFERS + 1 for slot in copies.buffers)
