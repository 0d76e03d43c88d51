"""The host KV store of the hierarchical cache (DESIGN.md principle 4): every full head block of every
running request, written as its tokens arrive (never later changed), so HBM eviction never writes back.

Layout, shaped like the device KV cache plus one trash block:
    data: [num_layers, num_blocks + 1, num_kv_heads, 2, block_size, head_dim]
Block `num_blocks` is the trash row: the fixed-shape write-through sends every token that does not end
a block there. Pinned when CUDA is available (a pinned tensor is readable by a Triton kernel over UVA:
kernels/flash_h2d.py), plain memory on CPU. Viewed flat as [num_layers * (num_blocks + 1) * Hkv, 2, bs, D],
head block (layer, block, kv_head) is row (layer * (num_blocks + 1) + block) * Hkv + kv_head: the same
index as the HBM pool's residency map (kvcache/pool.py).

Host block ids are the engine's token block ids (one allocator, sized to min(device blocks, host blocks)).

Two ways in (store_step): the tokens of a step go through FlashD2H (D2HWriter: one contiguous copy per
layer into a staging buffer, CPU worker threads scatter it into the block layout while later layers
compute); blocks that a decode token completes are also written through whole (write_through), which
is all a step captured in a CUDA graph does. fence() waits for the workers; the runner calls it before
every step, and no step reads a block written in the same step (decodes read only their own full
blocks before the local window, prefill chunks nothing through the store).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def host_block_bytes(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token block (all layers and KV heads) takes in the host store."""
    return num_layers * num_kv_heads * 2 * block_size * head_dim * dtype.itemsize


