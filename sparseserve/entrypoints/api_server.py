"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`build_app` wires an AsyncLLMEngine into a FastAPI app; `add_cli_args` / `run_server` are what
`sparseserve serve` calls (uvicorn with read deadlines and a graceful drain: http_server.py). Every failure
is answered with an OpenAI-style error body ({"error": {"message", "type", "param", "code"}}), 5xx included,
and never stops the server or resets a kept-alive connection.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from sparseserve.config import parse_size
from sparseserve.engine.async_engine import AsyncLLMEngine, RequestAborted
from sparseserve.entrypoints.cli import add_engine_args, engine_kwargs_from_args
from sparseserve.entrypoints.http_server import ClientLimits, DrainingServer, uvicorn_config
from sparseserve.entrypoints.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                              CompletionResponse, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                                              invalid_unicode, random_id)
from sparseserve.entrypoints.serving import ChatFormat, CompletionFormat, last_output, sse_events
from sparseserve.metrics import CONTENT_TYPE, ServerMetrics
from sparseserve.sampling_params import ParameterError

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers


class ErrorJSONResponse(JSONResponse):
    """JSON that encodes whatever a message quotes back: a string the client sent may hold a lone surrogate."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return ErrorJSONResponse(body.model_dump(), status_code=status, headers=headers)


# The server closes the connection after these (the rest of the request was not read, or it is going away).
CLOSE = {"Connection": "close"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    metrics_require_api_key: bool = False  # /metrics behind the API key too
    disable_fastapi_docs: bool = False     # no /docs, /redoc, /openapi.json
    engine_watchdog_timeout: float = 60.0  # /health is 503 when a step takes longer (s)


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
                raise HTTPException(413, f"request body exceeds {self.max_bytes} bytes", headers=CLOSE)
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        await error_response(413, f"request body exceeds {self.max_bytes} bytes", headers=CLOSE)(scope, receive, send)


class ErrorBoundary:
    """Outermost ASGI middleware: an exception that escapes the app becomes a 500 with a JSON body and is not
    re-raised. (Starlette's handler for Exception re-raises after answering, and uvicorn then closes the
    connection, so a pooling client's next request on it failed.) After a response has started, the response
    is ended cleanly instead; a cancelled request (a forced shutdown) ends without a traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = finished = False

        async def tracked_send(message: dict) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            logger.warning("%s %s cancelled by the shutdown", scope.get("method"), scope.get("path"))
        except Exception as e:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(500, f"Internal server error: {type(e).__name__}", type="internal_error",
                                     code=500)(scope, receive, send)
            elif not finished:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_doc(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# What the OpenAPI document lists for the /v1 routes (FastAPI alone lists 200 and 422).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error_doc("Invalid request (a value out of range, a prompt too long, malformed JSON)."),
    401: _error_doc("Missing or wrong API key."),
    404: _error_doc("Unknown model."),
    413: _error_doc("Request body too large."),
    422: _error_doc("Request body does not match the schema."),
    503: _error_doc("Shutting down, or the request was aborted by a shutdown or an engine failure."),
}


def _stream_doc(model: Any) -> dict[int | str, dict[str, Any]]:
    sse = {"schema": {"type": "string", "description": "Server-sent events: `data: <chunk JSON>` lines, an error "
                                                       "event if the request fails, then `data: [DONE]`."}}
    return {200: {"model": model, "description": "The completion; with `stream: true`, server-sent events.",
                  "content": {"text/event-stream": sse}}, **ERROR_RESPONSES}


# ---- per-app state (app.state.engine, app.state.server_config) and the checks the routes share --------------


def engine_of(request: Request) -> AsyncLLMEngine:
    return request.app.state.engine


def config_of(request: Request) -> ServerConfig:
    return request.app.state.server_config


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine: AsyncLLMEngine = app.state.engine
    engine.start()
    yield
    await engine.shutdown()  # a no-op after DrainingServer's drain; aborts what is left otherwise


def check_api_key(request: Request) -> None:
    """'Authorization: Bearer KEY', the scheme in any case (RFC 9110); the comparison takes constant time."""
    api_key = config_of(request).api_key
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    key_ok = hmac.compare_digest(given.strip().encode(), api_key.encode())
    if not (key_ok and scheme.lower() == "bearer"):
        raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                       type="authentication_error", code="invalid_api_key")


