"""Prompt logprobs (SamplingParams.prompt_logprobs; the completions API's `echo` with `logprobs`): each prompt
token's logprob under the model at the position before it, computed from a prefill chunk's hidden states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sparseserve.outputs import Logprob

ROWS = 256  # positions per logits slice: a chunk's full [tokens, vocab] logits may not fit


def record_prompt_logprobs(
    scheduled: list[tuple[Any, int]], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """For each (sequence, tokens) of a step, in the batch's row order, whose sequence keeps `prompt_logprobs`
    (a list, as far as computed: entry j for prompt token j): appends the entries its chunk's positions give.
    Position q predicts prompt token q + 1; a recomputed chunk (after a preemption) adds nothing twice."""
    offset = 0
    for seq, n in scheduled:
        lps = seq.prompt_logprobs
        if lps is not None:
            c, prompt = seq.num_computed_tokens, seq.prompt_token_ids
            k = seq.params.prompt_logprobs
            for lo in range(max(c, len(lps) - 1), min(c + n, len(prompt) - 1), ROWS):
                hi = min(lo + ROWS, c + n, len(prompt) - 1)
                logprobs = torch.log_softmax(compute_logits(hidden[offset + lo - c : offset + hi - c]).float(), -1)
                targets = torch.tensor(prompt[lo + 1 : hi + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])
                ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
                top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
                for t, lp, rank, alt_lp, alt_ids in zip(
                    targets.tolist(), chosen[:, 0].tolist(), ranks, top_lp.tolist(), top_ids.tolist()
                ):
                    entry = {t: Logprob(lp, rank)}
                    for r, (tid, alp) in enumerate(zip(alt_ids, alt_lp)):
                        entry.setdefault(tid, Logprob(alp, r + 1))
                    lps.append(entry)
        offset += n
