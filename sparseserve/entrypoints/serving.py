"""Turning engine outputs into OpenAI responses: logprobs, stream deltas, SSE events, and the
final output of a non-streamed request (watching for a client that goes away)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from sparseserve.engine.async_engine import RequestAborted
from sparseserve.entrypoints.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from sparseserve.entrypoints.tools import ToolPlan, ToolStream, output_calls
from sparseserve.outputs import CompletionOutput

logger = logging.getLogger(__name__)


def _top(entry: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The k best alternatives of one position, best first."""
    return sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k), key=lambda t_lp: t_lp[1].rank
    )


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Any]], k: int, offset: int, decode: Any
) -> CompletionLogprobs:
    """Legacy completions format; `offset` is the text offset of the first token."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry[tid]
        token = sampled.decoded_token if sampled.decoded_token is not None else decode(tid)
        out.tokens.append(token)
        out.token_logprobs.append(sampled.logprob)
        out.top_logprobs.append(
            {(lp.decoded_token if lp.decoded_token is not None else decode(t)): lp.logprob for t, lp in _top(entry, k)}
            if k
            else None
        )
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
class StreamState:
    """Per-choice progress of a response, built from the engine's deltas (the engine holds back the text
    that a stop string may still cut, so every delta's text is final)."""

    prompt_tokens: int = 0
    cached_tokens: int | None = None
    text_len: dict[int, int] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)

    def deltas(self, out: Any) -> list[Delta]:
        self.prompt_tokens = num_prompt_tokens(out)
        if getattr(out, "num_cached_tokens", None) is not None:
            self.cached_tokens = out.num_cached_tokens
        result = []
        for c in out.outputs:
            offset = self.text_len.get(c.index, 0)
            result.append(Delta(c.index, c.text, list(c.token_ids), c.logprobs, offset, c.finish_reason))
            self.text_len[c.index] = offset + len(c.text)
            self.num_tokens[c.index] = self.num_tokens.get(c.index, 0) + len(c.token_ids)
        return result

    def usage(self) -> UsageInfo:
        completion = sum(self.num_tokens.values())
        return usage_info(self.prompt_tokens, completion, self.cached_tokens)


def num_prompt_tokens(out: Any) -> int:
    """A RequestOutput's prompt tokens, or the sum of a PromptsOutput's."""
    n = getattr(out, "num_prompt_tokens", None)
    return len(out.prompt_token_ids or []) if n is None else n


def usage_of(out: Any) -> UsageInfo:
    """Usage of a cumulative (folded) output."""
    return usage_info(
        num_prompt_tokens(out), sum(len(c.token_ids) for c in out.outputs), getattr(out, "num_cached_tokens", None)
    )


def usage_info(prompt: int, completion: int, cached: int | None) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached),
    )


def reported(usage: UsageInfo, cached_tokens: bool) -> UsageInfo:
    """The usage a client sees: cached_tokens only when the server reports it (--enable-prompt-tokens-details)."""
    return usage if cached_tokens else usage.model_copy(update={"prompt_tokens_details": None})


