"""The prefix cache's host tier without KV offload (kvcache/host_cache.py): rows of every block-indexed tensor
(KV cache, int8 key-metadata codes, float32 scales) written through to host slots and copied back exactly into
other blocks, LRU eviction, the accounting, the row copy on its Triton path (interpreter on CPU), and through
the engine: a prompt evicted from the device cache is restored from the host instead of recomputed."""

from __future__ import annotations

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.config import EngineConfig
from sparseserve.engine.request import Sequence
from sparseserve.kernels.flash_h2d import flash_h2d_triton
from sparseserve.kvcache.host_cache import HostPrefixCache, layer_stack


def tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 6, 2, 2, 4, 8, generator=g)  # [layers, blocks, Hkv, K/V, bs, D]
    codes = torch.randint(-127, 128, (3, 7, 2, 2, 1, 8), generator=g, dtype=torch.int8)  # blocks + trash row
    scale = torch.rand(3, 7, 2, 1, generator=g)
    return [kv, codes, scale]


def test_store_restore_lru_and_accounting():
    dev = tensors()
    orig = [t.clone() for t in dev]
    cache = HostPrefixCache(dev, num_slots=3, pin=False)
    assert HostPrefixCache.block_bytes(dev) == 3 * (2 * 2 * 4 * 8 * 4 + 2 * 2 * 8 + 2 * 4)
    h = [bytes([i]) * 32 for i in range(5)]
    cache.store([1, 2], h[:2])
    cache.store([3], h[:1])  # a hash the tier holds: not stored twice
    assert cache.num_used == 2 and cache.num_stored == 2 and cache.lookup(h) == 2 and cache.lookup(h[1:]) == 1
    for t in dev:
        t[:, 1:3] = 0  # the device blocks are reused for other contents
    cache.restore([4, 5], h[:2])
    cache.begin_step()
    for t, o in zip(dev, orig):
        assert torch.equal(t[:, 4], o[:, 1]) and torch.equal(t[:, 5], o[:, 2])
    cache.store([0], h[2:3])
    cache.store([3], h[3:4])  # full: the least recently used (h[0], restored before h[1]) is evicted
    assert cache.num_evictions == 1 and cache.lookup(h[:1]) == 0 and cache.lookup(h[1:4]) == 3
    cache.check()
    with pytest.raises(ValueError, match="at least one block"):
        HostPrefixCache(dev, 0, pin=False)


def test_rows_copy_on_the_triton_path():
    """The kernel both directions use, on rows of any shape and dtype (int8 codes, float32 scales, K/V): on the
    GPU from pinned host rows into device rows, as the host tier runs it; on the CPU under the interpreter."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for src in tensors(1):
        flat = src.view(-1, *src.shape[2:])
        if dev == "cuda":
            flat = flat.pin_memory()
        dst = torch.zeros(5, *flat.shape[1:], dtype=flat.dtype, device=dev)
        key = torch.tensor([4, 0, 9, 13])
        load = torch.tensor([2, -1, 0, 4])
        flash_h2d_triton(flat, dst, key.to(dev), load.to(dev))
        got = dst.cpu()
        assert torch.equal(got[load[load >= 0]], flat[key[load >= 0]]) and not got[[1, 3]].any()


def test_layer_stack_aliases_the_cache():
    kv = torch.zeros(3, 4, 2)
    stacked = layer_stack(list(kv))
    stacked[1, 2] = 7
    assert kv[1, 2].eq(7).all()
    with pytest.raises(ValueError, match="slices of one tensor"):
        layer_stack([torch.zeros(4, 2), torch.zeros(4, 2)])


def test_config_refusals():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig.from_kwargs(host_prefix_cache_memory=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host KV store"):
        EngineConfig.from_kwargs(host_prefix_cache_memory=1 << 20, kv_offload=True, sparse_policy="topk")
    with pytest.raises(ValueError, match="available memory"):
        EngineConfig.from_kwargs(host_prefix_cache_memory=1 << 60)


@pytest.mark.parametrize(
    "policy",
    [
        dict(),
        dict(
            sparse_policy="topk",
            sparse_budget=64,
            sparse_dense_layers=0,
            sparse_sink_blocks=1,
            sparse_local_blocks=1,
            sparse_dense_context=0,
        ),
    ],
)
def test_evicted_prompt_comes_back_from_the_host(tiny_model_dir, policy):
    """A device cache of 8 blocks: after three other prompts the first one's blocks are evicted from it, but
    the host tier restores them (K/V and key metadata): the repeat computes only its last block, with the same
    tokens as the first time."""
    g = torch.Generator().manual_seed(5)
    first, *others = [torch.randint(10, 2000, (100,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=128,
        num_gpu_blocks_override=8,
        host_prefix_cache_memory=1 << 22,
        **policy,
    )
    engine = llm.llm_engine
    want = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    for p in others:
        llm.generate([p], params, use_tqdm=False)
    assert engine.allocator.lookup(engine.scheduler.kv.prompt_hashes(Sequence(0, "x", 0, first, params))) == []
    before = engine.get_stats()
    got = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    after = engine.get_stats()
    assert got == want
    assert after.num_prompt_tokens - before.num_prompt_tokens == 100 - 96  # 6 blocks restored, 4 tokens computed
    assert after.host_prefix_cache_hits - before.host_prefix_cache_hits == 96
    assert after.prefix_cache_hits == before.prefix_cache_hits
    assert (
        after.host_prefix_cache_blocks <= engine.model_runner.host_cache.num_slots and after.prefix_cache_evictions > 0
    )
    engine.model_runner.host_cache.check()
    engine.allocator.check()
