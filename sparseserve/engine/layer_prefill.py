"""Layer-segmented prefill under KV offload, the runner's side (docs/offload.md, "Layer-segmented
prefill"; docs/architecture.md, principle 7).

A prompt longer than a step's budget runs a few layers per step for all its tokens, in token
chunks of the budget. A sparse layer's K/V go to a one-layer scratch (row j = the prompt's token
block j; a kept prefix is first copied in from the host store), its full blocks leave by FlashD2H
(kvcache/host.py LayerD2H) and its first decode's window is copied into the device block cache;
a dense layer uses its full-size cache. The hidden states persist between steps. The scheduler's
side: engine/scheduler/segments.py. One at a time (buffers allocated at start).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparseserve.attention.backend import AttentionMetadata
from sparseserve.attention.sparse import SparseStepMeta
from sparseserve.engine.scheduler.segments import LayerSegment
from sparseserve.kernels.flash_h2d import flash_h2d
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.host import LayerD2H
from sparseserve.kvcache.transfer import to_device_many


@dataclass
class _Prefill:
    """The prefill in progress."""

    seq_id: int
    computed: int  # tokens computed before it (a prefix-cache hit): whole blocks
    tokens: int  # tokens it computes
    layers_done: int
    rope: tuple[torch.Tensor, torch.Tensor]
    chunks: list[tuple[int, int, AttentionMetadata]]  # [a, b) of the new tokens, its metadata
    prefix_rows: torch.Tensor | None  # int64 [c / bs] (device): the prefix's host rows, or None
    host_rows: torch.Tensor  # int64 [full new blocks] (CPU): their host store rows
    window_start: int  # token block of the window's first device block
    window_blocks: torch.Tensor  # int64 [w] (device): the window's device blocks


class _Chunk:
    """What a prefill attention's prepare reads of a scheduled sequence (attention/backend.py)."""

    def __init__(self, seq_id: int, computed: int, block_table: list[int]) -> None:
        self.seq_id, self.num_computed_tokens, self.block_table = seq_id, computed, block_table