class CompletionFormat:
    """Completions' responses. prompts: the request's prompts (echo: each choice's text and logprobs start with
    its prompt's; echo_only: max_tokens 0, the one generated token is dropped)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: int | None,
        tokenizer: Any,
        cached_tokens: bool = False,
        prompts: Prompts | None = None,
        echo: bool = False,
        echo_only: bool = False,
    ) -> None:
        self.id, self.model, self.k, self.cached_tokens = request_id, model, logprobs, cached_tokens
        self._decode = lambda tid: tokenizer.decode([tid])
        self.prompts, self.echo, self.echo_only = prompts, echo, echo_only
        self._echoed: set[int] = set()
        self._offset: dict[int, int] = {}  # streamed: text characters sent per choice (logprobs' text_offset)

    def _logprobs(self, token_ids: list[int], lps: Any, offset: int) -> CompletionLogprobs | None:
        if self.k is None or lps is None:
            return None
        return completion_logprobs(token_ids, lps, self.k, offset, self._decode)

    def _choice(
        self, index: int, text: str, token_ids: list[int], lps: Any, finish: str | None, first: bool
    ) -> CompletionChoice:
        if self.echo_only:
            text, token_ids, lps = "", [], [] if lps is not None else None
        offset = self._offset.get(index, 0)
        logprobs = self._logprobs(token_ids, lps, offset + (len(self._echo_text(index)) if first else 0))
        if first and self.echo:
            prompt_lps = self._prompt_logprobs(index)
            if prompt_lps is not None and logprobs is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(prompt_lps, name).extend(getattr(logprobs, name))
                logprobs = prompt_lps
            elif self.k is not None:
                logprobs = prompt_lps or logprobs
            text = self._echo_text(index) + text
        self._offset[index] = offset + len(text)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)

    def _echo_text(self, index: int) -> str:
        return self.prompts.texts[index // self.prompts.n] if self.echo and self.prompts is not None else ""

    def _prompt_logprobs(self, index: int) -> CompletionLogprobs | None:
        p = index // self.prompts.n
        lps = self.prompts.logprobs.get(p)
        if self.k is None or lps is None:
            return None
        out = CompletionLogprobs()
        offset = 0
        for i, (tid, entry) in enumerate(zip(self.prompts.token_ids[p], lps)):
            token = self._decode(tid)
            out.tokens.append(token)
            out.token_logprobs.append(None if entry is None else entry[tid].logprob)
            out.top_logprobs.append(
                None if entry is None else {self._decode(t): lp.logprob for t, lp in _top(entry, self.k)}
            )
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chunks(self, deltas: list[Delta]) -> list[BaseModel]:
        out = []
        for d in deltas:
            first = d.index not in self._echoed
            self._echoed.add(d.index)
            choice = self._choice(d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, first)
            out.append(CompletionResponse(id=self.id, model=self.model, choices=[choice]))
        return out

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=reported(usage, self.cached_tokens))

    def full_response(self, out: Any) -> BaseModel:
        choices = [
            self._choice(c.index, c.text, list(c.token_ids), c.logprobs, c.finish_reason, True) for c in out.outputs
        ]
        return CompletionResponse(
            id=self.id, model=self.model, choices=choices, usage=reported(usage_of(out), self.cached_tokens)
        )


class ChatFormat:
    """Chat responses; tools: the request's tool plan (tools.py: the output's calls, streamed or whole)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        top_logprobs: int | None,
        tokenizer: Any,
        cached_tokens: bool = False,
        tools: ToolPlan | None = None,
    ) -> None:
        self.id, self.model, self.k, self.cached_tokens = request_id, model, top_logprobs, cached_tokens
        self._decode = lambda tid: tokenizer.decode([tid])
        self._role_sent: set[int] = set()
        self.tools = tools if tools is not None and tools.calls_expected else None
        self._tool_streams: dict[int, ToolStream] = {}

    def _finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: tool_calls when the model chose to call (not for a named function, which it must call)."""
        return "tool_calls" if reason == "stop" and num_calls and self.tools.choice != "named" else reason

    def _delta(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        if self.tools is None:
            return {"content": d.text}, d.finish_reason
        stream = self._tool_streams.setdefault(d.index, ToolStream(self.tools))
        content, calls = stream.feed(d.text, d.finish_reason is not None, lambda: random_id("call"))
        delta: dict[str, Any] = {"tool_calls": calls} if calls else {}
        if content or not calls:
            delta["content"] = content
        return delta, self._finish_reason(d.finish_reason, stream.num_calls)

    def _logprobs(self, token_ids: list[int], lps: Any) -> ChatLogprobs | None:
        if self.k is None or lps is None:
            return None
        return chat_logprobs(token_ids, lps, self.k, self._decode)

    def chunks(self, deltas: list[Delta]) -> list[BaseModel]:
        out = []
        for d in deltas:
            delta, finish = self._delta(d)
            if d.index not in self._role_sent:  # OpenAI opens every choice with its role
                self._role_sent.add(d.index)
                delta["role"] = "assistant"
            out.append(
                ChatCompletionChunk(
                    id=self.id,
                    model=self.model,
                    choices=[
                        ChatStreamChoice(
                            index=d.index,
                            delta=delta,
                            logprobs=self._logprobs(d.token_ids, d.logprobs),
                            finish_reason=finish,
                        )
                    ],
                )
            )
        return out

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=reported(usage, self.cached_tokens))

    def _message(self, c: Any) -> tuple[ChatResponseMessage, str | None]:
        if self.tools is None:
            return ChatResponseMessage(content=c.text), c.finish_reason
        content, calls = output_calls(self.tools, c.text)
        message = ChatResponseMessage(
            content=content,
            tool_calls=[ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls],
        )
        return message, self._finish_reason(c.finish_reason, len(calls))

    def full_response(self, out: Any) -> BaseModel:
        choices = []
        for c in out.outputs:
            message, finish = self._message(c)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    finish_reason=finish,
                    logprobs=self._logprobs(list(c.token_ids), c.logprobs),
                )
            )
        return ChatCompletionResponse(
            id=self.id, model=self.model, choices=choices, usage=reported(usage_of(out), self.cached_tokens)
        )


# ---- a completion request's prompts --------------------------------------------------------------------------


@dataclass
class Prompts:
    """A completion request's prompts as submitted (their text for echo, their tokens), `n` choices each; the
    prompt logprobs (per prompt index) fill in as the engine sends them."""

    texts: list[str]
    token_ids: list[list[int]]
    n: int
    logprobs: dict[int, list] = field(default_factory=dict)


@dataclass
class PromptsOutput:
    """A delta (or the folded output) of a completion request's prompts: choices indexed prompt * n + choice."""

    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int | None = None

    def add(self, delta: PromptsOutput) -> None:
        mine = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in mine:
                mine[c.index].add(c)
            else:
                mine[c.index] = c
        self.outputs = sorted(mine.values(), key=lambda c: c.index)
        self.finished = delta.finished
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens


