"""Working-set counting: per state slot, the distinct head blocks its lists asked the HBM pool
for over the last `window` decode steps, updated on the device once per layer (capturable;
docs/architecture.md, principles 2 and 7). State owner: kvcache/working_set.py. On the GPU the
count runs inside kernels/pool_plan.py pool_read (`touch_keys`); working_set_touch_ref is its
reference.

State (int tensors on the device):
    stamp [num_keys + 1] int64  key -> clock * num_slots + slot of its last touch (-1: never;
                                the last entry, the trash key's, is scratch)
    hist  [num_slots, window]   (slot, clock % window): keys last touched by slot at that step
    since [num_slots] int64     the clock when the slot was last handed to a sequence
    clock [1] int64             decode steps so far (`working_set_begin_step` advances it)

Each key in the window counts once, in the bucket of its last touch, so a slot's buckets sum to
its working set. A block shared by two sequences counts for the last one to touch it (two rows
touching it in one step both count it until it leaves the window). See docs/working_set.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparseserve.kernels.dispatch import tl, triton


def working_set_begin_step(hist: torch.Tensor, clock: torch.Tensor) -> None:
    """A decode step starts: the clock advances, the bucket leaving the window is emptied."""
    clock.add_(1)
    hist.index_fill_(1, clock % hist.shape[1], 0)


def working_set_touch_ref(
    key: torch.Tensor,
    slots: torch.Tensor,
    stamp: torch.Tensor,
    hist: torch.Tensor,
    since: torch.Tensor,
    clock: torch.Tensor,
) -> None:
    """One layer's lists touch their head blocks; updates stamp and hist in place.
    key: int64 [B, K] head-block keys of row b's entries (stamp.numel() - 1: no entry);
    slots: int [B] each row's state slot (-1: none)."""
    num_slots, window = hist.shape
    trash = stamp.numel() - 1
    slot = slots.long()[:, None].expand_as(key)
    valid = (key != trash) & (slot >= 0)
    prev = stamp[key]
    step0 = torch.div(prev, num_slots, rounding_mode="floor")
    owner = prev.remainder(num_slots)
    live = valid & (prev >= 0) & (clock - step0 < window) & (step0 > since[owner])
    flat = hist.view(-1)
    flat.index_add_(
        0, torch.where(live, owner * window + step0 % window, 0).reshape(-1), -live.reshape(-1).to(hist.dtype)
    )
    flat.index_add_(
        0, torch.where(valid, slot * window + clock % window, 0).reshape(-1), valid.reshape(-1).to(hist.dtype)
    )
    stamp.index_put_((torch.where(valid, key, trash).reshape(-1),), (clock * num_slots + slot).reshape(-1))


class TouchState(NamedTuple):
    """The count's device state (owner: kvcache/working_set.py), for kernels that touch keys
    they compute themselves (kernels/pool_plan.py pool_read)."""

    stamp: torch.Tensor
    hist: torch.Tensor
    since: torch.Tensor
    clock: torch.Tensor


@triton.jit
def touch_keys(
    key, valid, prev, slot, t, stamp_ptr, hist_ptr, since_ptr, NUM_SLOTS: tl.constexpr, WINDOW: tl.constexpr
):
    """One row's valid keys touched at clock t; prev = stamp[key] (-1 where not valid), loaded by
    the caller. Moves each key out of its previous bucket (if that touch is in the window and
    newer than its slot's `since`); returns how many the row's bucket
    (slot, t % WINDOW) gains, for the caller's one atomic add. The trap: most keys leave one bucket, the
    row's own of one step back; they leave it in one atomic (an atomic a key on one address serializes
    the plan's programs)."""
    step0 = tl.where(prev >= 0, prev // NUM_SLOTS, 0)
    owner = tl.where(prev >= 0, prev % NUM_SLOTS, 0)
    since = tl.load(since_ptr + owner, mask=valid, other=0)
    live = valid & (prev >= 0) & (t - step0 < WINDOW) & (step0 > since)
    bucket = owner * WINDOW + step0 % WINDOW
    last = slot * WINDOW + (t + WINDOW - 1) % WINDOW
    same = live & (bucket == last)
    leaving = tl.sum(same.to(tl.int32), axis=0)
    tl.atomic_add(hist_ptr + last, -leaving, mask=leaving > 0)
    tl.atomic_add(hist_ptr + bucket, tl.full(key.shape, -1, tl.int32), mask=live & ~same)
    tl.store(stamp_ptr + key, t * NUM_SLOTS + slot, mask=valid)
    return tl.sum(valid.to(tl.int32), axis=0)
