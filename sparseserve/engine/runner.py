"""Model runner: owns the model, the KV cache and the sampler; runs a scheduled step."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseserve.attention.backend import AttentionMetadata, BackendContext, create_backend
from sparseserve.attention.selection import load_streaming_heads
from sparseserve.config import EngineConfig
from sparseserve.distributed.group import get_tp_group
from sparseserve.distributed.utils import shard_heads
from sparseserve.engine.cuda_graph import DecodeGraphs
from sparseserve.engine.kv_memory import profile_kv_bytes, rank_offload_config
from sparseserve.engine.overlap import PLACEHOLDER, TokenFeed
from sparseserve.engine.request import Sequence
from sparseserve.engine.staging import StepUpload
from sparseserve.engine.step_inputs import StepInputs
from sparseserve.kernels.dispatch import check_impl, forced
from sparseserve.kvcache.blocks import blocks_needed
from sparseserve.kvcache.offload_plan import OffloadPlan
from sparseserve.kvcache.transfer import to_device_many
from sparseserve.layers.logits_processors import LogitsProcessors
from sparseserve.layers.prompt_logprobs import record_prompt_logprobs
from sparseserve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from sparseserve.models.config import ArchConfig
from sparseserve.models.loader import build_model, load_hf_config, resolve_dtype
from sparseserve.profiler import Profiler

logger = logging.getLogger(__name__)
CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_idx: torch.Tensor  # token index of each sampled sequence's last query token
    sampled: list[Sequence]  # the sequences that get a new token this step
    graph: bool = False  # built into the decode graphs' static inputs


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' asked for, but no CUDA device is available")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {device!r}: choose auto, cuda or cpu")
    return torch.device(device)


class ModelRunner:
    """One rank's runner. At tensor_parallel_size > 1 every rank builds one over its shard (its KV
    heads: `num_kv_heads`) in engine/parallel.py's process group; sizes every rank must share (KV
    blocks, the offload layout) are agreed on (the smallest); the engine drives rank 0's."""

    def __init__(self, config: EngineConfig, model_dir: Path, profiler: Profiler | None = None) -> None:
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.config = config
        self.profiler = profiler
        self.model_dir = model_dir
        self.tp = tp = get_tp_group()
        self.device = resolve_device(mc.device)
        if tp.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.local_rank)
        hf_config = load_hf_config(model_dir)
        self.arch = a = ArchConfig.from_hf(hf_config)
        heads = shard_heads(a.num_heads, a.num_kv_heads, tp.world_size, tp.rank)
        self.num_kv_heads = heads.num_kv_heads  # this rank's
        self.dtype = resolve_dtype(mc.dtype, hf_config, self.device)
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.arch.max_position_embeddings}"
            )
        self.block_size = cc.block_size
        # The kernels' path for this engine ("auto": Triton on CUDA tensors, references on CPU).
        self.kernel_impl = check_impl(mc.attention_backend)
        if self.kernel_impl == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1); use 'torch' on CPU"
            )
        sparse, streaming = config.sparse_config, None
        if tp.world_size > 1 and sparse.sparse_prefill_calibration is not None:
            raise ValueError(
                "sparse_prefill_calibration names global query heads; with tensor_parallel_size > 1 "
                "use one sparse_prefill_threshold for every head"
            )
        if tp.world_size > 1 and sparse.streaming_heads is not None:  # it names global KV heads
            mask = load_streaming_heads(sparse.streaming_heads, a.num_layers, a.num_kv_heads)
            streaming = mask[:, heads.kv_start : heads.kv_start + heads.num_kv_heads]
            sparse = dataclasses.replace(sparse, streaming_heads=None)
        ctx = BackendContext(
            a.num_layers,
            self.num_kv_heads,
            a.head_dim,
            self.block_size,
            self.dtype,
            self.device,
            sc.max_num_seqs,
            self.max_model_len,
            sparse,
            num_q_heads=heads.num_heads,
            profiler=profiler,
            offload_prefetch=config.prefetches,
        )
        self.attn_backend = create_backend("sparse" if sparse.enabled else "dense", ctx)
        if streaming is not None:
            self.attn_backend.state.streaming = streaming.to(self.device)
        torch.manual_seed(mc.seed)
        with self._kernels():
            self.model = build_model(self.arch, self.attn_backend, model_dir, self.dtype, self.device, mc.load_format)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(mc.seed))
        self._sampling: tuple[list[int] | None, SamplingMetadata | None] = (None, None)  # (seq ids, theirs)
        self.offload = None  # kvcache/offload.py OffloadCache: the hierarchical HBM/DRAM cache
        if config.offload_config.kv_offload:
            self.offload = self._build_offload()
            self.num_blocks = self.offload.num_token_blocks
        else:
            self.num_blocks = tp.min_int(self._num_kv_blocks())
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: lower max_model_len or give more KV memory"
            )
        if self.offload is None:
            shape = (self.num_kv_heads, 2, self.block_size, a.head_dim)
            kv_cache = torch.empty(a.num_layers, self.num_blocks, *shape, dtype=self.dtype, device=self.device)
            self.kv_caches: list[torch.Tensor] = list(kv_cache)
        else:
            self.kv_caches = self.offload.kv_caches
        logger.info(
            "KV cache: %d token blocks of %d tokens (%.2f GiB on the device)",
            self.num_blocks,
            self.block_size,
            sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**30,
        )
        if self.offload is None:
            self.attn_backend.allocate(self.num_blocks)
        else:
            self.attn_backend.allocate(self.offload.layout.rows, self.offload)  # metadata by device row
            with self._kernels():  # row saves and restores compile here, not at serving's first
                self.offload.warm_up()
        self.inputs = StepInputs(self.block_size, self.device, self.offload)  # a step's host inputs
        self.layer_prefill = None  # engine/layer_prefill.py: prompts prefilled layer by layer
        if config.offload_config.layer_segmented_prefill:
            from sparseserve.engine.layer_prefill import LayerPrefill

            self.layer_prefill = LayerPrefill(
                self.model,
                self.attn_backend,
                self.offload,
                self.kv_caches,
                hidden_size=a.hidden_size,
                max_model_len=self.max_model_len,
                chunk_tokens=sc.max_num_batched_tokens,
                dtype=self.dtype,
                device=self.device,
            )
            logger.info(
                "KV offload: layer-segmented prefill buffers %.2f GiB (two layers' scratch K/V, the prompt's hidden "
                "states)",
                self.layer_prefill.nbytes / 2**30,
            )
        self.graphs = None
        if self.device.type == "cuda" and not mc.enforce_eager and self.kernel_impl != "torch":
            with self._kernels():
                self.graphs = DecodeGraphs(
                    self.model,
                    self.attn_backend,
                    self.kv_caches,
                    sc.max_num_seqs,
                    self.max_model_len,
                    self.block_size,
                    profiler,
                )
        self.host_cache = None  # the prefix cache's host tier without offload (the scheduler's)
        if cc.host_prefix_cache_memory is not None:
            self.host_cache = self._build_host_cache(cc.host_prefix_cache_memory)

    def _kernels(self):
        """This engine's kernel path (kernels/dispatch.py); "auto" keeps the caller's choice."""
        return contextlib.nullcontext() if self.kernel_impl == "auto" else forced(self.kernel_impl)

    def _build_offload(self):
        from sparseserve.kvcache.offload import OffloadCache

        a, cc, sc = self.arch, self.config.cache_config, self.config.scheduler_config
        budget = None
        if cc.num_gpu_blocks_override is None:
            budget = self.tp.min_int(
                cc.kv_cache_memory or (self._profile_kv_bytes() if self.device.type == "cuda" else CPU_DEFAULT_KV_BYTES)
            )
        if budget is not None and self.config.offload_config.layer_segmented_prefill:
            from sparseserve.engine.layer_prefill import LayerPrefill

            budget -= LayerPrefill.device_bytes(
                num_kv_heads=self.num_kv_heads,
                head_dim=a.head_dim,
                hidden_size=a.hidden_size,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                dtype=self.dtype,
            )
        sp = self.attn_backend.params
        return OffloadCache.build(
            rank_offload_config(
                self.config, self.tp, a, self.num_kv_heads, self.block_size, self.dtype, self.max_model_len
            ),
            num_layers=a.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=a.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
            dense_layers=self.config.sparse_config.sparse_dense_layers,
            local_blocks=sp.local,
            cap=sp.cap,
            metadata_block_bytes=self.attn_backend.block_bytes(),
            max_model_len=self.max_model_len,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            budget=budget,
            device_blocks=cc.num_gpu_blocks_override,
        )

    def _build_host_cache(self, nbytes: int):
        """The prefix cache's host tier over every tensor indexed by token block: the KV cache and,
        with a sparse policy, the key metadata."""
        from sparseserve.kvcache.host_cache import HostPrefixCache, layer_stack

        tensors = [layer_stack(self.kv_caches)]
        key_meta = getattr(self.attn_backend, "key_meta", None)
        if key_meta is not None:
            tensors += [key_meta.codes, key_meta.scale]
        cache = HostPrefixCache(tensors, nbytes // HostPrefixCache.block_bytes(tensors))
        logger.info("prefix cache host tier: %d blocks (%.2f GiB)", cache.num_slots, cache.nbytes / 2**30)
        return cache

    def build_offload_space(self):
        """The scheduler's side of this runner's KV offload (kvcache/device_space.py), or None."""
        if self.offload is None:
            return None
        from sparseserve.kvcache.device_space import DeviceBlockMap, DeviceRowMap, OffloadSpace
        from sparseserve.kvcache.working_set import WorkingSetEstimate

        off, oc = self.offload, self.config.offload_config
        layout = off.layout
        estimate = WorkingSetEstimate(
            off.working_set,
            window=oc.working_set_window,
            capacity=off.pool.num_slots,
            # a pool that never evicts fits whatever runs: no margin holds back
            margin=0.0 if off.pool.num_slots >= layout.head_blocks else oc.working_set_margin,
            enabled=oc.working_set_control,
            lists=(self.arch.num_layers - layout.dense_layers) * self.num_kv_heads,
            cap=off.cap,
            local=off.local_blocks,
            block_size=self.block_size,
        )
        dm = DeviceBlockMap(layout.device_blocks, off.local_blocks, self.block_size, layout.token_blocks)
        return OffloadSpace(
            dm, self.block_size, estimate, DeviceRowMap(layout.rows, self.block_size, layout.token_blocks)
        )

    def counters(self) -> dict[str, torch.Tensor]:
        """Cumulative device counters (int64 scalars), read without a sync (engine/stats.py)."""
        return self.attn_backend.counters()

    def gauges(self) -> dict[str, int]:
        """Host-side values of the KV offload and the layer-segmented prefill."""
        out = {} if self.offload is None else self.offload.gauges()
        if self.layer_prefill is not None:
            out |= self.layer_prefill.progress() | {"offload_hbm_bytes_buffers": self.layer_prefill.nbytes}
        return out

    def sync(self) -> None:
        """The host store's writes so far have landed (statistics, tests)."""
        if self.offload is not None:
            self.offload.sync()

    def release_graphs(self) -> None:
        """Drops the captured decode graphs (eager from here on); before leaving an NCCL group, whose
        communicators' end may wait for every graph that launches their collectives to be destroyed."""
        self.graphs = None
        gc.collect()  # graphs in reference cycles too
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self) -> None:
        """Raises if a landed step's outputs cannot be trusted (one rank: never; TPDriver: a rank is gone)."""

    def release(self, seq_id: int, paused: bool = False) -> None:
        """A sequence finished or was preempted (paused: it resumes with what it computed): the
        backend's per-sequence state is free again."""
        self.attn_backend.release(seq_id, paused)
        if self.layer_prefill is not None:
            self.layer_prefill.release(seq_id)

    @property
    def block_bytes(self) -> int:
        a = self.arch
        kv = a.num_layers * self.num_kv_heads * 2 * self.block_size * a.head_dim * self.dtype.itemsize
        return kv + self.attn_backend.block_bytes()

    def _profile_kv_bytes(self) -> int:
        return profile_kv_bytes(
            self.model,
            self.config,
            self.arch,
            self.num_kv_heads,
            self.block_size,
            self.dtype,
            self.device,
            self.max_model_len,
            self._kernels(),
        )

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

    def prepare(self, scheduled: list[tuple[Sequence, int]], feed: TokenFeed | None = None) -> StepBatch:
        """A step's batch: host inputs (engine/step_inputs.py and the backend's), one upload (into
        the graphs' static inputs when a graph can replay it), then handed to the backend. feed
        (async scheduling): the last input token of each sequence it names is a placeholder,
        filled on the device from the previous step's sampled tokens."""
        # Decodes (one query token) first: the attention backend runs its decode kernel on them.
        scheduled = sorted(scheduled, key=lambda item: item[1] != 1)
        graph = self.graphs.begin(len(scheduled)) if self.graphs is not None and scheduled[-1][1] == 1 else None
        upload = graph if graph is not None else StepUpload(self.device)
        host, ids, fill, sampled, max_seq_len = self.inputs.build(scheduled, feed)
        num_decodes = sum(1 for _, n in scheduled if n == 1)
        host.update(self.attn_backend.step_inputs(scheduled, num_decodes))
        dev = dict(zip(host, upload.add(list(host.values()), list(host))))
        upload.commit()
        if "query_start_loc" not in dev:  # a decode step's: on the device already
            dev["query_start_loc"], dev["sample_idx"] = self.inputs.decode_ranges(len(scheduled))
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"],
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_tables=dev["block_tables"],
            num_decodes=num_decodes,
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max_seq_len,
        )
        self.attn_backend.prepare(scheduled, meta, dev)
        input_ids = dev["input_ids"]
        if feed is not None:
            if ids.count(PLACEHOLDER) != fill:
                raise RuntimeError("a placeholder token would reach the model without its feed row")
            if "fill_dst" in dev:
                input_ids.index_copy_(0, dev["fill_dst"], feed.token_ids[dev["fill_src"]])
            elif fill:  # every row from the feed's row of the same index: one copy
                input_ids.copy_(feed.token_ids[:fill])
        return StepBatch(input_ids, dev["positions"], meta, dev["sample_idx"], sampled, graph is not None)

    def sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The sampling parameters of `seqs` on the device; the previous step's again when it sampled the same
        sequences in the same order (a decode batch's usual step: a sequence's parameters never change)."""
        ids = [s.seq_id for s in seqs]
        if ids == self._sampling[0]:
            return self._sampling[1]
        ps = [s.params for s in seqs]
        vocab = self.arch.vocab_size
        logprobs = [p.logprobs for p in ps if p.logprobs is not None]
        temperature, top_k, top_p, min_p = to_device_many(
            [
                torch.tensor([p.temperature for p in ps], dtype=torch.float32),
                torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps]),
                torch.tensor([p.top_p for p in ps], dtype=torch.float32),
                torch.tensor([p.min_p for p in ps], dtype=torch.float32),
            ],
            self.device,
        )
        meta = SamplingMetadata(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={i: s.generator for i, s in enumerate(seqs) if s.generator is not None and not s.params.greedy},
            all_greedy=all(p.greedy for p in ps),
            need_top_k=any(0 < p.top_k < vocab for p in ps),
            need_top_p=any(p.top_p < 1.0 for p in ps),
            need_min_p=any(p.min_p > 0.0 for p in ps),
            max_num_logprobs=max(logprobs) if logprobs else None,
            processors=LogitsProcessors.build(seqs, vocab, self.device),
        )
        self._sampling = (ids, meta)
        return meta

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        segments: list = (),
        plan: OffloadPlan | None = None,
        feed: TokenFeed | None = None,
    ) -> tuple[list[Sequence], SamplerOutput | None]:
        """One step: the KV-offload plan (once, before any kernel), the scheduled batch (async
        scheduling: `feed` fills its placeholder tokens on the device), then the layer-segmented
        prefills' segments; one sampling over every sequence that gets a token."""
        with self._kernels():  # every op of the step on the engine's kernel path
            if self.offload is not None:
                self.offload.begin_step(plan)
                self.inputs.note_plan(plan)  # its ranges and stale blocks: the step's inputs carry them
                if not scheduled:  # no batch to carry the stale blocks
                    self.offload.drop_stale(self.inputs.take_stale())
            if self.host_cache is not None:
                self.host_cache.begin_step()
            batch = self.prepare(scheduled, feed) if scheduled else None
        sampled: list[Sequence] = []
        logits: list[torch.Tensor] = []
        with self._kernels():
            if batch is None:
                pass
            elif batch.graph and len(batch.sampled) == batch.meta.num_seqs and self.attn_backend.can_replay(batch.meta):
                logits.append(self.graphs.run(batch.meta.num_seqs))
                sampled += batch.sampled
            else:
                hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
                if (
                    self.tp.is_driver
                    and not self.inputs.steady
                    and any(s.prompt_logprobs is not None for s, _ in scheduled)
                ):
                    # (a step with a prompt chunk; rows in prepare's order: decodes first)
                    record_prompt_logprobs(
                        sorted(scheduled, key=lambda item: item[1] != 1), hidden, self.model.compute_logits
                    )
                if batch.sampled:
                    logits.append(self.model.compute_logits(hidden[batch.sample_idx]))
                    sampled += batch.sampled
            for seg in segments:
                last = self.layer_prefill.run(seg)
                if last is not None and self.tp.is_driver and seg.seq.prompt_logprobs is not None:
                    hidden = self.layer_prefill.prompt_hidden()
                    record_prompt_logprobs([(seg.seq, hidden.shape[0])], hidden, self.model.compute_logits)
                if last is not None:
                    logits.append(self.model.compute_logits(last))
                    sampled.append(seg.seq)
            if not sampled:
                return [], None
            if not self.tp.is_driver:  # only rank 0 samples; its tokens come in the next step's message ...
                if feed is None:
                    return sampled, None
                # ... or, under async scheduling, here on the device: the next step's feed (engine/parallel.py)
                return sampled, SamplerOutput(
                    self.tp.broadcast(torch.empty(len(sampled), dtype=torch.int64, device=self.device))
                )
            step_logits = logits[0] if len(logits) == 1 else torch.cat(logits)
            forced = None if self.profiler is None else self.profiler.on_logits(sampled, step_logits)
            meta = self.sampling_metadata(sampled)
            if meta.processors is not None:  # after the forward's launch: the host's part (grammar masks) overlaps it
                meta.processors.begin_step(sampled, feed)
            out = self.sampler(step_logits, meta)
            if forced is not None:
                forced = forced.to(out.token_ids.device)
                out.token_ids = torch.where(forced >= 0, forced, out.token_ids)
            if feed is not None:  # async scheduling: the other ranks' next feed (no-op at one rank)
                self.tp.broadcast(out.token_ids)
        return sampled, out
