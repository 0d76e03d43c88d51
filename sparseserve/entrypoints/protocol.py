"""OpenAI API request and response models (the subset SparseServe serves), plus vLLM extensions.

Requests ignore unknown fields, as OpenAI-compatible servers do, so clients that send extra
options keep working; options we accept but cannot honour are rejected explicitly instead.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, Field, StrictInt

from sparseserve.sampling_params import SEED_MAX, SEED_MIN, ParameterError, SamplingParams, StructuredOutputsParams


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
    continuous_usage_stats: bool = False  # vLLM's: accepted; usage comes once, at the end


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    # "schema" is a BaseModel attribute: stored as json_schema, read and written as "schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = {"populate_by_name": True}


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (free), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` field: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    model_config = {"populate_by_name": True}


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
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        """SamplingParams validates the values and raises ParameterError with a user-facing message (`param` names
        the request's field). extra: more SamplingParams fields (prompt_logprobs, a tool choice's constraint)."""
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options can only be set with stream=true", "stream_options")
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        optional = dict(
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            logprobs=logprobs,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            structured_outputs=self.structured_constraint(),
        )
        kw.update({k: v for k, v in optional.items() if v is not None})
        if "structured_outputs" in kw and extra.get("structured_outputs") is not None:
            raise ParameterError(
                "a tool_choice of required or a named function constrains the output itself; "
                "it cannot be combined with response_format or structured_outputs",
                "tool_choice",
            )
        kw.update({k: v for k, v in extra.items() if v is not None})
        return SamplingParams(**kw)

    def structured_constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint from response_format, structured_outputs or the guided_* fields (one of them)."""
        found = self._constraints()
        if not found:
            return None
        if len(found) > 1:
            raise ParameterError(
                f"the output can have one constraint; got {', '.join(p for p, _ in found)}", found[1][0]
            )
        param, fields = found[0]
        try:
            return StructuredOutputsParams(**fields)
        except ParameterError as e:
            raise ParameterError(str(e), param) from None

    def constraint_param(self) -> str | None:
        """The field that constrains the output (the `param` of its errors)."""
        found = self._constraints()
        return found[0][0] if found else None

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ParameterError(
                    "response_format of type json_schema needs json_schema.schema", "response_format.json_schema"
                )
            found.append(("response_format", {"json": rf.json_schema.json_schema}))
        so = self.structured_outputs
        if so is not None:
            fields = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": so.json_object,
            }
            found.append(
                (
                    "structured_outputs",
                    {k: v for k, v in fields.items() if v is not None}
                    | {"disable_any_whitespace": so.disable_any_whitespace},
                )
            )
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", {kind: value}))
        return found

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """prompt: one prompt (a string or token ids) or a list of them, each its own choices (index = prompt * n +
    choice, as OpenAI's)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None

    MAX_PROMPTS: ClassVar[int] = 64

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts; ParameterError for the fields this server refuses (as vLLM V1)."""
        if self.suffix is not None:
            raise ParameterError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != 1:
            raise ParameterError("best_of is not supported (as in vLLM V1): only 1; use n for more outputs", "best_of")
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(q) == 0 for q in prompts):
            raise ParameterError("prompt must not be empty", "prompt")
        if len(prompts) > self.MAX_PROMPTS:
            raise ParameterError(f"at most {self.MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        return prompts


class ChatContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None  # newer OpenAI name of max_tokens
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def logprobs_k(self) -> int | None:
        """Alternatives per token: None without logprobs; top_logprobs needs logprobs (OpenAI's rule)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


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
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    # {"role": ...} first, then {"content": ...} or {"tool_calls": [...]}, {} with the finish_reason
    delta: dict[str, Any]
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
    root: str | None = None  # vLLM's: the model it serves


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
