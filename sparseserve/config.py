"""Engine configuration: frozen dataclasses, one field per LLM keyword argument and CLI flag.

Every field of the sub-configs is also a keyword of `LLM(...)` and a `--flag-with-dashes` of the CLI;
`EngineConfig.from_kwargs` routes flat keywords to the sub-config that owns them, so a new option
is added in exactly one place.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from sparseserve.registry import SELECTION_POLICIES

# long_prefill_token_threshold's default on CPU (docs/scheduler.md says why).
CPU_LONG_PREFILL_TOKENS = 512
# What the options a sparse policy may set (SelectionPolicy.defaults) take where neither it nor the user does.
POLICY_FALLBACKS: dict[str, Any] = {
    "sparse_budget": 2048,
    "sparse_top_p": 0.95,
    "sparse_topp_flat_hold": 0,
    "block_size": 32,
}


def policy_default(policy: str, name: str) -> Any:
    """The default of option `name` under sparse_policy `policy` (dense: POLICY_FALLBACKS)."""
    own = SELECTION_POLICIES.get(policy).defaults if policy in SELECTION_POLICIES else {}
    return own.get(name, POLICY_FALLBACKS[name])


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata={"help": "Maximum number of sequences in one step."})
    max_num_batched_tokens: int = field(
        default=8192, metadata={"help": "Token budget of one engine step (prefill chunks + decodes).", "size": True}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "Split prompts longer than the step's token budget into chunks."}
    )
    init_new_token_ratio: float = field(
        default=0.7,
        metadata={
            "help": "Admission estimate: the fraction of its remaining max_tokens a running request is expected "
            "to still generate (0: admit whatever fits its prompt now)."
        },
    )
    min_new_token_ratio: float = field(
        default=0.1,
        metadata={
            "help": "Admission: the lowest the expected fraction decays to while nothing is preempted (a preemption "
            "raises it halfway to 1)."
        },
    )
    new_token_ratio_decay_steps: int = field(
        default=600,
        metadata={
            "help": "Admission: engine steps over which the expected fraction decays from its initial value to the "
            "minimum."
        },
    )
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata={
            "size": True,
            "help": "A prompt is prefilled at most this many tokens a step, as in vLLM "
            "(0: no limit; default: 512 on CPU, no limit on CUDA).",
        },
    )
    max_long_partial_prefills: int = field(
        default=1,
        metadata={
            "help": "At most this many prompts longer than long_prefill_token_threshold are prefilled a step, "
            "the oldest first."
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": "Schedule and prepare the next step while the device runs the current one (stop checks run "
            "one step late; greedy and seeded outputs are unchanged; default: on with kv_offload on a CUDA device, "
            "off otherwise: on CPU the step is the host's own work)."
        },
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError(
                f"need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                f"{self.min_new_token_ratio} and {self.init_new_token_ratio}"
            )
        if self.new_token_ratio_decay_steps < 1:
            raise ValueError(f"new_token_ratio_decay_steps must be >= 1, got {self.new_token_ratio_decay_steps}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: no limit), got {self.long_prefill_token_threshold}"
            )
        if self.max_long_partial_prefills < 1:
            raise ValueError(f"max_long_partial_prefills must be >= 1, got {self.max_long_partial_prefills}")

    def prefill_token_threshold(self, device_type: str) -> int:
        """long_prefill_token_threshold resolved for the device (0: no limit; docs/scheduler.md)."""
        if not self.enable_chunked_prefill:  # an unchunked prompt cannot be split: a limit would starve it
            return 0
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return CPU_LONG_PREFILL_TOKENS if device_type == "cpu" else 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per KV token block (default: 32; 16 with sparse_policy topp)."}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Fraction of GPU memory the engine may use (weights, activations, KV)."}
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata={
            "help": "Bytes of KV cache, e.g. 2GiB (default: sized by gpu_memory_utilization).",
            "size": True,
            "flag": "kv_cache_memory_bytes",
        },
    )  # vLLM's name first
    num_gpu_blocks_override: int | None = field(
        default=None,
        metadata={
            "help": "Exact number of KV token blocks, for tests and capacity experiments (default: sized from memory)."
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "Automatic prefix caching: full KV blocks are shared by the hash of their tokens and "
            "evicted least recently used."
        },
    )
    host_prefix_cache_memory: int | None = field(
        default=None,
        metadata={
            "size": True,
            "help": "Bytes of pinned host memory keeping prefix-cache blocks for copy-back instead of recompute, "
            "without KV offload (default: none).",
        },
    )

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.host_prefix_cache_memory is not None:
            if self.host_prefix_cache_memory < 1:
                raise ValueError(f"host_prefix_cache_memory must be >= 1 byte, got {self.host_prefix_cache_memory}")
            if not self.enable_prefix_caching:
                raise ValueError(
                    "host_prefix_cache_memory is the prefix cache's host tier: it needs enable_prefix_caching"
                )
            available = available_host_memory()
            if available is not None and self.host_prefix_cache_memory > available:
                raise ValueError(
                    f"host_prefix_cache_memory={self.host_prefix_cache_memory} bytes exceeds the "
                    f"host's available memory ({available} bytes): lower it"
                )


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None,
        metadata={"help": "Hugging Face model directory, GGUF file or known name (default: the embedded model)."},
    )
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer directory (default: the model's)."})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (the checkpoint's), float32, bfloat16 or float16.",
            "choices": ["auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"],
        },
    )
    device: str = field(
        default="auto", metadata={"help": "auto (CUDA when present), cuda or cpu.", "choices": ["auto", "cuda", "cpu"]}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "Longest prompt + output in tokens, e.g. 32k or 32K (default: the model's).", "size": True},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the engine's random state."})
    load_format: str = field(
        default="auto",
        metadata={
            "help": "auto (the directory's safetensors) or dummy (random weights, for benchmarks).",
            "choices": ["auto", "dummy"],
        },
    )
    enforce_eager: bool = field(default=False, metadata={"help": "Disable CUDA graphs."})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "Kernels: auto (Triton on CUDA, the torch references otherwise), triton or torch (CUDA graphs "
            "off).",
            "choices": ["auto", "triton", "torch"],
        },
    )


@dataclass(frozen=True)
class SparseConfig:
    """Dynamic sparse attention: sparse decode (docs/architecture.md, principle 6) and SALE's
    sparse prefill (attention/prefill.py)."""

    sparse_policy: str = field(
        default="dense",
        metadata={
            "help": "Decode attention: dense, or a registered selection policy: topk (fixed token budget), topp "
            "(adaptive budget, mass p)."
        },
    )
    sparse_budget: int | None = field(
        default=None,
        metadata={
            "size": True,
            "help": "Tokens each (sequence, KV head) attends per decode step, sink and local window included "
            "(topp: the candidates it prunes; default: 2048, topp 4096).",
        },
    )
    sparse_top_p: float | None = field(
        default=None,
        metadata={
            "help": "topp: the softmax mass the kept blocks must reach, estimated on the candidates' keys "
            "(default: 0.99)."
        },
    )
    sparse_topp_heads: str = field(
        default="mean",
        metadata={
            "help": "topp: whose mass must reach p: the mean of a KV group's query heads, or each head (union).",
            "choices": ["mean", "each"],
        },
    )
    sparse_topp_flat_share: float = field(
        default=0.5,
        metadata={
            "help": "topp: where the blocks a (sequence, KV head) selects among have estimated masses this flat or "
            "flatter (the share of their mass under their mean), its list is attended whole, without the prune, "
            "and takes sparse_topp_flat_budget tokens where sparse_budget cannot reach sparse_top_p of such masses "
            "either (1: never)."
        },
    )
    sparse_topp_flat_budget: int | None = field(
        default=None,
        metadata={
            "size": True,
            "help": "topp: the tokens a flat list takes (sparse_topp_flat_share; default: half of sparse_budget; "
            "at least one block past the sink and local window).",
        },
    )
    sparse_topp_flat_hold: int | None = field(
        default=None,
        metadata={
            "help": "topp: a list flagged flat (sparse_topp_flat_share) is kept for this many more decode steps "
            "before its (sequence, layer, KV head) selects again: flat masses do not follow the query, so a fresh "
            "selection each step only changes which blocks the step reads (under KV offload: reads over PCIe "
            'inside the step; docs/sparse.md, "Holding flat lists"). Needs sparse_reuse=1, sparse_lag=0 and, '
            "under kv_offload, offload_prefetch (0: every step selects; default: 4 where topp allows it and "
            "kv_offload is off, else 0)."
        },
    )
    sparse_reuse: int = field(
        default=1,
        metadata={"help": "Recompute a sequence's block selection every this many decode steps (1: every step)."},
    )
    sparse_lag: int | None = field(
        default=None,
        metadata={
            "help": "1: a decode step attends the blocks selected from the previous step's query (topp: prunes "
            "those candidates with its own), so selection runs beside the attention (0: each step selects from "
            "its own query; default: 1 with kv_offload, topk and sparse_reuse 1, whose loads then run beside "
            "the layers before them, else 0: lagged topp loses answers).",
            "choices": [0, 1],
        },
    )
    sparse_stickiness: float = field(
        default=2.0,
        metadata={
            "help": "Hysteresis of the block lists: a block of a sequence's previous list ranks by its estimated "
            "mass times 1 + this at the next selection (0: off). Steadier lists: smaller working sets and fewer "
            'loads under KV offload (docs/sparse.md, "Stickiness").'
        },
    )
    sparse_dense_layers: int = field(default=2, metadata={"help": "The first N layers always attend densely."})
    sparse_sink_blocks: int = field(default=1, metadata={"help": "Leading token blocks always attended."})
    sparse_local_blocks: int = field(
        default=4, metadata={"help": "Most recent token blocks always attended (the local window, >= 1)."}
    )
    sparse_dense_context: int | None = field(
        default=None,
        metadata={
            "size": True,
            "help": "Steps whose longest context is at most this many tokens run dense (default: the budget; "
            "0: never, for tests).",
        },
    )
    streaming_heads: str | None = field(
        default=None,
        metadata={
            "help": "JSON file of (layer, KV head) pairs that only see sink + local window "
            "(`sparseserve calibrate` proposes one)."
        },
    )
    logical_page_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per key-metadata page inside a block (hierarchical paging; default: block_size)."},
    )
    sparse_prefill: str = field(
        default="dense",
        metadata={
            "help": "Prefill attention: dense, or sale (block-sparse over the tiles whose fp8 estimate clears "
            "the head's threshold).",
            "choices": ["dense", "sale"],
        },
    )
    sparse_prefill_threshold: float = field(
        default=0.01,
        metadata={
            "help": "sale: every query head's threshold, a share of the sink + local region's softmax mass, when "
            "no calibration file is given (0: dense)."
        },
    )
    sparse_prefill_min_len: int = field(
        default=8192,
        metadata={
            "help": "sale: prefill chunks whose context (earlier tokens + the chunk) is shorter than this run dense."
        },
    )
    sparse_prefill_calibration: str | None = field(
        default=None,
        metadata={
            "help": "sale: JSON file of per-(layer, query head) thresholds (`sparseserve calibrate --prefill` "
            "writes one), overriding sparse_prefill_threshold."
        },
    )

    def __post_init__(self) -> None:
        if self.sparse_policy != "dense" and self.sparse_policy not in SELECTION_POLICIES:
            raise ValueError(
                f"sparse_policy must be dense or one of {', '.join(SELECTION_POLICIES.names())}, "
                f"got {self.sparse_policy!r}"
            )
        for name in ("sparse_budget", "sparse_top_p"):  # unset: the policy's own
            if getattr(self, name) is None:
                object.__setattr__(self, name, policy_default(self.sparse_policy, name))
        if self.sparse_budget < 1:
            raise ValueError(f"sparse_budget must be >= 1, got {self.sparse_budget}")
        if not 0.0 < self.sparse_top_p <= 1.0:
            raise ValueError(f"sparse_top_p must be in (0, 1], got {self.sparse_top_p}")
        if self.sparse_topp_heads not in ("mean", "each"):
            raise ValueError(f"sparse_topp_heads must be mean or each, got {self.sparse_topp_heads!r}")
        if not 0.0 < self.sparse_topp_flat_share <= 1.0:
            raise ValueError(f"sparse_topp_flat_share must be in (0, 1], got {self.sparse_topp_flat_share}")
        if self.sparse_topp_flat_budget is not None and not 1 <= self.sparse_topp_flat_budget <= self.sparse_budget:
            raise ValueError(
                f"sparse_topp_flat_budget must be in [1, sparse_budget={self.sparse_budget}], "
                f"got {self.sparse_topp_flat_budget}"
            )
        if self.sparse_reuse < 1:
            raise ValueError(f"sparse_reuse must be >= 1, got {self.sparse_reuse}")
        if self.sparse_topp_flat_hold is not None and self.sparse_topp_flat_hold < 0:
            raise ValueError(f"sparse_topp_flat_hold must be >= 0, got {self.sparse_topp_flat_hold}")
        if (
            self.sparse_topp_flat_hold
            and self.enabled
            and (
                not SELECTION_POLICIES.get(self.sparse_policy).prunes
                or self.sparse_topp_flat_share >= 1.0
                or self.sparse_reuse != 1
                or self.sparse_lag
            )
        ):
            raise ValueError(
                "sparse_topp_flat_hold needs a pruning sparse_policy (topp) that flags flat lists "
                "(sparse_topp_flat_share < 1), sparse_reuse=1 and sparse_lag=0: a held list is the one its "
                "last selection wrote for its own step"
            )
        if not (0.0 <= self.sparse_stickiness < float("inf")):
            raise ValueError(f"sparse_stickiness must be a finite number >= 0, got {self.sparse_stickiness}")
        if self.sparse_lag not in (None, 0, 1):
            raise ValueError(f"sparse_lag must be 0 or 1, got {self.sparse_lag}")
        if self.sparse_lag and self.enabled and not SELECTION_POLICIES.get(self.sparse_policy).supports_lag:
            raise ValueError(
                f"sparse_lag=1 does not work with sparse_policy={self.sparse_policy}: its lists fit "
                f"the query that selected them, not the next one"
            )
        if self.sparse_dense_layers < 0 or self.sparse_sink_blocks < 0:
            raise ValueError("sparse_dense_layers and sparse_sink_blocks must be >= 0")
        if self.sparse_local_blocks < 1:
            raise ValueError(
                f"sparse_local_blocks must be >= 1 (the decode token's own block), got {self.sparse_local_blocks}"
            )
        if self.sparse_dense_context is not None and self.sparse_dense_context < 0:
            raise ValueError(f"sparse_dense_context must be >= 0, got {self.sparse_dense_context}")
        lps = self.logical_page_size
        if lps is not None and (lps < 1 or lps & (lps - 1)):
            raise ValueError(f"logical_page_size must be a power of two, got {lps}")
        if self.sparse_prefill not in ("dense", "sale"):
            raise ValueError(f"sparse_prefill must be dense or sale, got {self.sparse_prefill!r}")
        if not math.isfinite(self.sparse_prefill_threshold) or self.sparse_prefill_threshold < 0:
            raise ValueError(f"sparse_prefill_threshold must be finite and >= 0, got {self.sparse_prefill_threshold}")
        if self.sparse_prefill_min_len < 0:
            raise ValueError(f"sparse_prefill_min_len must be >= 0, got {self.sparse_prefill_min_len}")
        if self.sparse_prefill_calibration is not None and self.sparse_prefill != "sale":
            raise ValueError("sparse_prefill_calibration needs sparse_prefill='sale'")

    @property
    def enabled(self) -> bool:
        return self.sparse_policy != "dense"


# Layers a segment step gives a layer-segmented prefill by default: short steps beside the decodes they delay
# (docs/offload.md, "Layer-segmented prefill": TPOT against segments as long as the budget allows).
PREFILL_LAYER_SEGMENT = 4
# Steps of the decodes alone after a segment beside them (docs/offload.md, "Decode steps between segments").
SEGMENT_DECODE_STEPS = 2
# Prompts waiting to prefill beyond which, when they also outnumber the requests decoding, the two above are off: a
# burst, whose TTFT is its queue (docs/offload.md, "A burst's queue").
SEGMENT_PACING_MAX_WAITING = 4


@dataclass(frozen=True)
class OffloadConfig:
    """Hierarchical KV cache (docs/architecture.md, principles 4 and 5): every full head block
    written through to a host store; sparse decode reads its selections through an HBM pool.
    Working-set control is part of it, never a switch: without it the pool thrashes
    (docs/working_set.md)."""

    kv_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep every full KV head block in a (pinned) host store and cache the selected ones in an "
            "HBM slot pool, decoding only as many requests as their working sets fit it (needs a sparse policy)."
        },
    )
    host_kv_memory: int | None = field(
        default=None,
        metadata={
            "size": True,
            "help": "Bytes of the host KV store, which holds every token block (default: max_num_seqs "
            "sequences of max_model_len, at most half the host's available memory).",
        },
    )
    hbm_cache_blocks: int | None = field(
        default=None,
        metadata={
            "help": "Head-block slots of the HBM pool, shared by all layers and KV heads (default: one decode "
            "step's selections of max_num_seqs sequences, at most half the device KV memory left)."
        },
    )
    offload_prefetch: bool = field(
        default=False,
        metadata={
            "help": "KV offload with topp not lagged (sparse_lag=0, its default, and sparse_reuse=1): each step "
            "selects from its own query and reads its candidates where they are, the HBM pool, which loads the "
            "previous step's candidates beside the step, or host memory over UVA (off: each layer loads its misses "
            "before it prunes). Faster where attention moves little between steps, slower where it churns "
            '(docs/offload.md, "Prefetching reads").'
        },
    )
    layer_segmented_prefill: bool | None = field(
        default=None,
        metadata={
            "help": "KV offload: prefill a prompt longer than layer_segment_min_tokens a few layers at a time, "
            "each layer's K/V written through to the host store, so prefill HBM is one layer's scratch (default: "
            "on with kv_offload where that needs less device memory than chunked prefill's whole prompt: all but "
            "tiny models and short max_model_len)."
        },
    )
    layer_segment_min_tokens: int = field(
        default=2048,
        metadata={
            "help": "Layer-segmented prefill: prompts longer than this (or than max_num_batched_tokens, if less) go "
            "layer by layer; shorter ones prefill whole in the device block cache, which keeps room for one step "
            'of them (docs/offload.md, "The device budget").',
            "size": True,
        },
    )
    prefill_layer_segment: int | None = field(
        default=None,
        metadata={
            "help": f"Layer-segmented prefill: at most this many layers per step while other requests decode (a "
            f"segment's step delays their tokens; alone, as many as the step's token budget allows), fewer where the "
            f"budget allows fewer (default: {PREFILL_LAYER_SEGMENT})."
        },
    )
    segment_decode_steps: int = field(
        default=SEGMENT_DECODE_STEPS,
        metadata={
            "help": "Layer-segmented prefill: steps of the decodes alone after each segment that ran beside them "
            "(their tokens come more often, the prefill finishes later; 0: back to back)."
        },
    )
    segment_pacing_max_waiting: int = field(
        default=SEGMENT_PACING_MAX_WAITING,
        metadata={
            "help": "Layer-segmented prefill: the per-step layer cap and the decode steps between segments hold "
            "while at most this many prompts, or no more than the requests decoding, wait to prefill; a longer "
            "queue (a burst) gets the step's whole budget, as chunked prefill gives it (its TTFT is the queue's)."
        },
    )
    working_set_window: int = field(
        default=12, metadata={"help": "Decode steps over which a request's working set is the union of its selections."}
    )
    working_set_margin: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of the HBM pool the decoding requests' working sets leave free (none when the pool "
            "holds every head block of the host store: it never evicts)."
        },
    )
    max_prefilled_waiting: int = field(
        default=8,
        metadata={
            "help": "At most this many requests whose working sets do not fit yet are prefilled ahead, one at a "
            "time, and wait paused for a decode slot (0: they wait unprefilled)."
        },
    )
    max_park_steps: int = field(
        default=8,
        metadata={
            "help": "A request is prefilled ahead only if its decode slot is expected to open at most this many "
            "steps after its prefill ends (from the running requests' remaining max_tokens)."
        },
    )

    def __post_init__(self) -> None:
        if self.prefill_layer_segment is not None and self.prefill_layer_segment < 1:
            raise ValueError(f"prefill_layer_segment must be >= 1, got {self.prefill_layer_segment}")
        if self.prefill_layer_segment is not None and self.layer_segmented_prefill is False:
            raise ValueError(
                "prefill_layer_segment needs layer_segmented_prefill (off: turned off, or by default where it "
                "would not save device memory: a tiny model or a short max_model_len)"
            )
        if self.layer_segmented_prefill and not self.kv_offload:
            raise ValueError(
                "layer_segmented_prefill needs kv_offload: each finished layer's K/V goes to the host "
                "KV store, which only KV offload has"
            )
        if self.segment_decode_steps < 0:
            raise ValueError(f"segment_decode_steps must be >= 0, got {self.segment_decode_steps}")
        if self.segment_pacing_max_waiting < 0:
            raise ValueError(f"segment_pacing_max_waiting must be >= 0, got {self.segment_pacing_max_waiting}")
        if self.layer_segment_min_tokens < 1:
            raise ValueError(f"layer_segment_min_tokens must be >= 1, got {self.layer_segment_min_tokens}")
        if self.working_set_window < 1:
            raise ValueError(f"working_set_window must be >= 1, got {self.working_set_window}")
        if not 0.0 <= self.working_set_margin < 1.0:
            raise ValueError(f"working_set_margin must be in [0, 1), got {self.working_set_margin}")
        if self.max_prefilled_waiting < 0:
            raise ValueError(f"max_prefilled_waiting must be >= 0, got {self.max_prefilled_waiting}")
        if self.max_park_steps < 0:
            raise ValueError(f"max_park_steps must be >= 0, got {self.max_park_steps}")
        if self.host_kv_memory is not None and self.host_kv_memory < 1:
            raise ValueError(f"host_kv_memory must be >= 1 byte, got {self.host_kv_memory}")
        if self.hbm_cache_blocks is not None and self.hbm_cache_blocks < 1:
            raise ValueError(f"hbm_cache_blocks must be >= 1, got {self.hbm_cache_blocks}")
        if self.kv_offload and self.host_kv_memory is not None:
            available = available_host_memory()
            if available is not None and self.host_kv_memory > available:
                raise ValueError(
                    f"host_kv_memory={self.host_kv_memory} bytes exceeds the host's available "
                    f"memory ({available} bytes): lower it"
                )

    def resolve_layer_segments(self, *, segmented_bytes: int, chunked_bytes: int) -> "OffloadConfig":
        """layer_segmented_prefill's default (None) for a model: on under KV offload where the device memory it
        needs (its scratch and hidden states, one step's short prompts and a window in the device block cache) is
        at most chunked prefill's (a whole max_model_len prompt in the device block cache): all but tiny models
        or short max_model_len."""
        if self.layer_segmented_prefill is not None:
            return self
        return dataclasses.replace(self, layer_segmented_prefill=self.kv_offload and segmented_bytes <= chunked_bytes)

    @property
    def segment_layers(self) -> int:
        """The most layers a layer-segmented prefill runs in one step."""
        return self.prefill_layer_segment or PREFILL_LAYER_SEGMENT

    def segment_min_tokens(self, max_num_batched_tokens: int) -> int:
        """Prompts longer than this prefill layer by layer (with layer_segmented_prefill); the device
        block cache keeps room for one step of the shorter ones."""
        return min(max_num_batched_tokens, self.layer_segment_min_tokens)

    @property
    def working_set_control(self) -> bool:
        """Whether the decode batch is limited to the working sets the HBM pool holds: always with
        kv_offload (docs/working_set.md)."""
        return self.kv_offload


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str | int) -> int:
    """A number of tokens or bytes, plain (4096, 4e9) or with a unit. One letter follows vLLM: k, m, g, t are
    powers of 1000 and K, M, G, T powers of 1024 (32k = 32000, 32K = 32768); kB, MB, GB, TB (any case) are
    powers of 1000 and KiB, MiB, GiB, TiB powers of 1024; B is bytes. Decimals work with every unit (1.5G)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip()
    m = re.fullmatch(r"(\d+\.?\d*(?:[eE]\d+)?|\.\d+)\s*([A-Za-z]{0,3})", s)
    if m is None:
        raise ValueError(f"invalid size {text!r}: write e.g. 4096, 32k, 32K, 2GiB or 1.5G")
    number, unit = m.groups()
    u = unit.lower()
    if unit in ("", "b", "B"):
        mult = 1
    elif len(unit) == 1 and u in _DECIMAL:
        mult = _BINARY[u] if unit.isupper() else _DECIMAL[u]
    elif len(unit) == 2 and u[1] == "b" and u[0] in _DECIMAL:
        mult = _DECIMAL[u[0]]
    elif len(unit) == 3 and u[1:] == "ib" and u[0] in _BINARY:
        mult = _BINARY[u[0]]
    else:
        raise ValueError(f"invalid size {text!r}: unknown unit {unit!r} (k, K, kB, KiB, ... up to T)")
    if mult == 1 and number.isdigit():
        return int(number)
    return int(float(number) * mult)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (docs/tensor_parallel.md): the model's heads, MLP and vocabulary split over ranks."""

    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "GPUs (ranks) the model is split over, one process each, spawned by rank 0 or started by "
            "torchrun (1: no process group)."
        },
    )

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


