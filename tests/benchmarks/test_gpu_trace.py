"""The GPU critical path of scripts/profile_decode.py and decode_time's profiled window (bench/gpu_trace.py):
kernels that overlap (programmatic dependent launch starts one before its predecessor ends) count once, each only
past the end of what ran before it; gaps are idle time."""

from __future__ import annotations

from sparseserve.bench.gpu_trace import LAYER_MARK, critical_path, kind, layer_times


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
