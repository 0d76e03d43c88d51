"""The hierarchical KV cache as one component (DESIGN.md principles 4 and 5): `OffloadCache`.

With kv_offload every full head block lives in a pinned host store (kvcache/host.py), written through once as
its tokens arrive; the device keeps, per token block, the key metadata and the dense layers' K/V, and for the
sparse layers only each running sequence's working set (its prefill's blocks, its decode window: the device
block cache, `DeviceBlockMap`) plus a unified pool of HBM head-block slots (kvcache/pool.py) through which
sparse decode reads the other blocks it selects. How the device budget is split: kvcache/layout.py.

Everything outside reaches the offload path through this class:
  - the runner builds it (`build`) and takes its per-layer caches (`kv_caches`) and each step's device
    addressing (`prepare_step`: slots and tables of the device block cache), and fences it before a step;
  - the scheduler asks its device block space whether a step fits (`can_schedule`, `can_admit`), maps a
    step's blocks (`schedule`), releases a sequence's (`free`) or pauses it (`pause`: its partial tail block
    saved to its host row, its device blocks released, everything it computed kept in the store) and reports
    token blocks handed to a new owner (`on_allocate`: their pool slots are stale);
  - blocks mapped over tokens already computed (a prefix-cache hit, a paused sequence resuming) are restored
    from their host rows into the device block cache by one FlashH2D gather (`begin_step`, before the step's
    kernels), never recomputed: the key metadata and the dense layers' K/V are indexed by token block and
    never left the device (docs/prefix_cache.md);
  - the sparse backend writes each layer's new full blocks through (`write_through`) and reads a layer's
    selected blocks into an HBM view (`read`: pool lookup, victims and FlashH2D of the misses; `lookup` after
    the lists changed without loading); with lagged selection it plans the next step's lists beside the step in
    flight (`plan_lagged`, on its side stream) and the step reads the views planned the step before
    (`lagged_view`): no pool work is left between a layer's selection and its attention;
  - CUDA graphs replay the step's device addressing from their static inputs (`graph_inputs`, `capture_step`);
  - working-set-aware batch control: `working_set` (kvcache/working_set.py) counts each sequence's working
    set in the pool's unit (head blocks) on the device; the sparse backend feeds it, the scheduler reads it;
  - statistics: `counters()` (device, read without a sync) and `gauges()`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from sparseserve.config import OffloadConfig, available_host_memory
from sparseserve.kernels.flash_h2d import flash_h2d
from sparseserve.kernels.sparse_decode import listed_rows
from sparseserve.kvcache.blocks import BlockAllocator, blocks_needed
from sparseserve.kvcache.decode_rows import DecodeRows, tables_of
from sparseserve.kvcache.host import HostKVStore, host_block_bytes
from sparseserve.kvcache.staging import InputField, to_device_many
from sparseserve.kvcache.layout import OffloadLayout
from sparseserve.kvcache.pool import HBMPool
from sparseserve.kvcache.working_set import WorkingSet

logger = logging.getLogger(__name__)

# A view of a layer's selected blocks for the sparse kernels: (pool slots, host rows, loc, key).
OffloadView = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class OffloadStep:
    """One step's addressing of the sparse layers' device block cache (token-block addressing is the step's
    AttentionMetadata). Released entries of a table name the cache's trash row."""
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, W]
    # token blocks handed to new owners since the last step (on_allocate), to leave the pool before the step's
    # kernels (`drop_stale`); None when there are none, and in CUDA graphs' static steps
    stale: torch.Tensor | None = None


