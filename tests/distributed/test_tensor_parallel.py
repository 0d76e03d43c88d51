"""Tensor parallelism end to end on the CPU: 2 ranks over gloo (rank 0 here, one spawned worker), tiny models of
every supported architecture (tests/conftest.py VARIANTS: MHA, GQA, a single KV head replicated on both ranks,
qkv bias, q/k norm, tied and untied embeddings). Greedy tokens equal tensor_parallel_size=1's, and so do the
logprobs up to float rounding (the row-parallel sums add in another order), with dense attention, topk sparse
decode (also with streaming heads), and topk with KV offload; under a random schedule with aborts and
preemptions too. A worker that dies
stops rank 0 with an error naming it, within a bounded time (and so does one failing at start); a rank 0 that
dies stops its worker; and the torchrun path (every rank from the environment, the same CLI command on each)
gives the same tokens."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.distributed.launch import WorkerProcesses, report_worker_error, worker_setup
from sparseserve.engine.parallel import WORKER_PRELOAD
from sparseserve.kvcache.host import host_block_bytes
from sparseserve.profiler import Profiler
from tests.conftest import VARIANTS, VOCAB
from tests.schedules import drive_random_schedule

BS = 8
COMMON = dict(
    device="cpu", dtype="float32", block_size=BS, max_model_len=192, max_num_seqs=4, max_num_batched_tokens=48
)  # chunked prefill mixed with decodes
TOPK = dict(
    sparse_policy="topk",
    sparse_budget=4 * BS,
    sparse_sink_blocks=1,
    sparse_local_blocks=2,
    sparse_dense_layers=0,
    sparse_dense_context=0,
)  # every decode through selection: 2 of ~11 blocks
OFFLOAD = dict(TOPK, sparse_dense_layers=1, kv_offload=True, num_gpu_blocks_override=40, hbm_cache_blocks=16)
CONFIGS = {"dense": {}, "topk": TOPK, "offload": OFFLOAD}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
# rank 0's wait for a worker's death to surface (the worker is killed between or inside steps)
FAILURE_BOUND_S = 30.0


def prompts() -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (70, 29, 5)] + ["Hello, world"]


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list:
    return [o.outputs[0] for o in llm.generate(prompts(), params, use_tqdm=False)]


def assert_same(ref: list, got: list) -> None:
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.cumulative_logprob, a.cumulative_logprob, rtol=0, atol=1e-3)
        for la, lb in zip(a.logprobs, b.logprobs):  # the top-2 alternatives too
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4


def tp_engine(model_dir: Path, **kw) -> LLM:
    return LLM(str(model_dir), **COMMON, **kw, tensor_parallel_size=2)


def shutdown(llm: LLM) -> None:
    llm.llm_engine.model_runner.shutdown()


# Every variant whose query heads split over 2 ranks (SmolLM2's 9 heads over 2 are refused: test_parallel_layers)
SPLIT = [v for v in VARIANTS if VARIANTS[v][1]["num_attention_heads"] % 2 == 0]
CASES = (
    [(v, "dense") for v in SPLIT]
    + [(v, "offload") for v in SPLIT]
    + [("qwen3-qknorm-d128", "topk"), ("llama3-gqa-d128-tied-rope", "topk")]
)


@pytest.mark.parametrize("variant, config", CASES)
def test_greedy_tokens_equal_one_rank(hf_models, variant, config):
    model_dir = hf_models[variant][0]
    ref = generate(LLM(str(model_dir), **COMMON, **CONFIGS[config]))
    llm = tp_engine(model_dir, **CONFIGS[config])
    try:
        assert_same(ref, generate(llm))
        stats = llm.llm_engine.get_stats(sync=True)
        if config != "dense":
            assert stats.sparse_selections > 0  # rank 0's counters: selections over its KV heads
        if config == "offload":
            assert stats.offload_blocks_loaded > 0 and stats.offload_device_blocks == 40
    finally:
        shutdown(llm)


@pytest.mark.parametrize("variant, config", [("llama3-gqa-d128-tied-rope", "dense"), ("mistral-gqa", "offload")])
def test_async_scheduling_equals_one_rank(hf_models, variant, config):
    """Async scheduling under TP: each step's message leaves the sampled tokens as placeholders, rank 0
    broadcasts its sampled tokens on the device and every worker fills them from there (no host round trip):
    the tokens and logprobs of one synchronous rank."""
    model_dir = hf_models[variant][0]
    ref = generate(LLM(str(model_dir), **COMMON, **CONFIGS[config]))
    llm = tp_engine(model_dir, **CONFIGS[config], async_scheduling=True)
    try:
        assert_same(ref, generate(llm))
        assert llm.llm_engine.allocator.num_used == 0
    finally:
        shutdown(llm)


def test_streaming_heads_name_global_kv_heads(hf_models, tmp_path):
    """The streaming-heads file names the model's KV heads; each rank applies the flags of its own."""
    spec = tmp_path / "streaming.json"
    spec.write_text(json.dumps({"streaming_heads": {"0": [1]}}))  # rank 1's KV head in layer 0
    model_dir = hf_models["llama3-gqa-d128-tied-rope"][0]  # 2 KV heads: one a rank
    kw = dict(TOPK, streaming_heads=str(spec))
    ref = generate(LLM(str(model_dir), **COMMON, **kw))
    assert [o.token_ids for o in ref] != [o.token_ids for o in generate(LLM(str(model_dir), **COMMON, **TOPK))]
    llm = tp_engine(model_dir, **kw)
    try:
        assert_same(ref, generate(llm))
    finally:
        shutdown(llm)


