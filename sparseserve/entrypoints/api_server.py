"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`build_app` wires an AsyncLLMEngine into a FastAPI app; `add_cli_args` / `run_server` are what
`sparseserve serve` calls. Request handling (prompt building, streaming) lives in `serving.py`-like
helpers below; every failure is answered with an OpenAI-style error body and never stops the server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import threading
from typing import Any, AsyncIterator, Iterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from sparseserve.engine.async_engine import AsyncLLMEngine, RequestAborted
from sparseserve.entrypoints import streaming
from sparseserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse,
                                              ModelCard, ModelList, random_id)
from sparseserve.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_n: int = 16


class BodySizeLimit:
    """ASGI middleware: 413 for bodies over the limit, checked on the header and while streaming in."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(scope, receive, send)
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # chunked bodies carry no content-length
                raise HTTPException(413, f"request body exceeds {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        await error_response(413, f"request body exceeds {self.max_bytes} bytes")(scope, receive, send)


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    llm = engine.engine
    if engine.metrics is None:
        engine.metrics = ServerMetrics(lambda: engine.stats, config.served_model_names[0])
    metrics: ServerMetrics = engine.metrics

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()  # after uvicorn's graceful wait: aborts whatever is still running

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                           type="authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> str:
        if name is None:
            return config.served_model_names[0]
        if name not in config.served_model_names:
            raise APIError(404, f"The model '{name}' does not exist; served: {list(config.served_model_names)}.",
                           param="model", code="model_not_found")
        return name

    def check_n(n: int) -> None:
        if n > config.max_n:
            raise APIError(400, f"n must be at most {config.max_n}, got {n}.", param="n")

    async def submit(prefix: str, prompt: str | list[int], params: Any) -> tuple[str, Any]:
        request_id = random_id(prefix)
        try:
            return request_id, await engine.add_request(request_id, prompt, params)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        except RequestAborted as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    def sampling(req: Any, max_tokens: int | None, logprobs: int | None) -> Any:
        check_n(req.n)
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    router = APIRouter(dependencies=[Depends(check_api_key)])

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=llm.max_model_len)
                               for name in config.served_model_names])

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        model = check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "Only one prompt per request is supported.", param="prompt")
            prompt = prompt[0]
        if req.echo or req.suffix:
            raise APIError(400, "echo and suffix are not supported.", param="echo" if req.echo else "suffix")
        params = sampling(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        request_id, stream = await submit("cmpl", prompt, params)
        fmt = streaming.CompletionFormat(request_id, model, req.logprobs, llm.tokenizer)
        return await respond(fmt, stream, req, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        model = check_model(req.model)
        tokenizer = llm.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"The model '{model}' has no chat template; use /v1/completions.",
                           param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt)
        prompt_ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:  # OpenAI chat default: the rest of the context
            max_tokens = max(1, llm.max_model_len - len(prompt_ids))
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling(req, max_tokens, k)
        request_id, stream = await submit("chatcmpl", prompt_ids, params)
        fmt = streaming.ChatFormat(request_id, model, k, tokenizer)
        return await respond(fmt, stream, req, raw)

    async def respond(fmt: Any, stream: Any, req: Any, raw: Request) -> Response:
        hold = max((len(s) for s in ([req.stop] if isinstance(req.stop, str) else req.stop or [])), default=1) - 1
        if req.stream:
            events = streaming.sse_events(fmt, stream, hold, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            final = await streaming.last_output(stream, raw)
        except RequestAborted as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        finally:
            stream.abort()
        return JSONResponse(fmt.full_response(final).model_dump())

    app = FastAPI(title="SparseServe", lifespan=lifespan)
    app.include_router(router)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(400, "Malformed JSON in the request body.", code="invalid_json")
        err = errors[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        detail = "; ".join(f"{'.'.join(str(p) for p in x.get('loc', ()) if p != 'body')}: {x.get('msg')}"
                           for x in errors[:5])
        return error_response(422, f"Invalid request: {detail}", param=param, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type=kind)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}", type="internal_error")

    return BodySizeLimit(app, config.max_request_body_bytes)  # type: ignore[return-value]
