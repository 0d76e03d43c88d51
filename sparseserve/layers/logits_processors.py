"""The sampler's logits processors: structured outputs' token masks, min_tokens, logit_bias and the penalties
(repetition, frequency, presence), batched on the device.

A batch's parameters are built once when its sequences change (`LogitsProcessors.build`, None when no
sequence uses any, so such a batch pays nothing); `begin_step` sets the per-step inputs (output tokens,
output lengths, grammar bitmasks) after the step's forward pass was launched; `apply` changes the logits in
place. Nothing here loops over tokens in Python: per-step host work is per sequence (list slices, a padded
tensor), per-token work is on the device.

Async scheduling (engine/overlap.py): the last token of a sequence may still be a placeholder (-1) whose value
is on the device in the feed; penalties read it there; a grammar needs it on the host: it waits for the
previous step's host copy (the feed's event), not for the step's own forward (docs/structured_outputs.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# small uploads through the pinned staging ring: a pageable copy waits for the stream's queued work (the forward)
from sparseserve.kvcache.transfer import to_device

PLACEHOLDER = -1  # engine/overlap.py's (layers/ does not import the engine)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] (int32 words, bit t % 32 of word t // 32) is 0."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:  # tokens past the mask's words are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """vLLM's order and definitions, in place. repetition [B]: a logit of a token in the prompt or the output is
    divided by it when positive, multiplied when not; then frequency [B] * count and presence [B] * (count > 0)
    of the output's tokens are subtracted."""
    seen = output_counts > 0
    if prompt_mask is not None:
        seen_any = seen | prompt_mask
        r = repetition[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen_any, scaled, logits))
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * seen


