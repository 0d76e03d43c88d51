"""Shared by the Triton kernel tests: where they run and how results are compared.

Without CUDA the kernels run on the CPU under the Triton interpreter (conftest.py sets
TRITON_INTERPRET before any kernel module is imported); with CUDA the same tests run on the GPU.
"""
from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: its absence must fail, not skip)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The Triton 3.9 interpreter multiplies bf16 tl.dot operands as their raw uint16 bits
# (InterpreterBuilder.create_dot), so bf16 attention is checked on the GPU only.
ATTN_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def launched_kernels():
    """The project's `@triton.jit` functions (JITFunction, or InterpretedFunction under the interpreter): the
    kernels, and the device functions they call (never launched: their hooks never run)."""
    import importlib
    import pkgutil

    import sparseserve.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for fn in vars(module).values():
            if hasattr(fn, "add_pre_run_hook") and getattr(getattr(fn, "fn", None), "__module__", None) \
                    == module.__name__:
                yield fn


class Specializations:
    """Every launch of the project's Triton kernels while active, as Triton's compilation key sees it: per
    argument, the constexpr value, or what Triton specializes a runtime argument on (an integer equal to 1 or
    divisible by 16, a pointer's 16-byte alignment, the dtype), honouring each kernel's do_not_specialize and
    do_not_specialize_on_alignment; plus launch options passed with the call (num_warps, ...; the interpreter
    drops them). Two launches with different keys compile twice on a GPU. Through the kernels' pre-run hooks
    (JITFunction and the interpreter's InterpretedFunction both have them)."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple]] = []
        self._hooked: list[tuple[object, object]] = []

    def __enter__(self) -> Specializations:
        import inspect

        for fn in launched_kernels():
            hook = self._hook(fn, inspect.signature(fn.fn))
            fn.add_pre_run_hook(hook)
            self._hooked.append((fn, hook))
        return self

    def __exit__(self, *exc) -> None:
        for fn, hook in self._hooked:
            fn.pre_run_hooks.remove(hook)

    def _hook(self, fn, sig):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        opts = getattr(fn, "kwargs", None) or vars(fn)  # the interpreter keeps the decorator's options in kwargs
        params = list(sig.parameters)

        def named(entries) -> set[str]:  # by name or by position, as the decorator takes them
            return {params[e] if isinstance(e, int) else e for e in entries or ()}
        dns = named(opts.get("do_not_specialize"))
        dns_align = named(opts.get("do_not_specialize_on_alignment"))
        constexpr = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
        names = set(params)

        def hook(*args, **kwargs):
            bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
            key = tuple((n, repr(v)) if n in constexpr else
                        (n, native_specialize_impl(BaseBackend, v, False, n not in dns, n not in dns_align))
                        for n, v in bound.arguments.items())
            options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
            self.launches.append((f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}", key + options))
        return hook

    def keys(self, start: int = 0) -> set[tuple[str, tuple]]:
        return set(self.launches[start:])

    @staticmethod
    def differences(new: set, known: set) -> list[str]:
        """Each key of `new` not in `known`, told by the arguments in which it differs from the nearest known key
        of the same kernel."""
        lines = []
        for name, key in sorted(new - known, key=str):
            seen = [k for n, k in known if n == name]
            if not seen:
                lines.append(f"{name}: no launch before")
                continue
            nearest = min(([(a[0], a[1], b[1]) for a, b in zip(key, k) if a != b] for k in seen), key=len)
            lines.append(f"{name}: " + ", ".join(f"{n}={new_v} (before: {old_v})" for n, new_v, old_v in nearest))
        return lines