def not_accepting(engine: AsyncLLMEngine) -> str:
    return "The server is shutting down." if engine.is_running else "The engine is not running."


def check_accepting(request: Request) -> None:
    engine = engine_of(request)
    if not engine.accepting:
        raise APIError(503, not_accepting(engine), type="service_unavailable", code=503, headers=CLOSE)


def check_model(config: ServerConfig, name: str | None) -> str:
    if name is None:
        return config.served_model_names[0]
    if name not in config.served_model_names:
        raise APIError(404, f"The model '{name}' does not exist; served: {list(config.served_model_names)}.",
                       param="model", code="model_not_found")
    return name


def check_unicode(req: Any) -> None:
    param = invalid_unicode(req.model_dump(exclude_defaults=True))
    if param is not None:
        raise APIError(400, f"{param} is not valid Unicode (it holds a lone UTF-16 surrogate).", param=param,
                       code="invalid_unicode")


def sampling(engine: AsyncLLMEngine, req: Any, max_tokens: int | None, logprobs: int | None) -> Any:
    max_num_seqs = engine.engine.config.scheduler_config.max_num_seqs
    if req.n > max_num_seqs:  # its sequences could never run in one batch
        raise APIError(400, f"n must be at most max_num_seqs={max_num_seqs}, got {req.n}.", param="n")
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ParameterError as e:
        raise APIError(400, str(e), param=e.param) from None


async def submit(engine: AsyncLLMEngine, prefix: str, prompt: str | list[int], params: Any, prompt_param: str,
                 cache_salt: str | None = None) -> tuple[str, Any]:
    llm = engine.engine
    request_id = random_id(prefix)
    if isinstance(prompt, str):  # tokenized here (off the event loop) to check the context length
        if not prompt:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        prompt = await asyncio.to_thread(llm.tokenizer.encode, prompt)
    if params.max_tokens is not None and len(prompt) + params.max_tokens > llm.max_model_len:
        # vLLM refuses what it cannot finish; the prompt is at fault when not even one token fits after it
        raise APIError(400, f"This model's maximum context length (max_model_len) is {llm.max_model_len} tokens; "
                       f"the request asks for {len(prompt) + params.max_tokens} ({len(prompt)} in the prompt, "
                       f"{params.max_tokens} to generate).",
                       param=prompt_param if len(prompt) >= llm.max_model_len else "max_tokens")
    if cache_salt is not None:
        prompt = {"prompt_token_ids": prompt, "cache_salt": cache_salt}
    try:
        return request_id, await engine.add_request(request_id, prompt, params)
    except ParameterError as e:
        raise APIError(400, str(e), param=prompt_param if e.param == "prompt" else e.param) from None
    except ValueError as e:
        raise APIError(400, str(e), param=prompt_param) from None
    except RequestAborted as e:
        raise APIError(503, str(e), type="service_unavailable", code=503, headers=CLOSE) from None


async def respond(fmt: Any, stream: Any, req: Any, raw: Request) -> Response:
    if req.stream:
        return StreamingResponse(sse_events(fmt, stream, req.include_usage), media_type="text/event-stream")
    try:
        final = await last_output(stream, raw)
    except RequestAborted as e:
        raise APIError(503, str(e), type="service_unavailable", code=503) from None
    finally:
        stream.abort()
    if final is None:  # nobody is listening; nginx's "client closed request"
        return error_response(499, "client disconnected")
    return JSONResponse(fmt.full_response(final).model_dump())


# ---- routes -----------------------------------------------------------------------------------------------

# /v1: behind the API key. The rest (/health, /metrics) is on `router`.
v1_router = APIRouter(dependencies=[Depends(check_api_key)], responses=ERROR_RESPONSES)
router = APIRouter()


@v1_router.get("/v1/models")
async def show_available_models(raw: Request) -> ModelList:
    max_model_len = engine_of(raw).engine.max_model_len
    return ModelList(data=[ModelCard(id=name, max_model_len=max_model_len)
                           for name in config_of(raw).served_model_names])


