"""Block selection for sparse decode: the policy interface, its parameters, per-sequence state.

A `SelectionPolicy` (registered by name in `registry.SELECTION_POLICIES`; built-ins in
attention/policies.py) writes, for each decode row of a sparse layer, a list of `cap` logical
blocks (-1 padded) the row attends besides its local window, into `SelectionState.sel` at the
row's state slot (slot -1: none this step); `refine` may trim them once the blocks are readable.
Kernels: kernels/block_score.py (selection), kernels/sparse_decode.py (attention).

SelectionState owns what persists across steps, in fixed device buffers indexed by state slot:
every layer's lists (with topp's flat flags), reuse (or flat hold) counters, streaming-head masks and counters.
With lagged selection a slot keeps two lists (attended, being written; kernels/block_score.py
step_slots).
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from sparseserve.kvcache.transfer import to_device


@dataclass(frozen=True)
class SelectionParams:
    cap: int  # list length in blocks (the budget)
    sink: int  # blocks always attended at the start
    local: int  # blocks always attended at the end (>= 1: the decode token's own)
    reuse: int  # a list is recomputed every `reuse` decode steps
    block_size: int
    page_size: int  # tokens per key-metadata page (hierarchical paging)
    short_dense: bool = True  # a context of at most cap blocks selects all of them without scoring
    top_p: float = 1.0
    per_head: bool = False  # topp: each query head's mass reaches p (union), not the mean
    lag: bool = False  # lagged selection (step_slots): kernels then see no reuse
    stickiness: float = 0.0  # a listed block ranks by its mass x (1 + this) at the next selection
    flat_share: float = 1.0  # topp: lists whose candidates are at least this flat stay unpruned (1: none)
    flat_cap: int = 0  # blocks such a list takes where cap blocks cannot reach top_p on flat masses (<= cap)
    flat_hold: int = 0  # topp: decode steps a list flagged flat is kept before its row selects again
    # with lag: each step selects its candidates from its own query into its write row and prunes them into its
    # read row, which it attends; only the KV offload pool's loads lag (a prefetch of the previous step's
    # candidates: docs/offload.md, "Prefetching reads")
    prefetch: bool = False

    @classmethod
    def from_config(cls, cfg: Any, block_size: int, prefetch: bool = False) -> "SelectionParams":
        """cfg: config.SparseConfig; prefetch: KV offload's prefetching reads (the lag machinery, lists fresh)."""
        return cls(
            cap=cfg.sparse_budget // block_size,
            sink=cfg.sparse_sink_blocks,
            local=cfg.sparse_local_blocks,
            reuse=cfg.sparse_reuse,
            block_size=block_size,
            page_size=cfg.logical_page_size or block_size,
            short_dense=cfg.sparse_dense_context != 0,
            top_p=cfg.sparse_top_p,
            per_head=cfg.sparse_topp_heads == "each",
            lag=bool(cfg.sparse_lag) or prefetch,
            prefetch=prefetch,
            stickiness=cfg.sparse_stickiness,
            flat_share=cfg.sparse_topp_flat_share,
            flat_hold=cfg.sparse_topp_flat_hold or 0,  # unset outside EngineConfig: none
            flat_cap=min(
                cfg.sparse_budget // block_size,
                max(
                    (cfg.sparse_topp_flat_budget or cfg.sparse_budget // 2) // block_size,
                    cfg.sparse_sink_blocks + cfg.sparse_local_blocks + 1,  # room past the forced blocks, as cap
                ),
            ),
        )

    def kernel_args(self) -> dict[str, Any]:
        """The selection kernels' shape arguments (kernels/block_score.py)."""
        return dict(
            block_size=self.block_size,
            cap=self.cap,
            sink=self.sink,
            local=self.local,
            reuse=1 if self.lag else self.reuse,
            short_dense=self.short_dense,
            stickiness=self.stickiness,
        )


@dataclass
class DecodeRows:
    """The rows a sparse layer selects for: decodes, or prefill chunks' last tokens (lag)."""

    seq_lens: torch.Tensor  # int32 [B]
    tables: torch.Tensor  # int32 [B, W] key-metadata rows: token blocks (KV offload: device rows)
    cache_tables: torch.Tensor  # int32 [B, W] the layer's KV cache blocks (differ under KV offload)
    slots: torch.Tensor  # int32 [B] selection-buffer rows to write (-1: none this step)
    max_blocks: int  # host-side bound of the contexts in blocks
    scale: float
    width: int = 0  # selection launch size (longest context in blocks; 0: max_blocks)
    prev_slots: torch.Tensor | None = None  # int32 [B] rows of the previous lists (None: slots; -1: none)
    ahead: int = 0  # 1: the lists serve the next step (lagged selection), whose local window they force
    decodes: int | None = None  # rows before this are decodes (the rest: prefill chunks' last tokens); None: all


def load_streaming_heads(path: str | None, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """bool [num_layers, num_kv_heads] from {"streaming_heads": {"<layer>": [kv_head, ...]}}."""
    mask = torch.zeros(num_layers, num_kv_heads, dtype=torch.bool)
    if path is None:
        return mask
    try:
        spec = json.loads(Path(path).read_text())["streaming_heads"]
        for layer, heads in spec.items():
            for h in heads:
                if not (0 <= int(layer) < num_layers and 0 <= int(h) < num_kv_heads):
                    raise ValueError(
                        f"(layer {layer}, KV head {h}) is outside the model's "
                        f"{num_layers} layers x {num_kv_heads} KV heads"
                    )
                mask[int(layer), int(h)] = True
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read streaming heads from {path}: {e!r}") from e
    return mask


class SelectionState:
    """Selection lists, reuse counters and statistics of every sparse layer, per state slot."""

    def __init__(
        self,
        params: SelectionParams,
        num_layers: int,
        num_kv_heads: int,
        max_num_seqs: int,
        streaming: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.num_slots = max_num_seqs
        rows = max_num_seqs * (2 if params.lag else 1)  # lag: attended + being written
        self._rows_per_slot = rows // max_num_seqs
        # Sticky lists are history: a new sequence's must not stick to another's, and a paused one's
        # come back with it (its lists and counters, stashed on the device while it waits).
        self._sticky = params.stickiness > 0
        self._stash: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.sel = torch.full((num_layers, rows, num_kv_heads, params.cap), -1, dtype=torch.int32, device=device)
        self.counter = torch.zeros(num_layers, max_num_seqs, num_kv_heads, dtype=torch.int32, device=device)
        # with each list: whether its estimated masses are flat (topp then attends it unpruned)
        self.flat = torch.zeros(num_layers, rows, num_kv_heads, dtype=torch.int8, device=device)
        self.stats = torch.zeros(2, dtype=torch.int64, device=device)  # blocks selected, selections
        self.uncounted = torch.zeros(2, dtype=torch.int64, device=device)  # selections a later refine counts
        # topp: new lists flagged flat, lists held (SelectionParams.flat_hold)
        self.flat_lists = torch.zeros(2, dtype=torch.int64, device=device)
        self.streaming = streaming.to(device)
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._held: dict[int, int] = {}
        self._parked: dict[int, int] = {}  # `park`ed, oldest first
        self.fresh: list[int] = []  # the slots the last `assign` handed out anew
        self.restored: list[int] = []  # of them, those whose sticky lists came back from the stash
        # (seq ids, slots) of the last `assign` while no slot changed hands since: a steady
        # decode batch asks the same every step
        self._last: tuple[list[int], list[int]] | None = None

    def assign(self, seq_ids: list[int]) -> list[int]:
        """Each sequence's state slot. One without gets a free slot, counters reset (`fresh` lists
        them, for per-slot state kept elsewhere; sticky lists: cleared, or a paused sequence's
        restored); a parked one gets its own back; with none free, the longest-parked sequence
        gives its slot up (sticky: stashing its lists)."""
        if self._last is not None and seq_ids == self._last[0]:
            self.fresh, self.restored = [], []
            return self._last[1]
        self.fresh = fresh = []
        self.restored = []
        for sid in seq_ids:
            if sid in self._parked:
                self._held[sid] = self._parked.pop(sid)
        for sid in seq_ids:
            if sid not in self._held:
                if not self._free:
                    oldest = next(iter(self._parked))
                    self._stash_lists(oldest, self._parked[oldest])
                    self._free.append(self._parked.pop(oldest))
                self._held[sid] = slot = self._free.pop()
                fresh.append(slot)
        if fresh:
            idx = to_device(torch.tensor(fresh), self.counter.device)  # pinned staging: no wait on the device
            # index_fill_, not `t[:, idx] = 0`: index_put_ copies its scalar from pageable memory, which waits for
            # the device's queue (docs/engine.md, "The host never waits inside a step")
            self.counter.index_fill_(1, idx, 0)
            if self._sticky:
                rows = self._rows(idx)
                self.sel.index_fill_(1, rows, -1)
                self.flat.index_fill_(1, rows, 0)
                for sid in seq_ids:
                    if sid in self._stash:
                        sel, counter, flat = self._stash.pop(sid)
                        slot = self._held[sid]
                        rows = self._rows(to_device(torch.tensor([slot]), idx.device))
                        self.sel[:, rows], self.flat[:, rows] = sel, flat
                        self.counter[:, slot] = counter
                        self.restored.append(slot)
        slots = [self._held[sid] for sid in seq_ids]
        self._last = (list(seq_ids), slots)
        return slots

    def release(self, seq_id: int, paused: bool = False) -> None:
        """The sequence leaves its slot: finished (paused False: any stash dropped) or paused
        (sticky lists: stashed for its resume)."""
        self._last = None
        slot = self._held.pop(seq_id, self._parked.pop(seq_id, None))
        self._stash.pop(seq_id, None)
        if slot is not None:
            if paused:
                self._stash_lists(seq_id, slot)
            self._free.append(slot)

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.cat([slots + k * self.num_slots for k in range(self._rows_per_slot)])

    def _stash_lists(self, seq_id: int, slot: int) -> None:
        if self._sticky:
            rows = self._rows(to_device(torch.tensor([slot]), self.sel.device))
            self._stash[seq_id] = (self.sel[:, rows].clone(), self.counter[:, slot].clone(), self.flat[:, rows].clone())

    @property
    def num_stashed(self) -> int:
        """Paused sequences whose sticky lists wait for their resume (accounting)."""
        return len(self._stash)

    def park(self, seq_id: int) -> None:
        """A paused sequence keeps its slot and lists while no other needs the slot (lag: on
        resuming it attends the list its last step selected)."""
        self._last = None
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._parked[seq_id] = slot

    def held_slots(self) -> dict[int, int]:
        """Sequence id -> state slot of every sequence holding one (accounting)."""
        return dict(self._held)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)


class SelectionPolicy(abc.ABC):
    """How a sparse layer picks the blocks each decode row attends (module docstring)."""

    supports_lag = True  # whether lists selected from an earlier query serve the next one
    lags_by_default = True  # whether KV offload turns the lag on (EngineConfig.lags_by_default)
    prunes = False  # whether it has a `refine` (called only then; KV offload reads its candidates first)
    # engine options this policy sets where the user leaves them unset (None): SparseConfig's fields and
    # block_size (EngineConfig); what is not named here takes POLICY_FALLBACKS (config.py)
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: SelectionParams) -> None:
        self.params = params

    @abc.abstractmethod
    def select(self, layer: int, q: torch.Tensor, rows: DecodeRows, state: SelectionState, key_meta: Any) -> None:
        """Writes the lists of rows q [B, Hq, D] into state.sel[layer] at rows.slots;
        key_meta: the layer's kvcache/metadata.py KeyMeta."""

    def refine(
        self,
        layer: int,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: DecodeRows,
        state: SelectionState,
        offload: tuple | None,
        out: torch.Tensor | None = None,
        host_reads: torch.Tensor | None = None,
        **view_kw,
    ) -> bool:
        """With `prunes`: once the listed blocks are readable (offload: a view of where each is,
        pool or host, kernels/sparse_decode.py, after the pool read the lists), may trim the
        lists just selected in place, or (out: lagged selection) write row i's trimmed list into
        out[i], the lists left as they are. Returns whether it changed them. host_reads (offload):
        += the listed blocks whose keys it read from the host. view_kw (lag + offload): view_by_slot
        (the view's rows are the lists' slots) and out_view (loc: the kept entries' view by row i)."""
        return False
