"""Programmatic dependent launch (PDL, compute capability 9+) for a decode layer's short kernels.

With PDL a kernel's programs may start while its predecessor finishes (gain: docs/sparse.md).
`pdl_wait` blocks until the predecessor completed, then lets this kernel's successor launch, so
only the predecessor can still be running when a kernel starts.
Before `pdl_wait` a kernel may load only what its predecessor does not write (the step's inputs:
sequence lengths, state slots, slot mappings, earlier steps' reuse counters); it writes nothing
and reads no activation there. The trap: every kernel of the chain must call `pdl_wait` on every
path, early returns included, or its successor runs ahead of the grid before it.
Work beside the step's chain (a side stream) launches without PDL (`beside_the_step`): its early
programs would wait on the SMs the chain's kernels want (docs/offload.md, "Side-stream work").
"""

from __future__ import annotations

import contextlib
import contextvars
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
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


_BESIDE = contextvars.ContextVar("sparseserve_pdl_beside", default=False)


@contextlib.contextmanager
def beside_the_step():
    """Kernels launched inside run without PDL (work on a side stream, beside the step's chain)."""
    token = _BESIDE.set(True)
    try:
        yield
    finally:
        _BESIDE.reset(token)


def use_pdl(device: torch.device) -> bool:
    """Pass as the kernel's PDL constexpr and as `launch_pdl=` of its launch."""
    return ENABLED and not _BESIDE.get() and _capable(device)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
