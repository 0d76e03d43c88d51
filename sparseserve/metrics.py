"""Prometheus metrics of the API server, named like vLLM's (``vllm:`` -> ``sparseserve:``).

Engine state (running/waiting requests, KV blocks, cumulative token and preemption counters) is
read at scrape time from the snapshot that the engine thread publishes after every step, so a
scrape never touches the engine itself. Per-request latencies are observed on the event loop
by the AsyncLLMEngine as outputs arrive.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Buckets follow vLLM's choices: TTFT and ITL span milliseconds to minutes (long prompts on CPU).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineStatsCollector:
    """Exposes the latest EngineStats snapshot as gauges and counters."""

    def __init__(self, get_stats: Callable[[], Any], model_name: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._get_stats()
        if stats is None:  # engine thread has not published a snapshot yet
            return
        label = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(f"sparseserve:{name}", doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(f"sparseserve:{name}", doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        total = stats.num_blocks_total
        yield gauge("num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield gauge("kv_cache_blocks_used", "KV token blocks in use.", stats.num_blocks_used)
        yield gauge("kv_cache_blocks_total", "KV token blocks in the pool.", total)
        yield gauge(
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.num_blocks_used / total if total else 0.0,
        )
        yield counter("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", stats.num_generation_tokens)
        yield from _prefix_cache_metrics(stats, gauge, counter)
        selections = getattr(stats, "sparse_selections", 0)
        if selections:  # sparse decode on: blocks attended per (sequence, layer, KV head) selection
            yield counter(
                "sparse_blocks_selected", "Blocks in all sparse decode selections.", stats.sparse_blocks_selected
            )
            yield counter("sparse_selections", "Sparse decode selections (sequence x layer x KV head).", selections)
            yield gauge(
                "sparse_mean_blocks_attended",
                "Mean blocks per sparse decode selection.",
                stats.sparse_blocks_selected / selections,
            )
            yield gauge(
                "sparse_mean_budget_tokens",
                "Mean tokens per sparse decode selection (the budget used).",
                stats.sparse_blocks_selected * stats.sparse_block_size / selections,
            )
            flat = getattr(stats, "sparse_flat_lists", 0)
            yield counter("sparse_flat_lists", "topp selections whose candidates were flat (kept unpruned).", flat)
            held = getattr(stats, "sparse_held_lists", 0)
            yield counter(
                "sparse_held_lists", "topp flat lists kept instead of selected (sparse_topp_flat_hold).", held
            )
            yield gauge(
                "sparse_flat_list_share",
                "Share of sparse decode selections whose candidates were flat.",
                flat / selections,
            )
        if getattr(stats, "offload_hbm_slots", 0):
            yield from _offload_metrics(stats, gauge, counter)
            yield gauge(
                "layer_prefills_running",
                "Layer-segmented prefills in progress.",
                getattr(stats, "layer_prefills_running", 0),
            )
            yield gauge(
                "layer_prefill_layers_done",
                "Layers done by the layer-segmented prefills in progress.",
                getattr(stats, "layer_prefill_layers_done", 0),
            )
        if getattr(stats, "prefill_tiles_dense", 0):
            yield from _sparse_prefill_metrics(stats, counter)


def _prefix_cache_metrics(stats: Any, gauge: Callable, counter: Callable) -> Iterable[Metric]:
    """vLLM's prefix-cache counters (prompt tokens looked up and found at first admissions) of
    the device cache and the host tier (tokens the device missed, found in host memory), and the
    cached blocks."""
    yield counter(
        "prefix_cache_queries",
        "Prefix cache queries: prompt tokens looked up.",
        getattr(stats, "prefix_cache_queries", 0),
    )
    yield counter(
        "prefix_cache_hits", "Prefix cache hits: prompt tokens found cached.", getattr(stats, "prefix_cache_hits", 0)
    )
    yield counter(
        "host_prefix_cache_queries",
        "Host-tier prefix cache queries: prompt tokens the device cache missed, looked up in host memory.",
        getattr(stats, "host_prefix_cache_queries", 0),
    )
    yield counter(
        "host_prefix_cache_hits",
        "Host-tier prefix cache hits: prompt tokens restored from host memory.",
        getattr(stats, "host_prefix_cache_hits", 0),
    )
    yield gauge(
        "prefix_cache_blocks",
        "KV blocks holding a cached prefix block (in use or free).",
        getattr(stats, "prefix_cache_blocks", 0),
    )
    yield counter(
        "prefix_cache_evictions",
        "Cached KV blocks taken back for new contents.",
        getattr(stats, "prefix_cache_evictions", 0),
    )
    yield gauge("host_prefix_cache_blocks", "Host-tier blocks in use.", getattr(stats, "host_prefix_cache_blocks", 0))
    yield counter(
        "host_prefix_cache_evictions", "Host-tier blocks evicted.", getattr(stats, "host_prefix_cache_evictions", 0)
    )


def _offload_metrics(stats: Any, gauge: Callable, counter: Callable) -> Iterable[Metric]:
    """KV offload: HBM pool hit ratio, blocks loaded per (step, sparse layer), host store use."""
    hits, loads = stats.offload_hbm_hits, stats.offload_blocks_loaded
    bypass, layer_steps = stats.offload_bypass_reads, stats.offload_layer_steps
    requests = hits + getattr(stats, "offload_hbm_misses", loads + bypass)
    yield counter("offload_hbm_hits", "Listed head blocks found in the HBM pool.", hits)
    yield counter("offload_head_blocks_loaded", "Head blocks copied host -> HBM pool (FlashH2D).", loads)
    yield counter("offload_hbm_misses", "Listed head blocks not found in the HBM pool.", requests - hits)
    yield counter(
        "offload_bypass_reads",
        "Head blocks the attention read straight from the host store (set full; prefetching reads: not prefetched).",
        bypass,
    )
    yield counter(
        "offload_head_blocks_seeded",
        "Head blocks a layer-segmented prefill put in the HBM pool for its first decode (no FlashH2D).",
        getattr(stats, "offload_blocks_seeded", 0),
    )
    yield counter(
        "offload_head_blocks_filled",
        "Head blocks a layer-segmented prefill put in free HBM pool slots beyond its first decode's lists.",
        getattr(stats, "offload_blocks_filled", 0),
    )
    yield gauge(
        "offload_hbm_hit_ratio",
        "HBM pool hits / listed head blocks read, since start.",
        hits / requests if requests else 0.0,
    )
    yield gauge(
        "offload_head_blocks_loaded_per_layer_step",
        "Head blocks loaded per (decode step, sparse layer).",
        loads / layer_steps if layer_steps else 0.0,
    )
    # Cumulative bytes: rate() gives transfer throughput over wall time (not the link bandwidth).
    yield counter("offload_h2d_bytes", "Bytes loaded host -> HBM pool.", stats.offload_h2d_bytes)
    yield counter(
        "offload_uva_bytes",
        "Bytes read straight from the host store: bypass reads and topp's candidate keys (its prune).",
        getattr(stats, "offload_uva_bytes", 0),
    )
    yield counter("offload_d2h_bytes", "Bytes written through to the host store.", stats.offload_d2h_bytes)
    yield gauge("offload_host_blocks_used", "Token blocks of the host KV store in use.", stats.num_blocks_used)
    yield gauge("offload_host_blocks_total", "Token blocks of the host KV store.", stats.offload_host_blocks)
    yield gauge("offload_hbm_slots", "Head-block slots of the HBM pool.", stats.offload_hbm_slots)
    yield gauge(
        "offload_device_rows",
        "Device rows for the running requests' token blocks (dense layers' KV and key metadata).",
        getattr(stats, "offload_device_rows", 0),
    )
    yield gauge("offload_device_rows_used", "Device rows mapped.", getattr(stats, "offload_device_rows_used", 0))
    yield counter(
        "offload_rows_saved", "Device rows saved to the host store (pauses, releases).", stats.offload_rows_saved
    )
    yield counter(
        "offload_rows_restored",
        "Device rows restored from the host store (resumes, hits).",
        stats.offload_rows_restored,
    )
    for part in ("pool", "dense_layers", "metadata", "device_block_cache", "buffers"):
        yield gauge(
            f"offload_hbm_bytes_{part}",
            f"KV offload's device memory: {part.replace('_', ' ')} (bytes).",
            getattr(stats, f"offload_hbm_bytes_{part}", 0),
        )
    yield from _working_set_metrics(stats, gauge, counter)


def _working_set_metrics(stats: Any, gauge: Callable, counter: Callable) -> Iterable[Metric]:
    """KV offload: working-set-aware batch control (estimates reported with the control off too)."""
    yield gauge(
        "working_set_blocks",
        "Sum of the running requests' working sets (head blocks their selections "
        "touched over the last working_set_window decode steps).",
        getattr(stats, "working_set_blocks", 0),
    )
    yield gauge(
        "working_set_capacity_blocks",
        "Head-block slots of the HBM pool the working sets compare with.",
        getattr(stats, "working_set_capacity", 0),
    )
    yield gauge(
        "working_set_limit_blocks",
        "Head blocks the running working sets may take (the pool less the margin).",
        getattr(stats, "working_set_limit", 0),
    )
    yield gauge(
        "num_requests_held_back",
        "Requests waiting because the working-set limit stopped the batch.",
        getattr(stats, "working_set_held_back", 0),
    )
    yield counter(
        "working_set_hold_backs",
        "Running requests paused by the working-set limit.",
        getattr(stats, "working_set_hold_backs", 0),
    )
    yield gauge(
        "num_requests_parked",
        "Prefilled requests waiting for the working-set limit to let them decode (max_prefilled_waiting).",
        getattr(stats, "working_set_parked", 0),
    )
    yield counter(
        "working_set_prefill_aheads",
        "Requests admitted for prefill beyond the working-set limit (their decode waits).",
        getattr(stats, "working_set_prefill_aheads", 0),
    )
    yield gauge(
        "working_set_growth",
        "A request's working set over the whole working_set_window, in one step's lists (running mean; 1 until "
        "a request has counted a whole window): how much its selections move from step to step.",
        getattr(stats, "working_set_growth", 0.0),
    )


def _sparse_prefill_metrics(stats: Any, counter: Callable) -> Iterable[Metric]:
    """Sparse prefill: attention tiles computed against the causally visible ones (dense's work)."""
    yield counter(
        "prefill_tiles_computed",
        "Sparse prefill: (query tile, key tile, KV head) attention tiles computed, all layers.",
        stats.prefill_tiles_computed,
    )
    yield counter(
        "prefill_tiles_dense",
        "Sparse prefill: causally visible attention tiles (what dense prefill computes), all layers.",
        stats.prefill_tiles_dense,
    )


class ServerMetrics:
    """One registry per server, so several in-process servers (tests) never collide."""

    def __init__(self, get_stats: Callable[[], Any], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self._ttft = Histogram(
            "sparseserve:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=_TTFT_BUCKETS,
            **kw,
        )
        self._itl = Histogram(
            "sparseserve:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=_ITL_BUCKETS,
            **kw,
        )
        self._e2e = Histogram(
            "sparseserve:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            buckets=_E2E_BUCKETS,
            **kw,
        )
        self._success = Counter(
            "sparseserve:request_success",
            "Count of successfully processed requests.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(get_stats, model_name))

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.labels(self.model_name).observe(seconds)

    def observe_finished(self, e2e_seconds: float, finish_reason: str | None) -> None:
        self._e2e.labels(self.model_name).observe(e2e_seconds)
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of a Prometheus text exposition by sample name (labels dropped).

    Used by tests and the benchmark to compare the server's counters with client-side counts.
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
