"""Decode steps built straight into the decode graphs' static inputs (engine/cuda_graph.py, kvcache/staging.py
StaticInputs) give the tokens of eager steps: dense, sparse, lagged selection, KV offload with a small HBM
pool, async scheduling, under a random schedule (arrivals, aborts, preemption). Without a GPU a "replay" runs
the captured step eagerly over the same static inputs, padding rows included; on a GPU the graphs are real."""

from __future__ import annotations

import contextlib
import random

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.engine.cuda_graph import DecodeGraphs
from sparseserve.profiler import Profiler
from tests.kernel_utils import DEVICE
from tests.schedules import check_pool, drive_random_schedule, held_blocks

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
CONFIGS = {
    "dense": dict(),
    "topk": SPARSE,
    "topk-lag": dict(SPARSE, sparse_lag=1),
    "topp-lag": dict(SPARSE, sparse_policy="topp", sparse_top_p=0.8, sparse_lag=1),
    "offload-lag": dict(
        SPARSE, sparse_lag=1, kv_offload=True, hbm_cache_blocks=16, num_gpu_blocks_override=40, async_scheduling=False
    ),
    "offload-async": dict(SPARSE, kv_offload=True, hbm_cache_blocks=16, async_scheduling=True),
}


class ReplayCount(Profiler):
    """Counts the decode graphs' replays (their profiler phase "graph")."""

    def __init__(self) -> None:
        self.replays = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        self.replays += name == "graph"
        yield


def run(model_dir, graphs: bool, seed: int, **kw) -> tuple[dict[str, list[int]], ReplayCount, object]:
    kw = {"num_gpu_blocks_override": 64, **kw}  # a small cache: preemptions, and engines side by side on a GPU
    count = ReplayCount()
    llm = LLM(
        str(model_dir),
        device=DEVICE.type,
        dtype="float32",
        max_model_len=136,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        enforce_eager=not graphs,
        profiler=count,
        **kw,
    )
    engine = llm.llm_engine
    runner = engine.model_runner
    if graphs and runner.graphs is None:  # no CUDA: the same static inputs, each "replay" run eagerly
        runner.graphs = DecodeGraphs(
            runner.model, runner.attn_backend, runner.kv_caches, 6, runner.max_model_len, runner.block_size, count
        )
    tokens: dict[str, list[int]] = {}

    def after(outs):
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids[len(tokens.get(o.request_id, [])) :])

    params = lambda rng: SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0, ignore_eos=True)  # noqa: E731
    drive_random_schedule(engine, random.Random(seed), 60, 40, after, greedy=True, params=params)
    while engine.has_unfinished_requests():
        after(engine.step())
    return tokens, count, engine


@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_steps_equal_eager_steps(tiny_model_dir, name):
    kw = CONFIGS[name]
    eager, _, _ = run(tiny_model_dir, False, 7, **kw)
    graphed, count, engine = run(tiny_model_dir, True, 7, **kw)
    assert graphed == eager
    assert count.replays > 20  # most decode steps replayed
    assert held_blocks(engine) == []
    if engine.model_runner.offload is not None:
        check_pool(engine.model_runner.offload)
