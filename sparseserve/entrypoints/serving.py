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
from sparseserve.entrypoints.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                                              ChatResponseMessage, ChatStreamChoice, CompletionChoice,
                                              CompletionLogprobs, CompletionResponse, ErrorInfo, ErrorResponse,
                                              PromptTokensDetails, TokenLogprob, TopLogprob, UsageInfo)

logger = logging.getLogger(__name__)


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
class StreamState:
    """Per-choice progress of a response, built from the engine's deltas (the engine holds back the text
    that a stop string may still cut, so every delta's text is final)."""
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    text_len: dict[int, int] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)

    def deltas(self, out: Any) -> list[Delta]:
        self.prompt_tokens = len(out.prompt_token_ids or [])
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


def usage_of(out: Any) -> UsageInfo:
    """Usage of a cumulative (folded) output."""
    return usage_info(len(out.prompt_token_ids or []), sum(len(c.token_ids) for c in out.outputs),
                      getattr(out, "num_cached_tokens", None))


def usage_info(prompt: int, completion: int, cached: int | None) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached))


def reported(usage: UsageInfo, cached_tokens: bool) -> UsageInfo:
    """The usage a client sees: cached_tokens only when the server reports it (--enable-prompt-tokens-details)."""
    return usage if cached_tokens else usage.model_copy(update={"prompt_tokens_details": None})


class CompletionFormat:
    def __init__(self, request_id: str, model: str, logprobs: int | None, tokenizer: Any,
                 cached_tokens: bool = False) -> None:
        self.id, self.model, self.k, self.cached_tokens = request_id, model, logprobs, cached_tokens
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
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=reported(usage, self.cached_tokens))

    def full_response(self, out: Any) -> BaseModel:
        choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                    logprobs=self._logprobs(list(c.token_ids), c.logprobs, 0))
                   for c in out.outputs]
        return CompletionResponse(id=self.id, model=self.model, choices=choices,
                                  usage=reported(usage_of(out), self.cached_tokens))


class ChatFormat:
    def __init__(self, request_id: str, model: str, top_logprobs: int | None, tokenizer: Any,
                 cached_tokens: bool = False) -> None:
        self.id, self.model, self.k, self.cached_tokens = request_id, model, top_logprobs, cached_tokens
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
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=reported(usage, self.cached_tokens))

    def full_response(self, out: Any) -> BaseModel:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(list(c.token_ids), c.logprobs), finish_reason=c.finish_reason)
                   for c in out.outputs]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices,
                                      usage=reported(usage_of(out), self.cached_tokens))


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