# Options that no longer exist, and why (a clear error rather than "unknown").
REMOVED_ARGS = {
    "working_set_control": (
        "kv_offload always runs working-set control; without it the HBM pool thrashes (hit ratio "
        "near 0) and serving stalls (docs/working_set.md)"
    )
}

_SUBCONFIGS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "sparse_config": SparseConfig,
    "offload_config": OffloadConfig,
    "parallel_config": ParallelConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    sparse_config: SparseConfig = field(default_factory=SparseConfig)
    offload_config: OffloadConfig = field(default_factory=OffloadConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.sparse_config.sparse_lag is None:  # the default: lagged selection under KV offload
            lag = int(self.lags_by_default)
            object.__setattr__(self, "sparse_config", dataclasses.replace(self.sparse_config, sparse_lag=lag))
        if self.sparse_config.sparse_topp_flat_hold is None:
            hold = policy_default(self.sparse_config.sparse_policy, "sparse_topp_flat_hold") if self._holds else 0
            object.__setattr__(
                self, "sparse_config", dataclasses.replace(self.sparse_config, sparse_topp_flat_hold=hold)
            )
        if self.cache_config.block_size is None:  # unset: the sparse policy's (topp: 16)
            bs = policy_default(self.sparse_config.sparse_policy, "block_size")
            object.__setattr__(self, "cache_config", dataclasses.replace(self.cache_config, block_size=bs))
        sp, bs = self.sparse_config, self.cache_config.block_size
        if self.offload_config.kv_offload and not sp.enabled:
            raise ValueError(
                "kv_offload needs a sparse decode policy (sparse_policy='topk' or 'topp'): with "
                "dense attention every block is read every step, so an HBM cache cannot help"
            )
        if self.offload_config.kv_offload and self.cache_config.host_prefix_cache_memory is not None:
            raise ValueError(
                "host_prefix_cache_memory is the host tier without KV offload: with kv_offload the "
                "host KV store already holds the prefix cache (size it with host_kv_memory)"
            )
        if self.parallel_config.tensor_parallel_size > 1 and self.cache_config.host_prefix_cache_memory is not None:
            raise ValueError(
                "host_prefix_cache_memory does not work with tensor_parallel_size > 1 yet: the host "
                "tier copies rank 0's KV only (KV offload's host store, per rank, does work)"
            )
        if self.offload_config.kv_offload and sp.sparse_lag and sp.sparse_reuse > 1:
            raise ValueError(
                "sparse_lag=1 with kv_offload needs sparse_reuse=1: each step plans the views of the "
                "lists the next step reads, and a reused list's view would be older than one step"
            )
        if self.offload_config.offload_prefetch and not self.prefetches:
            raise ValueError(
                "offload_prefetch needs kv_offload, a pruning sparse_policy (topp: its candidates are prefetched), "
                "sparse_lag=0 (lagged selection loads a step ahead already) and sparse_reuse=1 (each step's "
                "candidates are the next step's prefetch)"
            )
        if self.offload_config.kv_offload and sp.sparse_topp_flat_hold and not self.prefetches:
            raise ValueError(
                "sparse_topp_flat_hold under kv_offload needs offload_prefetch=true: with plain reads a hold "
                'thrashes the HBM pool under load (docs/offload.md, "With plain reads the hold thrashes the '
                'pool"); set sparse_topp_flat_hold=0 or turn offload_prefetch on'
            )
        if self.scheduler_config.async_scheduling is True and self.cache_config.host_prefix_cache_memory is not None:
            raise ValueError(
                "async_scheduling does not work with host_prefix_cache_memory yet: its per-step host copies "
                "assume the previous step has landed"
            )
        if sp.logical_page_size is not None and sp.logical_page_size > bs:
            raise ValueError(f"logical_page_size {sp.logical_page_size} exceeds block_size {bs}")
        if sp.enabled and sp.sparse_budget // bs < sp.sparse_sink_blocks + sp.sparse_local_blocks + 1:
            raise ValueError(
                f"sparse_budget {sp.sparse_budget} holds {sp.sparse_budget // bs} blocks of {bs} "
                f"tokens: need more than sink + local = "
                f"{sp.sparse_sink_blocks + sp.sparse_local_blocks}"
            )

    @property
    def prefetches(self) -> bool:
        """Whether KV offload's reads are prefetching ones (OffloadConfig.offload_prefetch, where it applies)."""
        oc, sp = self.offload_config, self.sparse_config
        return (
            oc.offload_prefetch
            and oc.kv_offload
            and sp.enabled
            and not sp.sparse_lag
            and sp.sparse_reuse == 1
            and SELECTION_POLICIES.get(sp.sparse_policy).prunes
        )

    @property
    def _holds(self) -> bool:
        """Whether sparse_topp_flat_hold's default is the policy's: a hold can run (unlagged, reuse 1, flat lists
        flagged) and KV offload is off (plain reads refuse a hold; with prefetching reads it served within a few
        percent of hold 0: docs/sparse.md, "topp's defaults")."""
        sp = self.sparse_config
        unlagged = sp.enabled and not sp.sparse_lag and sp.sparse_reuse == 1 and sp.sparse_topp_flat_share < 1.0
        return unlagged and not self.offload_config.kv_offload

    @property
    def lags_by_default(self) -> bool:
        """Whether sparse_lag's default is 1: KV offload, a policy whose lagged lists keep its answers
        (topk; not topp), and lists selected every step (docs/offload.md, "Lagged reads")."""
        sp = self.sparse_config
        return (
            self.offload_config.kv_offload
            and sp.enabled
            and SELECTION_POLICIES.get(sp.sparse_policy).supports_lag
            and SELECTION_POLICIES.get(sp.sparse_policy).lags_by_default
            and sp.sparse_reuse == 1
        )

    def schedules_async(self, device_type: str) -> bool:
        """async_scheduling resolved for the device: its default (None) is on with KV offload on CUDA (every
        SparseServe-mode figure ran with it), off otherwise (on CPU the step is the host's own work)."""
        if self.scheduler_config.async_scheduling is not None:
            return self.scheduler_config.async_scheduling
        return self.offload_config.kv_offload and device_type == "cuda"

    @staticmethod
    def arg_fields() -> list[dataclasses.Field]:
        """All user-facing options, in CLI order."""
        return [f for cls in _SUBCONFIGS.values() for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Also takes vLLM's names where ours differ (metadata "flag") and sizes as strings ("32k", "2GiB")."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SUBCONFIGS}
        aliases = {f.metadata["flag"]: f.name for f in cls.arg_fields() if "flag" in f.metadata}
        sizes = {f.name for f in cls.arg_fields() if f.metadata.get("size")}
        for key, value in kwargs.items():
            key = aliases.get(key, key)
            owner = next((n for n, c in _SUBCONFIGS.items() if key in {f.name for f in fields(c)}), None)
            if key in REMOVED_ARGS:
                raise TypeError(f"engine argument {key!r} was removed: {REMOVED_ARGS[key]}")
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            parts[owner][key] = parse_size(value) if key in sizes and isinstance(value, str) else value
        return cls(**{name: _SUBCONFIGS[name](**vals) for name, vals in parts.items()})
