"""The engine's device counters read without a sync (engine/stats.py DeviceCounters): late by at most a step and
the copy interval while steps run, never ahead of the device, and exact once an idle engine's reads have polled."""

from __future__ import annotations

import time

import torch

from sparseserve.engine.stats import DeviceCounters
from tests.kernel_utils import DEVICE


def test_counters_lag_then_land_when_idle():
    a = torch.zeros((), dtype=torch.int64, device=DEVICE)
    b = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    counters = DeviceCounters({"a": a, "b": b}, interval_s=0.002)
    seen = []
    for step in range(1, 200):
        a += 1
        b += 2
        counters.refresh()
        v = counters.values()
        assert v["b"] == 2 * v["a"] and v["a"] <= step  # one consistent copy, never ahead of the device
        seen.append(v["a"])
    assert seen == sorted(seen)
    deadline = time.monotonic() + 5.0
    while counters.values() != {"a": 199, "b": 398}:  # idle: the reads alone land the last steps
        assert time.monotonic() < deadline, counters.values()
        time.sleep(0.001)
    a += 5
    counters.refresh()
    assert counters.values(sync=True) == {"a": 204, "b": 398}
