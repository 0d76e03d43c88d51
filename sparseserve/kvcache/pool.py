"""The HBM pool of head-block slots shared by all layers and KV heads (docs/architecture.md,
principle 4; docs/offload.md).

State (fixed-shape device tensors; one extra trash entry each, so updates never filter):
    slots:     [num_slots + 1, 2, block_size, head_dim]  K and V of one head block per slot
    resident:  int64 [num_keys + 1]   head block key -> slot, -1 when not resident
    owner:     int64 [num_slots + 1]  slot -> head block key, -1 when free
    last_use:  int64 [num_slots + 1]  the clock value of the slot's last use (-1: free)
Key of head block (layer, token block, KV head): (layer * (num_blocks + 1) + block) * Hkv + head,
its row in the host store's flat view (kvcache/host.py).

Set-associative LRU: slot s is in set s // ways; a key lives only in set hash(key) % num_sets. A
miss with no evictable way in its set is a bypass: read from the host store this step, not
cached. Fixed shapes, no host sync (capturable): kernels/pool_plan.py.
"""

from __future__ import annotations

import torch

from sparseserve.kernels.pool_plan import ListLayout, PoolState, invalidate, pool_plan, pool_read, set_of
from sparseserve.kernels.working_set import TouchState
from sparseserve.kvcache.transfer import to_device

_HASH = 2654435761


class HBMPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        ways: int = 32,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the HBM pool needs at least one slot, got {num_slots}")
        self.ways = min(ways, num_slots)
        self.num_sets = num_slots // self.ways
        self.num_slots = self.num_sets * self.ways  # a remainder under one set is left unused
        self.num_keys = num_layers * (num_blocks + 1) * num_kv_heads
        self.num_layers, self.num_blocks, self.num_kv_heads = num_layers, num_blocks, num_kv_heads
        n = self.num_slots
        self.slots = torch.zeros(n + 1, 2, block_size, head_dim, dtype=dtype, device=device)
        self.resident = torch.full((self.num_keys + 1,), -1, dtype=torch.int64, device=device)
        self.owner = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        # hits, head blocks loaded (H2D), bypass reads, layer steps planned
        self.stats = torch.zeros(4, dtype=torch.int64, device=device)
        # The Triton plan's scratch: misses per set (zero between calls: the kernel resets them),
        # each set's queue of misses by rank, and the clock of the call in flight.
        self.set_misses = torch.zeros(self.num_sets, dtype=torch.int32, device=device)
        self.set_queue = torch.zeros(n, dtype=torch.int32, device=device)
        self.plan_cur = torch.zeros(1, dtype=torch.int64, device=device)
        self.claim = torch.full((self.num_keys + 1,), -1, dtype=torch.int64, device=device)  # repeats
        self.leaders = torch.zeros(2 + self.num_sets, dtype=torch.int32, device=device)  # kernel 2's work list
        # Lagged reads (`begin_round`): the oldest stamp no victim may carry (the step's start).
        self.floor = torch.zeros(1, dtype=torch.int64, device=device)
        self.free_floor = torch.zeros(1, dtype=torch.int64, device=device)  # 0: only free slots (-1) are victims

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    @property
    def trash_key(self) -> int:
        return self.num_keys

    def keys(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: int [..., Hkv, K] token block ids (-1: no request) -> int64 keys (-1: trash)."""
        h = torch.arange(self.num_kv_heads, device=blocks.device)[:, None]
        key = (layer * (self.num_blocks + 1) + blocks.long()) * self.num_kv_heads + h
        return torch.where(blocks >= 0, key, self.trash_key)

    def set_of(self, key: torch.Tensor) -> torch.Tensor:
        return set_of(key, self.num_sets, _HASH)

    def plan(
        self, key: torch.Tensor, lagged: bool = False, stats: torch.Tensor | None = None, free_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's step: residency lookup of the head blocks key [N] (int64; the trash key:
        no request; each at most once), victims and installs for the misses
        (kernels/pool_plan.py). Returns (loc, load): the slot each request reads (-1: bypass or
        none) and the slot each miss is loaded into (-1: none). lagged: as in `read`. stats:
        where the plan counts (default the pool's: hits, loads, bypass reads, layer steps).
        free_only: misses go into free slots only, evicting nothing."""
        floor = self.free_floor if free_only else self.floor if lagged else None
        return pool_plan(
            key,
            self.resident,
            self.owner,
            self.last_use,
            self.clock,
            self.stats if stats is None else stats,
            self.set_misses,
            self.set_queue,
            self.plan_cur,
            self.leaders,
            ways=self.ways,
            num_sets=self.num_sets,
            hash_mult=_HASH,
            floor=floor,
        )

    def mark_unused(self, slots: torch.Tensor) -> None:
        """Slots (-1: none) filled for no request: stamped older than any use, so they are the first victims
        (a device op, no sync)."""
        self.last_use.index_fill_(0, torch.where(slots >= 0, slots, self.trash_slot), 0)
        self.last_use[self.trash_slot].fill_(-1)

    def read(
        self,
        host_flat: torch.Tensor,
        layer: int,
        sel: torch.Tensor,
        row_slots: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        local: int,
        block_size: int,
        touch: TouchState | None = None,
        lagged: bool = False,
        defer: bool = False,
        views: bool = True,
    ) -> tuple[torch.Tensor | None, ...]:
        """One layer's decode lists read through the pool (kernels/pool_plan.py pool_read).
        sel: int32 [S, Hkv, cap] the lists by state slot; row_slots [B]: each row's slot; tables
        [B, W]: token block tables (host rows); seq_lens [B]. Misses load from host_flat; touch:
        the working-set count the listed keys join in the same pass. Returns (loc, key)
        [B, Hkv, cap]: each entry's slot, or -(key + 1) where it has none (read host row `key`, or no
        request). lagged: a read beside the step in flight, which keeps every slot stamped since `begin_round`. defer:
        (loc, key, loads), the misses' FlashH2D left to the caller, loads listed by layer; views=False:
        loc None (kernels/pool_plan.py)."""
        state = PoolState(
            self.resident,
            self.owner,
            self.last_use,
            self.clock,
            self.stats,
            self.set_misses,
            self.set_queue,
            self.plan_cur,
            self.claim,
            self.leaders,
            self.ways,
            self.num_sets,
            _HASH,
            self.floor if lagged else None,
        )
        lay = ListLayout(layer, self.num_blocks, self.num_kv_heads, local, block_size)
        return pool_read(host_flat, self.slots, sel, row_slots, tables, seq_lens, lay, state, touch, defer, views)

    def begin_round(self) -> None:
        """Lagged reads: a step starts planning its lists, every layer's before its first sparse
        layer and some layer by layer: no plan of the step evicts a slot another one stamped,
        which a later layer still reads (a device op, no sync)."""
        self.floor.copy_(self.clock.view(1))

    def invalidate(self, blocks: torch.Tensor | list[int]) -> None:
        """Token blocks given to a new owner (their old contents are gone; a device tensor, or a
        list moved there): drop their head blocks of every layer and KV head, so the new owner
        never hits a stale slot. Between steps; one launch (kernels/pool_plan.py invalidate)."""
        if isinstance(blocks, list):
            if not blocks:
                return
            blocks = to_device(torch.tensor(blocks, dtype=torch.int64), self.resident.device)
        invalidate(
            blocks, self.resident, self.owner, self.last_use, self.num_layers, self.num_blocks, self.num_kv_heads
        )

    def check(self) -> None:
        """Accounting invariants (tests; syncs): owner and resident are inverse maps, no slot
        holds two blocks, the trash entries stay empty, the Triton plan's miss counters are back
        to zero."""
        assert not self.set_misses.any(), "a set's miss counter was not reset"
        parity = int(self.clock) % 2  # the next plan's leader count starts at zero (torch plans list none)
        assert self.leaders[parity].item() == 0, "the next plan's leader count was not reset"
        owner, resident = self.owner[: self.num_slots].cpu(), self.resident.cpu()
        assert self.owner[self.trash_slot].item() == -1 and resident[self.trash_key].item() == -1
        held = owner >= 0
        assert (resident[owner[held]] == torch.nonzero(held)[:, 0]).all(), "slot owner not resident there"
        res = torch.nonzero(resident >= 0)[:, 0]
        assert (owner[resident[res]] == res).all(), "resident block's slot owned by another block"
        assert len(set(resident[res].tolist())) == res.numel(), "two blocks in one slot"
        sets = self.set_of(owner[held])
        assert (torch.nonzero(held)[:, 0] // self.ways == sets).all(), "block outside its set"