class SegmentLog(Profiler):
    """Per step: the layer-segmented prefill segments it runs and rank 0's layer-progress gauges
    before it (set `engine` after the engine is built)."""

    def __init__(self) -> None:
        self.engine, self.steps = None, []

    def on_schedule(self, out) -> None:
        stats = self.engine.get_stats()
        gauges = (stats.layer_prefills_running, stats.layer_prefill_layers_done)
        self.steps.append(([(s.seq.seq_id, s.start, s.end) for s in out.segments], gauges))


def test_layer_segmented_prefill_equals_one_rank(hf_models):
    """SparseServe mode (topk + KV offload + layer-segmented prefill): prompts longer than a step's budget run
    one layer per step on every rank (layer 0 dense, layer 1 sparse through the scratch and the host store), one
    of them after a 40-token prefix-cache hit restored from the host store; the same segments, greedy tokens
    and logprobs as one rank, and rank 0's gauges show the prefill's progress. The working-set limit is off in
    both (`unlimited`: each rank's pool holds its share of the KV heads, so TP=2 would admit more at once)."""
    model_dir = hf_models["mistral-gqa"][0]
    kw = dict(OFFLOAD, layer_segmented_prefill=True, prefill_layer_segment=1)
    g = torch.Generator().manual_seed(1)  # ids over the whole vocabulary: both ranks' embedding rows
    long, short, tiny = (torch.randint(10, VOCAB, (n,), generator=g).tolist() for n in (70, 29, 5))
    reqs = [long, long[:40] + short, short, tiny]  # the second: 69 tokens (> 48 a step), 5 blocks cached

    def run(llm: LLM) -> tuple[list, SegmentLog, list]:
        log = llm.llm_engine.profiler
        log.engine = llm.llm_engine
        unlimited(llm.llm_engine)
        outs = llm.generate(reqs, GREEDY, use_tqdm=False)
        return [o.outputs[0] for o in outs], log, [o.num_cached_tokens for o in outs]

    ref, ref_log, ref_cached = run(LLM(str(model_dir), **COMMON, **kw, profiler=SegmentLog()))
    llm = tp_engine(model_dir, **kw, profiler=SegmentLog())
    try:
        got, log, cached = run(llm)
        stats = llm.llm_engine.get_stats(sync=True)
    finally:
        shutdown(llm)
    assert_same(ref, got)
    assert log.steps == ref_log.steps
    segs = [seg for step, _ in log.steps for seg in step]
    assert [(start, end) for _, start, end in segs] == [(0, 1), (1, 2)] * 2  # the two long prompts
    assert cached[1] == ref_cached[1] == 40
    assert (1, 1) in [g for _, g in log.steps]  # rank 0's progress gauges, between a prefill's segments
    assert stats.layer_prefills_running == 0 and stats.offload_blocks_loaded > 0


