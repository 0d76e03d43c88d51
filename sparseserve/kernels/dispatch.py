"""The one switch between an op's torch reference and its Triton kernel.

Every `kernels/<op>.py` holds `<op>_ref` (torch: the CPU path and the kernel's oracle),
`<op>_triton` (the launch) and the dispatcher `<op>`, which asks `use_triton` of its first
tensor. `forced(impl)` runs a block on one path; the choice is a context variable, so it
never leaks into another thread or task. Without Triton (the `gpu` extra) every kernel
module still imports: its `@triton.jit` functions stay plain, never-called functions.
See docs/architecture.md, principle 1.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU install: the references run
    HAS_TRITON = False

    class _Missing:
        """Stands in for `triton` and `triton.language`: decorators return the function
        unchanged, any attribute is another stand-in; nothing of it ever runs."""

        def __getattr__(self, name: str) -> "_Missing":
            return _Missing()

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return self

    triton = tl = _Missing()

IMPLS = ("auto", "torch", "triton")
_impl: contextvars.ContextVar[str] = contextvars.ContextVar("sparseserve_kernel_impl", default="auto")


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor x runs its Triton kernel."""
    impl = _impl.get()
    if impl == "auto":
        return x.is_cuda and HAS_TRITON
    return impl == "triton"


def check_impl(impl: str) -> str:
    """auto (Triton on CUDA tensors), torch or triton (CPU tensors need TRITON_INTERPRET=1)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r}: choose {', '.join(IMPLS)}")
    if impl == "triton" and not HAS_TRITON:
        raise ValueError("Triton is not installed (pip install 'sparseserve[gpu]'): use the torch kernels")
    return impl


@contextlib.contextmanager
def forced(impl: str) -> Iterator[None]:
    """Runs the block with every op on one path (check_impl's choices)."""
    token = _impl.set(check_impl(impl))
    try:
        yield
    finally:
        _impl.reset(token)
