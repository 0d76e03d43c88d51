"""SparseBackend: sparse decode (docs/architecture.md, principles 2, 3 and 6; docs/sparse.md, "The
backend as it is"). Per layer: store (+ key metadata, + write-through under offload), select,
read through the HBM pool (offload), refine, attend; prefill chunks through attention/prefill.py.
Lagged selection selects the next lists on a side stream joined at the last layer. The trap:
padding rows of CUDA graphs (seq_len 0) must never touch the selection state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from sparseserve.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    BackendContext,
    InputField,
    attend_paged,
)
from sparseserve.attention.selection import DecodeRows, SelectionParams, SelectionState, load_streaming_heads
from sparseserve.kernels.block_score import step_slots
from sparseserve.kernels.key_meta import store_kv_key_meta
from sparseserve.kernels.pdl import beside_the_step
from sparseserve.kernels.sparse_decode import attended_blocks, sparse_decode
from sparseserve.kernels.store_kv import store_kv
from sparseserve.kvcache.metadata import KeyMeta, allocate_key_meta, key_meta_block_bytes
from sparseserve.kvcache.offload import OffloadCache, OffloadStep, OffloadView
from sparseserve.registry import SELECTION_POLICIES


@dataclass
class SparseStepMeta:
    slots: torch.Tensor  # int32 [B]: each row's state slot
    cache: AttentionMetadata  # the step in the sparse layers' cache (device blocks: offload)
    offload: OffloadStep | None = None
    # Lag + offload: decode rows with fresh state slots, which select their own lists first and
    # plan them layer by layer (bool [num_decodes]; None: none; such a step runs eagerly).
    fix_select: torch.Tensor | None = None
    selects: bool = True  # False: rows that select nothing (a layer-segmented prefill's chunks but its last)
    # KV offload: the step by device row (dense layers' cache, key metadata); made at first use
    rows: AttentionMetadata | None = None


@ATTENTION_BACKENDS.register("sparse")
class SparseBackend(AttentionBackend):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.sparse
        self.params = p = SelectionParams.from_config(cfg, ctx.block_size, ctx.offload_prefetch)
        # Every selection launches at the graphs' width: an eager step compiles nothing new.
        self.width = -(-ctx.max_model_len // ctx.block_size)
        self.policy = SELECTION_POLICIES.get(cfg.sparse_policy)(p)
        if cfg.sparse_lag and not self.policy.supports_lag:
            raise ValueError(
                f"sparse_lag=1 does not work with sparse_policy={cfg.sparse_policy!r}: its lists fit the "
                f"query that selected them, not the next one"
            )
        self.dense_layers = cfg.sparse_dense_layers
        self.dense_context = cfg.sparse_budget if cfg.sparse_dense_context is None else cfg.sparse_dense_context
        streaming = load_streaming_heads(cfg.streaming_heads, ctx.num_layers, ctx.num_kv_heads)
        self.state = SelectionState(p, ctx.num_layers, ctx.num_kv_heads, ctx.max_num_seqs, streaming, ctx.device)
        self.key_meta: KeyMeta | None = None
        self.offload: OffloadCache | None = None
        self.side = torch.cuda.Stream(ctx.device) if p.lag and ctx.device.type == "cuda" else None
        # lag + a refining policy: each step's refined lists, row i for decode row i (the candidates stay)
        self.refined: tuple[torch.Tensor, torch.Tensor] | None = None
        # offload + a refining policy: the pruned lists' view (loc: pool slot or host row) by decode row, which
        # the prune writes (lagged: beside self.refined; else beside the lists it shrinks in place)
        self.refined_view: torch.Tensor | None = None
        if p.lag and self.policy.prunes and not p.prefetch:
            shape = (ctx.max_num_seqs, ctx.num_kv_heads, p.cap)
            ids = torch.arange(ctx.max_num_seqs, dtype=torch.int32, device=ctx.device)
            self.refined = (torch.full(shape, -1, dtype=torch.int32, device=ctx.device), ids)
        self.pending: list[torch.Tensor] = []  # lag: the side stream's inputs, alive until end_step
        self.loaded: list[torch.cuda.Event] = []  # lag + offload: each sparse layer's loads done (side stream)
        self.step_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # lag: (read, write) rows
        # lag + stickiness: the rows whose lists the step's selections stick to (a decode's read row; a
        # prompt chunk's end selects afresh, -1, so chunk boundaries such as prefix-cache hits change no list)
        self.stick_rows: torch.Tensor | None = None
        # prefetch: the read rows of the step's prompt chunks, cleared for their first decodes (_select_next)
        self.chunk_rows: torch.Tensor | None = None
        self._step_meta: AttentionMetadata | None = None
        # the last step's state slots (SelectionState.assign's list) and as a tensor (prepare)
        self._slots: tuple[list[int] | None, torch.Tensor | None] = (None, None)

    def block_bytes(self) -> int:
        c = self.ctx
        return c.num_layers * key_meta_block_bytes(c.num_kv_heads, c.block_size // self.params.page_size, c.head_dim)

    def allocate(self, num_blocks: int, offload: OffloadCache | None = None) -> None:
        c = self.ctx
        self.key_meta = allocate_key_meta(
            c.num_layers, num_blocks, c.num_kv_heads, c.block_size, self.params.page_size, c.head_dim, c.device
        )
        self.offload = offload
        if offload is not None:
            offload.attach_key_meta(self.key_meta)
        if offload is not None and self.params.lag:
            offload.init_lagged(self.state.sel.shape[1], self.params.cap, self.params.prefetch)
        if offload is not None and self.policy.prunes:
            shape = (c.max_num_seqs, c.num_kv_heads, self.params.cap)
            self.refined_view = torch.full(shape, -1, dtype=torch.int64, device=c.device)

    def step_inputs(self, scheduled, num_decodes: int) -> dict[str, torch.Tensor]:
        """Each row's selection-state slot; under lag + offload the decodes with fresh slots."""
        ws = self.offload.working_set if self.offload is not None else None
        if ws is not None:  # the counts after the previous step, with the slots of their sequences
            ws.publish(self.state.held_slots())
        slots = self.state.assign([seq.seq_id for seq, _ in scheduled])
        if ws is not None:
            ws.reset_slots(self.state.fresh)
        if slots is not self._slots[0]:  # assign hands its list back for the same sequences, order
            self._slots = (slots, torch.tensor(slots, dtype=torch.int32))
        out = {"slots": self._slots[1]}
        if self.offload is not None and self.params.lag:  # decodes with fresh state slots
            fresh = set(self.state.fresh).difference(self.state.restored).intersection(slots[:num_decodes])
            if fresh:
                out["fix_select"] = torch.tensor([s in fresh for s in slots[:num_decodes]])
        return out

    def prefill_state_slot(self, seq_id: int) -> int | None:
        """A layer-segmented prefill's state slot under lagged selection, held from its first segment: its last
        chunk selects the first decode's lists into it, as a chunked prefill's last chunk does (None: no lag)."""
        if not self.params.lag:
            return None
        slot = self.state.assign([seq_id])[0]
        if self.offload is not None and self.offload.working_set is not None:
            self.offload.working_set.reset_slots(self.state.fresh)
        return slot

    def prepare(self, scheduled, meta: AttentionMetadata, dev: dict[str, torch.Tensor]) -> None:
        super().prepare(scheduled, meta, dev)
        step = None
        if self.offload is not None:
            step = OffloadStep(dev["offload_slot_mapping"], dev["offload_block_tables"], dev.get("offload_stale"))
            self.offload.drop_stale(step.stale)  # before the step's kernels
        meta.backend_meta = SparseStepMeta(
            dev["slots"], self._cache_view(meta, step), step, fix_select=dev.get("fix_select")
        )

    def can_replay(self, meta: AttentionMetadata) -> bool:
        sm: SparseStepMeta | None = meta.backend_meta
        return sm is None or sm.fix_select is None

    def release(self, seq_id: int, paused: bool = False) -> None:
        if paused and self.params.lag:  # its next list is selected already: kept for its resume
            self.state.park(seq_id)
        else:  # sticky lists of a paused sequence wait for it
            self.state.release(seq_id, paused)

    def counters(self) -> dict[str, torch.Tensor]:
        out = {
            "sparse_blocks_selected": self.state.stats[0],
            "sparse_selections": self.state.stats[1],
            "sparse_flat_lists": self.state.flat_lists[0],
            "sparse_held_lists": self.state.flat_lists[1],
        }
        return out | super().counters() | (self.offload.counters() if self.offload is not None else {})

    @staticmethod
    def _cache_view(meta: AttentionMetadata, step: OffloadStep | None) -> AttentionMetadata:
        if step is None:
            return meta
        return AttentionMetadata(
            step.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            step.block_tables,
            meta.num_decodes,
            meta.max_query_len,
            meta.max_seq_len,
            prefill_meta=meta.prefill_meta,
        )

    def _rows(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step addressed by device row (KV offload; else the step itself), made by the first
        layer of a forward that needs it: inside a CUDA graph's capture, so replays redo it. The
        trap: a graph's warm-up runs the same metadata first (hence the reset at layer 0)."""
        sm: SparseStepMeta | None = meta.backend_meta
        if self.offload is None or sm is None:
            return meta
        if sm.rows is None:
            tables, slots = self.offload.row_view(meta.block_tables, meta.slot_mapping)
            sm.rows = AttentionMetadata(
                slots,
                meta.query_start_loc,
                meta.seq_lens,
                tables,
                meta.num_decodes,
                meta.max_query_len,
                meta.max_seq_len,
                prefill_meta=meta.prefill_meta,
            )
        return sm.rows

    def is_sparse(self, layer: int, meta: AttentionMetadata) -> bool:
        """Host-side decision, fixed while a graph replays (max_seq_len is its bound). Under offload
        short contexts go sparse too: the device cache holds only the decodes' windows."""
        return (
            self.key_meta is not None
            and layer >= self.dense_layers
            and meta.num_decodes > 0
            and (meta.max_seq_len > self.dense_context or self.offload is not None)
        )

    def _phase(self, name: str):
        profiler = self.ctx.profiler
        return profiler.phase(name) if profiler is not None else contextlib.nullcontext()

    # ---- one layer -------------------------------------------------------------------------------

    def _forward(self, layer, q, k, v, kv_cache, meta, scale):
        sm: SparseStepMeta | None = meta.backend_meta
        if layer == 0 and sm is not None:
            sm.rows = None  # each forward translates its own inputs (a graph's capture, not its warm-up)
        lagged = self.params.lag and (sm is None or sm.selects)
        if lagged and (layer == 0 or self._step_meta is not meta):
            self.begin_step(meta)
        if self.offload is not None and not self.offload.offloads(layer):
            # a dense layer keeps its running blocks by device row: saved when they leave
            rm = self._rows(meta)
            store_kv(k, v, kv_cache, rm.slot_mapping)
            return attend_paged(q, kv_cache, rm, scale, self.prefill, layer)
        cm = meta if sm is None else sm.cache
        # (a layer-segmented prefill writes a layer whole: no write-through)
        write = self.offload is not None and sm is not None and sm.offload is not None
        if self.key_meta is None or layer < self.dense_layers:  # dense layers never score
            store_kv(k, v, kv_cache, cm.slot_mapping)
            decodes = True
        else:  # with offload the decodes' completed blocks go to the host store in the same kernel
            km = self.key_meta[layer]
            host, count = self.offload.decode_write(layer) if write else (None, None)
            store_kv_key_meta(
                k,
                v,
                kv_cache,
                km.codes,
                km.scale,
                cm.slot_mapping,
                self.params.page_size,
                None if cm is meta else self._rows(meta).slot_mapping,
                host,
                meta.num_decodes,
                count,
                None if cm is meta else meta.slot_mapping,  # host rows: token blocks
            )
            decodes = False
        if write:
            self.offload.write_through(
                layer, kv_cache, sm.offload, meta.slot_mapping, meta.num_decodes, meta.num_seqs, decodes
            )
        return self.attend_layer(layer, q, kv_cache, meta, scale)

    def attend_layer(
        self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """A layer's attention once its K/V are stored; with lagged selection also the next lists'
        selection (side stream), joined at the step's last layer."""
        sm: SparseStepMeta | None = meta.backend_meta
        cm = meta if sm is None else sm.cache
        if self.params.lag and self.key_meta is not None and layer >= self.dense_layers and (sm is None or sm.selects):
            if self.params.prefetch:  # this step's lists, then the prefetch its lookup reads (no plan of its own)
                self._select_next(layer, q, meta, cm, scale)
                self._wait_loads(layer, sm, q.device)
            else:
                self._wait_loads(layer, sm, q.device)
                if sm is not None and sm.fix_select is not None:
                    self._plan_fresh(layer, q, meta, cm, scale)
                self._select_next(layer, q, meta, cm, scale)
        out = self.attend(layer, q, kv_cache, meta, scale)
        if layer == self.ctx.num_layers - 1:
            self.end_step()
        return out

    def _wait_loads(self, layer: int, sm: SparseStepMeta | None, device: torch.device) -> None:
        """Lag + offload: the current stream waits for begin_step's plan and this layer's loads (a step with
        fresh slots, for the whole plan at its first sparse layer: _plan_fresh plans after it)."""
        if self.loaded and (sm is None or sm.fix_select is None):
            torch.cuda.current_stream(device).wait_event(self.loaded[layer - self.dense_layers])
        elif self.offload is not None and layer == self.dense_layers and self.side is not None:
            torch.cuda.current_stream(device).wait_stream(self.side)

    def attend(
        self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Select (unless lagged), read (offload), refine, attend: one layer's decode attention."""
        sm: SparseStepMeta | None = meta.backend_meta
        cm = meta if sm is None else sm.cache
        if not self.is_sparse(layer, meta):
            return attend_paged(q, kv_cache, cm, scale, self.prefill, layer)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if meta.num_seqs > nd:  # the prefill chunks
            self.prefill.attend(layer, q, kv_cache, cm, scale, out)
        q, p, state = q[:nd], self.params, self.state
        tokens = meta.block_tables[:nd]  # host rows: the pool's keys
        rows = DecodeRows(
            meta.seq_lens[:nd],
            self._rows(meta).block_tables[:nd],
            cm.block_tables[:nd],
            sm.slots[:nd],
            self._max_blocks(meta),
            scale,
            self.width,
        )
        sel, view = state.sel[layer], None
        if p.prefetch:  # this step's candidates (write rows) pruned into the read rows: _prefetched
            view = self._prefetched(layer, q, kv_cache, rows, tokens)
        elif p.lag:  # lists selected at an earlier step; _select_next selects the next ones beside
            rows.slots = self.step_rows[0][:nd]
            if self.offload is not None:  # planned by begin_step (fresh slots: _plan_fresh), by list row
                view = self.offload.lagged_view(layer)
            if self.refined is not None:  # refined for this step's query, into rows of their own
                # under offload on the candidates' keys in the pool (their view by slot), writing the kept
                # entries' view beside them (by decode row)
                kw = {}
                if view is not None:
                    kw = dict(host_reads=self.offload.prune_key_reads, view_by_slot=True, out_view=self.refined_view)
                with self._phase("selection"):
                    self.policy.refine(layer, q, kv_cache, rows, state, view, out=self.refined[0], **kw)
                sel, rows.slots = self.refined[0], self.refined[1][:nd]
                if view is not None:
                    view = (*view[:2], self.refined_view[:nd])
        else:
            with self._phase("selection"):
                self.policy.select(layer, q, rows, state, self.key_meta[layer])
                if self.offload is None and self.policy.prunes:
                    self.policy.refine(layer, q, kv_cache, rows, state, None)
        if self.offload is not None and not p.lag:
            with self._phase("h2d"):  # a refining policy's candidates load: the prune reads their keys in HBM
                view = self.offload.read(layer, tokens, rows.seq_lens, state.sel[layer], rows.slots)
            if self.policy.prunes:  # in place, with the kept entries' view (docs/offload.md, "topp under KV offload")
                rv = self.refined_view
                self.policy.refine(
                    layer, q, kv_cache, rows, state, view, host_reads=self.offload.prune_key_reads, out_view=rv
                )
                view = (*view[:2], rv[:nd])
        with self._phase("attention"):
            sparse_decode(
                q,
                kv_cache,
                rows.cache_tables,
                rows.seq_lens,
                sel,
                rows.slots,
                p.local,
                scale,
                out=out[:nd],
                offload=view,
                view_by_slot=p.lag and self.refined is None and not p.prefetch,  # (prefetch: by decode row)
            )
        return out

    def _prefetched(self, layer, q, kv_cache, rows: DecodeRows, tokens) -> OffloadView:
        """Prefetching reads (docs/offload.md): the candidates this step selected (write rows) are looked up
        in the pool, which holds what begin_step prefetched, and pruned on their keys into the read rows, by
        whose kept lists the attention goes (the candidates stay: the next step prefetches them; the kept
        lists are the next selection's sticky ones, in place, as without offload). Returns the kept view."""
        nd, state = len(rows.slots), self.state
        rows.slots = self.step_rows[1][:nd]  # (-1: padding rows, which read and write nothing)
        view, lookup = self.offload.lookup(layer, tokens, state.sel.shape[-1])
        rv = self.refined_view
        with self._phase("selection"):
            self.policy.refine(
                layer,
                q,
                kv_cache,
                rows,
                state,
                view,
                out=state.sel[layer],
                host_reads=self.offload.prune_key_reads,
                out_view=rv,
                out_rows=self.step_rows[0][:nd],
                host_attended=self.offload.lookup_stats[2:],
                lookup=lookup,
            )
        rows.slots = self.step_rows[0][:nd]
        return (*view[:2], rv[:nd])

    def _max_blocks(self, meta: AttentionMetadata) -> int:
        return max(1, -(-meta.max_seq_len // self.params.block_size))

    # ---- lagged selection ------------------------------------------------------------------------

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Lagged selection, at layer 0 before its K/V store: the step's read and write rows
        (step_slots); under offload then every sparse layer's views of the decode rows in one plan
        on the side stream and each layer's loads after it (each sparse layer waits for its own).
        The trap: kernels read the rows before their PDL wait (kernels/pdl.py), so their writer
        must not directly precede them."""
        self.loaded.clear()
        sm: SparseStepMeta | None = meta.backend_meta
        dev = meta.seq_lens.device
        slots = sm.slots if sm is not None else torch.arange(meta.num_seqs, dtype=torch.int32, device=dev)
        self.step_rows = step_slots(meta.seq_lens, slots, meta.num_decodes, self.params.reuse, self.state.num_slots)
        if self.params.stickiness > 0:  # once a step, not once a layer
            decode = torch.arange(meta.num_seqs, device=dev) < meta.num_decodes
            # (prefetch: the kept lists the previous step's prune wrote into this step's write rows)
            self.stick_rows = torch.where(decode, self.step_rows[1 if self.params.prefetch else 0], -1)
        self._step_meta = meta
        nd = meta.num_decodes
        if self.params.prefetch:  # once a step, not once a layer
            self.chunk_rows = self.step_rows[0][nd:].long() if meta.num_seqs > nd else None
        if self.offload is None or sm is None or nd == 0 or self.key_meta is None:
            return
        plan = meta.seq_lens[:nd] > 0  # padding rows of CUDA graphs plan nothing
        if sm.fix_select is not None:
            plan &= ~sm.fix_select
        rows = torch.where(plan, self.step_rows[0][:nd], -1)
        with self._beside(rows):
            self.offload.plan_lagged(
                None, meta.block_tables[:nd], meta.seq_lens[:nd], self.state.sel, rows, new_round=True
            )
            # each layer's loads, then its event: layer L's attention waits for its own loads only, which
            # run beside the layers before it (a fresh slot's step waits for all: _plan_fresh plans after)
            for layer in range(self.dense_layers, self.ctx.num_layers):
                self.offload.load_lagged(layer)
                if self.side is not None:
                    self.loaded.append(self.side.record_event())

    def _plan_fresh(self, layer, q, meta, cm, scale) -> None:
        """Lag + offload: decode rows with fresh state slots select their lists from their own
        query and plan their views, layer by layer, after the side stream's plans (one planner)."""
        sm: SparseStepMeta = meta.backend_meta
        nd = meta.num_decodes
        if self.side is not None and layer > self.dense_layers:
            torch.cuda.current_stream(q.device).wait_stream(self.side)
        tables, seq_lens = meta.block_tables[:nd], meta.seq_lens[:nd]
        rows = DecodeRows(
            seq_lens,
            self._rows(meta).block_tables[:nd],
            cm.block_tables[:nd],
            torch.where(sm.fix_select, self.step_rows[0][:nd], -1),
            self._max_blocks(meta),
            scale,
            self.width,
        )
        self.policy.select(layer, q[:nd], rows, self.state, self.key_meta[layer])
        self.offload.plan_lagged(layer, tables, seq_lens, self.state.sel[layer], rows.slots)

    def _select_next(self, layer, q, meta, cm, scale) -> None:
        """Selects from each sequence's last query token into its write row (decodes every R-th
        step; a prompt's last token for the first decode), in every step of a sparse layer, dense
        ones too. Side stream: the main stream writes nothing it reads before the join."""
        if meta.num_seqs > meta.num_decodes:
            q = q[meta.query_start_loc[1:].long() - 1]
        beside = contextlib.nullcontext() if self.params.prefetch else self._beside(q)  # prefetch: this step's
        rows = DecodeRows(
            meta.seq_lens,
            self._rows(meta).block_tables,
            cm.block_tables,
            self.step_rows[1],
            self._max_blocks(meta),
            scale,
            self.width,
            prev_slots=self.stick_rows,
            ahead=0 if self.params.prefetch else 1,  # prefetch: the lists serve this step
            decodes=meta.num_decodes,  # (a chunk's list never holds: its first decode selects)
        )
        with beside:  # (a refining policy refines at the step that reads the lists: attend)
            self.policy.select(layer, q, rows, self.state, self.key_meta[layer])
        if self.params.prefetch and self.chunk_rows is not None:
            # a prompt's first decode prunes into its write row, whose kept list its next step sticks to: none
            # yet, as without offload (an earlier chunk may have selected into it)
            self.state.sel[layer].index_fill_(0, self.chunk_rows, -1)

    @contextlib.contextmanager
    def _beside(self, keep: torch.Tensor):
        """Work beside the step: on the side stream after the current stream's work so far, its kernels
        without PDL (kernels/pdl.py); `keep` (an input) lives until end_step. No side stream: in line."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(keep.device))
        self.pending.append(keep)
        with torch.cuda.stream(self.side), beside_the_step():
            yield

    def seed_first_lists(self, layer: int, meta: AttentionMetadata, scratch: torch.Tensor) -> None:
        """Layer-segmented prefill under KV offload with lagged selection, after a sparse layer's selecting
        chunk (meta): the lists it selected for the first decode go into the HBM pool from the layer's scratch
        K/V (OffloadCache.seed), which that decode then finds there instead of loading them from the host."""
        if self.offload is None or not self.params.lag or self.key_meta is None or layer < self.dense_layers:
            return
        if self.side is not None:  # the selection ran there
            torch.cuda.current_stream(scratch.device).wait_stream(self.side)
        row = self.step_rows[1][:1].long()  # the chunk's write row: the first decode reads it
        self.offload.seed(layer, meta.block_tables[:1], meta.seq_lens[:1] + 1, self.state.sel[layer][row], scratch)

    def fill_pool(self, layer: int, meta: AttentionMetadata, scratch: torch.Tensor) -> None:
        """Layer-segmented prefill under KV offload, after a sparse layer's last chunk (meta): the prompt's other
        head blocks into the HBM pool's free slots from the layer's scratch K/V (OffloadCache.fill), any
        selection mode; after `seed_first_lists`, whose lists take victims if need be."""
        if self.offload is None or self.key_meta is None or layer < self.dense_layers:
            return
        if self.side is not None:  # the pool's plans may run there
            torch.cuda.current_stream(scratch.device).wait_stream(self.side)
        self.offload.fill(layer, meta.block_tables[:1], meta.seq_lens[:1] + 1, scratch)

    def end_step(self) -> None:
        """Joins the side stream into the current one (a graph capture must join every fork)."""
        if self.pending:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.pending.clear()
        self.loaded.clear()

    # ---- CUDA graphs -----------------------------------------------------------------------------

    def graph_inputs(self, max_batch: int, max_blocks: int) -> list[InputField]:
        # Padding rows name state slot 0: with length 0 they select, read and write nothing.
        fields = super().graph_inputs(max_batch, max_blocks) + [InputField("slots", torch.int32)]
        if self.offload is not None:  # padding rows write nothing and name the trash row
            fields += [
                InputField("offload_slot_mapping", torch.long, pad=-1),
                InputField("offload_block_tables", torch.int32, width=max_blocks, pad=self.offload.num_device_blocks),
            ]
        return fields

    def capture_metadata(self, batch: int, inputs: dict[str, torch.Tensor]) -> AttentionMetadata:
        meta = super().capture_metadata(batch, inputs)
        step = None
        if self.offload is not None:
            step = OffloadStep(inputs["offload_slot_mapping"], inputs["offload_block_tables"])
        meta.backend_meta = SparseStepMeta(inputs["slots"], self._cache_view(meta, step), step)
        return meta

    # ---- probes ----------------------------------------------------------------------------------

    def attended_blocks(self, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """bool [num_decodes, Hkv, max_blocks] of the step just run (bench/attention_probe.py)."""
        nd, bs = meta.num_decodes, self.params.block_size
        mb = meta.block_tables.shape[1]
        seq_lens = meta.seq_lens[:nd]
        if not self.is_sparse(layer, meta):
            nb = (seq_lens.long() + bs - 1) // bs
            return (torch.arange(mb, device=nb.device)[None] < nb[:, None])[:, None].expand(
                -1, self.ctx.num_kv_heads, -1
            )
        if self.refined is not None:  # this layer's refined lists: the probe calls after each layer
            lists = self.refined[0][:nd]
        else:
            slots = self.step_rows[0][:nd] if self.params.lag else meta.backend_meta.slots[:nd]
            lists = self.state.sel[layer][slots.long()]
        return attended_blocks(lists, seq_lens, self.params.local, bs, mb)
