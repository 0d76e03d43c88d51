"""KV offload, each rank's side (docs/offload.md): `OffloadCache` owns the host store, the sparse
layers' device block cache, the HBM pool and the working-set counter. The runner hands it the
step's OffloadPlan once (`begin_step`: one host fence, saves, ranges, restores); the sparse
backend drops stale blocks, writes blocks through and reads its selected blocks through views."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sparseserve.config import OffloadConfig, available_host_memory
from sparseserve.kernels.flash_h2d import flash_h2d
from sparseserve.kernels.row_view import row_view
from sparseserve.kernels.sparse_decode import listed_rows
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.host import HostKVStore, host_block_bytes, pinned_zeros
from sparseserve.kvcache.layout import OffloadLayout
from sparseserve.kvcache.offload_plan import OffloadPlan
from sparseserve.kernels.pool_plan import ListLayout, ListLookup
from sparseserve.kvcache.pool import HBMPool
from sparseserve.kvcache.transfer import to_device_many
from sparseserve.kvcache.working_set import WorkingSetCounter

logger = logging.getLogger(__name__)

# FlashH2D beside the layers (the lagged per-layer loads): a program holds its SM while it waits on PCIe, so
# these loads take a quarter of the SMs: less of the link, still ahead of the layers (docs/offload.md).
BESIDE_PROGRAMS_PER_SM = 0.25
# ... and take 4 loads at a time: the plan lists a layer's loads apart (a few of tens of thousands of
# requests), so a small block spreads them over those programs (docs/offload.md, "FlashH2D's grid").
BESIDE_SCAN_BLOCK = 4

# A view of a layer's selected blocks for the sparse kernels: (pool slots, host rows, loc), loc an entry's
# slot, or -(host row + 1) (kernels/pool_plan.py view_loc).
OffloadView = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class OffloadStep:
    """One step's addressing of the sparse layers' device block cache."""

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, W]; released entries name the trash row
    # token blocks with new owners, to leave the pool before the step's kernels (`drop_stale`);
    # None when there are none, and in CUDA graphs' static steps
    stale: torch.Tensor | None = None


class OffloadCache:
    def __init__(
        self,
        layout: OffloadLayout,
        host: HostKVStore,
        pool: HBMPool,
        kv_caches: list[torch.Tensor],
        block_size: int,
        local_blocks: int,
        sparse_cache: torch.Tensor,
        working_set: WorkingSetCounter | None = None,
        dense_cache: torch.Tensor | None = None,
    ) -> None:
        self.layout, self.host, self.pool = layout, host, pool
        self.working_set = working_set
        self.kv_caches = kv_caches
        self.block_size, self.local_blocks = block_size, local_blocks
        self.dense_layers = layout.dense_layers
        self.num_device_blocks = layout.device_blocks
        # The sparse layers' device block cache, [L - dense, device blocks + 1, Hkv, 2, bs, D]
        # (the last kv_caches are its layers): restores and saves address it whole.
        self.sparse_cache = sparse_cache
        # seq_id -> (first token block, device blocks): the scheduler's ranges, as its plans said
        self.ranges: dict[int, tuple[int, list[int]]] = {}
        self.num_restored_blocks = 0  # token blocks restored into the device block cache (stats)
        self.lag_loc: torch.Tensor | None = None  # lag: [sparse layers, list rows + 1, Hkv, cap]
        self.cap = 0  # blocks a selection lists (set by `build`)
        # the every-layer plan's loads by layer: (key, load, count), kernels/pool_plan.py pool_read
        self._lag_loads: tuple[torch.Tensor, ...] | None = None
        # token block -> device row (kvcache/device_space.py DeviceRowMap), the trash row where none
        dev = pool.resident.device
        self.row_of = torch.full((layout.token_blocks + 1,), layout.rows, dtype=torch.int32, device=dev)
        self.dense_cache = dense_cache  # [dense layers, rows + 1, Hkv, 2, bs, D]: the first kv_caches
        self.key_meta = None  # the sparse backend's, by device row (attach_key_meta)
        self.host_meta: tuple[torch.Tensor, torch.Tensor] | None = None  # its copy by host row
        self.num_row_moves = [0, 0]  # device rows saved, restored (stats)
        self.seed_stats = torch.zeros(4, dtype=torch.int64, device=dev)  # `seed`'s plans (as the pool's stats)
        self.fill_stats = torch.zeros(4, dtype=torch.int64, device=dev)  # `fill`'s plans
        self.prune_key_reads = torch.zeros(1, dtype=torch.int64, device=dev)  # topp's candidate keys from the host
        # Prefetching reads (`lookup`): listed head blocks found in the pool, not found, and of those the ones
        # the attention reads from the host. `prefetch` (init_lagged): the reads are lookups, the plans prefetch.
        self.lookup_stats = torch.zeros(3, dtype=torch.int64, device=dev)
        self.prefetch = False

    @classmethod
    def build(
        cls,
        config: OffloadConfig,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        dense_layers: int,
        local_blocks: int,
        cap: int,
        metadata_block_bytes: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        budget: int | None,
        device_blocks: int | None,
    ) -> "OffloadCache":
        """Sizes the host store from config.host_kv_memory (default: max_num_seqs sequences of
        max_model_len, at most half the host's available memory), splits the device budget (bytes;
        None: device_blocks given) by OffloadLayout and allocates everything. With layer-segmented
        prefill the device cache keeps no whole-prefill reserve (docs/offload.md)."""
        hbb = host_block_bytes(num_layers, num_kv_heads, block_size, head_dim, dtype)
        seq_blocks = blocks_needed(max_model_len, block_size)
        step_tokens = max_num_batched_tokens
        if config.layer_segmented_prefill:  # longer prompts go layer by layer: one step of shorter ones
            step_tokens = config.segment_min_tokens(max_num_batched_tokens)
        step_blocks = blocks_needed(min(step_tokens, max_model_len), block_size)
        whole_prefill = 0 if config.layer_segmented_prefill else seq_blocks
        if config.host_kv_memory is not None:
            token_blocks = config.host_kv_memory // hbb
        else:
            token_blocks = max_num_seqs * seq_blocks
            avail = available_host_memory()
            if avail is not None:
                token_blocks = min(token_blocks, avail // 2 // hbb)
        if token_blocks * block_size < max_model_len:
            raise ValueError(
                f"the host KV store holds {token_blocks * block_size} tokens, fewer than "
                f"max_model_len={max_model_len}: raise host_kv_memory or lower max_model_len"
            )
        layout = OffloadLayout.plan(
            budget=budget,
            device_blocks=device_blocks,
            token_blocks=token_blocks,
            pool_slots=config.hbm_cache_blocks,
            # a decode step's lists of max_num_seqs sequences per layer, at most every head block
            default_pool_slots=num_layers * num_kv_heads * min(max_num_seqs * cap, token_blocks),
            min_device_blocks=step_blocks + local_blocks + 1 if config.layer_segmented_prefill else seq_blocks,
            # rows: at least one max_model_len sequence (and its first decode); a share of the
            # budget as for sequences of half max_model_len (docs/offload.md, "Device rows")
            min_rows=blocks_needed(max_model_len + 1, block_size),
            seq_rows=min(seq_blocks, max(seq_blocks // 2, 4 * cap)),
            # a whole prefill and a step's prefill tokens (short prompts beside a long prefill),
            # then a decode window (+1 block of slack) for each sequence the pool can serve
            want_device_blocks=whole_prefill + step_blocks,
            seq_window_blocks=local_blocks + 1,
            seq_pool_slots=(num_layers - dense_layers) * num_kv_heads * cap,
            max_seqs=max_num_seqs,
            num_layers=num_layers,
            dense_layers=dense_layers,
            kv_layer_block_bytes=hbb // num_layers,
            meta_block_bytes=metadata_block_bytes,
            head_block_bytes=2 * block_size * head_dim * dtype.itemsize,
        )
        logger.info(
            "KV offload device budget%s: %s", "" if budget is None else f" {budget / 2**30:.2f} GiB", layout.describe()
        )
        need = (layout.token_blocks + 1) * hbb
        avail = available_host_memory()
        if avail is not None and need > avail:
            raise ValueError(
                f"the host KV store needs {need} bytes, more than the host's available memory "
                f"({avail} bytes): set host_kv_memory lower"
            )
        shape = (num_kv_heads, 2, block_size, head_dim)
        dl = layout.dense_layers
        # Dense layers: a cache by device row (the running sequences' blocks). Sparse layers: the
        # device block cache (+ a trash row that released table entries name), the working set.
        dense_cache = torch.empty(dl, layout.rows + 1, *shape, dtype=dtype, device=device)
        sparse_cache = torch.empty(num_layers - dl, layout.device_blocks + 1, *shape, dtype=dtype, device=device)
        host = HostKVStore(num_layers, layout.token_blocks, num_kv_heads, block_size, head_dim, dtype, device=device)
        host.attach_d2h(max_num_batched_tokens, max_num_seqs)
        pool = HBMPool(
            num_layers, layout.token_blocks, num_kv_heads, block_size, head_dim, layout.pool_slots, dtype, device
        )
        counter = WorkingSetCounter(
            num_keys=pool.num_keys,
            num_slots=max_num_seqs,
            window=config.working_set_window,
            enabled=config.working_set_control,
            device=device,
        )
        logger.info(
            "KV offload: host store %d blocks (%.2f GiB, pinned=%s); device: %s",
            layout.token_blocks,
            host.nbytes / 2**30,
            host.data.is_pinned(),
            ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.2f} GiB" for k, v in layout.split().items()),
        )
        cache = cls(
            layout,
            host,
            pool,
            list(dense_cache) + list(sparse_cache),
            block_size,
            local_blocks,
            sparse_cache,
            counter,
            dense_cache,
        )
        cache.cap = cap
        return cache

    @property
    def num_token_blocks(self) -> int:
        return self.layout.token_blocks

    def attach_key_meta(self, key_meta) -> None:
        """The sparse backend's key metadata (kvcache/metadata.py KeyMeta, by device row) and its
        copy by host row, which saved rows go to and restored ones come from."""
        self.key_meta = key_meta
        pin = torch.cuda.is_available()
        rows = self.layout.token_blocks + 1
        shapes = [((t.shape[0], rows, *t.shape[2:]), t.dtype) for t in (key_meta.codes, key_meta.scale)]
        self.host_meta = tuple(pinned_zeros(s, d) if pin else torch.zeros(s, dtype=d) for s, d in shapes)

    def row_view(self, tables: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, slot mapping) by token block -> by device row (fixed shapes: CUDA
        graphs capture it; -1 slots stay -1; one launch: kernels/row_view.py)."""
        return row_view(self.row_of, tables, slots, self.block_size)

    def offloads(self, layer: int) -> bool:
        """Whether a layer's blocks live in the host store (dense layers keep theirs on device)."""
        return layer >= self.dense_layers

    def range_of(self, seq_id: int) -> tuple[int, list[int]]:
        """(first token block, device blocks) of a sequence's device range."""
        return self.ranges.get(seq_id, (0, []))

    # ---- the step (the runner) ----------------------------------------------------------------

    def begin_step(self, plan: OffloadPlan | None) -> None:
        """Before any kernel of a step, once: the host store's pending writes land (the step may
        rewrite device blocks the scheduler released, and may read any row written before), then
        the plan's tail saves, its device ranges and its restores (every sparse layer and KV head
        of the restored blocks in one FlashH2D gather). Its stale blocks are the runner's
        (`drop_stale`)."""
        self.host.fence()
        if plan is None:
            return
        if plan.saves:  # one UVA launch (a strided copy_ per block went through pageable memory, blocking)
            rows = torch.tensor([r for r, _ in plan.saves], dtype=torch.int64)
            devs = torch.tensor([d for _, d in plan.saves], dtype=torch.int64)
            self._copy_rows(self.sparse_cache, self.host.data[self.dense_layers :], devs, rows)
        if plan.row_saves:
            self._move_rows(plan.row_saves, save=True)
        for sid, rng in plan.ranges.items():
            if rng is None:
                self.ranges.pop(sid, None)
            else:
                self.ranges[sid] = rng
        if plan.rows:
            blocks = torch.tensor([b for b, _ in plan.rows], dtype=torch.int64)
            rows = torch.tensor([r if r >= 0 else self.layout.rows for _, r in plan.rows], dtype=torch.int32)
            self.row_of.index_copy_(0, *to_device_many([blocks, rows], self.row_of.device))
        if plan.restores:
            self._restore(plan.restores)
        if plan.row_restores:
            self._move_rows(plan.row_restores, save=False)

    def _restore(self, restores: list[tuple[int, int]]) -> None:
        self.num_restored_blocks += len(restores)
        rows = torch.tensor([r for r, _ in restores], dtype=torch.int64)
        devs = torch.tensor([d for _, d in restores], dtype=torch.int64)
        self._copy_rows(self.host.data[self.dense_layers :], self.sparse_cache, rows, devs)

    def _move_rows(self, pairs: list[tuple[int, int]], save: bool) -> None:
        """(token block, device row) pairs: the dense layers' KV and the sparse layers' key
        metadata, device row -> the block's host row (save) or back (restore)."""
        self.num_row_moves[0 if save else 1] += len(pairs)
        blocks = torch.tensor([b for b, _ in pairs], dtype=torch.int64)
        rows = torch.tensor([r for _, r in pairs], dtype=torch.int64)
        self._copy_row_tensors(blocks, rows, save)

    def _copy_row_tensors(self, blocks: torch.Tensor, rows: torch.Tensor, save: bool) -> None:
        dl = self.dense_layers
        moves = [(self.host.data[:dl], self.dense_cache)] if dl else []
        if self.key_meta is not None:
            (codes, scale), km = self.host_meta, self.key_meta
            moves += [(codes[dl:], km.codes[dl:]), (scale[dl:], km.scale[dl:])]
        for host, device in moves:
            if save:
                self._copy_rows(device, host, rows, blocks)
            else:
                self._copy_rows(host, device, blocks, rows)

    def warm_up(self) -> None:
        """Saves and restores the trash rows (device and host: nothing reads them), so that a serving step's
        first row save or restore compiles no kernel: the warm-up's requests have rows to spare and move none
        (docs/engine.md, "The warm-up"). Counts nothing."""
        blocks = torch.tensor([self.layout.token_blocks], dtype=torch.int64)
        rows = torch.tensor([self.layout.rows], dtype=torch.int64)
        for save in (True, False):
            self._copy_row_tensors(blocks, rows, save)

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """dst[:, dst_rows[i]] = src[:, src_rows[i]] for every layer and KV head of [layers, rows,
        Hkv, ...] tensors (on the device or pinned on the host): one FlashH2D launch over UVA."""
        layers = torch.arange(src.shape[0])[:, None, None]
        heads = torch.arange(src.shape[2])[None, None, :]
        key = ((layers * src.shape[1] + src_rows[None, :, None]) * src.shape[2] + heads).reshape(-1)
        load = ((layers * dst.shape[1] + dst_rows[None, :, None]) * dst.shape[2] + heads).reshape(-1)
        flash_h2d(
            src.reshape(-1, *src.shape[3:]),
            dst.reshape(-1, *dst.shape[3:]),
            *to_device_many([key, load], self.row_of.device),
        )

    def drop_stale(self, blocks: torch.Tensor | list[int] | None) -> None:
        """Token blocks with new owners leave the pool (one launch), before any kernel that may
        list them: the step's (uploaded with its inputs), or a plan's without a batch."""
        if blocks is not None and len(blocks):
            self.pool.invalidate(blocks)

    def sync(self) -> None:
        """Every FlashD2H write submitted so far is in the store (statistics, tests)."""
        self.host.fence(host=True)

    # ---- the sparse backend, per layer -----------------------------------------------------------

    def write_through(
        self,
        layer: int,
        kv_cache: torch.Tensor,
        step: OffloadStep,
        token_slot_mapping: torch.Tensor,
        num_decodes: int,
        num_seqs: int,
        decodes: bool = True,
    ) -> None:
        """Every token block a token of this step completes goes to the host store whole
        (kvcache/host.py); decodes=False: the decodes' blocks were written by the K/V store
        kernel (`decode_write`)."""
        self.host.store_step(layer, kv_cache, step.slot_mapping, num_decodes, num_seqs, token_slot_mapping, decodes)

    def decode_write(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host store layer, blocks-written counter): where the K/V store kernel writes the
        blocks that decode tokens complete (kernels/key_meta.py store_kv_key_meta), saving a
        launch a layer."""
        return self.host.data[layer], self.host.blocks_written

    def keys(self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel_rows: torch.Tensor) -> torch.Tensor:
        """int64 [B, Hkv, cap]: the host row (pool key) of each listed entry before the local
        window, the pool's trash key elsewhere. tables: token block tables."""
        listed = listed_rows(sel_rows, seq_lens, self.local_blocks, self.block_size)
        blocks = torch.where(listed, tables.gather(1, sel_rows.clamp_min(0).flatten(1).long()).view_as(sel_rows), -1)
        return self.pool.keys(layer, blocks)

    def seed(
        self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel_rows: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        """Lists a layer-segmented prefill selected for its first decode, into the pool straight from the
        layer's scratch K/V (device to device), so that decode reads them without FlashH2D: sel_rows [1, Hkv,
        cap] token blocks (-1: none), tables [1, W] their host rows, seq_lens [1] the first decode's length,
        scratch [blocks, Hkv, 2, bs, D] by token block. Planned as a lagged read (the step's lists stay); its
        installs count apart (`seed_stats`), not as loads."""
        self._install(layer, tables, seq_lens, sel_rows, scratch, self.seed_stats, lagged=True)

    def fill(self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, scratch: torch.Tensor) -> None:
        """A layer-segmented prompt's head blocks before the first decode's window into the pool's free slots,
        from the layer's scratch K/V (device to device), evicting nothing, stamped as the first victims: where
        the pool has room, what later steps list is there instead of crossing PCIe (docs/offload.md, "Filling
        free slots"). `seed`'s arguments; counted apart (`fill_stats`)."""
        num_kv_heads, width = scratch.shape[1], tables.shape[1]
        blocks = torch.arange(width, dtype=torch.int32, device=tables.device).expand(1, num_kv_heads, width)
        load = self._install(layer, tables, seq_lens, blocks, scratch, self.fill_stats, free_only=True)
        self.pool.mark_unused(load)

    def _install(
        self,
        layer: int,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        blocks: torch.Tensor,
        scratch: torch.Tensor,
        stats: torch.Tensor,
        **plan_kw,
    ) -> torch.Tensor:
        """Plans blocks [1, Hkv, K] (token blocks, -1: none; those before the window) into the pool and copies
        what it installs from the scratch (one FlashH2D launch, device to device). Returns the plan's `load`."""
        key = self.keys(layer, tables, seq_lens, blocks)
        _, load = self.pool.plan(key.reshape(-1), stats=stats, **plan_kw)
        heads = torch.arange(blocks.shape[1], device=blocks.device)[:, None]
        rows = (blocks[0].clamp_min(0).long() * blocks.shape[1] + heads).reshape(-1)  # the scratch's flat rows
        flash_h2d(scratch.view(-1, *scratch.shape[2:]), self.pool.slots, rows, load)
        return load

    def read(
        self, layer: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel: torch.Tensor, row_slots: torch.Tensor
    ) -> OffloadView:
        """One layer's listed head blocks read through the pool (HBMPool.read: lookup, victims,
        FlashH2D of the misses, working-set count); returns the sparse kernels' view. sel [S,
        Hkv, cap]: the layer's lists by state slot; row_slots [B]: the decode rows' slots. A head
        block listed twice (shared prefix) is planned once. Fixed shapes, no sync."""
        ws = self.working_set
        if ws is not None and layer == self.dense_layers:  # the first sparse layer starts the count
            ws.begin_step()
        host_flat = self.host.flat()
        loc, _ = self.pool.read(
            host_flat,
            layer,
            sel,
            row_slots,
            tables,
            seq_lens,
            self.local_blocks,
            self.block_size,
            None if ws is None else ws.touch_state(),
        )
        return self.pool.slots, host_flat, loc

    def lookup(self, layer: int, tables: torch.Tensor, cap: int) -> tuple[OffloadView, ListLookup]:
        """The prefetching read (docs/offload.md, "Prefetching reads"): where each listed head block
        is now, by decode row, planning and loading nothing; the pool holds what the step's plan of the
        previous step's lists loaded (`plan_lagged`, beside the step) and the rest is read from the
        host over UVA (topp's prune counts the host reads it keeps into `lookup_stats[2:]`). Returns
        the view to be written and the lookup that writes it: topp's prune does it in its first kernel
        (kernels/topp_prune.py `lookup`), one launch a layer less. tables: the decode rows' token block
        tables [B, W]; cap: the lists' length."""
        lay = ListLayout(layer, self.pool.num_blocks, self.pool.num_kv_heads, self.local_blocks, self.block_size)
        shape = (tables.shape[0], self.pool.num_kv_heads, cap)
        loc = torch.empty(shape, dtype=torch.int64, device=tables.device)
        view = (self.pool.slots, self.host.flat(), loc)
        return view, ListLookup(tables, lay, self.pool.resident, self.lookup_stats[:2])

    def init_lagged(self, list_rows: int, cap: int, prefetch: bool = False) -> None:
        """Lagged selection: a view buffer per sparse layer with a row per list row (state slot
        and parity, kernels/block_score.py step_slots) and a scratch row for rows that plan
        nothing. prefetch: the lagged plans only prefetch; the step's reads are `lookup`s."""
        self.prefetch = prefetch
        shape = (len(self.kv_caches) - self.dense_layers, list_rows + 1, self.host.data.shape[2], cap)
        dev = self.pool.resident.device
        self.lag_loc = torch.full(shape, -1, dtype=torch.int64, device=dev)

    def plan_lagged(
        self,
        layer: int | None,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sel: torch.Tensor,
        list_rows: torch.Tensor,
        new_round: bool = False,
    ) -> None:
        """Reads the lists of list_rows (-1: none) through the pool as `read` does and keeps their
        views by list row: one layer's (sel [S', Hkv, cap]), or with layer None every sparse
        layer's in one plan (sel: all layers' buffer), whose loads wait for `load_lagged`, layer
        by layer. new_round: the step's first plan (no later plan of the step evicts what it
        stamps; starts the working-set count). Prefetching reads keep no views of the every-layer
        plan (their reads are lookups). The trap: the host rows must be in the store, i.e. after the step's fence."""
        ws = self.working_set
        if new_round:
            self.pool.begin_round()
            if ws is not None:
                ws.begin_step()
        if layer is None:
            sel = sel[self.dense_layers :]
        views = not (self.prefetch and layer is None)
        loc, _, *loads = self.pool.read(
            self.host.flat(),
            self.dense_layers if layer is None else layer,
            sel,
            list_rows,
            tables,
            seq_lens,
            self.local_blocks,
            self.block_size,
            None if ws is None else ws.touch_state(),
            lagged=True,
            defer=layer is None,
            views=views,
        )
        if layer is None:
            self._lag_loads = loads[0]
        if not views:
            return
        dst = torch.where(list_rows >= 0, list_rows.long(), self.lag_loc.shape[1] - 1)
        if layer is None:
            self.lag_loc.index_copy_(1, dst, loc)
        else:
            self.lag_loc[layer - self.dense_layers].index_copy_(0, dst, loc)

    def load_lagged(self, layer: int) -> None:
        """FlashH2D of one sparse layer's misses of the last every-layer `plan_lagged` (its views
        name their slots already: a reader waits for this load, not for the whole plan's)."""
        key, load, count = self._lag_loads
        li = layer - self.dense_layers
        flash_h2d(
            self.host.flat(),
            self.pool.slots,
            key[li],
            load[li],
            BESIDE_PROGRAMS_PER_SM,
            BESIDE_SCAN_BLOCK,
            count[li : li + 1],
        )
        if li == key.shape[0] - 1:  # the last sparse layer's: the plan's buffers may go
            self._lag_loads = None

    def lagged_view(self, layer: int) -> OffloadView:
        """The views `plan_lagged` kept, by list row (sparse_decode's view_by_slot)."""
        li = layer - self.dense_layers
        return self.pool.slots, self.host.flat(), self.lag_loc[li]

    # ---- statistics ------------------------------------------------------------------------------

    def counters(self) -> dict[str, torch.Tensor]:
        """Cumulative device counters: the listed head blocks found in the pool and not (hit ratio),
        head blocks loaded (FlashH2D), bypass reads (head blocks the attention read from the host),
        layer steps, candidate head blocks whose keys a prune read from the host (over UVA, not
        loaded), and token blocks x layers written through by decode steps."""
        s = self.pool.stats
        # prefetching reads: the step's reads are lookups; the plans' own hits and bypasses read nothing
        # (without: every miss is loaded or bypassed, and the engine adds them up; these tensors are read later)
        hits, misses, bypass = self.lookup_stats if self.prefetch else (s[0], None, s[2])
        return {
            "offload_hbm_hits": hits,
            **({} if misses is None else {"offload_hbm_misses": misses}),
            "offload_blocks_loaded": s[1],
            "offload_bypass_reads": bypass,
            "offload_layer_steps": s[3],
            "offload_blocks_seeded": self.seed_stats[1],
            "offload_blocks_filled": self.fill_stats[1],
            "offload_prune_key_reads": self.prune_key_reads[0],
            "offload_blocks_written": self.host.blocks_written,
        }

    def gauges(self) -> dict[str, int]:
        """Host-side values: sizes, blocks restored, FlashD2H's blocks written."""
        return {
            "offload_host_blocks": self.layout.token_blocks,
            "offload_hbm_slots": self.pool.num_slots,
            "offload_head_block_bytes": self.layout.head_block_bytes,
            "offload_blocks_restored": self.num_restored_blocks,
            "offload_device_rows": self.layout.rows,
            "offload_rows_saved": self.num_row_moves[0],
            "offload_rows_restored": self.num_row_moves[1],
            **{f"offload_hbm_bytes_{k}": v for k, v in self.layout.split().items()},
            "offload_d2h_blocks_written": self.host.d2h_blocks_written(),
        }
