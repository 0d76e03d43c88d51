"""Shared by the Triton kernel tests: where they run and how results are compared.

Without CUDA the kernels run on the CPU under the Triton interpreter (conftest.py sets
TRITON_INTERPRET before any kernel module is imported); with CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import dataclasses
import inspect

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
            if (
                hasattr(fn, "add_pre_run_hook")
                and getattr(getattr(fn, "fn", None), "__module__", None) == module.__name__
            ):
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
            key = tuple(
                (n, repr(v))
                if n in constexpr
                else (n, native_specialize_impl(BaseBackend, v, False, n not in dns, n not in dns_align))
                for n, v in bound.arguments.items()
            )
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


class ReferenceLaunches:
    """Under Triton's interpreter, while active: an op with a torch reference (`kernels/<op>.py`: the dispatcher
    `<op>` and `<op>_ref`) first runs its Triton path with every kernel launch dry (the pre-run hooks see the
    launch, so Specializations records the key a GPU would compile; the program is not interpreted), then returns
    its reference's result (the dispatcher under `forced("torch")`). A launch costs milliseconds instead of the
    interpreter's tenths of a second. Kernels launched otherwise still run interpreted. Tensors the Triton path
    changes in place outside its kernels (statistics) are put back before the reference runs."""

    SNAPSHOT_NUMEL = 1 << 20  # larger: KV caches and host stores, which only kernels write

    def __init__(self) -> None:
        self._dry = False
        self._patched: list[tuple[object, str, object]] = []

    def __enter__(self) -> ReferenceLaunches:
        import importlib
        import pkgutil
        import sys

        from triton.runtime import interpreter

        import sparseserve.kernels as kernels

        if ON_GPU:
            raise RuntimeError("ReferenceLaunches is for Triton's interpreter (CPU)")
        real_call = interpreter.GridExecutor.__call__
        owner = self

        def call(executor, *args, **kwargs):
            if not owner._dry:
                return real_call(executor, *args, **kwargs)
            spec = inspect.getfullargspec(executor.fn)  # the interpreter passes only these to the hooks
            kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
            for hook in executor.pre_run_hooks:
                hook(*args, **kwargs)

        self._patch(interpreter.GridExecutor, "__call__", call)
        ops = {}
        for info in pkgutil.iter_modules(kernels.__path__):
            module = importlib.import_module(f"{kernels.__name__}.{info.name}")
            for name, fn in vars(module).items():
                if (
                    inspect.isfunction(fn)
                    and fn.__module__ == module.__name__
                    and inspect.isfunction(getattr(module, name + "_ref", None))
                ):
                    ops[fn] = self._reference_op(fn)
        for module in list(sys.modules.values()):  # the dispatchers wherever they were imported
            if getattr(module, "__name__", "").startswith("sparseserve."):
                for name, value in list(vars(module).items()):
                    if inspect.isfunction(value) and value in ops:
                        self._patch(module, name, ops[value])
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old in reversed(self._patched):
            setattr(obj, name, old)
        self._patched.clear()

    def _patch(self, obj: object, name: str, new: object) -> None:
        self._patched.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    def _reference_op(self, dispatcher):
        from sparseserve.kernels.dispatch import forced

        def op(*args, **kwargs):
            if self._dry:  # called from another op's dry pass: its launches are dry already
                return dispatcher(*args, **kwargs)
            # (inference tensors keep no version counter: the small ones are compared)
            saved = [(t, t.clone()) for t in _tensors_of((args, kwargs)) if t.numel() <= self.SNAPSHOT_NUMEL]
            self._dry = True
            try:
                with forced("triton"):
                    dispatcher(*args, **kwargs)
            finally:
                self._dry = False
            for t, before in saved:
                if not torch.equal(t, before):
                    t.copy_(before)
            with forced("torch"):
                return dispatcher(*args, **kwargs)

        return op


def _tensors_of(value, depth: int = 0) -> list:
    """The tensors in an op's arguments: in tuples, lists, dicts and the fields of state objects (PoolState)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        items = vars(value).values()
    else:
        return []
    seen, out = set(), []
    for item in items:
        for t in _tensors_of(item, depth + 1):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out
