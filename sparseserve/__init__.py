"""SparseServe: long-context LLM serving with dynamic sparse attention."""
from sparseserve.config import EngineConfig
from sparseserve.entrypoints.llm import LLM
from sparseserve.outputs import CompletionOutput, RequestOutput
from sparseserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
