"""SparseBackend: dense prefill, sparse decode (DESIGN.md principles 2, 3 and 6).

Wraps a dense backend (torch reference on CPU, Triton on CUDA). Every step it stores the new K/V
through the dense backend and refreshes the key metadata of the pages it wrote. Prefill chunks
attend densely. Decodes of a sparse layer are scored against the metadata, select blocks
(selection.py) and attend only those (kernels/sparse_decode.py); the first `sparse_dense_layers`
layers and steps whose longest context fits the budget run dense.

Per-sequence state lives in fixed GPU buffers indexed by the state slot that the runner gives each
running sequence (AttentionMetadata.state_slots): the cached selection lists and the decode-step
counters of reuse. With sparse_lag=1 a decode attends the list selected at an earlier step (the previous
one without reuse; a prefill's last token selects for the first decode), and each sparse layer scores and
selects the next lists on a side CUDA stream beside its attention and the rest of the step: two lists a
slot (selection.step_slots_ref), the side stream joined at the step's last layer. Padding rows of CUDA
graphs (seq_len 0) never touch the state. Everything a decode step does depends only on tensor shapes and
host-side bounds, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from sparseserve.attention.backend import AttentionBackend, AttentionMetadata, PagedAttentionBackend
from sparseserve.attention.selection import (SelectionParams, attended_blocks, block_scores_ref,
                                             prune_selection_ref, step_slots_ref, update_selection_ref)
from sparseserve.config import SparseConfig
from sparseserve.kvcache.metadata import KeyMeta, allocate_key_meta, key_meta_block_bytes, update_key_meta_ref


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
                    raise ValueError(f"(layer {layer}, KV head {h}) is outside the model's "
                                     f"{num_layers} layers x {num_kv_heads} KV heads")
                mask[int(layer), int(h)] = True
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read streaming heads from {path}: {e!r}") from e
    return mask


def sparse_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      sel_rows: torch.Tensor, local: int, max_seq_len: int, scale: float) -> torch.Tensor:
    """Attention of decode queries q [B, Hq, D] over the blocks their lists sel_rows [B, Hkv, cap]
    name plus the local window, in float32 (reference of kernels/sparse_decode.py)."""
    block_size = kv_cache.shape[3]
    mb = max(1, -(-max_seq_len // block_size))
    blocks = attended_blocks(sel_rows, seq_lens, local, block_size, mb)  # [B, Hkv, MB]
    kv = kv_cache[block_tables[:, :mb].long()].float()  # [B, MB, Hkv, 2, bs, D]
    return _attend_blocks_ref(q, kv, seq_lens, blocks, scale)


def sparse_decode_offload_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, sel_rows: torch.Tensor, listed_kv: torch.Tensor, local: int,
                              max_seq_len: int, scale: float) -> torch.Tensor:
    """sparse_decode_ref with the listed blocks (those before the local window) read from listed_kv
    [B, Hkv, cap, 2, bs, D] (HBM pool slots or host store) instead of the device cache; only the local
    window comes from kv_cache. Same arithmetic, so the outputs are bit-identical when the data are."""
    ctx = offload_context_ref(kv_cache, block_tables, seq_lens, sel_rows, listed_kv, local, max_seq_len)
    blocks = attended_blocks(sel_rows, seq_lens, local, kv_cache.shape[3], ctx.shape[1])
    return _attend_blocks_ref(q, ctx, seq_lens, blocks, scale)


def offload_context_ref(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        sel_rows: torch.Tensor, listed_kv: torch.Tensor, local: int, max_seq_len: int
                        ) -> torch.Tensor:
    """float32 [B, MB, Hkv, 2, bs, D]: each sequence's context as a decode may read it under kv_offload:
    the local window from kv_cache (through block_tables, the device blocks), the listed blocks before it
    from listed_kv, zeros elsewhere (no other block may come from the device cache)."""
    batch, num_kv_heads, cap = sel_rows.shape
    block_size = kv_cache.shape[3]
    mb, dev = max(1, -(-max_seq_len // block_size)), sel_rows.device
    nb = (seq_lens.long() + block_size - 1) // block_size
    j = torch.arange(mb, device=dev)[None]
    window = (j >= (nb - local).clamp_min(0)[:, None]) & (j < nb[:, None])  # [B, MB]
    kv = kv_cache[block_tables[:, :mb].long()].float()
    kv = torch.where(window[:, :, None, None, None, None], kv, 0.0)  # no other block from the device cache
    flat = torch.cat([kv.reshape(-1, *kv.shape[3:]), kv.new_zeros(1, *kv.shape[3:])])  # + a trash row
    listed = listed_rows(sel_rows, seq_lens, local, block_size)
    b = torch.arange(batch, device=dev)[:, None, None]
    h = torch.arange(num_kv_heads, device=dev)[None, :, None]
    dst = torch.where(listed, (b * mb + sel_rows.long().clamp(0, mb - 1)) * num_kv_heads + h, flat.shape[0] - 1)
    flat[dst.reshape(-1)] = listed_kv.reshape(-1, *kv.shape[3:]).float()
    return flat[:-1].view_as(kv)


def listed_rows(sel_rows: torch.Tensor, seq_lens: torch.Tensor, local: int, block_size: int) -> torch.Tensor:
    """bool [B, Hkv, cap]: list entries the kernel attends outside the local window (full blocks)."""
    nb = (seq_lens.long() + block_size - 1) // block_size
    return (sel_rows >= 0) & (sel_rows < (nb - local).clamp_min(0)[:, None, None])


def _attend_blocks_ref(q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor, blocks: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Attention of q [B, Hq, D] over the blocks marked in blocks [B, Hkv, MB] of kv [B, MB, Hkv, 2, bs, D]."""
    batch, num_q_heads, head_dim = q.shape
    _, mb, num_kv_heads, _, block_size, _ = kv.shape
    ctx = mb * block_size
    k = kv[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim)
    v = kv[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim)
    in_context = torch.arange(ctx, device=q.device) < seq_lens[:, None]
    visible = blocks.repeat_interleave(block_size, -1) & in_context[:, None]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = torch.einsum("bhgd,bhkd->bhgk", qg, k) * scale
    v = v.masked_fill(~visible[..., None], 0.0)  # unwritten cache memory may hold NaN: 0 * NaN is NaN
    probs = torch.softmax(s.masked_fill(~visible[:, :, None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhgk,bhkd->bhgd", probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)


class SparseBackend(AttentionBackend):
    name = "sparse"

    def __init__(self, dense: PagedAttentionBackend, config: SparseConfig, num_layers: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device, max_num_seqs: int) -> None:
        self.dense = dense
        self.use_triton = dense.name == "triton"
        page = config.logical_page_size or block_size
        self.params = SelectionParams(config.sparse_policy, config.sparse_budget // block_size,
                                      config.sparse_sink_blocks, config.sparse_local_blocks, config.sparse_top_p,
                                      config.sparse_reuse, block_size, page,
                                      short_dense=config.sparse_dense_context != 0,
                                      per_head=config.sparse_topp_heads == "each")
        # sparse_lag: selection kernels get no reuse (the step's write rows say which sequences select).
        self.lag = config.sparse_lag
        self.kernel_params = replace(self.params, reuse=1) if self.lag else self.params
        self.dense_layers = config.sparse_dense_layers
        dense_context = config.sparse_dense_context
        self.dense_context = config.sparse_budget if dense_context is None else dense_context
        self.shape = (num_layers, num_kv_heads, head_dim, block_size, dtype, device)
        self.streaming = load_streaming_heads(config.streaming_heads, num_layers, num_kv_heads).to(device)
        slots = max_num_seqs
        # sparse_lag: two lists a slot (step_slots_ref), the one attended and the one being selected.
        self.sel = torch.full((num_layers, slots * (1 + self.lag), num_kv_heads, self.params.cap), -1,
                              dtype=torch.int32, device=device)
        self.counter = torch.zeros(num_layers, slots, num_kv_heads, dtype=torch.int32, device=device)
        self.stats = torch.zeros(2, dtype=torch.int64, device=device)  # blocks selected, selections
        self.rows = torch.arange(slots, dtype=torch.int32, device=device)  # default slots: row b -> slot b
        self.step_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # sparse_lag: (read, write) of the step
        self.step_meta: AttentionMetadata | None = None
        self.side = torch.cuda.Stream(device) if self.lag and device.type == "cuda" else None
        self.pending: list[torch.Tensor] = []  # sparse_lag: queries the side stream reads, until end_step
        self.key_meta: KeyMeta | None = None
        self.host = None  # kv_offload: kvcache/host.py HostKVStore and kvcache/pool.py HBMPool (attach_offload)
        self.pool = None
        # What the metadata adds to each token block: the runner sizes the KV cache with it.
        self.metadata_block_bytes = num_layers * key_meta_block_bytes(num_kv_heads, block_size // page, head_dim)

    def allocate(self, num_blocks: int) -> None:
        """Key metadata for a cache of num_blocks blocks. Until then (the runner's memory-profiling
        prefill runs before the cache exists) the backend is dense."""
        num_layers, hkv, head_dim, block_size, _, device = self.shape
        self.key_meta = allocate_key_meta(num_layers, num_blocks, hkv, block_size, self.params.page_size, head_dim,
                                          device)

    def attach_offload(self, host, pool) -> None:
        """Hierarchical KV cache: every step writes the blocks it fills through to `host`; sparse decodes
        read the blocks they list (outside the local window) through the HBM `pool` (DESIGN.md 4, 5)."""
        self.host, self.pool = host, pool

    def reset_slots(self, slots: list[int]) -> None:
        """Sequences (re)starting in these slots: their first decode step selects afresh."""
        if slots:
            self.counter[:, torch.tensor(slots, device=self.counter.device)] = 0

    def sparse_stats(self) -> tuple[int, int, int]:
        """(blocks selected, selections, block size) since start; a selection is one (sequence, layer,
        KV head) list, made every decode step of a sparse layer (every R-th with reuse; sparse_lag: also at
        each prefill chunk's end)."""
        blocks, selections = self.stats.tolist()
        return blocks, selections, self.params.block_size

    def is_sparse(self, layer_idx: int, meta: AttentionMetadata) -> bool:
        """Host-side decision (fixed while a CUDA graph replays: max_seq_len is its bound)."""
        # kv_offload: the device cache holds only the decodes' local windows, so their other blocks can only
        # be read through the pool: short contexts go the sparse way too (selecting every block).
        return (self.key_meta is not None and layer_idx >= self.dense_layers and meta.num_decodes > 0
                and (meta.max_seq_len > self.dense_context or self.host is not None))

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.host is not None and layer_idx < self.dense_layers:
            # kv_offload: a dense layer keeps every block in its own full-size device cache, indexed by token
            # block (engine/runner.py), and never reads the host store: nothing to write through.
            return self.dense.forward(layer_idx, q, k, v, kv_cache, meta.token_view(), scale)
        if self.lag and (layer_idx == 0 or self.step_meta is not meta):
            self.begin_step(meta)
        if self.key_meta is not None and layer_idx >= self.dense_layers:  # dense layers never score
            self._store_kv_key_meta(k, v, kv_cache, self.key_meta[layer_idx], meta.slot_mapping,
                                    meta.token_slot_mapping)
        else:
            self.dense.store_kv(k, v, kv_cache, meta.slot_mapping)
        if self.host is not None:
            self.host.store_step(layer_idx, kv_cache, meta.slot_mapping, meta.num_decodes, meta.num_seqs,
                                 meta.token_slot_mapping)
        return self.attend_layer(layer_idx, q, kv_cache, meta, scale)

    def begin_step(self, meta: AttentionMetadata) -> None:
        """sparse_lag: the step's read and write rows (step_slots_ref). forward() calls it at layer 0, before
        the layer's K/V store: kernels read the rows before their PDL wait (kernels/pdl.py), so the launch
        that writes them must not be their direct predecessor."""
        self.step_rows, self.step_meta = self._step_rows(meta), meta

    def attend_layer(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
        """A layer's attention once its K/V are stored. sparse_lag: the next steps' lists are selected from
        this step's queries on a side stream, beside this layer's attention and the rest of the layer (the
        stream is joined back at the step's last layer, end_step)."""
        if self.lag and self.key_meta is not None and layer_idx >= self.dense_layers:
            if self.side is None:
                self._select_next(layer_idx, q, kv_cache, meta, scale)
            else:
                self.side.wait_stream(torch.cuda.current_stream(q.device))
                with torch.cuda.stream(self.side):
                    self._select_next(layer_idx, q, kv_cache, meta, scale)
                self.pending.append(q)
        out = self._attend(layer_idx, q, kv_cache, meta, scale)
        if layer_idx == self.shape[0] - 1:
            self.end_step()
        return out

    def end_step(self) -> None:
        """Joins the side stream into the current one (a CUDA graph capture must join every fork). Until then
        the main stream writes nothing the side stream reads: layer L's metadata and cache change only at the
        next step; the queries it reads are kept alive here, so their memory is not reused before."""
        if self.pending:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.pending.clear()

    def _attend(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if not self.is_sparse(layer_idx, meta):
            return self.dense.attend(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if meta.num_seqs > nd:  # prefill chunks: dense, on a metadata view without the decodes
            sub = AttentionMetadata(meta.slot_mapping[nd:], meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:],
                                    meta.block_tables[nd:], num_decodes=0, max_query_len=meta.max_query_len,
                                    max_seq_len=meta.max_seq_len)
            out[nd:] = self.dense.attend(q[nd:], kv_cache, sub, scale)
        self._decode(layer_idx, q[:nd], kv_cache, meta, scale, out[:nd])
        return out

    def _step_rows(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """sparse_lag: (read, write) selection-buffer rows of the step's sequences (step_slots_ref)."""
        slots = self.rows[:meta.num_seqs] if meta.state_slots is None else meta.state_slots
        if self.use_triton:
            from sparseserve.kernels.block_score import step_slots
            return step_slots(meta.seq_lens, slots, meta.num_decodes, self.params.reuse, self.rows.numel())
        return step_slots_ref(meta.seq_lens, slots, meta.num_decodes, self.params.reuse, self.rows.numel())

    def _select_next(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> None:
        """sparse_lag: selection from each sequence's last query token of the step, into its write row: the
        decodes' (every R-th step), and the prefill chunks' (the last prompt token's list serves the first
        decode). Runs every step of a sparse layer, dense-context ones too, so the lists stay current."""
        if meta.num_seqs > meta.num_decodes:
            q = q[meta.query_start_loc[1:].long() - 1]
        tables = meta.block_tables if meta.token_block_tables is None else meta.token_block_tables
        self._select(layer_idx, q, kv_cache, meta.block_tables, tables, meta.seq_lens, self.step_rows[1],
                     max(1, -(-meta.max_seq_len // self.params.block_size)), scale)

    def _slots(self, meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decodes
        return (meta.state_slots if meta.state_slots is not None else self.rows)[:nd]

    def _store_kv_key_meta(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, key_meta: KeyMeta,
                           slot_mapping: torch.Tensor, meta_slots: torch.Tensor | None) -> None:
        """store_kv, then the metadata of the pages the step's tokens end (Triton: one kernel). meta_slots
        (kv_offload): the tokens' slots in token blocks, whose metadata rows get the update."""
        if self.use_triton:
            from sparseserve.kernels.block_score import store_kv_key_meta
            store_kv_key_meta(k, v, kv_cache, key_meta, slot_mapping, self.params.page_size, meta_slots)
        else:
            self.dense.store_kv(k, v, kv_cache, slot_mapping)
            update_key_meta_ref(kv_cache, key_meta, slot_mapping, self.params.page_size, meta_slots)

    def _select(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                token_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, mb: int,
                scale: float, prune: bool = True) -> None:
        """Scoring and selection of the rows q [B, Hq, D] into their slots' lists (slot -1: none); topp
        selects candidates, then (prune) keeps those that carry the mass, on their keys in kv_cache."""
        p, key_meta = self.kernel_params, self.key_meta[layer_idx]
        sel, counter, streaming = self.sel[layer_idx], self.counter[layer_idx], self.streaming[layer_idx]
        prune = prune and p.policy == "topp"
        if self.use_triton:
            from sparseserve.kernels.block_score import score_and_select
            score_and_select(q, key_meta, token_tables, seq_lens, slots, sel, counter, self.stats, streaming,
                             p.candidates, mb, scale)
            if prune:
                from sparseserve.kernels.topp_prune import topp_prune
                topp_prune(q, kv_cache, tables, seq_lens, slots, sel, counter, self.stats, p, scale)
            return
        scores = block_scores_ref(q, key_meta, token_tables, seq_lens, mb, p.block_size, scale)
        update_selection_ref(scores, seq_lens, slots, sel, counter, self.stats, streaming, p.candidates)
        if prune:
            prune_selection_ref(q, kv_cache, tables, seq_lens, slots, sel, counter, self.stats, p, scale)

    def _decode(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor) -> None:
        nd, p = meta.num_decodes, self.params
        tables, seq_lens = meta.block_tables[:nd], meta.seq_lens[:nd]
        # kv_offload: scoring (metadata rows) and the pool address token blocks; `tables` (the device block
        # cache) serves only the local windows.
        token_tables = tables if meta.token_block_tables is None else meta.token_block_tables[:nd]
        mb = max(1, -(-meta.max_seq_len // p.block_size))
        if self.lag:  # the list selected at an earlier step; forward() selects the next one beside this
            slots = self.step_rows[0][:nd]
        else:
            slots = self._slots(meta)
            self._select(layer_idx, q, kv_cache, tables, token_tables, seq_lens, slots, mb, scale,
                         prune=self.pool is None)
        if not self.use_triton:
            if self.pool is not None:
                out.copy_(self._offload_decode(layer_idx, q, kv_cache, tables, token_tables, seq_lens, slots,
                                               meta.max_seq_len, scale))
            else:
                sel_rows = self.sel[layer_idx][slots.long()]
                out.copy_(sparse_decode_ref(q, kv_cache, tables, seq_lens, sel_rows, p.local, meta.max_seq_len, scale))
            return
        from sparseserve.kernels.sparse_decode import sparse_decode
        sel, offload = self.sel[layer_idx], None
        if self.pool is not None:  # topp: the candidates are loaded, so pruning reads their keys from HBM
            key, loc = self._offload_plan(layer_idx, token_tables, seq_lens, sel[slots.long()])
            offload = (self.pool.slots, self.host.flat(), loc, key)
            if p.policy == "topp":
                from sparseserve.kernels.topp_prune import topp_prune
                topp_prune(q, kv_cache, tables, seq_lens, slots, sel, self.counter[layer_idx], self.stats, p, scale,
                           offload=offload)
                # the lists shrank in place: look their entries up again (no state change)
                key = self._offload_keys(layer_idx, token_tables, seq_lens, sel[slots.long()])
                offload = (self.pool.slots, self.host.flat(), self.pool.resident[key], key)
        sparse_decode(q, kv_cache, tables, seq_lens, sel, slots, p.local, scale, out=out, offload=offload)

    def _offload_keys(self, layer_idx: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel_rows: torch.Tensor
                      ) -> torch.Tensor:
        """int64 [B, Hkv, cap]: the host store row (pool key) of each listed entry before the local window,
        the pool's trash key elsewhere. tables: token block tables."""
        p = self.params
        listed = listed_rows(sel_rows, seq_lens, p.local, p.block_size)
        blocks = torch.where(listed, tables.gather(1, sel_rows.clamp_min(0).flatten(1).long()).view_as(sel_rows), -1)
        return self.pool.keys(layer_idx, blocks)

    def _offload_plan(self, layer_idx: int, tables: torch.Tensor, seq_lens: torch.Tensor, sel_rows: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residency lookup of the listed head blocks (outside the local window), victims for the misses and
        FlashH2D of the misses into their slots. Returns (key, loc), int64 [B, Hkv, cap]: each entry's
        host store row and the slot to read it from (-1: bypass or not listed). Fixed shapes, no sync."""
        pool = self.pool
        key = self._offload_keys(layer_idx, tables, seq_lens, sel_rows).reshape(-1)
        loc, load = pool.plan(key)
        host_flat = self.host.flat()
        if self.use_triton:
            from sparseserve.kernels.flash_h2d import flash_h2d
            flash_h2d(host_flat, pool.slots, key, load)
        else:
            pool.gather_ref(host_flat, key, load)
        return key.view(sel_rows.shape), loc.view(sel_rows.shape)

    def _offload_decode(self, layer_idx: int, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                        token_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, max_seq_len: int,
                        scale: float) -> torch.Tensor:
        """The torch path: plan and load the listed blocks (topp: the candidates), then attention reading them
        through their slots (or the host store for bypass reads) and the local window from the device cache
        (tables). topp prunes the candidates on their keys read the same way, then attends the kept ones."""
        p, pool, sel, counter = self.params, self.pool, self.sel[layer_idx], self.counter[layer_idx]
        sel_rows = sel[slots.long()]
        key, loc = self._offload_plan(layer_idx, token_tables, seq_lens, sel_rows)
        listed_kv = pool.read(self.host.flat(), key.reshape(-1), loc.reshape(-1)).view(*sel_rows.shape,
                                                                                         *pool.slots.shape[1:])
        if p.policy != "topp":
            return sparse_decode_offload_ref(q, kv_cache, tables, seq_lens, sel_rows, listed_kv, p.local,
                                             max_seq_len, scale)
        # topp: every block a list may keep is in ctx ([B, MB] logical blocks, flattened); prune, then attend.
        ctx = offload_context_ref(kv_cache, tables, seq_lens, sel_rows, listed_kv, p.local, max_seq_len)
        batch, mb = ctx.shape[:2]
        ctx, ctx_tables = ctx.flatten(0, 1), torch.arange(batch * mb, device=q.device).view(batch, mb)
        prune_selection_ref(q, ctx, ctx_tables, seq_lens, slots, sel, counter, self.stats, p, scale)
        return sparse_decode_ref(q, ctx, ctx_tables, seq_lens, sel[slots.long()], p.local, max_seq_len, scale)

    def attended_blocks(self, layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:
        """bool [num_decodes, Hkv, max_blocks] of the step just run (for bench/attention_probe.py)."""
        nd, bs = meta.num_decodes, self.params.block_size
        mb = meta.block_tables.shape[1]
        seq_lens = meta.seq_lens[:nd]
        if not self.is_sparse(layer_idx, meta):
            nb = (seq_lens.long() + bs - 1) // bs
            return (torch.arange(mb, device=nb.device)[None] < nb[:, None])[:, None].expand(-1, self.shape[1], -1)
        slots = self.step_rows[0][:nd] if self.lag else self._slots(meta)
        return attended_blocks(self.sel[layer_idx][slots.long()], seq_lens, self.params.local, bs, mb)
