"""Named registries of components: a component is one class and one `@REGISTRY.register("name")`
line; the configuration validates names against the registry.

A registry names the module that registers its built-ins, imported on the first lookup, so
config.py can validate names without importing the layers above (docs/architecture.md,
principle 9).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, builtins: str | None = None) -> None:
        self.kind = kind
        self._builtins = builtins
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def _load(self) -> None:
        if self._builtins is not None:
            module, self._builtins = self._builtins, None
            importlib.import_module(module)

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries

    def get(self, name: str) -> T:
        self._load()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}: registered are {', '.join(self.names())}")
        return self._entries[name]


# Sparse decode's block-selection policies (attention/policies.py); "dense" is no policy at all.
SELECTION_POLICIES: Registry[type] = Registry("sparse_policy", builtins="sparseserve.attention.policies")
