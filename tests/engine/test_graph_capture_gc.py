"""No garbage collection inside a CUDA graph capture (engine/cuda_graph.py collector_paused): a collection there
runs finalizers, and an earlier engine's host store unregistering its pinned memory (a CUDA call) invalidates the
capture. Seen on the GPU as one engine after another in a process (the no-JIT test's configs): the capture failed,
the leaked registration then refused the next engine's host store."""

from __future__ import annotations

import gc
import weakref

import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.cuda_graph import collector_paused
from tests.engine.test_no_jit_while_serving import engine_kwargs
from tests.kernel_utils import gpu_only


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_collector_paused_collects_first_and_never_inside():
    before = _Cycle()
    finalized = []
    weakref.finalize(before, finalized.append, "before")
    del before
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with collector_paused():
            assert finalized == ["before"]  # garbage made before the capture is gone at its start
            n = len(collections)
            inside = _Cycle()
            weakref.finalize(inside, finalized.append, "inside")
            del inside
            _ = [_Cycle() for _ in range(5 * gc.get_threshold()[0])]  # enough allocations for a collection
            assert len(collections) == n and finalized == ["before"]
        assert gc.isenabled()
        gc.collect()
        assert finalized == ["before", "inside"]
    finally:
        gc.callbacks.remove(count)


@gpu_only
def test_no_collection_while_capturing_the_decode_graphs(tiny_model_dir):
    """An offload engine built after another was dropped in a reference cycle: no collection starts while a
    stream captures, and the engine serves."""
    kw = engine_kwargs("layerseg_lag_few_rows")
    first = LLM(str(tiny_model_dir), **kw)
    first.llm_engine.me = first  # a cycle: only a collection frees its host store
    del first
    inside = []

    def watch(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            inside.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        llm = LLM(str(tiny_model_dir), **kw)
    finally:
        gc.callbacks.remove(watch)
    assert inside == []
    out = llm.generate([[5, 6, 7] * 20], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
