"""KV offload: how the device KV budget is split (docs/offload.md, "The device budget";
docs/architecture.md, principle 4). Token blocks are host store rows; on the device: device rows
(the running sequences' token blocks: their key metadata and dense layers' KV), the sparse
layers' device block cache (decode windows, a step's prefill) and the HBM pool (the working sets).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)
GiB = 2**30
# A request's working set over the working-set window, in one step's lists, for the rows' share of the
# budget: measured 1.2-1.6 on SmolLM2 and about 2.6 on the MHA 7B shape with dummy weights (docs/offload.md).
WORKING_SET_LISTS = 2


@dataclass(frozen=True)
class OffloadLayout:
    token_blocks: int  # host store rows = the scheduler's token blocks
    rows: int  # device rows of running sequences' token blocks (dense layers + metadata), less trash
    device_blocks: int  # rows of the sparse layers' device block cache, less its trash row
    pool_slots: int  # HBM pool head-block slots
    dense_layers: int  # layers with a full-size device cache
    token_block_bytes: int  # device bytes per device row: dense layers' KV + metadata
    device_block_bytes: int  # bytes of one device block (every sparse layer and KV head)
    head_block_bytes: int  # bytes of one pool slot
    dense_row_bytes: int = 0  # of token_block_bytes, the dense layers' KV

    @classmethod
    def plan(
        cls,
        *,
        budget: int | None,
        device_blocks: int | None,
        token_blocks: int,
        pool_slots: int | None,
        default_pool_slots: int,
        min_device_blocks: int,
        want_device_blocks: int,
        num_layers: int,
        dense_layers: int,
        kv_layer_block_bytes: int,
        meta_block_bytes: int,
        head_block_bytes: int,
        seq_window_blocks: int = 0,
        seq_pool_slots: int = 0,
        max_seqs: int = 0,
        min_rows: int = 0,
        seq_rows: int = 0,
    ) -> "OffloadLayout":
        """budget: device bytes for all of it (None: device_blocks given, a row for every token
        block; the pool `pool_slots`, else `default_pool_slots`). kv_layer_block_bytes: K and V of
        one token block in one layer (every KV head). want_device_blocks: the device cache's fixed
        part; on top of it a decode window (`seq_window_blocks`) for each of at most `max_seqs`
        sequences, but only for as many as the budget can also give one step's lists
        (`seq_pool_slots` slots each). Rows take the budget's share of a sequence of `seq_rows`
        token blocks beside its working set (`WORKING_SET_LISTS` lists) and window, at least
        `min_rows` (one max_model_len sequence), at most a row per token block."""
        dense_layers = min(dense_layers, num_layers)
        if dense_layers == num_layers:
            raise ValueError(
                f"KV offload with sparse_dense_layers={dense_layers} >= the model's {num_layers} "
                f"layers offloads nothing: lower sparse_dense_layers"
            )
        token_bytes = dense_layers * kv_layer_block_bytes + meta_block_bytes
        device_bytes = (num_layers - dense_layers) * kv_layer_block_bytes
        rows = token_blocks
        if device_blocks is None:
            assert budget is not None
            rest = budget - token_bytes - device_bytes  # (the trash rows)
            if seq_rows:  # the share of what the device cache's fixed part leaves
                per_seq = (
                    seq_rows * token_bytes
                    + WORKING_SET_LISTS * seq_pool_slots * head_block_bytes
                    + seq_window_blocks * device_bytes
                )
                free = max(rest - max(want_device_blocks, min_device_blocks) * device_bytes, 0)
                rows = min(token_blocks, max(min_rows, free * seq_rows // per_seq))
            rest -= rows * token_bytes
            if pool_slots is None:
                want = want_device_blocks
                if seq_window_blocks:
                    per_seq = seq_window_blocks * device_bytes + seq_pool_slots * head_block_bytes
                    want += min(max_seqs, max(rest - want * device_bytes, 0) // per_seq) * seq_window_blocks
                device_blocks = min(max(want, min_device_blocks), token_blocks)
                if device_blocks * device_bytes > rest // 2:  # tight: the pool keeps at least half
                    device_blocks = max(min_device_blocks, rest // 2 // device_bytes)
                every_head_block = token_blocks * (device_bytes // head_block_bytes)
                pool_slots = min(max(rest - device_blocks * device_bytes, 0) // head_block_bytes, every_head_block)
            # The device cache takes what the pool leaves: more than above only when the pool is
            # explicit or holds every head block.
            device_blocks = min((rest - pool_slots * head_block_bytes) // device_bytes, token_blocks)
        elif pool_slots is None:
            pool_slots = default_pool_slots
        layout = cls(
            token_blocks,
            rows,
            max(device_blocks, 0),
            max(pool_slots, 0),
            dense_layers,
            token_bytes,
            device_bytes,
            head_block_bytes,
            dense_layers * kv_layer_block_bytes,
        )
        if layout.device_blocks < min_device_blocks or layout.pool_slots < 1:
            raise ValueError(
                f"KV offload: {layout.describe()}; the device block cache needs at least {min_device_blocks} "
                f"blocks (one max_model_len sequence; with layer-segmented prefill one step's prefill and a "
                f"window) and the pool one slot: lower host_kv_memory, "
                f"hbm_cache_blocks, sparse_dense_layers or max_model_len, or give the KV cache more memory"
            )
        return layout

    @property
    def head_blocks(self) -> int:
        """Every head block of the host store (sparse layers x KV heads a token block): a pool this large never
        evicts."""
        return self.token_blocks * (self.device_block_bytes // self.head_block_bytes)

    def split(self) -> dict[str, int]:
        """Device bytes by part (the start-up log and /metrics)."""
        dense = (self.rows + 1) * self.dense_row_bytes
        return {
            "pool": self.pool_slots * self.head_block_bytes,
            "dense_layers": dense,
            "metadata": (self.rows + 1) * self.token_block_bytes - dense,
            "device_block_cache": (self.device_blocks + 1) * self.device_block_bytes,
        }

    def describe(self) -> str:
        return (
            f"{self.token_blocks} token blocks, {self.rows} device rows (metadata + {self.dense_layers} dense "
            f"layers: {(self.rows + 1) * self.token_block_bytes / GiB:.2f} GiB), device block cache "
            f"{self.device_blocks} blocks ({(self.device_blocks + 1) * self.device_block_bytes / GiB:.2f} GiB), "
            f"HBM pool {self.pool_slots} head-block slots "
            f"({self.pool_slots * self.head_block_bytes / GiB:.2f} GiB)"
        )
