"""OpenAI API request and response models (the subset SparseServe serves), plus vLLM extensions.

Requests ignore unknown fields, as OpenAI-compatible servers do, so clients that send extra
options keep working; options we accept but cannot honour are rejected explicitly instead.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, StrictInt

from sparseserve.sampling_params import SEED_MAX, SEED_MIN, ParameterError, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def invalid_unicode(value: Any, path: str = "") -> str | None:
    """The path ("prompt", "messages.0.content") of the first string in a parsed JSON value that is not valid
    Unicode: JSON may escape a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or encoder accepts."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = invalid_unicode(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic's lax mode would take true as 1
        raise ValueError("expected a number, got a boolean")
    return value


# Numbers that refuse JSON booleans (token ids are StrictInt).
Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model: str | None = None  # optional as in vLLM: the (first) served model when absent
    max_tokens: Int | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int | None = None
    min_p: Float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # strict: JSON true is no token id
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    frequency_penalty: Float = 0.0
    presence_penalty: Float = 0.0
    user: str | None = None
    # vLLM's extension: only requests with the same salt share prefix-cache blocks (tenant isolation)
    cache_salt: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams validates the values and raises ParameterError with a user-facing message."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ParameterError(f"{name} is not supported", name)
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
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: Int | None = Field(default=None, ge=0, le=20)
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
    max_completion_tokens: Int | None = None  # newer OpenAI name of max_tokens
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


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
