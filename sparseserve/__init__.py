"""SparseServe: long-context LLM serving with dynamic sparse attention."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparseserve.config import EngineConfig
    from sparseserve.entrypoints.llm import LLM
    from sparseserve.outputs import CompletionOutput, RequestOutput
    from sparseserve.sampling_params import SamplingParams

# The public names load on first use, so light entry points do not import torch and
# transformers.
_EXPORTS = {
    "LLM": "sparseserve.entrypoints.llm",
    "SamplingParams": "sparseserve.sampling_params",
    "EngineConfig": "sparseserve.config",
    "RequestOutput": "sparseserve.outputs",
    "CompletionOutput": "sparseserve.outputs",
}
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparseserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
