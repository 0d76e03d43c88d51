"""How much KV memory a runner gets: the profiling pass on CUDA, each rank's offload options."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from pathlib import Path

import torch

from sparseserve.attention.backend import AttentionMetadata
from sparseserve.config import EngineConfig, OffloadConfig, available_host_memory
from sparseserve.distributed.utils import shard_heads
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.host import host_block_bytes
from sparseserve.models.config import ArchConfig
from sparseserve.models.loader import load_hf_config

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_kv_bytes(
    model,
    config: EngineConfig,
    a: ArchConfig,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    kernels: contextlib.AbstractContextManager,
) -> int:
    """KV bytes = gpu_memory_utilization * total - (in use now + a full-budget step's peak)."""
    cc, sc = config.cache_config, config.scheduler_config
    gc.collect()  # an engine dropped just before still holds its KV cache until collected
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    n = min(sc.max_num_batched_tokens, max_model_len)
    scratch = torch.empty(
        a.num_layers, blocks_needed(n, block_size), num_kv_heads, 2, block_size, a.head_dim, dtype=dtype, device=device
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(scratch.shape[1], dtype=torch.int32, device=device)[None],
        num_decodes=0,
        max_query_len=n,
        max_seq_len=n,
    )
    ids = torch.zeros(n, dtype=torch.long, device=device)
    with kernels:
        hidden = model(ids, torch.arange(n, device=device), list(scratch), meta)
    model.compute_logits(hidden[: sc.max_num_seqs])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - scratch.numel() * scratch.element_size()
    del scratch, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    kv_bytes = int(total * cc.gpu_memory_utilization) - (total - free) - peak
    if kv_bytes <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization="
            f"{cc.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
        )
    return kv_bytes


def rank_offload_config(
    config: EngineConfig, tp, a: ArchConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype, max_model_len: int
) -> OffloadConfig:
    """This rank's offload options; every size is per rank. At tensor_parallel_size > 1 the host
    store's default (max_num_seqs sequences of max_model_len, at most half the host's available
    memory, shared by its ranks) is agreed on, so every rank's store has the same rows."""
    oc = config.offload_config
    if tp.world_size == 1:
        return oc
    hbb = host_block_bytes(a.num_layers, num_kv_heads, block_size, a.head_dim, dtype)
    avail = available_host_memory()
    if oc.host_kv_memory is not None:
        if avail is not None and oc.host_kv_memory * tp.local_world_size > avail:
            raise ValueError(
                f"host_kv_memory={oc.host_kv_memory} bytes per rank for the {tp.local_world_size} "
                f"ranks of this host exceeds its available memory ({avail} bytes): lower it"
            )
        return oc
    rows = config.scheduler_config.max_num_seqs * blocks_needed(max_model_len, block_size)
    if avail is not None:
        rows = min(rows, avail // 2 // tp.local_world_size // hbb)
    return dataclasses.replace(oc, host_kv_memory=tp.min_int(rows) * hbb)


def with_offload_defaults(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """The offload options whose defaults depend on the model, resolved: layer_segmented_prefill by the device
    memory each prefill needs (OffloadConfig.resolve_layer_segments; the minimums OffloadCache.build asks of the
    device block cache, LayerPrefill's buffers; docs/offload.md, "Layer-segmented prefill")."""
    oc = config.offload_config
    if oc.layer_segmented_prefill is not None:
        return config
    from sparseserve.engine.layer_prefill import LayerPrefill

    a = ArchConfig.from_hf(load_hf_config(model_dir))
    bs, sc = config.cache_config.block_size, config.scheduler_config
    hkv = shard_heads(a.num_heads, a.num_kv_heads, config.parallel_config.tensor_parallel_size).num_kv_heads
    max_len = config.model_config.max_model_len or a.max_position_embeddings
    sparse_layers = a.num_layers - min(config.sparse_config.sparse_dense_layers, a.num_layers)
    block = sparse_layers * hkv * 2 * bs * a.head_dim  # a device block's elements (one dtype cancels out)
    step = blocks_needed(min(oc.segment_min_tokens(sc.max_num_batched_tokens), max_len), bs)
    segmented = (
        LayerPrefill.device_bytes(
            num_kv_heads=hkv,
            head_dim=a.head_dim,
            hidden_size=a.hidden_size,
            block_size=bs,
            max_model_len=max_len,
            dtype=torch.uint8,
        )
        + (step + config.sparse_config.sparse_local_blocks + 1) * block
    )
    chunked = blocks_needed(max_len, bs) * block
    oc = oc.resolve_layer_segments(segmented_bytes=segmented, chunked_bytes=chunked)
    if oc.layer_segmented_prefill:
        logger.info(
            "KV offload: layer-segmented prefill on by default (its device memory for prefill: %.2fx chunked "
            "prefill's; --no-layer-segmented-prefill turns it off)",
            segmented / chunked,
        )
    return dataclasses.replace(config, offload_config=oc)
