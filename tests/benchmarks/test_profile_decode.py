"""scripts/profile_decode.py's GPU critical path: kernels that overlap (programmatic dependent launch starts one
before its predecessor ends) count once, each only past the end of what ran before it; gaps are idle time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "scripts" / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_decode)


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
    busy, idle, by_name = profile_decode.critical_path(trace)
    assert (busy, idle) == (16, 6)
    assert dict(by_name) == {"a": 10, "inside": 0, "b": 4, "copy": 2}
    assert profile_decode.critical_path([]) == (0.0, 0.0, {})