class LayerPrefill:
    """The persisted hidden states, the scratch KV and the layer-by-layer forward."""

    def __init__(
        self,
        model,
        backend,
        offload,
        kv_caches: list[torch.Tensor],
        *,
        hidden_size: int,
        max_model_len: int,
        chunk_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model, self.backend, self.offload, self.kv_caches = model, backend, offload, kv_caches
        self.num_layers = len(kv_caches)
        self.chunk_tokens = chunk_tokens
        self.device = device
        host = offload.host
        _, _, hkv, _, bs, head_dim = host.data.shape
        self.block_size = bs
        nb = blocks_needed(max_model_len, bs)
        self.scratch = torch.empty(2, nb, hkv, 2, bs, head_dim, dtype=dtype, device=device)
        self.hidden = torch.empty(2, max_model_len, hidden_size, dtype=dtype, device=device)  # x, res
        host.layer_d2h = LayerD2H(host)
        self.events: list = [None, None]  # per scratch buffer: its last copy to the host (CUDA)
        self.current: _Prefill | None = None
        self.finished_tokens = 0  # tokens of the last finished prefill (prompt_hidden)

    @staticmethod
    def device_bytes(
        *, num_kv_heads: int, head_dim: int, hidden_size: int, block_size: int, max_model_len: int, dtype: torch.dtype
    ) -> int:
        """Device memory it allocates (taken from the KV budget)."""
        tokens = blocks_needed(max_model_len, block_size) * block_size
        return (2 * tokens * num_kv_heads * 2 * head_dim + 2 * max_model_len * hidden_size) * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Device memory its buffers hold (the scratch and the hidden states): `device_bytes`, as allocated."""
        return sum(t.numel() * t.element_size() for t in (self.scratch, self.hidden))

    def progress(self) -> dict[str, int]:
        """Prefills in progress and the layers they have done (statistics)."""
        cur = self.current
        return {
            "layer_prefills_running": int(cur is not None),
            "layer_prefill_layers_done": cur.layers_done if cur is not None else 0,
        }

    def release(self, seq_id: int) -> None:
        """A sequence finished, was aborted or preempted: its prefill's progress is gone (a resumed
        prefill starts again at layer 0), and the next step fences its copies (its rows may get new owners)."""
        if self.current is not None and self.current.seq_id == seq_id:
            self.current = None
            self.offload.host.layer_d2h.held = False

    @torch.inference_mode()
    def run(self, seg: LayerSegment) -> torch.Tensor | None:
        """Layers [seg.start, seg.end) of the prefill; after the last one the final-normed hidden
        state of the prompt's last token [1, hidden] (the LM head's input), else None."""
        seq = seg.seq
        if seg.start == 0:
            self.current = self._begin(seq)
        cur = self.current
        if cur is None or cur.seq_id != seq.seq_id or cur.layers_done != seg.start:
            raise RuntimeError(
                f"layer-segmented prefill of sequence {seq.seq_id}: segment from layer {seg.start} "
                f"does not continue the prefill in progress"
            )
        for layer in range(seg.start, seg.end):
            self._layer(cur, layer)
        cur.layers_done = seg.end
        # Until it finishes, the next steps need not wait for its copies: only its own later layers (the scratch
        # buffers' events) and its first decode (after the fence once it is done) read what they write.
        self.offload.host.layer_d2h.held = seg.end < self.num_layers
        if seg.end < self.num_layers:
            return None
        self.current = None
        t = cur.tokens
        x, _ = self.model.model.norm(self.hidden[0, t - 1 : t], self.hidden[1, t - 1 : t])
        self.finished_tokens = t
        return x

    def prompt_hidden(self) -> torch.Tensor:
        """[T, hidden]: the final-normed hidden states of every token the prefill that `run` just
        finished computed (prompt logprobs); valid until the next prefill begins."""
        t = self.finished_tokens
        x, _ = self.model.model.norm(self.hidden[0, :t], self.hidden[1, :t])
        return x

    def _begin(self, seq) -> _Prefill:
        bs, dev = self.block_size, self.device
        c, p = seq.num_computed_tokens, seq.num_tokens
        if c % bs:
            raise RuntimeError(
                f"layer-segmented prefill of sequence {seq.seq_id} after {c} computed tokens: needs whole blocks"
            )
        t = p - c
        table = np.asarray(seq.block_table[: blocks_needed(p, bs)], dtype=np.int64)
        pos = np.arange(c, p)
        start, blocks = self.offload.range_of(seq.seq_id)
        slot = self.backend.prefill_state_slot(seq.seq_id)  # lag: the last chunk selects the first decode's lists
        bounds = [(a, min(a + self.chunk_tokens, t)) for a in range(0, t, self.chunk_tokens)]
        # One upload through pinned staging (a pageable copy waits for the stream's queued work). Per chunk:
        # query_start_loc, seq_lens, and the state slot its selection writes.
        per_chunk = [[0, b - a, c + b, slot if slot is not None and b == t else 0] for a, b in bounds]
        token_slots, ids, token_table, prefix, window, per_chunk = to_device_many(
            [
                torch.from_numpy(table[pos // bs] * bs + pos % bs),
                torch.tensor(seq.token_ids[c:p], dtype=torch.long),
                torch.from_numpy(table.astype(np.int32))[None],
                torch.from_numpy(table[: c // bs]),
                torch.tensor(blocks, dtype=torch.long),
                torch.tensor(per_chunk, dtype=torch.int32),
            ],
            dev,
        )
        positions = torch.arange(c, p, device=dev)
        self.hidden[0, :t] = self.model.model.embed_tokens(ids)
        rope = self.model.model.rotary_emb(positions, self.hidden.dtype)
        scratch_table = torch.arange(len(table), dtype=torch.int32, device=dev)[None]
        chunks = []
        for (a, b), row in zip(bounds, per_chunk):
            qsl, seq_lens = row[0:2], row[2:3]
            meta = AttentionMetadata(
                token_slots[a:b], qsl, seq_lens, token_table, num_decodes=0, max_query_len=b - a, max_seq_len=c + b
            )
            meta.prefill_meta = self.backend.prefill.prepare(
                [(_Chunk(seq.seq_id, c + a, seq.block_table), b - a)], meta
            )
            # Sparse layers address the scratch (row j = the prompt's block j): slot = position.
            scratch = AttentionMetadata(
                positions[a:b],
                qsl,
                seq_lens,
                scratch_table,
                num_decodes=0,
                max_query_len=b - a,
                max_seq_len=c + b,
                prefill_meta=meta.prefill_meta,
            )
            last = slot is not None and b == t
            meta.backend_meta = SparseStepMeta(row[3:4], scratch, None, selects=last)
            chunks.append((a, b, meta))
        return _Prefill(
            seq.seq_id,
            c,
            t,
            0,
            rope,
            chunks,
            prefix if c else None,
            torch.from_numpy(table[c // bs : p // bs]),
            start,
            window,
        )

    def _layer(self, cur: _Prefill, layer: int) -> None:
        sparse = self.offload.offloads(layer)
        if sparse:
            buf = layer % 2
            if self.events[buf] is not None:  # its rows have left for the host store
                torch.cuda.current_stream(self.device).wait_event(self.events[buf])
            cache = self.scratch[buf]
            if cur.prefix_rows is not None:
                self._restore_prefix(cur, layer, cache)
        else:
            cache = self.kv_caches[layer]
        caches = {layer: cache}
        x, res = self.hidden[0], self.hidden[1]
        cos, sin = cur.rope
        for a, b, meta in cur.chunks:
            out, out_res = self.model.model.forward_layers(
                range(layer, layer + 1), (cos[a:b], sin[a:b]), x[a:b], None if layer == 0 else res[a:b], caches, meta
            )
            x[a:b] = out
            res[a:b] = out_res
        if not sparse:
            return
        last = cur.chunks[-1][2]
        if last.backend_meta.selects:  # its first decode's lists: into the pool from here, not over PCIe
            self.backend.seed_first_lists(layer, last, cache)
        self.backend.fill_pool(layer, last, cache)  # the rest, where the pool has free slots
        bs, c, p = self.block_size, cur.computed, cur.computed + cur.tokens
        n = cur.window_blocks.numel()
        if n:
            self.kv_caches[layer].index_copy_(0, cur.window_blocks, cache[cur.window_start : cur.window_start + n])
        self.events[buf] = self.offload.host.layer_d2h.submit(layer, cache[c // bs : p // bs], cur.host_rows)

    def _restore_prefix(self, cur: _Prefill, layer: int, cache: torch.Tensor) -> None:
        """This layer's prefix K/V from its host rows into the scratch's first rows (FlashH2D)."""
        host = self.offload.host
        hkv = cache.shape[1]
        heads = torch.arange(hkv, device=self.device)
        rows = cur.prefix_rows
        key = ((layer * (host.num_blocks + 1) + rows[:, None]) * hkv + heads).reshape(-1)
        load = (torch.arange(rows.numel(), device=self.device)[:, None] * hkv + heads).reshape(-1)
        flash_h2d(host.flat(), cache.view(-1, *cache.shape[2:]), key, load)