def unlimited(engine) -> None:
    """KV offload's working-set limit off inside rank 0's scheduler (no configuration does that): each rank's pool
    holds its share of the KV heads, so with the limit TP=2 decodes more requests than one GPU and the schedules
    (the preemptions compared below) differ."""
    engine.scheduler.working_set.ws.enabled = False


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_schedule_with_aborts_and_preemptions(hf_models, async_scheduling):
    """Arrivals (n up to 2), aborts, a device space and a host store small enough to preempt: every rank's
    offload cache and selection slots follow rank 0's scheduler, so each finished request's tokens equal one
    rank's (async: rank 0 schedules a step while the last one runs, and the workers' tokens come from its
    device broadcast)."""
    model_dir = hf_models["mistral-gqa"][0]
    kw = dict(
        OFFLOAD,
        max_model_len=96,
        num_gpu_blocks_override=14,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        async_scheduling=async_scheduling,
    )  # admit what fits now: preemptions happen
    host_block = host_block_bytes(2, 2, BS, 32, torch.float32)  # 2 layers, 2 KV heads of 32 (1 a rank)

    def run(llm: LLM) -> tuple[dict, int]:
        engine, done = llm.llm_engine, {}
        unlimited(engine)

        def collect(outs):
            done.update({o.request_id: [c.token_ids for c in o.outputs] for o in outs if o.finished})

        drive_random_schedule(engine, random.Random(3), steps=40, max_new=12, after_step=collect, greedy=True)
        while engine.has_unfinished_requests():
            collect(engine.step())
        return done, engine.get_stats().num_preemptions

    # The host store is sized per rank: the same 14 token blocks take half the bytes on each of 2 ranks.
    ref, ref_preemptions = run(LLM(str(model_dir), **{**COMMON, **kw}, host_kv_memory=14 * host_block))
    llm = LLM(str(model_dir), **{**COMMON, **kw}, host_kv_memory=14 * host_block // 2, tensor_parallel_size=2)
    try:
        got, preemptions = run(llm)
    finally:
        shutdown(llm)
    assert ref_preemptions > 0 and preemptions == ref_preemptions
    assert got == ref and len(ref) > 10


@pytest.mark.slow
def test_random_schedule_preempts_and_aborts_layer_segmented_prefills(hf_models):
    """Layer-segmented prefill under a random schedule with aborts and a device space small enough to preempt
    (this seed preempts a prefill after its first layer): every rank drops a released prefill's progress at
    the same point of the step order (the message's `released` before its segments) and restarts it at layer
    0, so the tokens and the preemptions equal one rank's."""
    model_dir = hf_models["mistral-gqa"][0]
    kw = dict(
        OFFLOAD,
        max_model_len=96,
        num_gpu_blocks_override=14,
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
        layer_segmented_prefill=True,
        prefill_layer_segment=1,
    )
    host_block = host_block_bytes(2, 2, BS, 32, torch.float32)

    def prompt(rng: random.Random) -> list[int]:  # over the whole vocabulary; half longer than a step's 48
        return [rng.randrange(10, VOCAB) for _ in range(rng.choice([rng.randint(1, 48), rng.randint(49, 80)]))]

    def run(llm: LLM) -> tuple[dict, int, list]:
        engine, done = llm.llm_engine, {}
        engine.profiler.engine = engine
        unlimited(engine)

        def collect(outs):
            done.update({o.request_id: [c.token_ids for c in o.outputs] for o in outs if o.finished})

        drive_random_schedule(
            engine, random.Random(16), steps=40, max_new=12, after_step=collect, greedy=True, prompts=prompt
        )
        while engine.has_unfinished_requests():
            collect(engine.step())
        segs = [seg for step, _ in engine.profiler.steps for seg in step]
        return done, engine.get_stats().num_preemptions, segs

    ref = run(LLM(str(model_dir), **{**COMMON, **kw}, host_kv_memory=14 * host_block, profiler=SegmentLog()))
    llm = LLM(
        str(model_dir),
        **{**COMMON, **kw},
        host_kv_memory=14 * host_block // 2,
        tensor_parallel_size=2,
        profiler=SegmentLog(),
    )
    try:
        got = run(llm)
    finally:
        shutdown(llm)
    done, preemptions, segs = ref
    started = [sid for sid, start, _ in segs if start == 0]
    finished = [sid for sid, _, end in segs if end == 2]
    assert preemptions > 0 and len(started) > len(finished) > 2  # a prefill left between its layers
    assert got == ref and len(done) > 10


def _wait_for_failure(llm: LLM) -> tuple[BaseException | None, float]:
    """Generates until rank 0 raises; (the error, seconds it took), or (None, ...) if it hung past the bound."""
    box: list = []

    def work() -> None:
        try:
            llm.generate(
                prompts() * 2, SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True), use_tqdm=False
            )
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(FAILURE_BOUND_S)
    return (box[0] if box else None), time.monotonic() - t0


