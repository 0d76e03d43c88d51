"""FlashH2D (DESIGN.md principle 5): one kernel gathers all missing head blocks of a layer from the host
store into their HBM pool slots. The host store is pinned, so on a GPU the kernel reads it directly over
UVA; one program copies one head block (K and V of block_size tokens, contiguous in both layouts).
Requests that load nothing (hits, bypass reads, padding: load < 0) return at once, so the grid has the
fixed size of the layer's requests (capturable). Reference: kvcache/pool.py HBMPool.gather_ref.

write_through_blocks is the other direction for the blocks a step completes (capturable, one program
per token of the step; only block-ending tokens copy): the device cache's head blocks of that token
block are stored straight into the pinned host store over UVA. It is an interim stand-in for FlashD2H
(one contiguous device-to-host copy per layer on a side stream + CPU scatter threads), fit for decode,
where few blocks fill per step. Reference: kvcache/host.py HostKVStore.write_through_ref.

Status: both kernels are tested against their references under the Triton interpreter on CPU only;
their bandwidth and UVA access to pinned memory have not been measured or checked on a GPU yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _flash_h2d_kernel(host_ptr, slots_ptr, key_ptr, load_ptr, ELEMS: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    dst = tl.load(load_ptr + i)
    if dst >= 0:
        src = tl.load(key_ptr + i)
        src_base = host_ptr + src * ELEMS
        dst_base = slots_ptr + dst * ELEMS
        offs = tl.arange(0, CHUNK)
        for start in range(0, ELEMS, CHUNK):
            idx = start + offs
            m = idx < ELEMS
            tl.store(dst_base + idx, tl.load(src_base + idx, mask=m), mask=m)


def flash_h2d(host_flat: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, load: torch.Tensor) -> None:
    """slots[load[i]] = host_flat[key[i]] for every i with load[i] >= 0.

    host_flat: [R, 2, bs, D] (pinned on a GPU host); slots: [S, 2, bs, D] on the device; key, load: int64 [N]."""
    assert host_flat.is_contiguous() and slots.is_contiguous() and host_flat.shape[1:] == slots.shape[1:]
    assert host_flat.dtype == slots.dtype
    n = key.numel()
    if n == 0:
        return
    elems = slots[0].numel()
    chunk = min(triton.next_power_of_2(elems), 4096)
    _flash_h2d_kernel[(n,)](host_flat, slots, key.contiguous(), load.contiguous(), ELEMS=elems, CHUNK=chunk,
                            num_warps=4)


@triton.jit
def _write_through_kernel(cache_ptr, host_ptr, slot_ptr, BLOCK_SIZE: tl.constexpr, ELEMS: tl.constexpr,
                          CHUNK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if (slot >= 0) & ((slot + 1) % BLOCK_SIZE == 0):
        blk = slot // BLOCK_SIZE
        offs = tl.arange(0, CHUNK)
        for start in range(0, ELEMS, CHUNK):
            idx = start + offs
            m = idx < ELEMS
            tl.store(host_ptr + blk * ELEMS + idx, tl.load(cache_ptr + blk * ELEMS + idx, mask=m), mask=m)


def write_through_blocks(kv_cache: torch.Tensor, host_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """host_layer[blk] = kv_cache[blk] for every token block that a token of slot_mapping completes.

    kv_cache: one layer [NB, Hkv, 2, bs, D]; host_layer: the store's layer [NB + 1, Hkv, 2, bs, D] (pinned)."""
    assert kv_cache.is_contiguous() and host_layer.is_contiguous() and kv_cache.dtype == host_layer.dtype
    assert kv_cache.shape[1:] == host_layer.shape[1:]
    t = slot_mapping.numel()
    if t == 0:
        return
    elems = kv_cache[0].numel()
    _write_through_kernel[(t,)](kv_cache, host_layer, slot_mapping.contiguous(), BLOCK_SIZE=kv_cache.shape[3],
                                ELEMS=elems, CHUNK=min(triton.next_power_of_2(elems), 4096), num_warps=4)
