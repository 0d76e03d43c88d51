"""Batched sampling on tensors: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs, after the
logits processors (structured outputs' masks, min_tokens, logit_bias, penalties: logits_processors.py).

Sampling draws Exponential(1) noise q and takes argmax(p / q), which samples from p. Seeded
requests draw their noise from their own generator, so their output does not depend on which
other requests share the batch; the rest share one engine generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseserve.layers.logits_processors import LogitsProcessors


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    top_k: torch.Tensor  # int64 [B]; vocab size when disabled
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_num_logprobs: int | None  # None: no row asked for logprobs
    processors: LogitsProcessors | None = None  # None: no row uses one (the batch pays nothing)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B, 1 + K]: sampled token, then top-K
    logprob_token_ids: torch.Tensor | None = None  # int64 [B, 1 + K]
    sampled_ranks: torch.Tensor | None = None  # int64 [B]: rank of the sampled token (1 = best)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = raw = logits.float()
        if meta.processors is not None:  # on a copy: logprobs report the model's raw distribution (vLLM's)
            logits = meta.processors.apply(raw.clone())
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            tokens = greedy
        else:
            tokens = torch.where(meta.temperature == 0, greedy, self._sample(logits, meta))
        out = SamplerOutput(token_ids=tokens)
        if meta.max_num_logprobs is not None:
            # Logprobs of the model's raw distribution, as vLLM reports them.
            logprobs = torch.log_softmax(raw, dim=-1)
            top_lp, top_ids = logprobs.topk(meta.max_num_logprobs, dim=-1)
            sampled_lp = logprobs.gather(1, tokens[:, None])
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
            out.logprob_token_ids = torch.cat([tokens[:, None], top_ids], dim=1)
            out.sampled_ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
        return out

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temp = torch.where(meta.temperature == 0, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp[:, None]
        if meta.need_top_k or meta.need_top_p:
            logits = apply_top_k_top_p(
                logits, meta.top_k if meta.need_top_k else None, meta.top_p if meta.need_top_p else None
            )
        probs = torch.softmax(logits, dim=-1)
        if meta.need_min_p:
            keep = probs >= meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs * keep
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in meta.generators.items():  # one loop iteration per seeded request, not per token
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks logits outside each row's top-k and top-p set with -inf (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]  # the most likely token always stays (mass_before = 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
