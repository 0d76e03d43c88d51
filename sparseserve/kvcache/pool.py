"""The unified HBM pool of head-block slots (DESIGN.md principle 4), shared by all layers and KV heads.

State (fixed-shape tensors on the device; one extra trash entry each, so updates never filter):
    slots:     [num_slots + 1, 2, block_size, head_dim]  K and V of one head block per slot
    resident:  int64 [num_keys + 1]   head block key -> slot, -1 when not resident
    owner:     int64 [num_slots + 1]  slot -> head block key, -1 when free
    last_use:  int64 [num_slots + 1]  the clock value of the slot's last use (-1: free)
A head block (layer, token block, KV head) has key (layer * (num_blocks + 1) + block) * Hkv + kv_head,
its row in the host store's flat view (kvcache/host.py).

Replacement is set-associative LRU: slot s belongs to set s // ways; a head block may only live in the
set hash(key) % num_sets. For one layer's requests of a decode step, `plan` finds the hits, then gives
the misses of each set the least recently used slots of that set that the step does not use (its hits
and the other misses' victims), in rank order: no sort of the whole pool, only of each missing block's
`ways` candidates. A miss that finds no free way in its set (more misses in a set than evictable ways)
is a bypass: it is read straight from the host store this step (on a GPU a UVA read; here a gather)
and not cached. 32 ways by default: a decode step's working set (every layer's lists) hashed over the sets
overflows some of them, and an overflowing set misses every one of its blocks every step (LRU over a cyclic
access): at half the pool in use, 7% of the working set with 8 ways, 1.5% with 16, 0.1% with 32 (Poisson).
Fixed shapes and no host sync (capturable): `plan_ref` in torch ops (CPU, tests), two
Triton kernels on CUDA (kernels/pool_plan.py: the ~25 torch ops cost ~5 ms a decode step on an H200).
"""
from __future__ import annotations

import torch

_NEVER = 1 << 62  # last_use of slots the current step uses: never a victim
_HASH = 2654435761