@v1_router.post("/v1/completions", dependencies=[Depends(check_accepting)],
                responses=_stream_doc(CompletionResponse))
async def create_completion(req: CompletionRequest, raw: Request) -> Response:
    engine = engine_of(raw)
    check_unicode(req)
    model = check_model(config_of(raw), req.model)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, "Only one prompt per request is supported.", param="prompt")
        prompt = prompt[0]
    if req.echo or req.suffix:
        raise APIError(400, "echo and suffix are not supported.", param="echo" if req.echo else "suffix")
    params = sampling(engine, req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
    request_id, stream = await submit(engine, "cmpl", prompt, params, "prompt", req.cache_salt)
    fmt = CompletionFormat(request_id, model, req.logprobs, engine.engine.tokenizer)
    return await respond(fmt, stream, req, raw)


@v1_router.post("/v1/chat/completions", dependencies=[Depends(check_accepting)],
                responses=_stream_doc(ChatCompletionResponse))
async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    engine = engine_of(raw)
    check_unicode(req)
    model = check_model(config_of(raw), req.model)
    tokenizer = engine.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"The model '{model}' has no chat template; use /v1/completions.", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt)
    except (TemplateError, ValueError, TypeError) as e:  # a template may refuse a conversation (roles out of order)
        raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from None
    prompt_ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    k = (req.top_logprobs or 0) if req.logprobs else None
    # None (OpenAI's chat default) lets the engine generate up to max_model_len.
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    params = sampling(engine, req, max_tokens, k)
    request_id, stream = await submit(engine, "chatcmpl", prompt_ids, params, "messages", req.cache_salt)
    fmt = ChatFormat(request_id, model, k, tokenizer)
    return await respond(fmt, stream, req, raw)


@router.get("/health", responses={503: _error_doc("Shutting down, or the engine loop is stuck in one step.")})
async def health(raw: Request) -> Response:
    """200 while the engine serves; 503 while it shuts down, or when its loop has work but has not completed a
    step for longer than --engine-watchdog-timeout (a load balancer should then restart it)."""
    engine, timeout = engine_of(raw), config_of(raw).engine_watchdog_timeout
    if not engine.accepting:
        return error_response(503, not_accepting(engine), type="service_unavailable", code=503)
    stuck = engine.seconds_without_progress()
    if stuck > timeout:
        return error_response(503, f"The engine loop has not completed a step for {stuck:.0f} s "
                              f"(--engine-watchdog-timeout {timeout:g}).", type="service_unavailable", code=503)
    return Response(status_code=200)


PROMETHEUS_DOC = {200: {"content": {CONTENT_TYPE.split(";")[0]: {}}, "description": "Prometheus text."}}


@router.get("/metrics", responses=PROMETHEUS_DOC)
async def prometheus(raw: Request) -> Response:
    if config_of(raw).metrics_require_api_key:
        check_api_key(raw)
    return Response(engine_of(raw).metrics.render(), media_type=CONTENT_TYPE)


# ---- error handlers ----------------------------------------------------------------------------------------


async def on_api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, headers=e.headers)


async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        return error_response(400, "Malformed JSON in the request body.", code="invalid_json")
    params = [param_of(err.get("loc", ())) for err in errors]
    detail = "; ".join(f"{p or 'body'}: {err.get('msg')}" for p, err in zip(params[:5], errors))
    return error_response(422, f"Invalid request: {detail}", param=params[0] or None, code="invalid_value")


async def on_http_error(_: Request, e: HTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), type=kind, headers=e.headers)  # 405 keeps its Allow


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The app of one engine: the module's routers, its state in `app.state`, the error handlers, middleware."""
    if engine.metrics is None:
        engine.metrics = ServerMetrics(lambda: engine.stats, config.served_model_names[0])
    docs: dict[str, Any] = {"openapi_url": None, "docs_url": None, "redoc_url": None} \
        if config.disable_fastapi_docs else {}
    app = FastAPI(title="SparseServe", lifespan=lifespan, **docs)
    app.state.engine = engine
    app.state.server_config = config
    app.include_router(v1_router)
    app.include_router(router)
    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    app.add_middleware(ErrorBoundary)  # added last: outermost
    return app