@pytest.mark.parametrize("when", ["idle", "during generation", "during async generation"])
def test_a_dead_worker_stops_rank_0_with_a_clear_error(hf_models, when):
    model_dir = hf_models["qwen2-gqa-bias"][0]
    llm = tp_engine(model_dir, async_scheduling=when == "during async generation")
    worker = llm.llm_engine.model_runner._session.workers.procs[0]
    if when == "idle":
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
    else:
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    err, took = _wait_for_failure(llm)
    assert err is not None, f"rank 0 neither finished nor failed within {FAILURE_BOUND_S} s"
    assert isinstance(err, RuntimeError) and f"rank 1 (pid {worker.pid}) was killed by signal 9" in str(err)
    with pytest.raises(RuntimeError, match="rank 1 .* killed"):  # and stays stopped
        llm.generate(["again"], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the failed requests were aborted, nothing is held
    # The failed engine left the process group: a new one starts in this process.
    llm2 = tp_engine(model_dir)
    try:
        assert len(generate(llm2)[0].token_ids) == GREEDY.max_tokens
    finally:
        shutdown(llm2)


ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_dead_rank_0_stops_its_worker(tiny_model_dir):
    script = (
        "import os, signal\n"
        "from sparseserve import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_model_dir)!r}, device='cpu', max_model_len=128, tensor_parallel_size=2)\n"
        "    print(llm.llm_engine.model_runner._session.workers.procs[0].pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the worker outlived rank 0"


def test_torchrun_environment_runs_the_same_command_on_every_rank(tiny_model_dir, tmp_path):
    """What `torchrun --nproc-per-node 2 -m sparseserve generate ... --tensor-parallel-size 2` does, with its
    environment variables set by hand: rank 0 prints the completion, rank 1 serves it and exits 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "sparseserve",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--max-model-len",
        "128",
        "--max-tokens",
        "6",
        "--prompt",
        "The secret number is",
        "--tensor-parallel-size",
        "2",
    ]
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    ref = (
        LLM(str(tiny_model_dir), device="cpu", max_model_len=128)
        .generate(["The secret number is"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert f"Output: {ref!r}" in outs[0][0] and "Output:" not in outs[1][0]


def _fails_after_joining(rank: int, world_size: int, port: int, env: dict, parent_pid: int) -> None:
    store = worker_setup(rank, port, env, parent_pid)
    try:
        raise ValueError("the worker's own error")
    except ValueError:
        report_worker_error(store, rank)
        os._exit(1)


def _dies_before_joining(rank: int, world_size: int, port: int, env: dict, parent_pid: int) -> None:
    os._exit(3)


def test_a_worker_failing_at_start_is_named():
    """Rank 0 names a worker that fails while starting, with the error it reported; one that dies before the
    rendezvous ends rank 0's wait at once instead of a timeout."""
    workers = WorkerProcesses(2, _fails_after_joining, (os.getpid(),), preload=WORKER_PRELOAD)
    try:
        msg = workers.failure(wait_s=FAILURE_BOUND_S)
        assert msg is not None and "rank 1" in msg and "exited with status 1" in msg
        assert "ValueError: the worker's own error" in msg
    finally:
        workers.shutdown()
    workers = WorkerProcesses(2, _dies_before_joining, (os.getpid(),), preload=WORKER_PRELOAD)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 .* exited with status 3"):
            workers.wait_ready(timeout_s=600)
        assert time.monotonic() - t0 < FAILURE_BOUND_S
    finally:
        workers.shutdown()
