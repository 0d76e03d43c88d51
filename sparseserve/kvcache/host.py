"""The host KV store: every full head block of every running request, written once as its tokens
arrive, so HBM eviction never writes back (docs/architecture.md, principles 4, 5; docs/offload.md).

    data: [num_layers, num_blocks + 1, num_kv_heads, 2, block_size, head_dim]
Rows are token (host) block ids; row `num_blocks` is a trash row for the fixed-shape write-through.
Pinned when CUDA is available (Triton kernels read it over UVA). Flat view: head block (layer,
block, head) is row (layer * (num_blocks + 1) + block) * Hkv + head, the HBM pool's key.
Decodes' completed blocks are written through over UVA, prefill chunks' by FlashD2H (D2HWriter).
The trap: `fence()` before every step's kernels (the runner's offload cache), or a step may read a
row a CPU worker has not written yet.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from sparseserve.kernels.flash_h2d import write_through


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly this size, readable by GPU kernels over UVA: plain memory
    registered with CUDA, since torch's pinned allocator rounds sizes up to a power of two."""
    t = torch.zeros(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    res = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    err = int(getattr(res, "value", res))
    if err != 0:  # 2: out of page-lockable memory (the common case); 712: the range is already registered
        raise MemoryError(
            f"could not page-lock {nbytes / 2**30:.1f} GiB of host memory for the KV store "
            f"(cudaHostRegister: CUDA error {err}): lower host_kv_memory"
        )
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def host_block_bytes(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token block (all layers and KV heads) takes in the host store."""
    return num_layers * num_kv_heads * 2 * block_size * head_dim * dtype.itemsize


class HostKVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        pin: bool | None = None,
        device: torch.device | None = None,
    ) -> None:
        pin = torch.cuda.is_available() if pin is None else pin
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks + 1, num_kv_heads, 2, block_size, head_dim)
        self.data = pinned_zeros(shape, dtype) if pin else torch.zeros(shape, dtype=dtype)
        # Token blocks x layers written through; on the compute device: counting never syncs.
        self.blocks_written = torch.zeros((), dtype=torch.int64, device=device)
        self.d2h: D2HWriter | None = None
        self.layer_d2h: LayerD2H | None = None  # layer-segmented prefill's writer
        self.num_fences = 0  # fence() calls (the runner's: one a step)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def flat(self) -> torch.Tensor:
        """[num_layers * (num_blocks + 1) * Hkv, 2, bs, D]: one row per head block."""
        return self.data.view(-1, *self.data.shape[3:])

    def attach_d2h(self, max_tokens: int, max_seqs: int, num_threads: int = 4) -> None:
        self.d2h = D2HWriter(self, max_tokens, max_seqs, num_threads)

    def fence(self, host: bool = False) -> None:
        """Every FlashD2H write submitted so far is in the store before the current stream's next
        kernel (host=True: before this returns, for a CPU reader)."""
        self.num_fences += 1
        if self.d2h is not None:
            self.d2h.fence()
        if self.layer_d2h is not None:
            self.layer_d2h.fence(host)

    def d2h_blocks_written(self) -> int:
        """Token blocks x layers the FlashD2H writers stored so far (host-side count)."""
        return sum(w.blocks_written for w in (self.d2h, self.layer_d2h) if w is not None)

    def store_step(
        self,
        layer: int,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_decode_tokens: int,
        num_seqs: int,
        token_slot_mapping: torch.Tensor | None = None,
        decodes: bool = True,
    ) -> None:
        """One layer's step after store_kv: each token block a token of the step completes goes to
        the store whole. Decode tokens (the first num_decode_tokens) by the write-through kernel
        (all a captured step can do; decodes=False: the K/V store kernel wrote them), prefill
        chunks' by FlashD2H. A partial block is never stored.

        slot_mapping: [T] device cache slots (-1: padding); token_slot_mapping: [T] their slots in
        token blocks (host rows) when the device cache has other ids (None: the same)."""
        nd, tsm = num_decode_tokens, token_slot_mapping
        if decodes and nd:
            self.write_through(layer, kv_cache, slot_mapping[:nd], None if tsm is None else tsm[:nd])
        if slot_mapping.numel() > nd:
            rest, rest_tsm = slot_mapping[nd:], None if tsm is None else tsm[nd:]
            if self.d2h is None:
                self.write_through(layer, kv_cache, rest, rest_tsm)
            else:
                self.d2h.submit(
                    layer, kv_cache, rest, num_seqs - nd, None if rest_tsm is None else rest_tsm // self.block_size
                )

    def bytes_written(self) -> int:
        """Bytes written into the store so far (whole blocks + FlashD2H tokens; syncs)."""
        block = self.data[0, 0].numel() * self.data.element_size()
        return (int(self.blocks_written) + self.d2h_blocks_written()) * block

    def write_through(
        self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, host_slots: torch.Tensor | None = None
    ) -> None:
        """After store_kv of `layer`: each token block a token of slot_mapping completes goes from
        the device cache layer [NB, Hkv, 2, bs, D] to the store row of host_slots[i] (its slot in
        host block ids; default: the same). Fixed shapes; blocks_written counts them."""
        write_through(kv_cache, self.data[layer], slot_mapping, host_slots, self.blocks_written)


def completed_blocks(
    slot_mapping: torch.Tensor, block_size: int, n: int, host_blocks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(device blocks, host blocks) [n] of the token blocks that the tokens of slot_mapping
    complete, compacted to the front on the device without a host sync (fixed shape; -1 pads). n
    must bound their count: floor(T / block_size) + the number of sequences does."""
    ends = (slot_mapping >= 0) & ((slot_mapping + 1) % block_size == 0)
    pos = torch.where(ends, torch.cumsum(ends, 0) - 1, n)  # n: a spare row that takes the rest
    src = torch.full((n + 1,), -1, dtype=torch.int64, device=slot_mapping.device)
    dst = torch.full_like(src, -1)
    src.scatter_(0, pos, slot_mapping // block_size)
    dst.scatter_(0, pos, slot_mapping // block_size if host_blocks is None else host_blocks.long())
    return src[:n], dst[:n]


class D2HWriter:
    """FlashD2H for the blocks prefill chunks complete (principle 5): per layer, on a side stream,
    those blocks gathered on the device and copied at once into pinned staging [L, max_blocks,
    Hkv, 2, bs, D] with their host ids; a CPU worker writes them into their rows while later
    layers compute. No host sync; fence() waits for the workers."""

    def __init__(self, store: HostKVStore, max_tokens: int, max_seqs: int, num_threads: int = 4) -> None:
        num_layers, _, hkv, _, bs, head_dim = store.data.shape
        pin = store.data.is_pinned()
        self.store = store
        self.max_blocks = max_tokens // bs + max_seqs
        self.staging = torch.empty(
            num_layers, self.max_blocks, hkv, 2, bs, head_dim, dtype=store.data.dtype, pin_memory=pin
        )
        self.staged_ids = torch.empty(num_layers, self.max_blocks, dtype=torch.int64, pin_memory=pin)
        self.workers = ThreadPoolExecutor(num_threads, thread_name_prefix="sparseserve-d2h")
        self.pending: list[Future] = []
        self.stream = None
        self.blocks_written = 0  # token blocks x layers written (stats)
        self._lock = threading.Lock()

    def submit(
        self,
        layer: int,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_seqs: int,
        host_blocks: torch.Tensor | None = None,
    ) -> None:
        """kv_cache: the layer's device cache [NB, Hkv, 2, bs, D] after store_kv; slot_mapping
        [T] (-1: padding) of the prefill tokens of num_seqs sequences; host_blocks [T]: their
        host block ids (None: the same)."""
        n = min(slot_mapping.numel() // self.store.block_size + num_seqs, self.max_blocks)
        staged, ids = self.staging[layer, :n], self.staged_ids[layer, :n]
        event = None
        if kv_cache.is_cuda:
            self.stream = self.stream or torch.cuda.Stream(kv_cache.device)
            self.stream.wait_stream(torch.cuda.current_stream(kv_cache.device))
            with torch.cuda.stream(self.stream):
                src, dst = completed_blocks(slot_mapping, self.store.block_size, n, host_blocks)
                staged.copy_(kv_cache[src.clamp_min(0)], non_blocking=True)
                ids.copy_(dst, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            # The side stream reads these after the compute stream may have freed them.
            for x in (kv_cache, slot_mapping) + (() if host_blocks is None else (host_blocks,)):
                x.record_stream(self.stream)
        else:
            src, dst = completed_blocks(slot_mapping, self.store.block_size, n, host_blocks)
            staged.copy_(kv_cache[src.clamp_min(0)])
            ids.copy_(dst)
        self.pending.append(self.workers.submit(self._write, layer, n, event))

    def _write(self, layer: int, n: int, event) -> None:
        if event is not None:
            event.synchronize()
        ids = self.staged_ids[layer, :n]
        valid = ids >= 0
        self.store.data[layer].index_copy_(0, torch.where(valid, ids, self.store.num_blocks), self.staging[layer, :n])
        with self._lock:
            self.blocks_written += int(valid.sum())

    def fence(self) -> None:
        """Wait for every write submitted so far (re-raising a worker's error)."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()


class LayerD2H:
    """FlashD2H of layer-segmented prefill: one layer of one prompt at a time, a contiguous slice of
    the scratch copied by the copy engine straight into its store rows on a side stream, one copy
    per run of consecutive host rows (one a block where the rows are scattered).
    No staging and no CPU writer: at MHA sizes a CPU scatter of a layer's rows took longer than the
    layer's compute (docs/offload.md, "Layer-segmented prefill"). The trap: submit returns the
    copies' event (None on CPU), which the compute stream must wait for before it overwrites those
    scratch rows; fence() orders the compute stream after every copy (no host wait), except while
    `held`: the copies are the rows of a prefill in progress, which nothing reads or rewrites before
    it finishes or is released (its owner then clears `held`, and the next step's fence waits)."""

    def __init__(self, store: HostKVStore) -> None:
        self.store = store
        self.stream = None
        self.last = None  # the event of the last copy not yet fenced
        self.held = False  # set by the prefill in progress (engine/layer_prefill.py) between its steps
        self.blocks_written = 0  # token blocks x layers written (stats)
        self.num_copies = 0  # copies issued, one a run of rows (stats)

    def submit(self, layer: int, src: torch.Tensor, host_rows: torch.Tensor):
        """src: [n, Hkv, 2, bs, D] full blocks (device); host_rows: int64 [n] (CPU): their rows."""
        n = src.shape[0]
        if n == 0:
            return None
        rows = host_rows.numpy()
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        runs = zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [n])).tolist())
        dst = self.store.data[layer]
        self.blocks_written += n
        self.num_copies += len(cuts) + 1
        if not src.is_cuda:
            for a, b in runs:
                dst[rows[a] : rows[a] + b - a].copy_(src[a:b])
            return None
        self.stream = self.stream or torch.cuda.Stream(src.device)
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            for a, b in runs:
                dst[rows[a] : rows[a] + b - a].copy_(src[a:b], non_blocking=True)
            self.last = event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def fence(self, host: bool = False) -> None:
        """The current stream waits (on the device) for every copy submitted so far, unless `held`;
        host=True: the caller waits (the rows are readable on the CPU), held or not."""
        if self.held and not host:
            return
        last, self.last = self.last, None
        if last is None:
            return
        if host:
            last.synchronize()
        else:
            torch.cuda.current_stream(self.stream.device).wait_event(last)