class PromptsStream:
    """The engine streams of a completion request's prompts as one stream of PromptsOutput deltas (in the
    order they arrive); `abort` aborts every prompt's request."""

    def __init__(self, streams: list[Any], prompts: Prompts) -> None:
        self.streams, self.prompts = streams, prompts
        self.request_id = streams[0].request_id
        self._cached: dict[int, int] = {}
        self._pending: dict[asyncio.Future, int] = {}
        self._started = False

    def __aiter__(self) -> PromptsStream:
        return self

    async def __anext__(self) -> PromptsOutput:
        if not self._started:
            self._started = True
            for i, s in enumerate(self.streams):
                self._pending[asyncio.ensure_future(s.__anext__())] = i
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            task = next(iter(done))
            p = self._pending.pop(task)
            try:
                out = task.result()
            except StopAsyncIteration:
                continue
            self._pending[asyncio.ensure_future(self.streams[p].__anext__())] = p
            return self._reindexed(p, out)
        raise StopAsyncIteration

    def _reindexed(self, p: int, out: Any) -> PromptsOutput:
        n = self.prompts.n
        if out.prompt_logprobs is not None:
            self.prompts.logprobs[p] = out.prompt_logprobs
        if out.num_cached_tokens is not None:
            self._cached[p] = out.num_cached_tokens
        outputs = [
            CompletionOutput(
                p * n + c.index,
                c.text,
                list(c.token_ids),
                c.cumulative_logprob,
                list(c.logprobs) if c.logprobs is not None else None,
                c.finish_reason,
                c.stop_reason,
            )
            for c in out.outputs
        ]
        finished = all(s.finished for s in self.streams)
        cached = sum(self._cached.values()) if self._cached else None
        return PromptsOutput(outputs, finished, sum(map(len, self.prompts.token_ids)), cached)

    def abort(self) -> None:
        for task in self._pending:
            task.cancel()
        self._pending.clear()
        for s in self.streams:
            s.abort()


def error_event(message: str, type: str, code: int) -> str:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, code=code))
    return f"data: {body.model_dump_json()}\n\n"


async def sse_events(fmt: Any, stream: Any, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of one request; every stream ends with `data: [DONE]`, after an error event when
    the request failed (shutdown, engine failure, a bug). A client that disconnects cancels this generator
    (Starlette cancels the response task), and the `finally` aborts the request, freeing its blocks."""
    state = StreamState()
    try:
        async for out in stream:
            for chunk in fmt.chunks(state.deltas(out)):
                yield f"data: {chunk.model_dump_json()}\n\n"
        if include_usage:
            yield f"data: {fmt.usage_chunk(state.usage()).model_dump_json()}\n\n"
    except RequestAborted as e:
        yield error_event(str(e), "service_unavailable", 503)
    except Exception as e:  # the status line went out long ago: report in band, keep the connection sane
        logger.exception("stream %s failed", getattr(stream, "request_id", "?"))
        yield error_event(f"Internal server error: {type(e).__name__}", "internal_error", 500)
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


async def last_output(stream: Any, raw: Request) -> Any | None:
    """The whole (folded) output of a non-streamed request, or None when the client went away first
    (nothing else notices a disconnect before the response is written)."""

    async def collect() -> Any:
        total = None
        async for out in stream:
            if total is None:
                total = out
            else:
                total.add(out)
        return total

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        work.cancel()  # no-op when done
    return work.result() if work in done else None
