"""OpenAI API request and response models (the subset SparseServe serves), plus vLLM extensions.

Requests ignore unknown fields, as OpenAI-compatible servers do, so clients that send extra
options keep working; options we accept but cannot honour are rejected explicitly instead.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from sparseserve.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model: str | None = None  # optional as in vLLM: the (first) served model when absent
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams validates the values and raises ValueError with a user-facing message."""
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported")
        kw: dict[str, Any] = dict(n=self.n, temperature=self.temperature, top_p=self.top_p,
                                  max_tokens=max_tokens, ignore_eos=self.ignore_eos)
        optional = dict(top_k=self.top_k, min_p=self.min_p, stop=self.stop,
                        stop_token_ids=self.stop_token_ids, seed=self.seed, logprobs=logprobs)
        kw.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**kw)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer OpenAI name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


# ---- responses ---------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role": ...} first, then {"content": ...}, {} with the finish_reason
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sparseserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- logprob conversion --------------------------------------------------------------------
# `logprobs` of a CompletionOutput: one dict[token_id, Logprob] per generated token; the sampled
# token is always in it, its alternatives carry ranks 1..k.


def _top(entry: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The k best alternatives of one position, best first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k),
                  key=lambda t_lp: t_lp[1].rank)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]], k: int, offset: int,
                        decode: Any) -> CompletionLogprobs:
    """Legacy completions format; `offset` is the text offset of the first token."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry[tid]
        token = sampled.decoded_token if sampled.decoded_token is not None else decode(tid)
        out.tokens.append(token)
        out.token_logprobs.append(sampled.logprob)
        out.top_logprobs.append({(lp.decoded_token if lp.decoded_token is not None else decode(t)): lp.logprob
                                 for t, lp in _top(entry, k)} if k else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]], k: int, decode: Any) -> ChatLogprobs:
    def item(tid: int, lp: Any) -> TopLogprob:
        token = lp.decoded_token if lp.decoded_token is not None else decode(tid)
        return TopLogprob(token=token, logprob=max(lp.logprob, -9999.0), bytes=list(token.encode("utf-8")))

    content = []
    for tid, entry in zip(token_ids, logprobs):
        sampled = item(tid, entry[tid])
        tops = [item(t, lp) for t, lp in _top(entry, k)]
        content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)


# ---- RequestOutput -> responses ---------------------------------------------------------------


@dataclass
class Delta:
    """What one choice gained since the last chunk."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Any]] | None
    text_offset: int
    finish_reason: str | None


@dataclass
class DeltaState:
    """Per-choice progress of a stream. Outputs are cumulative, so deltas are computed here."""
    text_sent: dict[int, int] = field(default_factory=dict)
    tokens_sent: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def deltas(self, out: Any, hold: int) -> list[Delta]:
        """`hold` characters stay back until the choice finishes: a stop string being matched may
        still be cut from the end of the text, and what was sent cannot be taken back."""
        result = []
        for c in out.outputs:
            if c.index in self.done:
                continue
            t0, k0 = self.text_sent.get(c.index, 0), self.tokens_sent.get(c.index, 0)
            end = len(c.text) if c.finish_reason is not None else max(t0, len(c.text) - hold)
            new_lp = c.logprobs[k0:] if c.logprobs is not None else None
            if end == t0 and len(c.token_ids) == k0 and c.finish_reason is None:
                continue
            result.append(Delta(c.index, c.text[t0:end], list(c.token_ids[k0:]), new_lp, t0, c.finish_reason))
            self.text_sent[c.index], self.tokens_sent[c.index] = end, len(c.token_ids)
            if c.finish_reason is not None:
                self.done.add(c.index)
        return result


def usage_of(out: Any) -> UsageInfo:
    prompt = len(out.prompt_token_ids or [])
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionFormat:
    def __init__(self, request_id: str, model: str, logprobs: int | None, tokenizer: Any) -> None:
        self.id, self.model, self.k = request_id, model, logprobs
        self._decode = lambda tid: tokenizer.decode([tid])

    def _logprobs(self, token_ids: list[int], lps: Any, offset: int) -> CompletionLogprobs | None:
        if self.k is None or lps is None:
            return None
        return completion_logprobs(token_ids, lps, self.k, offset, self._decode)

    def chunks(self, deltas: list[Delta]) -> list[BaseModel]:
        return [CompletionResponse(id=self.id, model=self.model, choices=[CompletionChoice(
            index=d.index, text=d.text, logprobs=self._logprobs(d.token_ids, d.logprobs, d.text_offset),
            finish_reason=d.finish_reason)]) for d in deltas]

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=usage)

    def full_response(self, out: Any) -> BaseModel:
        choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                    logprobs=self._logprobs(list(c.token_ids), c.logprobs, 0))
                   for c in out.outputs]
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage_of(out))


class ChatFormat:
    def __init__(self, request_id: str, model: str, top_logprobs: int | None, tokenizer: Any) -> None:
        self.id, self.model, self.k = request_id, model, top_logprobs
        self._decode = lambda tid: tokenizer.decode([tid])
        self._role_sent: set[int] = set()

    def _logprobs(self, token_ids: list[int], lps: Any) -> ChatLogprobs | None:
        if self.k is None or lps is None:
            return None
        return chat_logprobs(token_ids, lps, self.k, self._decode)

    def chunks(self, deltas: list[Delta]) -> list[BaseModel]:
        out = []
        for d in deltas:
            delta = {"content": d.text}
            if d.index not in self._role_sent:  # OpenAI opens every choice with its role
                self._role_sent.add(d.index)
                delta["role"] = "assistant"
            out.append(ChatCompletionChunk(id=self.id, model=self.model, choices=[ChatStreamChoice(
                index=d.index, delta=delta, logprobs=self._logprobs(d.token_ids, d.logprobs),
                finish_reason=d.finish_reason)]))
        return out

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)

    def full_response(self, out: Any) -> BaseModel:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(list(c.token_ids), c.logprobs), finish_reason=c.finish_reason)
                   for c in out.outputs]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage_of(out))
