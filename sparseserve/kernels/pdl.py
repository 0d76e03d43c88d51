"""Programmatic dependent launch (PDL, Hopper and later) for the decode layer's chain of short kernels.

A sparse decode layer runs several short kernels back to back (the K/V store with the metadata update,
scoring, selection, sparse attention and its merge), and every layer the small ops (kernels/small_ops.py).
Launched with PDL, a kernel's programs may start while its predecessor finishes (measured in
docs/sparse.md: about 1.5% of an 8B decode step).
`pdl_wait` blocks until the predecessor completed and its writes are visible; then the kernel lets its own
successor launch early. So when a kernel starts, every launch before its predecessor has completed (the
predecessor waited for them before letting it launch), and only the predecessor may still be running.
Before `pdl_wait` a kernel may therefore load what its predecessor does not write (the step's inputs:
sequence lengths, state slots, slot mappings, the reuse counters of earlier steps), so these loads and the
decisions on them overlap the predecessor's tail; it writes nothing and reads no activation there (q: a
direct caller may have just produced it). Every kernel of such a chain must call `pdl_wait` on every path
(also before an early return): a kernel that exits without waiting would let its successor run ahead of the
grid before it.
"""
from __future__ import annotations

import functools
import os

import torch
from sparseserve.kernels.dispatch import HAS_TRITON, tl, triton

if HAS_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# SPARSESERVE_PDL=0 turns it off (benchmarks compare; a driver without PDL in graphs).
ENABLED = os.environ.get("SPARSESERVE_PDL", "1") != "0"


@functools.lru_cache(maxsize=8)
def _capable(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def use_pdl(device: torch.device) -> bool:
    """Pass as the kernel's PDL constexpr and as `launch_pdl=` of its launch."""
    return ENABLED and _capable(device)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
