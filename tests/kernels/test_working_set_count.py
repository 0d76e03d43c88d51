"""Working-set counting (kernels/working_set.py): the per-slot counts equal a plain-Python recount of the
selections over the window (random selections, slots handed to new sequences, head blocks passing from one
sequence to another). The Triton path counts inside the pool's read kernel: tests/kernels/test_pool_plan.py."""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve.kernels.working_set import working_set_begin_step, working_set_touch_ref
from tests.kernel_utils import DEVICE


def state(num_keys: int, num_slots: int, window: int, device=DEVICE):
    return (
        torch.full((num_keys + 1,), -1, dtype=torch.int64, device=device),
        torch.zeros(num_slots, window, dtype=torch.int32, device=device),
        torch.zeros(num_slots, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    )


def counts(hist: torch.Tensor) -> list[int]:
    return hist.sum(1).tolist()


def random_rows(
    rng: random.Random,
    slots: list[int],
    pools: dict[int, list[int]],
    width: int,
    trash: int,
    shared: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's lists: row b (slot slots[b]) takes distinct keys of its own key range (and maybe some of the
    shared keys, each taken by one row at most), padded with the trash key."""
    free = list(shared or [])
    rng.shuffle(free)
    rows = []
    for s in slots:
        keys = rng.sample(pools[s], rng.randint(0, width))
        if free and rng.random() < 0.5:
            keys = keys[: width - 1] + [free.pop()]
        rows.append(keys + [trash] * (width - len(keys)))
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_equal_a_recount_of_the_window(seed):
    """Several layers a step, random lists per slot (each slot its own head blocks, as each sequence its own
    token blocks): each slot's count is the size of the union of its keys over the last `window` steps; a slot
    handed to a new sequence starts from nothing."""
    rng = random.Random(seed)
    num_slots, window, layers, width = 5, rng.choice([1, 3, 12]), 3, 6
    per_slot = 40
    num_keys = num_slots * per_slot * 4  # owners change: each slot draws from a fresh range when reassigned
    stamp, hist, since, clock = state(num_keys, num_slots, window, torch.device("cpu"))
    trash = num_keys
    gen = {s: 0 for s in range(num_slots)}  # generation of each slot's sequence
    history: list[dict[int, set[int]]] = []  # per step: slot -> keys touched
    born = {s: 0 for s in range(num_slots)}  # step a slot's sequence started
    for step in range(1, 40):
        if step > 1 and rng.random() < 0.2:  # between steps a slot is handed to a new sequence
            s = rng.randrange(num_slots)
            gen[s] = (gen[s] + 1) % 4
            born[s] = step
            hist[s] = 0
            since[s] = clock
        pools = {
            s: list(range((gen[s] * num_slots + s) * per_slot, (gen[s] * num_slots + s + 1) * per_slot))
            for s in range(num_slots)
        }
        active = sorted(rng.sample(range(num_slots), rng.randint(1, num_slots)))
        working_set_begin_step(hist, clock)
        touched: dict[int, set[int]] = {}
        for _ in range(layers):
            key, slots = random_rows(rng, active, pools, width, trash)
            working_set_touch_ref(key, slots, stamp, hist, since, clock)
            for s, row in zip(active, key.tolist()):
                touched.setdefault(s, set()).update(k for k in row if k != trash)
        history.append(touched)
        for s in range(num_slots):
            union = set()
            for t in range(max(step - window + 1, born[s]), step + 1):
                if t >= 1:
                    union |= history[t - 1].get(s, set())
            assert counts(hist)[s] == len(union), (step, s)


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_head_blocks_count_for_their_last_toucher(seed):
    """A head block two sequences read (a shared prefix) belongs to the working set of the one that touched it
    last (never two in one step here), so the counts sum to the distinct blocks touched in the window."""
    rng = random.Random(seed)
    num_slots, window, width = 3, 4, 5
    shared = list(range(100, 110))
    pools = {s: list(range(s * 20, s * 20 + 20)) for s in range(num_slots)}
    stamp, hist, since, clock = state(200, num_slots, window, torch.device("cpu"))
    last: dict[int, tuple[int, int]] = {}  # key -> (step, slot)
    for step in range(1, 30):
        working_set_begin_step(hist, clock)
        key, slots = random_rows(rng, list(range(num_slots)), pools, width, 200, shared)
        working_set_touch_ref(key, slots, stamp, hist, since, clock)
        for s, row in zip(range(num_slots), key.tolist()):
            last.update({k: (step, s) for k in row if k != 200})
        expect = [sum(1 for t, o in last.values() if o == s and t > step - window) for s in range(num_slots)]
        assert counts(hist) == expect