@dataclass
class LogitsProcessors:
    """One batch's processors (rows are the batch's sampled sequences, in order)."""

    vocab_size: int
    device: torch.device
    # penalties: rows that use any, their parameters, and the prompt tokens' mask (repetition only)
    penalty_rows: list[int] = field(default_factory=list)
    penalty_params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # repetition, frequency, presence
    prompt_mask: torch.Tensor | None = None
    # logit_bias: (rows, token ids, values)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # min_tokens: rows, their minimum, and the token ids each masks ([R, S], padded with vocab_size)
    min_rows: list[int] = field(default_factory=list)
    min_stop_ids: torch.Tensor | None = None
    # structured outputs: rows with a grammar (the sequence's `grammar`)
    grammar_rows: list[int] = field(default_factory=list)
    # per step (`begin_step`)
    output_counts: torch.Tensor | None = None
    min_active: torch.Tensor | None = None  # bool [len(min_rows)]
    bitmask: torch.Tensor | None = None  # int32 [len(grammar_rows), words] on the device
    _rows: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, seqs: list[Any], vocab_size: int, device: torch.device) -> LogitsProcessors | None:
        """From the sequences' `params` (SamplingParams) and `grammar`; None when no sequence needs one."""
        ps = [s.params for s in seqs]
        grammar_rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        penalty_rows = [i for i, p in enumerate(ps) if p.needs_penalties]
        bias_rows = [i for i, p in enumerate(ps) if p.logit_bias]
        # a grammar decides when its output may end (it allows EOS only once the structure is complete)
        min_rows = [i for i, p in enumerate(ps) if p.min_tokens and i not in grammar_rows]
        if not (grammar_rows or penalty_rows or bias_rows or min_rows):
            return None
        proc = cls(vocab_size, device, penalty_rows=penalty_rows, min_rows=min_rows, grammar_rows=grammar_rows)
        rows = {"penalty": penalty_rows, "min": min_rows, "grammar": grammar_rows}
        proc._rows = {k: to_device(torch.tensor(v, dtype=torch.long), device) for k, v in rows.items() if v}
        if penalty_rows:
            pp = [ps[i] for i in penalty_rows]
            proc.penalty_params = tuple(
                to_device(torch.tensor([getattr(p, name) for p in pp], dtype=torch.float32), device)
                for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
            )
            if any(p.repetition_penalty != 1.0 for p in pp):
                proc.prompt_mask = token_mask([seqs[i].prompt_token_ids for i in penalty_rows], vocab_size, device)
        if bias_rows:
            r, t, v = [], [], []
            for i in bias_rows:
                for tid, val in ps[i].logit_bias.items():
                    r.append(i)
                    t.append(tid)
                    v.append(val)
            proc.bias = (
                to_device(torch.tensor(r), device),
                to_device(torch.tensor(t), device),
                to_device(torch.tensor(v, dtype=torch.float32), device),
            )
        if min_rows:
            stops = [sorted(ps[i].all_stop_token_ids | set(ps[i].stop_token_ids)) for i in min_rows]
            width = max(1, max(map(len, stops)))
            padded = [s + [vocab_size] * (width - len(s)) for s in stops]
            proc.min_stop_ids = to_device(torch.tensor(padded, dtype=torch.long), device)
        return proc

    def begin_step(self, seqs: list[Any], feed: Any = None) -> None:
        """The step's inputs; feed (async scheduling, engine/overlap.py TokenFeed): the previous step's
        tokens, `feed.token_ids[feed.rows[seq_id]]` a trailing placeholder's value. Called after the
        forward pass was launched: the host work overlaps it."""
        feed_rows = feed.rows if feed is not None else {}
        feed_tokens = feed.token_ids if feed is not None else None
        if self.penalty_rows:
            self.output_counts = self._output_counts([seqs[i] for i in self.penalty_rows], feed_tokens, feed_rows)
        if self.min_rows:
            lens = [len(seqs[i].token_ids) - len(seqs[i].prompt_token_ids) for i in self.min_rows]
            mins = [seqs[i].params.min_tokens for i in self.min_rows]
            self.min_active = to_device(torch.tensor([n < m for n, m in zip(lens, mins)]), self.device)
        if self.grammar_rows:
            from sparseserve.structured.bitmask import fill_bitmask

            grammars = [seqs[i] for i in self.grammar_rows]
            tails = None
            if feed_rows and feed_tokens is not None:
                pending = [
                    (j, feed_rows[s.seq_id])
                    for j, s in enumerate(grammars)
                    if s.token_ids and s.token_ids[-1] == PLACEHOLDER and s.seq_id in feed_rows
                ]
                if pending:  # the previous step's tokens: their host copy (not behind this step's forward)
                    values = feed.host_values([r for _, r in pending])
                    tails = {j: v for (j, _), v in zip(pending, values)}
            self.bitmask = fill_bitmask(grammars, tails, self.vocab_size, self.device)

    def _output_counts(
        self, seqs: list[Any], feed_tokens: torch.Tensor | None, feed_rows: dict[int, int]
    ) -> torch.Tensor:
        """int32 [R, vocab]: each output token's count per row (placeholders read from the feed on the device)."""
        outs = [s.token_ids[len(s.prompt_token_ids) :] for s in seqs]
        width = max(1, max(map(len, outs)))
        pad = self.vocab_size  # a column past the vocabulary, dropped
        ids = to_device(torch.tensor([o + [pad] * (width - len(o)) for o in outs], dtype=torch.long), self.device)
        if feed_tokens is not None and any(o and o[-1] == PLACEHOLDER for o in outs):
            src = to_device(torch.tensor([feed_rows.get(s.seq_id, 0) for s in seqs]), self.device)
            ids = torch.where(ids == PLACEHOLDER, feed_tokens[src][:, None], ids)
        counts = torch.zeros(len(seqs), self.vocab_size + 1, dtype=torch.int32, device=self.device)
        counts.scatter_add_(1, ids.clamp_(0, pad), torch.ones_like(ids, dtype=torch.int32))
        return counts[:, : self.vocab_size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """In place, in vLLM's order: the grammar's mask, min_tokens, logit_bias, penalties."""
        if self.bitmask is not None:
            apply_token_bitmask(logits, self._rows["grammar"], self.bitmask)
        if self.min_rows:
            rows = self._rows["min"][self.min_active]
            stop = self.min_stop_ids[self.min_active]
            masked = torch.nn.functional.pad(logits[rows], (0, 1)).scatter_(1, stop, float("-inf"))
            logits[rows] = masked[:, : self.vocab_size]
        if self.bias is not None:
            logits.index_put_(self.bias[:2], self.bias[2], accumulate=True)
        if self.penalty_rows:
            rows = self._rows["penalty"]
            sub = logits[rows]
            apply_penalties(sub, self.prompt_mask, self.output_counts, *self.penalty_params)
            logits[rows] = sub
        return logits


def token_mask(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [len(token_lists), vocab]: which tokens each list holds."""
    width = max(1, max(map(len, token_lists)))
    ids = to_device(torch.tensor([t + [vocab_size] * (width - len(t)) for t in token_lists], dtype=torch.long), device)
    mask = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab_size]
