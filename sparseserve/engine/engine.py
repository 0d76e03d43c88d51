"""LLMEngine: requests in, one scheduled model step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from sparseserve.config import EngineConfig
from sparseserve.engine.detokenizer import Detokenizer, check_stop
from sparseserve.engine.kv_memory import with_offload_defaults
from sparseserve.engine.overlap import HostCopies, InflightStep, TokenFeed
from sparseserve.engine.parallel import build_runner
from sparseserve.engine.request import Sequence, SequenceStatus
from sparseserve.engine.scheduler import KVCacheManager, SchedulerOutput, build_scheduler
from sparseserve.engine.stats import DeviceCounters, EngineStats
from sparseserve.engine.warm_up import warm_up_prompts
from sparseserve.kvcache.blocks import BlockAllocator
from sparseserve.layers.sampler import SamplerOutput
from sparseserve.models.loader import load_tokenizer, resolve_model_dir
from sparseserve.outputs import CompletionOutput, Logprob, RequestOutput
from sparseserve.profiler import Profiler
from sparseserve.sampling_params import ParameterError, SamplingParams, is_int

logger = logging.getLogger(__name__)
# Sequence.finished, read directly in a step's per-sequence loops (property calls add up there)
FINISHED = SequenceStatus.FINISHED


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    # What the deltas have carried so far, per sequence: output tokens, characters of text.
    tokens_sent: list[int] = field(init=False)
    text_sent: list[int] = field(init=False)
    finished_sent: set[int] = field(default_factory=set)  # sequences whose final delta went out

    def __post_init__(self) -> None:
        self.tokens_sent = [0] * len(self.seqs)
        self.text_sent = [0] * len(self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, profiler: Profiler | None = None) -> None:
        """profiler: optional hooks for benchmarks and probes (sparseserve/profiler.py)."""
        self.profiler = profiler
        mc = config.model_config
        model_dir = resolve_model_dir(mc.model)
        self.config = config = with_offload_defaults(config, model_dir)  # those that depend on the model
        # A GGUF file or a known model name is served under its own name, not its directory's.
        self.model_name = "sparseserve-default" if mc.model is None else os.path.basename(os.path.normpath(mc.model))
        self.model_runner = build_runner(config, model_dir, profiler)  # refuses bad models first
        try:
            self.tokenizer = load_tokenizer(mc.tokenizer or model_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"could not load a tokenizer from {mc.tokenizer or model_dir}: {e}") from e
        self._detokenize = Detokenizer(self.tokenizer)
        self.max_model_len = self.model_runner.max_model_len
        runner = self.model_runner
        cc = config.cache_config
        self.allocator = BlockAllocator(runner.num_blocks, enable_caching=cc.enable_prefix_caching)
        # a sparse policy attends one-token chunks as decode rows: prompt chunks take >= 2 tokens
        kv = KVCacheManager(
            config.scheduler_config,
            self.allocator,
            cc.block_size,
            device_space=runner.build_offload_space(),
            host_cache=runner.host_cache,
            max_model_len=self.max_model_len,
            min_chunk=2 if config.sparse_config.enabled else 1,
        )
        self.scheduler = build_scheduler(config, kv, num_layers=runner.arch.num_layers, device_type=runner.device.type)
        self.counters = DeviceCounters(runner.counters())
        # resolved: its default is on with KV offload on CUDA (readers use this, not the config's field)
        self.async_scheduling = config.schedules_async(runner.device.type)
        if self.async_scheduling and config.scheduler_config.async_scheduling is None:
            logger.info("KV offload: async scheduling on by default (--no-async-scheduling turns it off)")
        self._inflight: InflightStep | None = None  # async scheduling: the step not yet landed
        self._host_copies = HostCopies()  # ... and the pinned buffers its outputs are copied into
        eos = set(self.model_runner.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._stats_start: EngineStats | None = None  # counters after the warm-up: get_stats' zero
        if runner.device.type == "cuda":
            self.warm_up()
        logger.info(
            "engine ready: model=%s device=%s dtype=%s max_model_len=%d",
            model_dir,
            self.model_runner.device,
            self.model_runner.dtype,
            self.max_model_len,
        )

    def warm_up(self) -> None:
        """Runs the step kinds the first requests meet, so they never wait for a kernel's JIT
        compilation (docs/engine.md, "The warm-up"). Afterwards no block is held or cached and the
        statistics start from zero. Runs by itself on CUDA."""
        bs = self.config.cache_config.block_size
        rounds = warm_up_prompts(
            bs,
            self.config.scheduler_config.max_num_batched_tokens,
            self.max_model_len,
            self.allocator.num_blocks,
            self.model_runner.arch.vocab_size,
        )
        if not rounds:
            return
        t0, steps = time.perf_counter(), 0
        for odd, prompts in enumerate(rounds):
            for i, prompt in enumerate(prompts):
                self.add_request(
                    f"warm-up-{odd}-{i}",
                    prompt,
                    SamplingParams(temperature=0.0, max_tokens=8 if i == 0 else 4, ignore_eos=True),
                )
            for _ in range(1000):
                if not (self.has_unfinished_requests() or self._inflight is not None):
                    break
                self.step()
                steps += 1
            if self.has_unfinished_requests():  # not expected: nothing of it may stay in the engine
                logger.warning("warm-up did not finish; its requests are aborted")
                self.abort_request(list(self.requests))
                while self._inflight is not None:
                    self.step()
        self.reset_prefix_cache()
        self._stats_start = None  # counted from the start
        self._stats_start = self.get_stats(sync=True)
        logger.info("warm-up: %d steps in %.1f s", steps, time.perf_counter() - t0)

    @classmethod
    def from_kwargs(cls, profiler: Profiler | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs), profiler)

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return None, list(prompt)
        raise ParameterError("a prompt must be a string, a list of token ids, or {'prompt_token_ids': [...]}", "prompt")

    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None
    ) -> None:
        """Validates fully before anything is allocated: an invalid request raises ValueError and changes nothing."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ParameterError("cache_salt must be a non-empty string", "cache_salt")
        if not ids or text == "":  # an empty string is empty even if the tokenizer adds a BOS
            raise ParameterError("the prompt is empty", "prompt")
        vocab = self.model_runner.arch.vocab_size
        if not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise ParameterError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ParameterError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        if len(ids) >= self.max_model_len:
            raise ParameterError(
                f"the prompt has {len(ids)} tokens; with at least one output token that exceeds "
                f"max_model_len={self.max_model_len}",
                "prompt",
            )
        sc = self.config.scheduler_config
        if not sc.enable_chunked_prefill and len(ids) > sc.max_num_batched_tokens:
            raise ParameterError(
                f"the prompt has {len(ids)} tokens, more than max_num_batched_tokens="
                f"{sc.max_num_batched_tokens} with chunked prefill disabled",
                "prompt",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            # vLLM's behaviour offline: generate what fits, end with finish_reason "length", and say so.
            logger.warning(
                "request %s: max_tokens=%d is cut to %d by max_model_len=%d (%d prompt tokens)",
                request_id,
                params.max_tokens,
                self.max_model_len - len(ids),
                self.max_model_len,
                len(ids),
            )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ParameterError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if params.prompt_logprobs is not None:
            if self.config.parallel_config.tensor_parallel_size > 1:
                raise ParameterError(
                    "prompt_logprobs is not supported with tensor_parallel_size > 1", "prompt_logprobs"
                )
            # every prompt token of every sequence computed, none served by the prefix cache
            salt = f"prompt-logprobs:{request_id}:{next(self._seq_ids)}"
        grammar = None
        if params.structured_outputs is not None:  # the server compiled it already (a cache hit here)
            from sparseserve.structured import structured_backend

            grammar = structured_backend(self).compile(params.structured_outputs)
        params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                seed = params.seed if i == 0 else hash((params.seed, i)) & (2**63 - 1)
                gen = torch.Generator(device=self.model_runner.device).manual_seed(seed)
            seq_salt = salt if params.prompt_logprobs is None else f"{salt}:{i}"
            seqs.append(Sequence(next(self._seq_ids), request_id, i, ids, params, gen, cache_salt=seq_salt))
            if grammar is not None:
                seqs[-1].grammar = grammar.matcher()
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]  # the first token has none (OpenAI's null)
        self.requests[request_id] = _Request(request_id, text, ids, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
                    self._finish(seq)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no request holds (benchmarks start cold); returns how many."""
        return self.allocator.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self, sync: bool = False) -> EngineStats:
        """Host counters now, device counters as of the newest landed copy (one step late;
        sync=True waits for the device and the host store's writers: tests and benchmarks)."""
        runner, s = self.model_runner, self.scheduler
        if sync:
            runner.sync()
        values = self.counters.values(sync=sync)
        alloc, pc = self.allocator, s.kv.prefix_stats
        values.update(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_blocks_used=alloc.num_used,
            num_blocks_total=alloc.num_blocks,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            prefix_cache_blocks=alloc.num_cached,
            prefix_cache_evictions=alloc.num_evictions,
            host_prefix_cache_queries=pc.host_queries,
            host_prefix_cache_hits=pc.host_hits,
        )
        host_cache = runner.host_cache
        if host_cache is not None:
            values.update(
                host_prefix_cache_blocks=host_cache.num_used, host_prefix_cache_evictions=host_cache.num_evictions
            )
        if "sparse_selections" in values:
            values["sparse_block_size"] = runner.block_size
        values.update(runner.gauges())
        values.update(s.kv.gauges())
        if "offload_head_block_bytes" in values:
            hbb = values["offload_head_block_bytes"]
            values.setdefault("offload_hbm_misses", values["offload_blocks_loaded"] + values["offload_bypass_reads"])
            values["offload_h2d_bytes"] = values["offload_blocks_loaded"] * hbb
            keys = values.get("offload_prune_key_reads", 0) * (hbb // 2)  # K: a head block's first half
            values["offload_uva_bytes"] = values["offload_bypass_reads"] * hbb + keys
            written = values["offload_blocks_written"] + values["offload_d2h_blocks_written"]
            values["offload_d2h_bytes"] = written * hbb * runner.arch.num_kv_heads
        stats = EngineStats.from_values(values)
        return stats if self._stats_start is None else stats.since(self._stats_start)

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_async()
        sched = self._schedule()
        if sched.is_empty:
            return []
        sampled, out = self.model_runner.execute(sched.scheduled, sched.segments, sched.offload)
        self.counters.refresh()
        self._advance(sched)
        if out is None:
            return []
        return self._outputs(self._append_tokens(sampled, out))

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if self.profiler is not None:
            self.profiler.on_schedule(sched)
        for seq, _ in sched.preempted:  # a paused sequence keeps its token blocks
            self.model_runner.release(seq.seq_id, paused=bool(seq.block_table))
        return sched

    def _step_async(self) -> list[RequestOutput]:
        """One step of async scheduling (engine/overlap.py): schedule and launch step N+1 while N
        is in flight, then land N (its outputs are what this call returns)."""
        prev, self._inflight = self._inflight, None
        sched = self._schedule()
        launched = None
        if not sched.is_empty:
            # the plan's saves and restores run after the step in flight, which wrote them
            feed = prev.feed() if prev is not None else TokenFeed.EMPTY
            sampled, out = self.model_runner.execute(sched.scheduled, sched.segments, sched.offload, feed=feed)
            self.counters.refresh()
            launched = InflightStep.launch(sched, sampled, out, self._host_copies)
        outputs = []
        if prev is not None and prev.out is not None:
            landed = prev.wait()
            self.model_runner.check()  # under tensor parallelism: no rank died while the step ran
            outputs = self._outputs(self._append_tokens(prev.sampled, landed, prev.placeholder))
        if launched is not None:  # after prev landed: the tokens its blocks hash are real now
            self._advance(sched)
            launched.add_placeholders(self.max_model_len)
            self._inflight = launched
        return outputs

    def _advance(self, sched: SchedulerOutput) -> None:
        """A launched step's bookkeeping: its tokens computed, full blocks into the prefix cache."""
        done = [
            (seg.seq, seg.seq.num_tokens - seg.seq.num_computed_tokens)
            for seg in sched.segments
            if self.scheduler.finish_segment(seg)
        ]  # layer-segmented prefills now done
        kv = self.scheduler.kv
        bs = kv.block_size
        for seq, n in sched.scheduled + done:
            if seq.status is FINISHED:  # async scheduling: stopped or aborted while the step ran
                continue
            c, prompt = seq.num_computed_tokens, len(seq.prompt_token_ids)
            if c < prompt:
                self.num_prompt_tokens += min(n, prompt - c)
            seq.num_computed_tokens = c = c + n
            # A decode fills a block once in block_size steps: most steps skip cache_full_blocks.
            if c // bs > seq.num_cached_blocks:
                kv.cache_full_blocks(seq)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        touched = dict.fromkeys(seq.request_id for seq in seqs)  # ordered, unique
        return [self._make_output(self.requests[rid]) for rid in touched if rid in self.requests]

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.model_runner.release(seq.seq_id)

    def _append_tokens(
        self, seqs: list[Sequence], out: SamplerOutput, placeholder: list[bool] | None = None
    ) -> list[Sequence]:
        """Appends each sequence's sampled token (async scheduling: replaces its placeholder) and checks its stop
        conditions; returns the sequences that advanced."""
        tokens = out.token_ids.tolist()  # the step's one host sync
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        lp_ids = out.logprob_token_ids.tolist() if out.logprob_token_ids is not None else None
        ranks = out.sampled_ranks.tolist() if out.sampled_ranks is not None else None
        advanced = []
        detokenize, eos, max_len = self._detokenize, self.eos_token_ids, self.max_model_len
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.status is FINISHED:  # async scheduling: it stopped (or was aborted) while this step ran: dropped
                continue
            advanced.append(seq)
            if placeholder is not None and placeholder[i]:
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            self.num_generation_tokens += 1
            if lps is not None:
                seq.cumulative_logprob += lps[i][0]
                if seq.logprobs is not None:
                    k = seq.params.logprobs
                    entry = {token: Logprob(lps[i][0], ranks[i], self.tokenizer.decode([token]))}
                    for r, (tid, lp) in enumerate(zip(lp_ids[i][1 : k + 1], lps[i][1 : k + 1])):
                        entry.setdefault(tid, Logprob(lp, r + 1, self.tokenizer.decode([tid])))
                    seq.logprobs.append(entry)
            new_text = detokenize(seq)
            seq.output_text += new_text
            grammar, min_tokens = seq.grammar, seq.params.min_tokens
            if grammar is not None:
                grammar.advance(seq.token_ids, len(seq.prompt_token_ids))
            if min_tokens and len(seq.token_ids) - len(seq.prompt_token_ids) < min_tokens:
                if len(seq.token_ids) >= max_len:  # EOS and stops wait for min_tokens; max_model_len does not
                    seq.finish_reason = "length"
            else:
                check_stop(seq, new_text, eos, max_len)
            if grammar is not None and seq.finish_reason is None and grammar.is_stopped:
                seq.finish_reason = "stop"  # the constraint is complete (or broken): nothing else may follow
            if seq.finish_reason is not None:
                self._finish(seq)
        return advanced

    def _make_output(self, req: _Request) -> RequestOutput:
        """The step's delta of a request: per sequence that advanced, its new tokens, logprobs and text (the
        last `stop_hold` characters stay back until it finishes; see SamplingParams.stop_hold). A finished
        request leaves the table."""
        seqs = req.seqs
        # (runs per request and step: n = 1 without a generator, lengths straight from the lists)
        finished = seqs[0].status is FINISHED if len(seqs) == 1 else all(s.status is FINISHED for s in seqs)
        if finished:
            self.requests.pop(req.request_id, None)
        outs = []
        prompt_logprobs = None
        for s in seqs:
            i = s.index
            k0, ids, prompt = req.tokens_sent[i], s.token_ids, len(s.prompt_token_ids)
            done = s.finish_reason is not None
            if (len(ids) - prompt == k0 and not done) or i in req.finished_sent:
                continue
            if k0 == 0 and s.prompt_logprobs is not None:  # with the request's first delta (complete by then)
                prompt_logprobs = s.prompt_logprobs
            text, t0 = s.output_text, req.text_sent[i]
            t1 = len(text) if done else max(t0, len(text) - s.params.stop_hold)
            lps = s.logprobs
            outs.append(
                CompletionOutput(  # positional: matching seven keywords is a visible part of the call
                    i,
                    text[t0:t1],
                    ids[prompt + k0 :],
                    s.cumulative_logprob if s.params.logprobs is not None else None,
                    lps[k0:] if lps is not None else None,
                    s.finish_reason,
                    s.stop_reason,
                )
            )
            req.tokens_sent[i], req.text_sent[i] = len(ids) - prompt, t1
            if done:
                req.finished_sent.add(i)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            finished,
            num_cached_tokens=seqs[0].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
