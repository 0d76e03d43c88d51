"""FlashH2D (docs/architecture.md, principle 5): one kernel gathers a layer's missing head
blocks from the pinned host store (read over UVA) into their HBM pool slots. The grid is
capturable and small, at most one program an SM, each scanning BLOCK requests at a time for
those that load (see docs/offload.md, "FlashH2D's grid").

write_through is the other direction, for the blocks that decode tokens complete: the device
cache's head blocks stored straight into the pinned host store over UVA (capturable; a
graphed step cannot hand work to host threads, so decode does not use FlashD2H).
"""

from __future__ import annotations

import functools

import torch

from sparseserve.kernels.dispatch import tl, triton, use_triton
from sparseserve.kernels.pdl import pdl_wait, use_pdl


def flash_h2d_ref(
    host_flat: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    load: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    """slots[load[i]] = host_flat[key[i]] for every i with load[i] >= 0 (and i < count, int32 [1], if given).

    host_flat: [R, 2, bs, D] (pinned on a GPU host); slots: [S, 2, bs, D] on the device;
    key, load: int64 [N]."""
    todo = load >= 0
    if count is not None:
        todo &= torch.arange(load.numel(), device=load.device) < count.to(load.device)
    slots[load[todo]] = host_flat[key[todo].to(host_flat.device)].to(slots.device)


def flash_h2d(
    host_flat: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    load: torch.Tensor,
    programs_per_sm: float = 1.0,
    block: int = 64,
    count: torch.Tensor | None = None,
) -> None:
    """flash_h2d_ref's contract, either way: slots may be the pinned host side (a save, written over UVA). The
    trap: dispatch on both sides; the reference on a save ran a CPU scatter behind a pageable, blocking copy.
    programs_per_sm, block: flash_h2d_triton's grid bound (loads beside the layers take fewer SMs) and scan."""
    if use_triton(slots) or use_triton(host_flat):
        flash_h2d_triton(host_flat, slots, key, load, programs_per_sm=programs_per_sm, block=block, count=count)
    else:
        flash_h2d_ref(host_flat, slots, key, load, count)


def write_through_ref(
    kv_cache: torch.Tensor,
    host_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    host_slots: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> None:
    """host_layer[dst] = kv_cache[blk] for each token block blk that a token of slot_mapping
    completes (writes offset block_size - 1); dst = host_slots[i] // block_size (default: blk).
    count (int64 [], optional) += blocks written.

    kv_cache: one layer [NB, Hkv, 2, bs, D]; host_layer: the store's layer
    [R + 1, Hkv, 2, bs, D], whose last row takes the tokens that complete nothing."""
    if slot_mapping.numel() == 0:
        return
    bs, trash = kv_cache.shape[3], host_layer.shape[0] - 1
    ends = (slot_mapping >= 0) & ((slot_mapping + 1) % bs == 0)
    src = kv_cache[torch.where(ends, slot_mapping // bs, 0)]
    dst = torch.where(ends, (slot_mapping if host_slots is None else host_slots) // bs, trash)
    host_layer[dst.to(host_layer.device)] = src.to(host_layer.device)
    if count is not None:
        count += ends.sum().to(count.device)


def write_through(
    kv_cache: torch.Tensor,
    host_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    host_slots: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> None:
    """write_through_ref's contract."""
    (write_through_triton if use_triton(kv_cache) else write_through_ref)(
        kv_cache, host_layer, slot_mapping, host_slots, count
    )


# Elements a FlashH2D program copies at once: several head blocks of a few KB each (docs/offload.md, "FlashH2D's grid").
TILE_ELEMS = 8192


# Nothing step-shaped is specialized on (docs/architecture.md, "kernels/").
@triton.jit(do_not_specialize=["n"])
def _flash_h2d_kernel(
    host_ptr,
    slots_ptr,
    key_ptr,
    load_ptr,
    resident_ptr,
    loc_ptr,
    todo_ptr,
    count_ptr,
    n,
    ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    REPEATS: tl.constexpr,
    COUNTED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # load and loc are the pool plan's output
    pid = tl.program_id(0)
    if COUNTED:  # the requests are the first count[0] (a compact list of loads)
        n = tl.minimum(tl.load(count_ptr), n)
    offs = tl.arange(0, BLOCK)
    cols = tl.arange(0, CHUNK)
    todo = todo_ptr + pid * BLOCK  # this program's list of the block's requests that load
    for first in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        idx = first + offs
        dst = tl.load(load_ptr + idx, mask=idx < n, other=-1)
        if REPEATS:  # a repeat of a key planned elsewhere in the call: its slot after the plan, if any
            rep = dst == -2
            rkey = tl.load(key_ptr + idx, mask=rep, other=0)
            rslot = tl.load(resident_ptr + rkey, mask=rep, other=-1)
            tl.store(loc_ptr + idx, rslot, mask=rep & (rslot >= 0))
        loads = (dst >= 0).to(tl.int32)
        count = tl.sum(loads, 0)
        if count > 0:
            tl.store(todo + tl.cumsum(loads, 0) - 1, idx, mask=loads > 0)
            tl.debug_barrier()  # the list is read back by other threads of the program
            for j0 in range(0, count, ROWS):  # ROWS head blocks in flight at once (a read over PCIe is slow)
                jj = j0 + tl.arange(0, ROWS)
                jm = jj < count
                i = tl.load(todo + jj, mask=jm, other=0)
                src_base = host_ptr + tl.load(key_ptr + i, mask=jm, other=0) * ELEMS
                dst_base = slots_ptr + tl.load(load_ptr + i, mask=jm, other=0) * ELEMS
                for start in range(0, ELEMS, CHUNK):
                    c = start + cols
                    m = jm[:, None] & (c < ELEMS)[None, :]
                    tl.store(dst_base[:, None] + c[None, :], tl.load(src_base[:, None] + c[None, :], mask=m), mask=m)
            tl.debug_barrier()  # list read by all before it is rewritten


def flash_h2d_triton(
    host_flat: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    load: torch.Tensor,
    chunk: int = 4096,
    num_warps: int = 4,
    repeats: tuple[torch.Tensor, torch.Tensor] | None = None,
    block: int = 64,
    programs_per_sm: float = 1.0,
    count: torch.Tensor | None = None,
) -> None:
    """repeats = (resident, loc) (pool_plan.pool_read): where load is -2 the entry repeats a key
    planned elsewhere, and loc[i] = resident[key[i]] is written in the same launch where that is a
    slot (>= 0; else loc[i] stays: the plan wrote the bypass's host row there). block:
    requests a program scans at a time (a power of two); programs_per_sm bounds the grid. count
    (int32 [1] on the device): only the first count requests (the grid still follows key's size)."""
    assert host_flat.is_contiguous() and slots.is_contiguous() and host_flat.shape[1:] == slots.shape[1:]
    assert host_flat.dtype == slots.dtype
    n = key.numel()
    if n == 0:
        return
    elems = slots[0].numel()
    chunk = min(triton.next_power_of_2(elems), chunk)
    resident, loc = repeats if repeats is not None else (load, load)  # unused without repeats
    dev = key.device  # slots may be pinned host memory (the host prefix cache)
    grid = min(triton.cdiv(n, block), max(1, int(programs_per_sm * num_sms(dev))))
    todo = torch.empty(grid * block, dtype=torch.int32, device=dev)
    pdl = use_pdl(slots.device)
    _flash_h2d_kernel[(grid,)](
        host_flat,
        slots,
        key.contiguous(),
        load.contiguous(),
        resident,
        loc,
        todo,
        todo if count is None else count,
        n,
        ELEMS=elems,
        CHUNK=chunk,
        ROWS=max(1, TILE_ELEMS // chunk),
        BLOCK=block,
        REPEATS=repeats is not None,
        COUNTED=count is not None,
        num_warps=num_warps,
        PDL=pdl,
        launch_pdl=pdl,
    )


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs (4 under the interpreter: a test's requests span several blocks a program)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _write_through_kernel(
    cache_ptr,
    host_ptr,
    slot_ptr,
    dst_ptr,
    count_ptr,
    BLOCK_SIZE: tl.constexpr,
    ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_DST: tl.constexpr,
    COUNT: tl.constexpr,
    PDL: tl.constexpr,
):
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


def write_through_triton(
    kv_cache: torch.Tensor,
    host_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    host_slots: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> None:
    assert kv_cache.is_contiguous() and host_layer.is_contiguous() and kv_cache.dtype == host_layer.dtype
    assert kv_cache.shape[1:] == host_layer.shape[1:]
    t = slot_mapping.numel()
    if t == 0:
        return
    elems = kv_cache[0].numel()
    dst = slot_mapping if host_slots is None else host_slots.contiguous()
    pdl = use_pdl(kv_cache.device)
    _write_through_kernel[(t,)](
        kv_cache,
        host_layer,
        slot_mapping.contiguous(),
        dst,
        slot_mapping if count is None else count,
        BLOCK_SIZE=kv_cache.shape[3],
        ELEMS=elems,
        CHUNK=min(triton.next_power_of_2(elems), 4096),
        HAS_DST=host_slots is not None,
        COUNT=count is not None,
        num_warps=4,
        PDL=pdl,
        launch_pdl=pdl,
    )