# pydantic names the branch of a union that failed ("prompt.str", "prompt.list[int].0"); not part of the param.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def param_of(loc: tuple | list) -> str:
    """The `param` of a validation error: its location in the body, without pydantic's union branch names."""
    parts = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p):
            break
        parts.append(str(p))
    return ".".join(parts)


# ---- command line ------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # positional MODEL and every engine flag, straight from EngineConfig
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on (default: 127.0.0.1, loopback only; 0.0.0.0 exposes the server).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) clients use in the `model` field (default: the model dir's name).")
    g.add_argument("--api-key", default=os.environ.get("SPARSESERVE_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on /v1 (default: $SPARSESERVE_API_KEY, else none).")
    g.add_argument("--metrics-require-api-key", action="store_true",
                   help="Require the API key on /metrics too (default: /metrics is open, like vLLM's).")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="Serve no OpenAPI schema, Swagger UI or ReDoc (/openapi.json, /docs, /redoc; default: served).")
    g.add_argument("--max-request-body-bytes", type=parse_size, default=ServerConfig.max_request_body_bytes,
                   help="Larger request bodies get 413; sizes like 16MiB work (default: %(default)s).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="Seconds in-flight requests get to finish after SIGINT/SIGTERM; those still running then end "
                        "with an error event (streams) or a 503 (default: %(default)s).")
    g.add_argument("--engine-watchdog-timeout", type=float, default=ServerConfig.engine_watchdog_timeout,
                   help="/health answers 503 when the engine loop has work but has not completed a step for this "
                        "many seconds (default: %(default)s).")
    limits = ClientLimits()
    g.add_argument("--timeout-header-read", type=float, default=limits.header_timeout,
                   help="Seconds a client has to send a request's headers, from their first byte (or the "
                        "connection's opening); then 408 and the connection is closed (default: %(default)s).")
    g.add_argument("--timeout-body-read", type=float, default=limits.body_timeout,
                   help="Seconds a client has to send a request's body once its headers arrived; then 408 and the "
                        "connection is closed (default: %(default)s).")
    g.add_argument("--timeout-keep-alive", type=float, default=limits.keep_alive_timeout,
                   help="Seconds an idle kept-alive connection stays open (uvicorn's; default: %(default)s).")
    g.add_argument("--limit-concurrency", type=int, default=limits.max_connections,
                   help="Most connections open at once; requests on connections beyond get 503 (default: "
                        "%(default)s).")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of uvicorn (default: %(default)s).")


def client_limits_from_args(args: argparse.Namespace) -> ClientLimits:
    return ClientLimits(header_timeout=args.timeout_header_read, body_timeout=args.timeout_body_read,
                        max_connections=args.limit_concurrency, keep_alive_timeout=args.timeout_keep_alive)


def run_server(args: argparse.Namespace) -> None:
    from sparseserve.engine.engine import LLMEngine

    engine = LLMEngine.from_kwargs(**engine_kwargs_from_args(args))
    config = ServerConfig(served_model_names=tuple(args.served_model_name or [engine.model_name]),
                          api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
                          metrics_require_api_key=args.metrics_require_api_key,
                          disable_fastapi_docs=args.disable_fastapi_docs,
                          engine_watchdog_timeout=args.engine_watchdog_timeout)
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, config)
    limits = client_limits_from_args(args)
    effective = {**dataclasses.asdict(engine.config), "max_model_len": engine.max_model_len,
                 "num_kv_blocks": engine.get_stats().num_blocks_total, "host": args.host, "port": args.port,
                 **dataclasses.asdict(config), "api_key": "set" if args.api_key else "none",
                 **dataclasses.asdict(limits), "shutdown_timeout": args.shutdown_timeout}
    logger.info("effective config: %s", json.dumps(effective, default=str))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    server = DrainingServer(uvicorn_config(app, args.host, args.port, limits, args.uvicorn_log_level),
                            async_engine, args.shutdown_timeout)
    server.run()


main = run_server  # `sparseserve serve` dispatches to the module's main(args)

