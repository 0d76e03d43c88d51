"""FlashH2D (DESIGN.md principle 5): one kernel gathers all missing head blocks of a layer from the host
store into their HBM pool slots. The host store is pinned, so on a GPU the kernel reads it directly over
UVA; one program copies one head block (K and V of block_size tokens, contiguous in both layouts).
Requests that load nothing (hits, bypass reads, padding: load < 0) return at once, so the grid has the
fixed size of the layer's requests (capturable).

write_through_blocks is the other direction for the blocks that decode tokens complete (capturable, one
program per token; only block-ending tokens copy): the device cache's head blocks of that token block
are stored straight into the pinned host store over UVA. Decode fills few blocks per step, and a step
captured in a CUDA graph cannot hand work to host threads, so this, not FlashD2H (kvcache/host.py), is
the decode path.

Both kernels pass their tests on an H200 and under the Triton interpreter; FlashH2D's bandwidth:
BENCHMARKS.md (python -m sparseserve.bench.offload --transfers).
"""
from __future__ import annotations

import torch
from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.pdl import pdl_wait, use_pdl


def flash_h2d_ref(host_flat: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, load: torch.Tensor) -> None:
    """slots[load[i]] = host_flat[key[i]] for every i with load[i] >= 0.

    host_flat: [R, 2, bs, D] (pinned on a GPU host); slots: [S, 2, bs, D] on the device; key, load: int64 [N]."""
    todo = load >= 0
    slots[load[todo]] = host_flat[key[todo].to(host_flat.device)].to(slots.device)


def flash_h2d(host_flat: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, load: torch.Tensor) -> None:
    """flash_h2d_ref's contract."""
    (flash_h2d_triton if use_triton(slots) else flash_h2d_ref)(host_flat, slots, key, load)


def write_through_ref(kv_cache: torch.Tensor, host_layer: torch.Tensor, slot_mapping: torch.Tensor,
                      host_slots: torch.Tensor | None = None, count: torch.Tensor | None = None) -> None:
    """host_layer[dst] = kv_cache[blk] for every token block blk that a token of slot_mapping completes (the
    token at offset block_size - 1 was written); dst = host_slots[i] // block_size of that token (its slot in
    the host store's block ids; default: blk). count (int64 [], optional) += the blocks written.

    kv_cache: one layer [NB, Hkv, 2, bs, D]; host_layer: the store's layer [R + 1, Hkv, 2, bs, D], whose last
    row takes the tokens that complete nothing (fixed shapes)."""
    if slot_mapping.numel() == 0:
        return
    bs, trash = kv_cache.shape[3], host_layer.shape[0] - 1
    ends = (slot_mapping >= 0) & ((slot_mapping + 1) % bs == 0)
    src = kv_cache[torch.where(ends, slot_mapping // bs, 0)]
    dst = torch.where(ends, (slot_mapping if host_slots is None else host_slots) // bs, trash)
    host_layer[dst.to(host_layer.device)] = src.to(host_layer.device)
    if count is not None:
        count += ends.sum().to(count.device)


def write_through(kv_cache: torch.Tensor, host_layer: torch.Tensor, slot_mapping: torch.Tensor,
                  host_slots: torch.Tensor | None = None, count: torch.Tensor | None = None) -> None:
    """write_through_ref's contract."""
    (write_through_triton if use_triton(kv_cache) else write_through_ref)(kv_cache, host_layer, slot_mapping,
                                                                            host_slots, count)


@triton.jit
def _flash_h2d_kernel(host_ptr, slots_ptr, key_ptr, load_ptr, resident_ptr, loc_ptr, ELEMS: tl.constexpr,
                      CHUNK: tl.constexpr, REPEATS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # load and loc are the pool plan's output
    i = tl.program_id(0)
    dst = tl.load(load_ptr + i)
    if REPEATS:
        if dst == -2:  # a repeat of a key planned elsewhere in the call: its slot after the plan
            tl.store(loc_ptr + i, tl.load(resident_ptr + tl.load(key_ptr + i)))
    if dst >= 0:
        src = tl.load(key_ptr + i)
        src_base = host_ptr + src * ELEMS
        dst_base = slots_ptr + dst * ELEMS
        offs = tl.arange(0, CHUNK)
        for start in range(0, ELEMS, CHUNK):
            idx = start + offs
            m = idx < ELEMS
            tl.store(dst_base + idx, tl.load(src_base + idx, mask=m), mask=m)


def flash_h2d_triton(host_flat: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, load: torch.Tensor,
                     chunk: int = 4096, num_warps: int = 4,
                     repeats: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """repeats = (resident, loc) (kernels/pool_plan.py pool_read): where load is -2 the entry repeats a key
    planned at another position, and loc[i] = resident[key[i]] is written in the same launch."""
    assert host_flat.is_contiguous() and slots.is_contiguous() and host_flat.shape[1:] == slots.shape[1:]
    assert host_flat.dtype == slots.dtype
    n = key.numel()
    if n == 0:
        return
    elems = slots[0].numel()
    chunk = min(triton.next_power_of_2(elems), chunk)
    resident, loc = repeats if repeats is not None else (load, load)  # unused without repeats
    pdl = use_pdl(slots.device)
    _flash_h2d_kernel[(n,)](host_flat, slots, key.contiguous(), load.contiguous(), resident, loc, ELEMS=elems,
                            CHUNK=chunk, REPEATS=repeats is not None, num_warps=num_warps, PDL=pdl, launch_pdl=pdl)


@triton.jit
def _write_through_kernel(cache_ptr, host_ptr, slot_ptr, dst_ptr, count_ptr, BLOCK_SIZE: tl.constexpr,
                          ELEMS: tl.constexpr, CHUNK: tl.constexpr, HAS_DST: tl.constexpr, COUNT: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_wait(PDL)  # the block's last token was just stored
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if (slot >= 0) & ((slot + 1) % BLOCK_SIZE == 0):
        blk = slot // BLOCK_SIZE
        dst = blk
        if HAS_DST:
            dst = tl.load(dst_ptr + i).to(tl.int64) // BLOCK_SIZE
        offs = tl.arange(0, CHUNK)
        for start in range(0, ELEMS, CHUNK):
            idx = start + offs
            m = idx < ELEMS
            tl.store(host_ptr + dst * ELEMS + idx, tl.load(cache_ptr + blk * ELEMS + idx, mask=m), mask=m)
        if COUNT:
            tl.atomic_add(count_ptr, 1, sem="relaxed")


def write_through_triton(kv_cache: torch.Tensor, host_layer: torch.Tensor, slot_mapping: torch.Tensor,
                         host_slots: torch.Tensor | None = None, count: torch.Tensor | None = None) -> None:
    assert kv_cache.is_contiguous() and host_layer.is_contiguous() and kv_cache.dtype == host_layer.dtype
    assert kv_cache.shape[1:] == host_layer.shape[1:]
    t = slot_mapping.numel()
    if t == 0:
        return
    elems = kv_cache[0].numel()
    dst = slot_mapping if host_slots is None else host_slots.contiguous()
    pdl = use_pdl(kv_cache.device)
    _write_through_kernel[(t,)](kv_cache, host_layer, slot_mapping.contiguous(), dst,
                                slot_mapping if count is None else count, BLOCK_SIZE=kv_cache.shape[3], ELEMS=elems,
                                CHUNK=min(triton.next_power_of_2(elems), 4096), HAS_DST=host_slots is not None,
                                COUNT=count is not None, num_warps=4, PDL=pdl, launch_pdl=pdl)