class StaleBlocks:
    """Token blocks handed to new owners (`OffloadCache.on_allocate`): the HBM pool must not serve their previous
    contents, so they leave it (one kernel launch, `OffloadCache.drop_stale`) before any selection can list
    them. A step's launch costs host time, and at a large decode batch some decode opens a block nearly every
    step; a block a decode opened holds one token, so a selection can list it (full) block_size - 1 decode steps
    later at the earliest: it waits for the next launch, at most block_size - 2 steps. Any other block (a
    prefill's: listed by the next step) leaves with its own step and takes the waiting ones along."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[int] = []  # since the last step
        self.waiting: list[int] = []  # opened by decodes, not yet taken
        self.deadline = 0  # the step by which the waiting ones leave
        self.steps = 0  # steps with a batch (take): every decode step is one

    def add(self, blocks: list[int]) -> None:
        self.pending += blocks

    def take(self, opened: list[int]) -> list[int]:
        """The blocks leaving the pool with this step; opened: the token blocks its decodes open."""
        self.steps += 1
        if not self.waiting:
            self.deadline = self.steps + self.block_size - 2
        if opened and self.pending:
            fresh = set(opened)
            self.waiting += [b for b in self.pending if b in fresh]
            self.pending = [b for b in self.pending if b not in fresh]
        if not self.pending and (not self.waiting or self.steps < self.deadline):
            return []
        return self.take_all()

    def take_all(self) -> list[int]:
        out, self.pending, self.waiting = self.pending + self.waiting, [], []
        return out

    def take_pending(self) -> list[int]:
        """A step without a batch (`OffloadCache.fence`): decodes opened nothing, the waiting ones may wait."""
        out, self.pending = self.pending, []
        return out


class DeviceBlockMap:
    """The device block cache's rows and which token blocks of each sequence they hold.

    A sequence maps a contiguous range of its token blocks [start, start + len(blocks)) to device blocks:
      - a step that prefills (more than one new token, or one token that is not the last one to compute)
        needs every block of the sequence: dense prefill attention reads all earlier blocks;
      - a decode (the one token left) needs the local window only (the last `local_blocks` blocks, tail
        included): the sparse kernel reads every other listed block through the HBM pool or the host store.
    Blocks leaving that range are released when the step is scheduled. The range only moves forward (a
    sequence never prefills after decoding unless preempted, which releases everything), so no block is
    ever loaded back into the device cache.

    Why releasing at scheduling time is safe: a released block left the window, so it is full and was
    written in an earlier step; the runner fences the host store before it launches a step's kernels
    (every write-through of earlier steps is in the store), and the step reads the block through the pool /
    host row only, so a new owner may overwrite the device block in that same step."""

    def __init__(self, num_blocks: int, local_blocks: int, block_size: int, token_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.token_blocks = token_blocks
        self.local_blocks = local_blocks
        self.block_size = block_size
        self.ranges: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (start, device blocks)
        # Sequences in layer-segmented prefill: they hold only their first decode's window (map_window).
        self.segmented: set[int] = set()
        # seq_id -> the end of the token block its last decode's `map` wrote into: decodes of tokens before it
        # keep the same window (a decoding sequence never prefills again without releasing its range first)
        self.steady_until: dict[int, int] = {}
        self.changed: set[int] = set()  # seq_ids whose range changed since `take_changed` (the step's tables)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def range_of(self, seq) -> tuple[int, list[int]]:
        return self.ranges.get(seq.seq_id, (0, []))

    def hot_range(self, seq, n: int) -> tuple[int, int]:
        """Token-block indices [lo, hi) that must be on the device for a step computing n new tokens."""
        c = seq.num_computed_tokens
        hi = blocks_needed(c + n, self.block_size)
        decode = n == 1 and c + 1 == seq.num_tokens
        return (max(hi - self.local_blocks, 0) if decode else 0), hi

    def num_to_allocate(self, seq, n: int) -> int:
        """Device blocks this step takes from the free list, net of what the sequence itself releases."""
        lo, hi = self.hot_range(seq, n)
        start, blocks = self.range_of(seq)
        held = len(blocks)
        missing = hi - max(lo, start + held) if held else hi - lo
        releasable = min(max(lo - start, 0), held)
        return missing - releasable

    def steady(self, seq, n: int) -> bool:
        """A decode whose mapped range is its window already (block_size - 1 of every block_size decode steps):
        the step maps, releases and restores nothing. The scheduler asks this of every running sequence every
        step, so it is one lookup (`steady_until`, set by a decode's `map`) before `hot_range`'s general test."""
        return n == 1 and seq.num_computed_tokens < self.steady_until.get(seq.seq_id, 0)

    def can_map(self, seq, n: int) -> bool:
        return self.steady(seq, n) or self.allocator.can_allocate(max(self.num_to_allocate(seq, n), 0))

    def can_admit(self, seq, running: list) -> bool:
        """Whether a waiting sequence may start: the device blocks its whole prefill will need (a paused
        sequence that was decoding: its window) fit next to what the running prefills still need (admitting a
        prompt whose later chunks cannot get their blocks would only preempt it again). Always true when the
        device space is as large as the token space."""
        if self.num_blocks >= self.token_blocks:
            return True
        reserved = sum(self._prefill_rest(s) for s in running)
        if seq.num_computed_tokens + 1 >= seq.num_tokens:
            lo, hi = self.hot_range(seq, 1)
            need = hi - lo
        else:
            need = blocks_needed(seq.num_tokens, self.block_size)
        return self.allocator.num_free - reserved >= need

    def _prefill_rest(self, seq) -> int:
        """Device blocks a running sequence still has to map to finish its prefill."""
        if seq.num_computed_tokens + 1 >= seq.num_tokens or seq.seq_id in self.segmented:
            return 0
        start, blocks = self.range_of(seq)
        return blocks_needed(seq.num_tokens, self.block_size) - start - len(blocks)

    def map(self, seq, n: int) -> list[int]:
        """Releases the sequence's device blocks before the step's range and maps the blocks it adds.
        Returns the released device blocks (already back on the free list)."""
        lo, hi = self.hot_range(seq, n)
        start, blocks = self.range_of(seq)
        if not blocks:
            start = lo
        if lo < start:
            raise RuntimeError(f"sequence {seq.seq_id} needs token block {lo} on the device again after "
                               f"releasing it (device range starts at {start})")
        cut = min(lo - start, len(blocks))
        released: list[int] = []
        if cut:  # a decode's window moves once per block_size steps: most steps release nothing
            released = blocks[:cut]
            self.allocator.free(released)
            blocks = blocks[cut:]
            start = start + cut if blocks else lo
        end = start + len(blocks)
        if hi > end:
            blocks = blocks + self.allocator.allocate(hi - end)
        self.ranges[seq.seq_id] = (start, blocks)
        self.changed.add(seq.seq_id)
        self.segmented.discard(seq.seq_id)
        if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:  # a decode: its range is [lo, hi) now
            self.steady_until[seq.seq_id] = hi * self.block_size
        else:
            self.steady_until.pop(seq.seq_id, None)
        return released

    def window(self, seq) -> tuple[int, int]:
        """Token-block indices [lo, hi) of the prompt's blocks in its first decode's local window (the prompt's
        tail block included): what a layer-segmented prefill leaves on the device (engine/layer_prefill.py)."""
        p, bs = seq.num_tokens, self.block_size
        return max(blocks_needed(p + 1, bs) - self.local_blocks, 0), blocks_needed(p, bs)

    def can_admit_window(self, seq, running: list) -> bool:
        """Whether a layer-segmented prefill may start: its window fits next to what running prefills still need."""
        lo, hi = self.window(seq)
        return self.allocator.num_free - sum(self._prefill_rest(s) for s in running) >= hi - lo

    def map_window(self, seq) -> None:
        """Maps the window of a sequence starting a layer-segmented prefill (it holds no device block); its
        first decode's `map` then extends the same range."""
        if seq.seq_id in self.ranges:
            raise RuntimeError(f"sequence {seq.seq_id} starts a layer-segmented prefill holding device blocks")
        lo, hi = self.window(seq)
        self.ranges[seq.seq_id] = (lo, self.allocator.allocate(hi - lo))
        self.changed.add(seq.seq_id)
        self.segmented.add(seq.seq_id)
        self.steady_until.pop(seq.seq_id, None)

    def take_changed(self) -> set[int]:
        out, self.changed = self.changed, set()
        return out

    def release(self, seq) -> None:
        _, blocks = self.ranges.pop(seq.seq_id, (0, []))
        self.changed.add(seq.seq_id)
        self.segmented.discard(seq.seq_id)
        self.steady_until.pop(seq.seq_id, None)
        self.allocator.free(blocks)


class OffloadCache:
    def __init__(self, layout: OffloadLayout, host: HostKVStore, pool: HBMPool, device_map: DeviceBlockMap,
                 kv_caches: list[torch.Tensor], block_size: int, local_blocks: int,
                 sparse_cache: torch.Tensor | None = None, working_set: WorkingSet | None = None) -> None:
        self.layout, self.host, self.pool, self.device_map = layout, host, pool, device_map
        self.working_set = working_set
        self.kv_caches = kv_caches
        self.block_size, self.local_blocks = block_size, local_blocks
        self.dense_layers = layout.dense_layers
        # The sparse layers' device block cache as one tensor [L - dense, device blocks + 1, Hkv, 2, bs, D] (the
        # last kv_caches are its layers): restores and pauses address it whole.
        self.sparse_cache = sparse_cache
        self._restores: list[tuple[int, int]] = []  # (token block = host row, device block) before the next step
        self._stale = StaleBlocks(block_size)  # token blocks handed to new owners, to leave the pool
        self._rows: DecodeRows | None = None  # the last decode step's rows (prepare_step)
        self.num_restored_blocks = 0  # token blocks restored into the device block cache (stats)
        self.lag_loc: torch.Tensor | None = None  # lagged views: [sparse layers, list rows + 1 scratch, Hkv, cap]
        self.lag_key: torch.Tensor | None = None

    @classmethod
    def build(cls, config: OffloadConfig, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: torch.device, dense_layers: int, local_blocks: int, cap: int,
              metadata_block_bytes: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
              budget: int | None, device_blocks: int | None) -> "OffloadCache":
        """The host store sized from config.host_kv_memory (default: max_num_seqs sequences of max_model_len,
        at most half the host's available memory), the device budget (bytes; None: device_blocks given) split
        by OffloadLayout, and everything allocated. With layer-segmented prefill (config.layer_segmented_prefill)
        no prompt longer than one step's budget maps its blocks on the device: the device block cache keeps no
        whole-prefill reserve and needs only one step's prefill and a window."""
        hbb = host_block_bytes(num_layers, num_kv_heads, block_size, head_dim, dtype)
        seq_blocks = blocks_needed(max_model_len, block_size)
        step_blocks = blocks_needed(min(max_num_batched_tokens, max_model_len), block_size)
        whole_prefill = 0 if config.layer_segmented_prefill else seq_blocks
        if config.host_kv_memory is not None:
            token_blocks = config.host_kv_memory // hbb
        else:
            token_blocks = max_num_seqs * seq_blocks
            avail = available_host_memory()
            if avail is not None:
                token_blocks = min(token_blocks, avail // 2 // hbb)
        if token_blocks * block_size < max_model_len:
            raise ValueError(f"the host KV store holds {token_blocks * block_size} tokens, fewer than "
                             f"max_model_len={max_model_len}: raise host_kv_memory or lower max_model_len")
        layout = OffloadLayout.plan(
            budget=budget, device_blocks=device_blocks, token_blocks=token_blocks, pool_slots=config.hbm_cache_blocks,
            # one decode step's lists of max_num_seqs sequences in every layer, at most every head block
            default_pool_slots=num_layers * num_kv_heads * min(max_num_seqs * cap, token_blocks),
            min_device_blocks=step_blocks + local_blocks + 1 if config.layer_segmented_prefill else seq_blocks,
            # one whole prefill and one step's prefill tokens, so short prompts can be admitted next to a long
            # prefill; then a decode window (+1 block of slack) of every sequence the pool can serve
            want_device_blocks=whole_prefill + step_blocks, seq_window_blocks=local_blocks + 1,
            seq_pool_slots=(num_layers - dense_layers) * num_kv_heads * cap, max_seqs=max_num_seqs,
            num_layers=num_layers, dense_layers=dense_layers, kv_layer_block_bytes=hbb // num_layers,
            meta_block_bytes=metadata_block_bytes, head_block_bytes=2 * block_size * head_dim * dtype.itemsize)
        logger.info("KV offload device budget%s: %s", "" if budget is None else f" {budget / 2**30:.2f} GiB",
                    layout.describe())
        need = (layout.token_blocks + 1) * hbb
        avail = available_host_memory()
        if avail is not None and need > avail:
            raise ValueError(f"the host KV store needs {need} bytes, more than the host's available memory "
                             f"({avail} bytes): set host_kv_memory lower")
        shape = (num_kv_heads, 2, block_size, head_dim)
        dl = layout.dense_layers
        # The dense layers attend every block every step: a full-size cache indexed by token block. The sparse
        # layers' device block cache (+ a trash row that released table entries name) holds the working set.
        dense_cache = torch.empty(dl, layout.token_blocks, *shape, dtype=dtype, device=device)
        sparse_cache = torch.empty(num_layers - dl, layout.device_blocks + 1, *shape, dtype=dtype, device=device)
        host = HostKVStore(num_layers, layout.token_blocks, num_kv_heads, block_size, head_dim, dtype, device=device)
        host.attach_d2h(max_num_batched_tokens, max_num_seqs)
        pool = HBMPool(num_layers, layout.token_blocks, num_kv_heads, block_size, head_dim, layout.pool_slots, dtype,
                       device)
        device_map = DeviceBlockMap(layout.device_blocks, local_blocks, block_size, layout.token_blocks)
        working_set = WorkingSet(num_keys=pool.num_keys, num_slots=max_num_seqs, window=config.working_set_window,
                                 capacity=pool.num_slots, margin=config.working_set_margin,
                                 enabled=config.working_set_control, lists=(num_layers - dl) * num_kv_heads,
                                 cap=cap, local=local_blocks, block_size=block_size, device=device)
        logger.info("KV offload: host store %d blocks (%.2f GiB, pinned=%s), device block cache %d blocks, "
                    "HBM pool %d head-block slots", layout.token_blocks, host.nbytes / 2**30, host.data.is_pinned(),
                    layout.device_blocks, pool.num_slots)
        return cls(layout, host, pool, device_map, list(dense_cache) + list(sparse_cache), block_size, local_blocks,
                   sparse_cache, working_set)

    @property
    def num_token_blocks(self) -> int:
        return self.layout.token_blocks

    def offloads(self, layer: int) -> bool:
        """Whether a layer's blocks live in the host store (the dense layers keep theirs on the device)."""
        return layer >= self.dense_layers

    # ---- the scheduler ------------------------------------------------------------------------------------

    def can_schedule(self, seq, n: int) -> bool:
        return self.device_map.can_map(seq, n)

    def can_admit(self, seq, running: list) -> bool:
        return self.device_map.can_admit(seq, running)

    def steady_decode(self, seq) -> bool:
        """A decode that maps, releases and restores nothing (can_schedule holds, schedule does nothing)."""
        return self.device_map.steady(seq, 1)

    def schedule(self, seq, n: int) -> None:
        """Maps the step's device blocks; those newly mapped over computed tokens (only a sequence that
        (re)starts with computed tokens has any: a prefix-cache hit, a paused sequence) are queued for
        restoring from their host rows."""
        dm = self.device_map
        if dm.steady(seq, n):
            return
        old_start, old = dm.range_of(seq)
        dm.map(seq, n)
        start, blocks = dm.range_of(seq)
        first = old_start + len(old) if old else start
        for j in range(max(first, start), min(start + len(blocks), blocks_needed(seq.num_computed_tokens,
                                                                                   self.block_size))):
            self._restores.append((seq.block_table[j], blocks[j - start]))

    def free(self, seq) -> None:
        self.device_map.release(seq)
        if self.working_set is not None:
            self.working_set.forget(seq)

    def can_admit_segmented(self, seq, running: list) -> bool:
        """Whether a layer-segmented prefill may start (its first decode's window fits)."""
        return self.device_map.can_admit_window(seq, running)

    def schedule_segmented(self, seq) -> None:
        """A layer-segmented prefill starts: its window's device blocks are mapped (filled layer by layer from
        the prefill's scratch, engine/layer_prefill.py; nothing to restore)."""
        self.device_map.map_window(seq)

    def pause(self, seq) -> None:
        """Preemption that keeps the work: the sequence keeps its token blocks (host rows hold every full block
        it computed) and its partial tail block, not yet written through, is saved to its host row now; its
        device blocks are released. Resuming restores its window (or all of it, mid-prefill) by copy."""
        c, bs = seq.num_computed_tokens, self.block_size
        start, blocks = self.device_map.range_of(seq)
        if c % bs and start <= c // bs < start + len(blocks):
            mine = set(blocks)
            self._restores = [(row, dev) for row, dev in self._restores if dev not in mine]
            row, dev = seq.block_table[c // bs], blocks[c // bs - start]
            self.host.data[self.dense_layers:, row].copy_(self.sparse_cache[:, dev])
        self.device_map.release(seq)
        if self.working_set is not None:
            self.working_set.on_pause(seq)

    def begin_step(self) -> None:
        """Before any kernel of a step: the host store's pending writes land (fence), then the blocks the
        schedule mapped over computed tokens are copied from their host rows into the device block cache, every
        sparse layer and KV head in one FlashH2D gather. (Blocks with new owners leave the pool with the step's
        addressing: `prepare_step`, `drop_stale`.)"""
        self.host.fence()
        if not self._restores:
            return
        rows = torch.tensor([r for r, _ in self._restores], dtype=torch.int64)
        devs = torch.tensor([d for _, d in self._restores], dtype=torch.int64)
        self._restores = []
        self.num_restored_blocks += rows.numel()
        dl, num_layers = self.dense_layers, self.host.data.shape[0]
        hkv = self.host.data.shape[2]
        layers = torch.arange(dl, num_layers)[:, None, None]
        heads = torch.arange(hkv)[None, None, :]
        key = ((layers * (self.host.num_blocks + 1) + rows[None, :, None]) * hkv + heads).reshape(-1)
        load = (((layers - dl) * (self.sparse_cache.shape[1]) + devs[None, :, None]) * hkv + heads).reshape(-1)
        dev = self.sparse_cache.device
        flash_h2d(self.host.flat(), self.sparse_cache.view(-1, *self.sparse_cache.shape[3:]),
                  *to_device_many([key, load], dev))

    def on_allocate(self, blocks: list[int]) -> None:
        """Token blocks given to a new owner: the pool must not serve their previous contents. They leave the pool
        in one launch before the kernels of their step or, opened by a decode, of a later one (StaleBlocks;
        `prepare_step` hands them to the step, which moves them to the device with its addressing, `drop_stale`)."""
        self._stale.add(blocks)

    # ---- the runner ---------------------------------------------------------------------------------------

    def prepare_step(self, scheduled: list) -> OffloadStep:
        """Device cache slots of the step's tokens and device tables of its sequences, in `scheduled` order
        ((sequence, new tokens) pairs), and the blocks to drop from the pool (the caller moves them to the device
        with the rest of the step's inputs, then calls `drop_stale`). Built per sequence and block on the host,
        except in a decode step of the same sequences as the decode step before (kvcache/decode_rows.py)."""
        dm, bs = self.device_map, self.block_size
        changed = dm.take_changed()
        if self._rows is None or not self._rows.fits(scheduled):
            self._rows = DecodeRows.build(scheduled, self._device_row, dm.num_blocks, bs)  # None unless all decode
            changed = ()
        if self._rows is not None:
            slots, tables, pos = self._rows.update(scheduled, changed)
            # (over Python ints: numpy's per-call overhead on a batch's 32 values is larger than the loop)
            opened = [scheduled[b][0].block_table[c // bs] for b, c in enumerate(pos.tolist()) if c % bs == 0]
            return self._step(slots, tables, opened)
        slots, opened = [], []  # opened: token blocks this step's decodes open (their first token)
        for seq, n in scheduled:
            start, blocks = dm.ranges[seq.seq_id]
            c = seq.num_computed_tokens
            if n == 1:
                slots.append(blocks[c // bs - start] * bs + c % bs)
                if c % bs == 0:
                    opened.append(seq.block_table[c // bs])
                continue
            for blk in range(c // bs, (c + n - 1) // bs + 1):  # tokens [c, c + n), block by block
                lo, hi = max(c, blk * bs), min(c + n, (blk + 1) * bs)
                base = blocks[blk - start] * bs - blk * bs
                slots.extend(range(base + lo, base + hi))
        width = max(len(seq.block_table) for seq, _ in scheduled)
        return self._step(torch.tensor(slots, dtype=torch.long),
                          tables_of(scheduled, self._device_row, dm.num_blocks, width), opened)

    def _device_row(self, seq) -> tuple[int, list[int]]:
        return self.device_map.ranges[seq.seq_id]

    def _step(self, slots: torch.Tensor, tables: np.ndarray, opened: list[int]) -> OffloadStep:
        # stale None when no block leaves the pool (most steps): nothing to move to the device or drop
        stale = self._stale.take(opened)
        return OffloadStep(slots, torch.from_numpy(tables),
                           torch.from_numpy(np.array(stale, dtype=np.int64)) if stale else None)

    def drop_stale(self, step: OffloadStep) -> None:
        """The step's blocks with new owners (`prepare_step`, on the device now) leave the pool: one launch,
        before the step's kernels."""
        if step.stale is not None and step.stale.numel():
            self.pool.invalidate(step.stale)

    def fence(self) -> None:
        """Before any kernel of a step: earlier steps' FlashD2H copies are in the store, so device blocks the
        scheduler released for this step may be rewritten; token blocks with new owners that no step's addressing
        took (`prepare_step`: a step without a batch) leave the pool here."""
        self.host.fence()
        stale = self._stale.take_pending()
        if stale:
            self.pool.invalidate(stale)

    # ---- the sparse backend, per layer --------------------------------------------------------------------

    def write_through(self, layer: int, kv_cache: torch.Tensor, step: OffloadStep, token_slot_mapping: torch.Tensor,
                      num_decodes: int, num_seqs: int, decodes: bool = True) -> None:
        """Every token block a token of this step completes goes to the host store whole (kvcache/host.py);
        decodes=False: the decodes' blocks were written by the K/V store kernel (`decode_write`)."""
        self.host.store_step(layer, kv_cache, step.slot_mapping, num_decodes, num_seqs, token_slot_mapping, decodes)

    def decode_write(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host store layer, blocks-written counter): where the K/V store kernel writes the blocks that decode
        tokens complete (kernels/key_meta.py store_kv_key_meta), saving a launch a layer."""
        return self.host.data[layer], self.host.blocks_written

    def keys(self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel_rows: torch.Tensor) -> torch.Tensor:
        """int64 [B, Hkv, cap]: the host row (pool key) of each listed entry before the local window, the pool's
        trash key elsewhere. tables: token block tables."""
        listed = listed_rows(sel_rows, seq_lens, self.local_blocks, self.block_size)
        blocks = torch.where(listed, tables.gather(1, sel_rows.clamp_min(0).flatten(1).long()).view_as(sel_rows), -1)
        return self.pool.keys(layer, blocks)

    def read(self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel: torch.Tensor,
             row_slots: torch.Tensor) -> OffloadView:
        """Residency lookup of the listed head blocks, victims for the misses and FlashH2D of the misses into
        their slots, and the listed blocks counted into their sequences' working sets (kvcache/pool.py `read`:
        three kernels a layer on the GPU); the view the sparse kernels read them through. sel: the layer's lists
        by state slot [S, Hkv, cap]; row_slots [B] the decode rows' slots. Fixed shapes, no sync. Sequences
        sharing prefix-cached token blocks may list the same head block: it is planned once, and every
        occurrence reads its slot."""
        ws = self.working_set
        if ws is not None and layer == self.dense_layers:  # the first sparse layer starts the step's count
            ws.begin_step()
        host_flat = self.host.flat()
        loc, key = self.pool.read(host_flat, layer, sel, row_slots, tables, seq_lens, self.local_blocks,
                                  self.block_size, None if ws is None else ws.touch_state())
        return self.pool.slots, host_flat, loc, key

    def init_lagged(self, list_rows: int, cap: int) -> None:
        """Lagged selection: a view buffer per sparse layer with a row per list row (state slot and parity,
        kernels/block_score.py step_slots) and a scratch row for rows that plan nothing."""
        shape = (len(self.kv_caches) - self.dense_layers, list_rows + 1, self.host.data.shape[2], cap)
        dev = self.pool.resident.device
        self.lag_loc = torch.full(shape, -1, dtype=torch.int64, device=dev)
        self.lag_key = torch.full(shape, self.pool.trash_key, dtype=torch.int64, device=dev)

    def plan_lagged(self, layer: int | None, tables: torch.Tensor, seq_lens: torch.Tensor, sel: torch.Tensor,
                    list_rows: torch.Tensor, new_round: bool = False) -> None:
        """Reads the lists of list_rows (-1: none) through the pool as `read` does, for the step's decodes
        (tables, seq_lens), and keeps their views by list row: one layer's (sel [S', Hkv, cap]), or with layer None
        every sparse layer's in one plan (sel: the selection buffer of all layers). new_round: the step's first
        plan: no later plan of the step evicts what it stamps (`HBMPool.begin_round`); it also starts the step's
        working-set count. The host rows a list names are in the store: the step's fence has landed the FlashD2H
        writes of earlier steps."""
        ws = self.working_set
        if new_round:
            self.pool.begin_round()
            if ws is not None:
                ws.begin_step()
        if layer is None:
            sel = sel[self.dense_layers:]
        loc, key = self.pool.read(self.host.flat(), self.dense_layers if layer is None else layer, sel, list_rows,
                                  tables, seq_lens, self.local_blocks, self.block_size,
                                  None if ws is None else ws.touch_state(), lagged=True)
        dst = torch.where(list_rows >= 0, list_rows.long(), self.lag_loc.shape[1] - 1)
        if layer is None:
            self.lag_loc.index_copy_(1, dst, loc)
            self.lag_key.index_copy_(1, dst, key)
        else:
            self.lag_loc[layer - self.dense_layers].index_copy_(0, dst, loc)
            self.lag_key[layer - self.dense_layers].index_copy_(0, dst, key)

    def lagged_view(self, layer: int) -> OffloadView:
        """The views `plan_lagged` kept, by list row (sparse_decode's view_by_slot)."""
        li = layer - self.dense_layers
        return self.pool.slots, self.host.flat(), self.lag_loc[li], self.lag_key[li]

    def lookup(self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel_rows: torch.Tensor) -> OffloadView:
        """The view of lists that shrank in place after `read` (no state change, nothing loaded)."""
        key = self.keys(layer, tables, seq_lens, sel_rows)
        return self.pool.slots, self.host.flat(), self.pool.resident[key], key

    # ---- CUDA graphs --------------------------------------------------------------------------------------

    def graph_inputs(self, max_blocks: int) -> list[InputField]:
        """The step addressing a captured decode step reads (`capture_step`; the sparse backend fills them by
        these names from `prepare_step`): padding rows write nothing (slot -1) and name the trash row."""
        return [InputField("offload_slot_mapping", torch.long, pad=-1),
                InputField("offload_block_tables", torch.int32, width=max_blocks, pad=self.device_map.num_blocks)]

    @staticmethod
    def capture_step(inputs: dict[str, torch.Tensor]) -> OffloadStep:
        return OffloadStep(inputs["offload_slot_mapping"], inputs["offload_block_tables"])

    # ---- statistics ---------------------------------------------------------------------------------------

    def counters(self) -> dict[str, torch.Tensor]:
        """Cumulative device counters: pool hits, head blocks loaded (FlashH2D), bypass reads, layer steps, and
        token blocks x layers written through by decode steps."""
        s = self.pool.stats
        return {"offload_hbm_hits": s[0], "offload_blocks_loaded": s[1], "offload_bypass_reads": s[2],
                "offload_layer_steps": s[3], "offload_blocks_written": self.host.blocks_written}

    def gauges(self) -> dict[str, int]:
        """Host-side values: sizes, the device block cache in use, FlashD2H's blocks written and the working-set
        control's accounting."""
        ws = self.working_set.gauges() if self.working_set is not None else {}
        return ws | {"offload_host_blocks": self.layout.token_blocks, "offload_hbm_slots": self.pool.num_slots,
                "offload_head_block_bytes": self.layout.head_block_bytes,
                "offload_device_blocks": self.device_map.num_blocks,
                "offload_device_blocks_used": self.device_map.allocator.num_used,
                "offload_blocks_restored": self.num_restored_blocks,
                "offload_d2h_blocks_written": self.host.d2h_blocks_written()}
