"""Model runner: owns the model, the KV cache and the sampler; turns a schedule into batch tensors."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sparseserve.attention.backend import AttentionMetadata, get_attention_backend
from sparseserve.config import EngineConfig
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from sparseserve.models.config import ArchConfig
from sparseserve.models.loader import build_model, load_hf_config, resolve_dtype

logger = logging.getLogger(__name__)
CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_idx: torch.Tensor            # token index of each sampled sequence's last query token
    sampled: list[Sequence]             # the sequences that get a new token this step


class StateSlots:
    """Per-sequence state slots 0..n-1 (the sparse backend's selection cache and step counters):
    a sequence holds one while it runs; finished or preempted sequences give theirs back."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))
        self.held: dict[Sequence, int] = {}

    def assign(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(slot of each sequence, slots whose state must be reset: sequences (re)starting at token 0)."""
        for seq in [s for s in self.held if s.status is not SequenceStatus.RUNNING]:
            self.free.append(self.held.pop(seq))
        slots = [self.held[s] if s in self.held else self.held.setdefault(s, self.free.pop()) for s in seqs]
        return slots, [slot for s, slot in zip(seqs, slots) if s.num_computed_tokens == 0]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but no CUDA device is available")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {device!r}: choose auto, cuda or cpu")
    return torch.device(device)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        mc, cc = config.model_config, config.cache_config
        self.config = config
        self.model_dir = model_dir
        self.device = resolve_device(mc.device)
        hf_config = load_hf_config(model_dir)
        self.arch = ArchConfig.from_hf(hf_config)
        self.dtype = resolve_dtype(mc.dtype, hf_config)
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{self.arch.max_position_embeddings}")
        self.block_size = cc.block_size
        self.attn_backend = get_attention_backend(mc.attention_backend, self.device)
        self.sparse = None
        if config.sparse_config.enabled:
            from sparseserve.attention.sparse import SparseBackend
            a, n = self.arch, config.scheduler_config.max_num_seqs
            self.sparse = self.attn_backend = SparseBackend(
                self.attn_backend, config.sparse_config, a.num_layers, a.num_kv_heads, a.head_dim, self.block_size,
                self.dtype, self.device, n)
            self.seq_slots = StateSlots(n)
        torch.manual_seed(mc.seed)
        self.model = build_model(self.arch, self.attn_backend, model_dir, self.dtype, self.device, mc.load_format)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(mc.seed))
        self.layout = None  # kv_offload: kvcache/layout.py OffloadLayout (the device budget's split)
        self.num_device_blocks: int | None = None
        if config.offload_config.kv_offload:
            self.layout = self._plan_offload()
            self.num_blocks, self.num_device_blocks = self.layout.token_blocks, self.layout.device_blocks
        else:
            self.num_blocks = self._num_kv_blocks()
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than "
                             f"max_model_len={self.max_model_len}: lower max_model_len or give more KV memory")
        a = self.arch
        shape = (a.num_kv_heads, 2, self.block_size, a.head_dim)
        if self.layout is None:
            self.kv_cache = torch.empty(a.num_layers, self.num_blocks, *shape, dtype=self.dtype, device=self.device)
            self.kv_caches: torch.Tensor | list[torch.Tensor] = self.kv_cache
        else:
            # The device block cache of the sparse layers (+ a trash row that released table entries name) and
            # a full-size cache, indexed by token block, for the dense layers. The model takes one tensor a layer.
            dl = self.layout.dense_layers
            self.kv_cache = torch.empty(a.num_layers - dl, self.num_device_blocks + 1, *shape, dtype=self.dtype,
                                        device=self.device)
            self.dense_kv_cache = torch.empty(dl, self.num_blocks, *shape, dtype=self.dtype, device=self.device)
            self.kv_caches = list(self.dense_kv_cache) + list(self.kv_cache)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.kv_cache.shape[1], self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)
        if self.sparse is not None:
            self.sparse.allocate(self.num_blocks)
        self.host_kv = self.hbm_pool = None
        if self.layout is not None:
            self._setup_offload()
        self.graphs = None
        if self.device.type == "cuda" and not mc.enforce_eager:
            from sparseserve.engine.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.scheduler_config.max_num_seqs,
                                       self.max_model_len, self.block_size, offload=self.layout is not None)

    def _plan_offload(self):
        """Token blocks from the host store's size; the device budget split by kvcache/layout.py."""
        from sparseserve.config import available_host_memory
        from sparseserve.kvcache.host import host_block_bytes
        from sparseserve.kvcache.layout import OffloadLayout
        a, oc, cc, sc = self.arch, self.config.offload_config, self.config.cache_config, self.config.scheduler_config
        hbb = host_block_bytes(a.num_layers, a.num_kv_heads, self.block_size, a.head_dim, self.dtype)
        if oc.host_kv_memory is not None:
            token_blocks = oc.host_kv_memory // hbb
        else:  # what every sequence at full length could use, at most half the host's available memory
            token_blocks = sc.max_num_seqs * blocks_needed(self.max_model_len, self.block_size)
            avail = available_host_memory()
            if avail is not None:
                token_blocks = min(token_blocks, avail // 2 // hbb)
        if token_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the host KV store holds {token_blocks * self.block_size} tokens, fewer than "
                             f"max_model_len={self.max_model_len}: raise host_kv_memory or lower max_model_len")
        budget = None
        if cc.num_gpu_blocks_override is None:
            budget = cc.kv_cache_memory or (self._profile_kv_bytes() if self.device.type == "cuda"
                                            else CPU_DEFAULT_KV_BYTES)
        sp = self.sparse
        seq_blocks = blocks_needed(self.max_model_len, self.block_size)
        layout = OffloadLayout.plan(
            budget=budget, device_blocks=cc.num_gpu_blocks_override, token_blocks=token_blocks,
            pool_slots=oc.hbm_cache_blocks,
            # one decode step's lists of max_num_seqs sequences in every layer, at most every head block
            default_pool_slots=a.num_layers * a.num_kv_heads * min(sc.max_num_seqs * sp.params.cap, token_blocks),
            min_device_blocks=seq_blocks,
            # DeviceBlockMap: one whole prefill, a decode window (+1 block of slack) of every sequence, and one
            # step's prefill tokens, so short prompts can be admitted next to a long prefill
            want_device_blocks=seq_blocks + sc.max_num_seqs * (sp.params.local + 1)
            + blocks_needed(min(sc.max_num_batched_tokens, self.max_model_len), self.block_size),
            num_layers=a.num_layers,
            dense_layers=sp.dense_layers, kv_layer_block_bytes=hbb // a.num_layers,
            meta_block_bytes=sp.metadata_block_bytes,
            head_block_bytes=2 * self.block_size * a.head_dim * self.dtype.itemsize)
        logger.info("KV offload device budget%s: %s", "" if budget is None else f" {budget / 2**30:.2f} GiB",
                    layout.describe())
        return layout

    def _setup_offload(self) -> None:
        from sparseserve.config import available_host_memory
        from sparseserve.kvcache.host import HostKVStore, host_block_bytes
        from sparseserve.kvcache.pool import HBMPool
        a, sp = self.arch, self.sparse
        need = (self.num_blocks + 1) * host_block_bytes(a.num_layers, a.num_kv_heads, self.block_size, a.head_dim,
                                                        self.dtype)
        avail = available_host_memory()
        if avail is not None and need > avail:
            raise ValueError(f"the host KV store needs {need} bytes, more than the host's available memory "
                             f"({avail} bytes): set host_kv_memory lower")
        self.host_kv = HostKVStore(a.num_layers, self.num_blocks, a.num_kv_heads, self.block_size, a.head_dim,
                                   self.dtype, device=self.device)
        self.hbm_pool = HBMPool(a.num_layers, self.num_blocks, a.num_kv_heads, self.block_size, a.head_dim,
                                self.layout.pool_slots, self.dtype, self.device)
        sc = self.config.scheduler_config
        self.host_kv.attach_d2h(sc.max_num_batched_tokens, sc.max_num_seqs)
        sp.attach_offload(self.host_kv, self.hbm_pool)
        logger.info("KV offload: host store %d blocks (%.2f GiB, pinned=%s), device block cache %d blocks, "
                    "HBM pool %d head-block slots", self.num_blocks, self.host_kv.nbytes / 2**30,
                    self.host_kv.data.is_pinned(), self.num_device_blocks, self.hbm_pool.num_slots)

    def free_blocks(self, blocks: list[int]) -> None:
        """The scheduler freed these token blocks: their HBM slots must not serve a later owner."""
        if self.hbm_pool is not None:
            self.hbm_pool.invalidate(blocks)

    def offload_stats(self) -> tuple[int, ...]:
        """(HBM hits, head blocks loaded, bypass reads, layer steps, host blocks, HBM slots, bytes loaded
        host -> HBM, bytes written HBM -> host)."""
        if self.hbm_pool is None:
            return ()
        pool, host = self.hbm_pool, self.host_kv
        host.fence()
        head_block = pool.slots[0].numel() * pool.slots.element_size()
        hits, loads, bypass, steps = pool.stats.tolist()
        return (hits, loads, bypass, steps, self.num_blocks, pool.num_slots, loads * head_block,
                host.bytes_written())

    @property
    def block_bytes(self) -> int:
        a = self.arch
        kv = a.num_layers * a.num_kv_heads * 2 * self.block_size * a.head_dim * self.dtype.itemsize
        return kv + (self.sparse.metadata_block_bytes if self.sparse is not None else 0)

    def _num_kv_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory is not None:
            return cc.kv_cache_memory // self.block_bytes
        if self.device.type == "cuda":
            return self._profile_kv_bytes() // self.block_bytes
        # CPU: never more than every sequence at full length could use; memory is touched lazily.
        cap = sc.max_num_seqs * blocks_needed(self.max_model_len, self.block_size)
        return min(CPU_DEFAULT_KV_BYTES // self.block_bytes, cap)

    @torch.inference_mode()
    def _profile_kv_bytes(self) -> int:
        """KV bytes = gpu_memory_utilization * total - (what is in use now + the peak of a full-budget step)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        gc.collect()  # an engine dropped just before still holds its KV cache until collected
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        n = min(sc.max_num_batched_tokens, self.max_model_len)
        a = self.arch
        scratch = torch.empty(a.num_layers, blocks_needed(n, self.block_size), a.num_kv_heads, 2, self.block_size,
                              a.head_dim, dtype=self.dtype, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(scratch.shape[1], dtype=torch.int32, device=self.device)[None],
            num_decodes=0, max_query_len=n, max_seq_len=n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), scratch, meta)
        self.model.compute_logits(hidden[: sc.max_num_seqs])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before - scratch.numel() * scratch.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        kv_bytes = int(total * cc.gpu_memory_utilization) - (total - free) - peak
        if kv_bytes <= 0:
            raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                             f"{cc.gpu_memory_utilization}: raise it or lower max_num_batched_tokens")
        return kv_bytes

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        """Batch tensors for one step, built in plain Python (per sequence and per block, never per
        token for slots) and moved to the device in one copy per tensor.

        kv_offload: slot_mapping and block_tables address the device block cache (released entries name its
        trash row); token_slot_mapping and token_block_tables the token blocks (host store rows, metadata
        rows, HBM pool keys)."""
        # Decodes (one query token) first: the attention backend runs its decode kernel on them.
        scheduled = sorted(scheduled, key=lambda item: item[1] != 1)
        bs, offload = self.block_size, self.num_device_blocks is not None
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        dev_slots: list[int] = []
        qsl, seq_lens, sample_idx, sampled = [0], [], [], []
        for seq, n in scheduled:
            c, table = seq.num_computed_tokens, seq.block_table
            ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            for blk in range(c // bs, (c + n - 1) // bs + 1):  # the slots of tokens [c, c + n), block by block
                lo, hi = max(c, blk * bs), min(c + n, (blk + 1) * bs)
                base = table[blk] * bs - blk * bs
                slots.extend(range(base + lo, base + hi))
                if offload:
                    base = seq.device_blocks[blk - seq.device_start] * bs - blk * bs
                    dev_slots.extend(range(base + lo, base + hi))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            if c + n == seq.num_tokens:
                sample_idx.append(qsl[-1] - 1)
                sampled.append(seq)
        width = max(len(s.block_table) for s, _ in scheduled)
        tables = np.zeros((len(scheduled), width), dtype=np.int32)
        dev_tables = np.zeros((len(scheduled), width), dtype=np.int32) if offload else None
        for b, (seq, _) in enumerate(scheduled):
            table = seq.block_table_array()
            tables[b, : len(table)] = table
            if offload:
                seq.fill_device_row(dev_tables[b], self.num_device_blocks)
        dev = self.device

        def to_dev(x: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        def table_to_dev(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).to(dev, non_blocking=True)

        state_slots = None
        if self.sparse is not None:
            seq_slots, fresh = self.seq_slots.assign([seq for seq, _ in scheduled])
            self.sparse.reset_slots(fresh)
            state_slots = to_dev(seq_slots, torch.int32)
        token_slots, token_tables = (to_dev(slots), table_to_dev(tables)) if offload else (None, None)
        meta = AttentionMetadata(
            slot_mapping=to_dev(dev_slots if offload else slots), query_start_loc=to_dev(qsl, torch.int32),
            seq_lens=to_dev(seq_lens, torch.int32), block_tables=table_to_dev(dev_tables if offload else tables),
            num_decodes=sum(1 for _, n in scheduled if n == 1), max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens), state_slots=state_slots, token_slot_mapping=token_slots,
            token_block_tables=token_tables)
        return StepBatch(to_dev(ids), to_dev(positions), meta, to_dev(sample_idx), sampled)

    def sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        ps = [s.params for s in seqs]
        vocab = self.arch.vocab_size
        dev = self.device
        logprobs = [p.logprobs for p in ps if p.logprobs is not None]
        return SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in ps], dtype=torch.float32).to(dev),
            top_k=torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps]).to(dev),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32).to(dev),
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32).to(dev),
            generators={i: s.generator for i, s in enumerate(seqs) if s.generator is not None and not s.params.greedy},
            all_greedy=all(p.greedy for p in ps),
            need_top_k=any(0 < p.top_k < vocab for p in ps),
            need_top_p=any(p.top_p < 1.0 for p in ps),
            need_min_p=any(p.min_p > 0.0 for p in ps),
            max_num_logprobs=max(logprobs) if logprobs else None)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SamplerOutput | None]:
        batch = self.prepare(scheduled)
        if self.host_kv is not None:
            # Before any kernel of this step: the previous steps' FlashD2H copies are in the store, so the
            # device blocks the scheduler released for this step may be rewritten (kvcache/blocks.py).
            self.host_kv.fence()
        if self.graphs is not None and len(batch.sampled) == batch.meta.num_seqs \
                and self.graphs.can_run(batch.meta.num_seqs, batch.meta.num_decodes):
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            if not batch.sampled:
                return [], None
            logits = self.model.compute_logits(hidden[batch.sample_idx])
        out = self.sampler(logits, self.sampling_metadata(batch.sampled))
        return batch.sampled, out
