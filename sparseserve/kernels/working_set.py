"""Working-set counting (DESIGN.md principle 7): per state slot, how many distinct head blocks its lists asked
the HBM pool for over the last `window` decode steps, kept current on the device by one update per layer
(fixed shapes, no host sync: capturable). The component that owns the state: kvcache/working_set.py. On the
GPU the count runs inside the pool's read kernel, which computes the keys (`touch_keys`, kernels/pool_plan.py
pool_read); working_set_touch_ref is its reference.

State (int tensors on the device):
    stamp [num_keys + 1] int64   head block key -> clock * num_slots + slot of its last touch (-1: never; the
                                 last entry, the trash key's, is scratch)
    hist  [num_slots, window]    slot x (clock % window): the keys whose last touch was that slot at that step
    since [num_slots] int64      the clock when the slot was last handed to a sequence
    clock [1] int64              decode steps so far (`working_set_begin_step` advances it)

Every key in the window is counted once, in the bucket of its last touch, so the sum of a slot's buckets is
the union of what it touched over the last `window` steps (its working set). A touch at clock t moves the key
from the bucket of its previous touch (if that one is still in the window and was made after its slot was
last handed out) to the bucket (slot, t % window); at the start of a step the bucket of the step that leaves
the window is cleared for every slot. A head block shared by two sequences (a prefix-cache hit) counts for
the one that touched it last; two rows touching it in the same step both count it until it leaves the window.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from sparseserve.kernels.dispatch import tl, triton


def working_set_begin_step(hist: torch.Tensor, clock: torch.Tensor) -> None:
    """A decode step starts: the clock advances and the bucket of the step leaving the window is emptied."""
    clock.add_(1)
    hist.index_fill_(1, clock % hist.shape[1], 0)


def working_set_touch_ref(key: torch.Tensor, slots: torch.Tensor, stamp: torch.Tensor, hist: torch.Tensor,
                          since: torch.Tensor, clock: torch.Tensor) -> None:
    """One layer's lists touch their head blocks. key: int64 [B, K] head block keys of row b's list entries
    (the trash key stamp.numel() - 1: no entry); slots: int [B] each row's state slot (-1: none). Updates stamp
    and hist in place."""
    num_slots, window = hist.shape
    trash = stamp.numel() - 1
    slot = slots.long()[:, None].expand_as(key)
    valid = (key != trash) & (slot >= 0)
    prev = stamp[key]
    step0 = torch.div(prev, num_slots, rounding_mode="floor")
    owner = prev.remainder(num_slots)
    live = valid & (prev >= 0) & (clock - step0 < window) & (step0 > since[owner])
    flat = hist.view(-1)
    flat.index_add_(0, torch.where(live, owner * window + step0 % window, 0).reshape(-1),
                    -live.reshape(-1).to(hist.dtype))
    flat.index_add_(0, torch.where(valid, slot * window + clock % window, 0).reshape(-1),
                    valid.reshape(-1).to(hist.dtype))
    stamp.index_put_((torch.where(valid, key, trash).reshape(-1),), (clock * num_slots + slot).reshape(-1))


class TouchState(NamedTuple):
    """The working-set count's device state (kvcache/working_set.py owns it), for kernels that touch keys they
    compute themselves (kernels/pool_plan.py pool_read)."""
    stamp: torch.Tensor
    hist: torch.Tensor
    since: torch.Tensor
    clock: torch.Tensor


@triton.jit
def touch_keys(key, valid, prev, slot, t, stamp_ptr, hist_ptr, since_ptr, NUM_SLOTS: tl.constexpr,
               WINDOW: tl.constexpr):
    """The touch of the valid keys of one row (state slot `slot`) at clock t, given their stamps (prev =
    stamp[key], -1 where not valid: the caller loads them beside its own loads): each moves out of the bucket of
    its previous touch (while that one is in the window and after its slot was handed out); returns how many
    the row's bucket (slot, t % WINDOW) gains, for the caller's one atomic add."""
    step0 = tl.where(prev >= 0, prev // NUM_SLOTS, 0)
    owner = tl.where(prev >= 0, prev % NUM_SLOTS, 0)
    since = tl.load(since_ptr + owner, mask=valid, other=0)
    live = valid & (prev >= 0) & (t - step0 < WINDOW) & (step0 > since)
    tl.atomic_add(hist_ptr + owner * WINDOW + step0 % WINDOW, tl.full(key.shape, -1, tl.int32), mask=live)
    tl.store(stamp_ptr + key, t * NUM_SLOTS + slot, mask=valid)
    return tl.sum(valid.to(tl.int32), axis=0)