class HBMPool:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 num_slots: int, dtype: torch.dtype, device: torch.device, ways: int = 32,
                 use_triton: bool | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the HBM pool needs at least one slot, got {num_slots}")
        self.ways = min(ways, num_slots)
        self.num_sets = num_slots // self.ways
        self.num_slots = self.num_sets * self.ways  # a remainder smaller than one set is left unused
        self.num_keys = num_layers * (num_blocks + 1) * num_kv_heads
        self.num_blocks, self.num_kv_heads = num_blocks, num_kv_heads
        n = self.num_slots
        self.slots = torch.zeros(n + 1, 2, block_size, head_dim, dtype=dtype, device=device)
        self.resident = torch.full((self.num_keys + 1,), -1, dtype=torch.int64, device=device)
        self.owner = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        # hits, head blocks loaded (H2D), bypass reads, layer steps planned
        self.stats = torch.zeros(4, dtype=torch.int64, device=device)
        # The Triton plan (None: on CUDA; tests force it under the interpreter) and its scratch: misses per
        # set (zero between calls: the kernel resets what it counts), each set's queue of misses by rank, and
        # the clock of the call in flight.
        self.use_triton = device.type == "cuda" if use_triton is None else use_triton
        self.set_misses = torch.zeros(self.num_sets, dtype=torch.int32, device=device)
        self.set_queue = torch.zeros(n, dtype=torch.int32, device=device)
        self.plan_cur = torch.zeros(1, dtype=torch.int64, device=device)

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    @property
    def trash_key(self) -> int:
        return self.num_keys

    def keys(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: int [..., Hkv, K] token block ids (-1: no request) -> int64 keys, trash key for -1."""
        h = torch.arange(self.num_kv_heads, device=blocks.device)[:, None]
        key = (layer * (self.num_blocks + 1) + blocks.long()) * self.num_kv_heads + h
        return torch.where(blocks >= 0, key, self.trash_key)

    def set_of(self, key: torch.Tensor) -> torch.Tensor:
        return (key * _HASH) % self.num_sets

    def plan(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """plan_ref's contract; on the GPU the Triton kernels, which may pair a set's misses with its victims
        in another order (the victims, hits and bypass count per set are the reference's)."""
        if self.use_triton:
            from sparseserve.kernels.pool_plan import pool_plan
            return pool_plan(self, key, _HASH)
        return self.plan_ref(key)

    def plan_ref(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's step. key: int64 [N] head blocks the step reads (trash key: none), each at most once
        (true while sequences share no blocks; prefix sharing would need a dedupe here).

        Updates residency, owners and LRU state, and returns (loc, load):
          loc  [N]: the slot each request reads after the loads, -1 for bypass reads and non-requests;
          load [N]: the slot each missing block must be copied into (FlashH2D), -1 where nothing loads."""
        n, trash_slot, trash_key = key.numel(), self.trash_slot, self.trash_key
        need = key != trash_key
        slot = self.resident[key]
        hit = need & (slot >= 0)
        miss = need & (slot < 0)
        in_use = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=key.device)
        # index_fill_, not `x[idx] = scalar`: the latter copies a CPU scalar, which CUDA-graph capture forbids.
        in_use.index_fill_(0, torch.where(hit, slot, trash_slot), True)
        # Rank of each miss among the misses of its set: a sort of the N requests, not of the pool.
        set_id = torch.where(miss, self.set_of(key), self.num_sets)
        sorted_set, order = torch.sort(set_id, stable=True)
        first = torch.searchsorted(sorted_set, sorted_set)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=key.device) - first
        ways = set_id.clamp_max(self.num_sets - 1)[:, None] * self.ways + torch.arange(self.ways, device=key.device)
        age = torch.where(in_use[ways], _NEVER, self.last_use[ways])
        age_sorted, way_order = torch.sort(age, dim=1, stable=True)
        r = rank.clamp_max(self.ways - 1)[:, None]
        victim = ways.gather(1, way_order.gather(1, r))[:, 0]
        ok = miss & (rank < self.ways) & (age_sorted.gather(1, r)[:, 0] < _NEVER)
        load = torch.where(ok, victim, -1)
        # Evict the victims' previous blocks, then install the new owners.
        old = self.owner[torch.where(ok, victim, trash_slot)]
        self.resident.index_fill_(0, torch.where(ok & (old >= 0), old, trash_key), -1)
        self.owner[torch.where(ok, victim, trash_slot)] = torch.where(ok, key, -1)
        self.resident[torch.where(ok, key, trash_key)] = victim
        self.resident[trash_key].fill_(-1)  # fill_: `x[i] = -1` copies a CPU scalar (no graph capture)
        self.owner[trash_slot].fill_(-1)
        loc = torch.where(hit, slot, load)
        self.last_use[torch.where(loc >= 0, loc, trash_slot)] = self.clock
        self.last_use[trash_slot].fill_(-1)
        self.clock += 1
        self.stats += torch.stack([hit.sum(), ok.sum(), (miss & ~ok).sum(), torch.ones_like(self.clock)])
        return loc, load

    def invalidate(self, blocks: list[int]) -> None:
        """Token blocks freed by the scheduler (finished, aborted, preempted): drop their head blocks of
        every layer and KV head, so a block id allocated again never hits a stale slot. Between steps."""
        if not blocks:
            return
        dev = self.resident.device
        b = torch.tensor(blocks, dtype=torch.int64, device=dev)
        layers = torch.arange(self.num_keys // ((self.num_blocks + 1) * self.num_kv_heads), device=dev)
        h = torch.arange(self.num_kv_heads, device=dev)
        key = ((layers[:, None, None] * (self.num_blocks + 1) + b[None, :, None]) * self.num_kv_heads
               + h[None, None]).reshape(-1)
        slot = self.resident[key]
        slot = torch.where(slot >= 0, slot, self.trash_slot)
        self.owner[slot] = -1
        self.last_use[slot] = -1
        self.resident[key] = -1

    def check(self) -> None:
        """Accounting invariants (tests; syncs): owner and resident are inverse maps, no slot holds two
        blocks, the trash entries stay empty, the Triton plan's miss counters are back to zero."""
        assert not self.set_misses.any(), "a set's miss counter was not reset"
        owner, resident = self.owner[: self.num_slots].cpu(), self.resident.cpu()
        assert self.owner[self.trash_slot].item() == -1 and resident[self.trash_key].item() == -1
        held = owner >= 0
        assert (resident[owner[held]] == torch.nonzero(held)[:, 0]).all(), "slot owner not resident there"
        res = torch.nonzero(resident >= 0)[:, 0]
        assert (owner[resident[res]] == res).all(), "resident block's slot owned by another block"
        assert len(set(resident[res].tolist())) == res.numel(), "two blocks in one slot"
        sets = self.set_of(owner[held])
        assert (torch.nonzero(held)[:, 0] // self.ways == sets).all(), "block outside its set"

    def gather_ref(self, host_flat: torch.Tensor, key: torch.Tensor, load: torch.Tensor) -> None:
        """FlashH2D reference: slots[load] = host_flat[key] where load >= 0 (fixed shapes: the rest go
        to the trash slot)."""
        dst = torch.where(load >= 0, load, self.trash_slot)
        self.slots[dst] = host_flat[key.clamp_max(self.num_keys - 1).to(host_flat.device)].to(self.slots.device)

    def read(self, host_flat: torch.Tensor, key: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """K/V of each request [N, 2, bs, D]: from its slot, or straight from the host store (bypass)."""
        from_pool = self.slots[torch.where(loc >= 0, loc, self.trash_slot)]
        from_host = host_flat[key.clamp_max(self.num_keys - 1).to(host_flat.device)].to(self.slots.device)
        return torch.where((loc >= 0)[:, None, None, None], from_pool, from_host)
