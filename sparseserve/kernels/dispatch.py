"""The one switch between an op's torch reference and its Triton kernel, and Triton itself where installed.

Every `kernels/<op>.py` holds `<op>_ref` (plain torch: the CPU path, and what the kernel is tested against),
`<op>_triton` (the launch of its Triton kernels) and the dispatcher `<op>` that calls `use_triton(x)` on its
first tensor: Triton for CUDA tensors, the reference otherwise. `forced("torch" | "triton")` runs a block on
one path (Triton on CPU tensors runs under TRITON_INTERPRET=1): tests force either, and the engine runs its
steps under its `attention_backend` option. The choice is a context variable, so it holds for the thread
(or task) that set it and never leaks into another engine's thread.

Triton is an optional dependency (the `gpu` extra): a CPU install without it still imports every kernel
module, whose `@triton.jit` functions then stay plain, never-called Python functions.
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
        """Stands in for `triton` and `triton.language`: decorators return the function unchanged, any
        attribute (tl.constexpr, tl.float32, ...) is another stand-in; nothing of it ever runs."""

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
    """auto (Triton on CUDA tensors), torch (references everywhere) or triton (kernels everywhere: CPU
    tensors need TRITON_INTERPRET=1)."""
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
