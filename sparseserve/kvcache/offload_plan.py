"""One step's KV-offload work, decided by the scheduler's block space (kvcache/device_space.py) and
executed once by every rank's OffloadCache (kvcache/offload.py) before the step's kernels. Plain
Python values: it crosses to tensor-parallel workers in the step message."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadPlan:
    # (host row, device block) in order: paused sequences' partial tail blocks saved to the host
    # store first (their device blocks may have new owners), then blocks mapped over computed
    # tokens restored from the store
    saves: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    # seq_id -> (first token block, device blocks) of sequences whose device range changed;
    # None: released
    ranges: dict[int, tuple[int, list[int]] | None] = field(default_factory=dict)
    # token blocks with new owners: they leave the HBM pool before the step's kernels
    stale: list[int] = field(default_factory=list)
    # device rows (dense layers' KV + key metadata, kvcache/device_space.py DeviceRowMap):
    # (token block, row; -1: none) changed, then (token block, row) saved to the block's host
    # row before any restore, then restored from it
    rows: list[tuple[int, int]] = field(default_factory=list)
    row_saves: list[tuple[int, int]] = field(default_factory=list)
    row_restores: list[tuple[int, int]] = field(default_factory=list)
