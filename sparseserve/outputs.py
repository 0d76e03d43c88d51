"""What generation returns, with vLLM's names.

The engine emits deltas (vLLM's `RequestOutputKind.DELTA`): each `RequestOutput` of
`LLMEngine.step()` carries, per sequence that advanced, only the step's new tokens, text and
logprobs, with the finish reason once it finishes. `RequestOutput.add` folds later deltas into an
earlier one; `LLM.generate` returns the folded (cumulative) outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # of every token so far, in a delta too
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Appends a later delta of the same sequence."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (None: not yet)
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), in the first delta
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, delta: RequestOutput) -> None:
        """Folds a later delta of the same request into this output (vLLM's `RequestOutput.add`):
        each sequence's texts, token ids and logprobs are concatenated, the rest is the newest."""
        mine = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in mine:
                mine[c.index].add(c)
            else:
                mine[c.index] = CompletionOutput(
                    c.index,
                    c.text,
                    list(c.token_ids),
                    c.cumulative_logprob,
                    list(c.logprobs) if c.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
        self.outputs = sorted(mine.values(), key=lambda c: c.index)
        self.finished = delta.finished
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
