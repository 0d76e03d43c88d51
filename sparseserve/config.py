"""Engine configuration: frozen dataclasses, one field per LLM keyword argument and CLI flag.

Every field of the sub-configs is also a keyword of `LLM(...)` and a `--flag-with-dashes` of the CLI;
`EngineConfig.from_kwargs` routes flat keywords to the sub-config that owns them, so a new option
is added in exactly one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from sparseserve.registry import SELECTION_POLICIES


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata={"help": "Maximum number of sequences in one step."})
    max_num_batched_tokens: int = field(
        default=8192, metadata={"help": "Token budget of one engine step (prefill chunks + decodes)."})
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "Split prompts longer than the step's token budget into chunks."})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=32, metadata={"help": "Tokens per KV token block."})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Fraction of GPU memory the engine may use (weights, activations, KV)."})
    kv_cache_memory: int | None = field(
        default=None, metadata={"help": "Bytes of KV cache; overrides gpu_memory_utilization sizing."})
    num_gpu_blocks_override: int | None = field(
        default=None, metadata={"help": "Exact number of KV token blocks (testing, capacity experiments)."})

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata={
        "help": "Hugging Face model directory, GGUF file or known name (default: the embedded model)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer directory (default: the model's)."})
    dtype: str = field(default="auto", metadata={
        "help": "auto (the checkpoint's), float32, bfloat16 or float16.",
        "choices": ["auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"]})
    device: str = field(default="auto", metadata={"help": "auto (CUDA when present), cuda or cpu.",
                                                   "choices": ["auto", "cuda", "cpu"]})
    max_model_len: int | None = field(
        default=None, metadata={"help": "Longest prompt + output in tokens (default: the model's)."})
    seed: int = field(default=0, metadata={"help": "Seed of the engine's random state."})
    load_format: str = field(default="auto", metadata={
        "help": "auto (the directory's safetensors) or dummy (random weights, for benchmarks).",
        "choices": ["auto", "dummy"]})
    enforce_eager: bool = field(default=False, metadata={"help": "Disable CUDA graphs."})
    attention_backend: str = field(default="auto", metadata={
        "help": "Kernels: auto (Triton on CUDA, the torch references otherwise), triton or torch (CUDA graphs "
                "off).", "choices": ["auto", "triton", "torch"]})


@dataclass(frozen=True)
class SparseConfig:
    """Dynamic sparse decode attention (DESIGN.md principle 6). Prefill always runs dense."""
    sparse_policy: str = field(default="dense", metadata={
        "help": "Decode attention: dense, or a registered selection policy: topk (fixed token budget), topp "
                "(adaptive budget, mass p)."})
    sparse_budget: int = field(default=2048, metadata={
        "help": "Tokens each (sequence, KV head) attends per decode step, sink and local window included "
                "(topk); topp: the candidates it prunes, at most this many tokens. Shorter contexts run dense."})
    sparse_top_p: float = field(default=0.95, metadata={
        "help": "topp: the softmax mass the kept blocks must reach, estimated from q.k over the candidate "
                "blocks (the best sparse_budget tokens by their key bounds)."})
    sparse_topp_heads: str = field(default="mean", metadata={
        "help": "topp: whose mass must reach p: the mean of a KV group's query heads, or each head (union).",
        "choices": ["mean", "each"]})
    sparse_reuse: int = field(default=1, metadata={
        "help": "Recompute a sequence's block selection every this many decode steps (1: every step)."})
    sparse_lag: int = field(default=0, metadata={
        "help": "1 (topk): a decode step attends the blocks selected from the previous step's query, so scoring "
                "and selection run beside the attention (a second CUDA stream) instead of before it; a prefill "
                "selects from its last token for the first decode. 0: each step selects from its own query.",
        "choices": [0, 1]})
    sparse_dense_layers: int = field(default=2, metadata={"help": "The first N layers always attend densely."})
    sparse_sink_blocks: int = field(default=1, metadata={"help": "Leading token blocks always attended."})
    sparse_local_blocks: int = field(default=4, metadata={
        "help": "Most recent token blocks always attended (the local window, >= 1)."})
    sparse_dense_context: int | None = field(default=None, metadata={
        "help": "Steps whose longest context is at most this many tokens run dense (default: the budget); "
                "0 sends every decode through scoring, selection and the sparse kernel (testing)."})
    streaming_heads: str | None = field(default=None, metadata={
        "help": "JSON file of (layer, KV head) pairs that only see sink + local window "
                "(python -m sparseserve.bench.calibrate proposes one)."})
    logical_page_size: int | None = field(default=None, metadata={
        "help": "Tokens per key-metadata page inside a block (hierarchical paging; default: block_size)."})

    def __post_init__(self) -> None:
        if self.sparse_policy != "dense" and self.sparse_policy not in SELECTION_POLICIES:
            raise ValueError(f"sparse_policy must be dense or one of {', '.join(SELECTION_POLICIES.names())}, "
                             f"got {self.sparse_policy!r}")
        if self.sparse_budget < 1:
            raise ValueError(f"sparse_budget must be >= 1, got {self.sparse_budget}")
        if not 0.0 < self.sparse_top_p <= 1.0:
            raise ValueError(f"sparse_top_p must be in (0, 1], got {self.sparse_top_p}")
        if self.sparse_topp_heads not in ("mean", "each"):
            raise ValueError(f"sparse_topp_heads must be mean or each, got {self.sparse_topp_heads!r}")
        if self.sparse_reuse < 1:
            raise ValueError(f"sparse_reuse must be >= 1, got {self.sparse_reuse}")
        if self.sparse_lag not in (0, 1):
            raise ValueError(f"sparse_lag must be 0 or 1, got {self.sparse_lag}")
        if self.sparse_lag and self.enabled and not SELECTION_POLICIES.get(self.sparse_policy).supports_lag:
            raise ValueError(f"sparse_lag=1 does not work with sparse_policy={self.sparse_policy}: its lists fit "
                             f"the query that selected them, not the next one")
        if self.sparse_dense_layers < 0 or self.sparse_sink_blocks < 0:
            raise ValueError("sparse_dense_layers and sparse_sink_blocks must be >= 0")
        if self.sparse_local_blocks < 1:
            raise ValueError(f"sparse_local_blocks must be >= 1 (the decode token's own block), "
                             f"got {self.sparse_local_blocks}")
        if self.sparse_dense_context is not None and self.sparse_dense_context < 0:
            raise ValueError(f"sparse_dense_context must be >= 0, got {self.sparse_dense_context}")
        lps = self.logical_page_size
        if lps is not None and (lps < 1 or lps & (lps - 1)):
            raise ValueError(f"logical_page_size must be a power of two, got {lps}")

    @property
    def enabled(self) -> bool:
        return self.sparse_policy != "dense"


@dataclass(frozen=True)
class OffloadConfig:
    """Hierarchical KV cache (DESIGN.md principles 4 and 5): every full head block written through to a
    host store; sparse decode reads the blocks it selects through a pool of HBM head-block slots."""
    kv_offload: bool = field(default=False, metadata={
        "help": "Keep every full KV head block in a (pinned) host store and cache the selected ones in an "
                "HBM slot pool (needs a sparse policy)."})
    host_kv_memory: int | None = field(default=None, metadata={
        "help": "Bytes of the host KV store, which holds every token block (default: max_num_seqs sequences of "
                "max_model_len, at most half the host's available memory); must fit in the host's available "
                "memory. The device then holds only the working set (num_gpu_blocks_override: its blocks)."})
    hbm_cache_blocks: int | None = field(default=None, metadata={
        "help": "Head-block slots of the HBM pool, shared by all layers and KV heads (default: one decode "
                "step's selections of max_num_seqs sequences in every layer, at most half the device KV memory "
                "left after key metadata and dense layers)."})

    def __post_init__(self) -> None:
        if self.host_kv_memory is not None and self.host_kv_memory < 1:
            raise ValueError(f"host_kv_memory must be >= 1 byte, got {self.host_kv_memory}")
        if self.hbm_cache_blocks is not None and self.hbm_cache_blocks < 1:
            raise ValueError(f"hbm_cache_blocks must be >= 1, got {self.hbm_cache_blocks}")
        if self.kv_offload and self.host_kv_memory is not None:
            available = available_host_memory()
            if available is not None and self.host_kv_memory > available:
                raise ValueError(f"host_kv_memory={self.host_kv_memory} bytes exceeds the host's available "
                                 f"memory ({available} bytes): lower it")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (docs/tensor_parallel.md): the model's heads, MLP and vocabulary split over ranks."""
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "GPUs (ranks) the model is split over: one worker process per rank, NCCL on CUDA, gloo on CPU; "
                "started by torchrun when its environment is set (multi-host), otherwise spawned by rank 0. "
                "1: no process group."})

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_SUBCONFIGS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
               "sparse_config": SparseConfig, "offload_config": OffloadConfig,
               "parallel_config": ParallelConfig}


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    sparse_config: SparseConfig = field(default_factory=SparseConfig)
    offload_config: OffloadConfig = field(default_factory=OffloadConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        sp, bs = self.sparse_config, self.cache_config.block_size
        if self.offload_config.kv_offload and not sp.enabled:
            raise ValueError("kv_offload needs a sparse decode policy (sparse_policy='topk' or 'topp'): with "
                             "dense attention every block is read every step, so an HBM cache cannot help")
        if self.offload_config.kv_offload and sp.sparse_lag:
            raise ValueError("sparse_lag=1 does not work with kv_offload yet: the offload path loads each "
                             "step's own selection before its attention")
        if sp.logical_page_size is not None and sp.logical_page_size > bs:
            raise ValueError(f"logical_page_size {sp.logical_page_size} exceeds block_size {bs}")
        if sp.enabled and sp.sparse_budget // bs < sp.sparse_sink_blocks + sp.sparse_local_blocks + 1:
            raise ValueError(f"sparse_budget {sp.sparse_budget} holds {sp.sparse_budget // bs} blocks of {bs} "
                             f"tokens: need more than sink + local = "
                             f"{sp.sparse_sink_blocks + sp.sparse_local_blocks}")

    @staticmethod
    def arg_fields() -> list[dataclasses.Field]:
        """All user-facing options, in CLI order."""
        return [f for cls in _SUBCONFIGS.values() for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SUBCONFIGS}
        for key, value in kwargs.items():
            owner = next((n for n, c in _SUBCONFIGS.items() if key in {f.name for f in fields(c)}), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            parts[owner][key] = value
        return cls(**{name: _SUBCONFIGS[name](**vals) for name, vals in parts.items()})