class HostKVStore:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, pin: bool | None = None, device: torch.device | None = None) -> None:
        pin = torch.cuda.is_available() if pin is None else pin
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(num_layers, num_blocks + 1, num_kv_heads, 2, block_size, head_dim, dtype=dtype,
                                pin_memory=pin)
        # Full token blocks x layers written through; on the compute device, so counting never syncs.
        self.blocks_written = torch.zeros((), dtype=torch.int64, device=device)
        self.d2h: D2HWriter | None = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def flat(self) -> torch.Tensor:
        """[num_layers * (num_blocks + 1) * Hkv, 2, bs, D]: one row per head block."""
        return self.data.view(-1, *self.data.shape[3:])

    def attach_d2h(self, max_tokens: int, num_threads: int = 2) -> None:
        self.d2h = D2HWriter(self, max_tokens, num_threads)

    def fence(self) -> None:
        if self.d2h is not None:
            self.d2h.fence()

    def store_step(self, layer: int, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, num_decode_tokens: int) -> None:
        """One layer's new K/V after store_kv. Blocks that a one-token entry (a decode, or a one-token
        prefill chunk) completes are written through whole from the device cache; every token of a step
        that is not being captured in a CUDA graph also goes through FlashD2H. Why both: a captured
        decode step cannot run host threads, so its tokens reach the store only when their block
        completes (whole); a block completed by a prefill chunk may hold earlier one-token entries, which
        FlashD2H wrote token by token because they ran outside a graph (only pure decode steps are
        captured, and a decoding sequence completes its blocks with decodes)."""
        if self.d2h is None:
            self.write_through(layer, kv_cache, slot_mapping)
            return
        if num_decode_tokens:
            self.write_through(layer, kv_cache, slot_mapping[:num_decode_tokens])
        if not (kv_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.d2h.submit(layer, k, v, slot_mapping)

    def bytes_written(self) -> int:
        """Bytes written into the store so far (whole blocks + FlashD2H tokens; syncs)."""
        _, _, hkv, _, bs, head_dim = self.data.shape
        token = hkv * 2 * head_dim * self.data.element_size()
        return int(self.blocks_written) * bs * token + (self.d2h.tokens_written if self.d2h is not None else 0) * token

    def write_through(self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The write-through of one layer's step: the Triton kernel on a GPU, the reference on CPU."""
        if kv_cache.is_cuda:
            from sparseserve.kernels.flash_h2d import write_through_blocks
            write_through_blocks(kv_cache, self.data[layer], slot_mapping)
            self.blocks_written += ((slot_mapping >= 0) & ((slot_mapping + 1) % self.block_size == 0)).sum()
        else:
            self.write_through_ref(layer, kv_cache, slot_mapping)

    def write_through_ref(self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After store_kv of `layer`: copy every token block that this step's tokens complete (the token at
        offset block_size - 1 was written) from the device cache layer [NB, Hkv, 2, bs, D] to the store.
        Fixed shapes ([T] blocks, the rest to the trash row). The CPU reference of FlashD2H: on a GPU
        this copy must leave the device in one contiguous transfer on a side stream (not done yet;
        write_through uses the interim UVA kernel kernels/flash_h2d.py write_through_blocks there)."""
        if slot_mapping.numel() == 0:
            return
        bs, trash = self.block_size, self.num_blocks
        ends = (slot_mapping >= 0) & ((slot_mapping + 1) % bs == 0)
        blk = torch.where(ends, slot_mapping // bs, trash)
        src = kv_cache[blk.clamp_max(kv_cache.shape[0] - 1)]
        dst = blk.to(self.data.device)
        self.data[layer][dst] = src.to(self.data.device)
        self.blocks_written += ends.sum().to(self.blocks_written.device)


class D2HWriter:
    """FlashD2H (DESIGN.md principle 5): the new K/V of a step's prefill tokens leave in one contiguous copy
    per layer into a staging buffer (pinned on a GPU host; [L, max_tokens, Hkv, 2, D] plus the tokens'
    slots), and CPU worker threads scatter them into the store's block layout, overlapped with the
    following layers. Token granular: a block is complete in the store once all its tokens are.

    On CUDA the copy is issued on a side stream after the compute stream's work so far, and a worker
    waits for its event before scattering. That branch has NOT been run on a GPU yet (the engine
    refuses kv_offload on CUDA); on CPU the copy is synchronous and the scatter runs on the threads."""

    def __init__(self, store: HostKVStore, max_tokens: int, num_threads: int = 2) -> None:
        num_layers, _, hkv, _, _, head_dim = store.data.shape
        pin = store.data.is_pinned()
        self.store = store
        self.staging = torch.empty(num_layers, max_tokens, hkv, 2, head_dim, dtype=store.data.dtype, pin_memory=pin)
        self.staged_slots = torch.empty(num_layers, max_tokens, dtype=torch.int64, pin_memory=pin)
        self.workers = ThreadPoolExecutor(num_threads, thread_name_prefix="sparseserve-d2h")
        self.pending: list[Future] = []
        self.stream = None
        self.tokens_written = 0  # token x layer entries scattered (stats)
        self._lock = threading.Lock()

    def submit(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] of one layer; slot_mapping [T] (-1: padding, skipped)."""
        t = slot_mapping.numel()
        if t > self.staging.shape[1]:
            raise ValueError(f"{t} tokens exceed the D2H staging buffer of {self.staging.shape[1]}")
        staged, slots = self.staging[layer, :t], self.staged_slots[layer, :t]
        event = None
        if k.is_cuda:
            self.stream = self.stream or torch.cuda.Stream(k.device)
            self.stream.wait_stream(torch.cuda.current_stream(k.device))
            with torch.cuda.stream(self.stream):
                staged[:, :, 0].copy_(k, non_blocking=True)
                staged[:, :, 1].copy_(v, non_blocking=True)
                slots.copy_(slot_mapping, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            for x in (k, v, slot_mapping):
                x.record_stream(self.stream)
        else:
            staged[:, :, 0] = k
            staged[:, :, 1] = v
            slots.copy_(slot_mapping)
        self.pending.append(self.workers.submit(self._scatter, layer, t, event))

    def _scatter(self, layer: int, t: int, event) -> None:
        if event is not None:
            event.synchronize()
        slots = self.staged_slots[layer, :t]
        valid = slots >= 0
        s = slots[valid]
        bs = self.store.block_size
        # Advanced indices around slices put the token dim first: [n, Hkv, 2, D].
        self.store.data[layer][s // bs, :, :, s % bs] = self.staging[layer, :t][valid]
        with self._lock:
            self.tokens_written += int(s.numel())

    def fence(self) -> None:
        """Wait for every scatter submitted so far (re-raising a worker's error)."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()
