"""The GPU critical path of scripts/profile_decode.py and decode_time's profiled window (bench/gpu_trace.py):
kernels that overlap (programmatic dependent launch starts one before its predecessor ends) count once, each only
past the end of what ran before it; gaps are idle time. A blocking host call is booked to the engine frames that
enclose it on its own thread (a CUDA runtime event has no parent link to them); each stream's work by kind."""

from __future__ import annotations

import gzip
import json

import torch

from sparseserve.bench.gpu_trace import (
    LAYER_MARK,
    WindowProfile,
    WindowReport,
    blocking_calls,
    by_stream,
    critical_path,
    kind,
    layer_times,
)


def event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_overlapping_kernels_count_once_and_gaps_are_idle():
    trace = [
        event("b", 8, 6),  # starts under a (PDL): only 10..14 is its own
        event("a", 0, 10),
        event("copy", 20, 2, "gpu_memcpy"),  # after 6 idle
        event("inside", 1, 3),  # wholly under a: nothing of its own
        event("host op", 0, 50, "cpu_op"),  # not the GPU's
        {"ph": "i", "name": "marker", "ts": 5},
    ]
    busy, idle, by_name = critical_path(trace)
    assert (busy, idle) == (16, 6)
    assert dict(by_name) == {"a": 10, "inside": 0, "b": 4, "copy": 2}
    assert critical_path([]) == (0.0, 0.0, {})


def test_kinds_of_work():
    assert kind("Memcpy DtoH (Device -> Pageable)") == "d2h pageable"
    assert kind("Memcpy DtoH (Device -> Pinned)") == "d2h"
    assert kind("_flash_h2d_kernel") == "flash_h2d"
    assert kind("nvjet_sm90_tst_256x8_64x6_4x1_v_bz_TNT") == "gemm"
    assert kind("_sparse_split_tma_kernel") == "sparse attention"
    assert kind("_add_rmsnorm_kernel") == "other"


def test_layer_times_take_each_positions_median_over_whole_steps():
    """Three layers a step: the marker's start-to-start time per layer position, the median over the steps; a
    leading partial step (another engine's step in flight) is dropped; fewer markers than a step: None."""
    trace = [event(LAYER_MARK, 0, 1), event("other", 1, 1)]  # a partial step first
    t = 100.0
    for gaps in ((10, 20), (12, 26), (11, 21)):  # per step: layer 0 -> 1, layer 1 -> 2
        trace += [event(LAYER_MARK, t + dt, 1) for dt in (0, gaps[0], gaps[0] + gaps[1])]
        trace.append(event("gemm", t + 2, 3))
        t += 100
    assert layer_times(trace, 3) == [11, 21]
    assert layer_times(trace[:4], 4) is None and layer_times(trace, 1) is None


def _x(name, ts, dur, cat, tid=1):
    """An event on a thread (host) or stream (device)."""
    return (
        event(name, ts, dur, cat)
        | {"tid": tid}
        | ({"args": {"stream": tid}} if cat in ("kernel", "gpu_memcpy") else {})
    )


def _frame(path, ts, dur, tid=1):
    return _x(path, ts, dur, "python_function", tid)


def test_blocking_calls_are_booked_to_their_enclosing_engine_frames():
    trace = [
        _frame("benchmarks/common.py(10): replay", 0, 1000),
        _frame("sparseserve/engine/engine.py(295): step", 10, 900),
        _frame("sparseserve/engine/runner.py(411): execute", 20, 500),
        _frame("sparseserve/attention/selection.py(158): assign", 30, 40),  # ended before the call: a sibling
        _frame("/usr/lib/python3/threading.py(1): wait", 100, 300),  # not the engine's: skipped
        _frame("sparseserve/engine/layer_prefill.py(144): _begin", 90, 400),
        _x("cudaStreamSynchronize", 120, 50, "cuda_runtime"),
        _x("cudaStreamSynchronize", 600, 30, "cuda_runtime"),  # after execute ended: step is its innermost
        _x("cudaStreamSynchronize", 130, 20, "cuda_runtime", tid=2),  # another thread: no engine frame there
        _x("cudaLaunchKernel", 140, 5, "cuda_runtime"),  # not blocking
        _frame("sparseserve/engine/overlap.py(143): wait", 700, 100, tid=1),
        _x("cudaEventSynchronize", 710, 80, "cuda_runtime"),
    ]
    out = {k: (n, round(ms, 6)) for k, (n, ms) in blocking_calls(trace).items()}
    begin = ("layer_prefill.py(144): _begin", "runner.py(411): execute", "engine.py(295): step")
    wait = ("overlap.py(143): wait", "engine.py(295): step", "common.py(10): replay")
    assert out == {
        ("cudaStreamSynchronize", begin): (1, 0.05),
        ("cudaStreamSynchronize", ("engine.py(295): step", "common.py(10): replay")): (1, 0.03),
        ("cudaStreamSynchronize", ()): (1, 0.02),
        ("cudaEventSynchronize", wait): (1, 0.08),
    }
    assert blocking_calls(trace, depth=1)[("cudaEventSynchronize", ("overlap.py(143): wait",))][0] == 1


def test_by_stream_books_each_op_whole_to_its_stream():
    trace = [
        _x("nvjet_gemm", 0, 1000, "kernel", tid=7),
        _x("_prefill_kernel", 1000, 500, "kernel", tid=7),
        _x("Memcpy DtoH (Device -> Pinned)", 200, 2000, "gpu_memcpy", tid=25),  # beside: booked whole
        _x("_flash_h2d_kernel", 100, 300, "kernel", tid=9),
        _x("cudaLaunchKernel", 0, 5, "cuda_runtime", tid=1),  # the host's
    ]
    streams = by_stream(trace)
    assert streams == {"7": {"gemm": 1.0, "prefill attention": 0.5}, "25": {"d2h": 2.0}, "9": {"flash_h2d": 0.3}}
    lines = WindowReport(0.0, 0.0, {}, {}, streams=streams).lines(streams=2)
    shown = [line for line in lines if line.startswith("  stream")]
    assert len(shown) == 2 and "25" in shown[0] and "gemm 1.0, prefill attention 0.5" in shown[1]


def _python_frames(tmp_path, stack: bool) -> int:
    def inner(x):
        return (x @ x).relu()

    path = tmp_path / f"t{int(stack)}.json.gz"
    prof = WindowProfile(str(path), stack=stack)
    prof.start()
    inner(torch.randn(8, 8))
    prof.stop()
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return sum(e.get("cat") == "python_function" and "inner" in e.get("name", "") for e in events)


def test_window_profile_records_python_frames_only_with_stack(tmp_path):
    assert _python_frames(tmp_path, stack=True) > 0
    assert _python_frames(tmp_path, stack=False) == 0
