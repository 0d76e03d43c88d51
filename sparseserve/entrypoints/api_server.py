"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`build_app` wires an AsyncLLMEngine into a FastAPI app; `add_cli_args` / `run_server` are what
`sparseserve serve` calls. Every failure is answered with an OpenAI-style error body
({"error": {"message", "type", "param", "code"}}) and never stops the server.
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
import socket
import threading
from typing import Any, AsyncIterator, Iterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from sparseserve.engine.async_engine import AsyncLLMEngine, RequestAborted
from sparseserve.entrypoints.cli import add_engine_args, engine_kwargs_from_args
from sparseserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse,
                                              ModelCard, ModelList, random_id)
from sparseserve.entrypoints.serving import ChatFormat, CompletionFormat, last_output, sse_events
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

    max_num_seqs = llm.config.scheduler_config.max_num_seqs

    def check_n(n: int) -> None:
        if n > max_num_seqs:  # its sequences could never run in one batch
            raise APIError(400, f"n must be at most max_num_seqs={max_num_seqs}, got {n}.", param="n")

    async def submit(prefix: str, prompt: str | list[int], params: Any, cache_salt: str | None = None
                     ) -> tuple[str, Any]:
        request_id = random_id(prefix)
        if isinstance(prompt, str):  # tokenized here (off the event loop) to check the context length
            if not prompt:
                raise APIError(400, "the prompt is empty", param="prompt")
            prompt = await asyncio.to_thread(llm.tokenizer.encode, prompt)
        if params.max_tokens is not None and len(prompt) + params.max_tokens > llm.max_model_len:
            raise APIError(400, f"This model's maximum context length (max_model_len) is {llm.max_model_len} tokens; the request "
                           f"asks for {len(prompt) + params.max_tokens} ({len(prompt)} in the prompt, "
                           f"{params.max_tokens} to generate).", param="max_tokens")
        if cache_salt is not None:
            prompt = {"prompt_token_ids": prompt, "cache_salt": cache_salt}
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
        request_id, stream = await submit("cmpl", prompt, params, req.cache_salt)
        fmt = CompletionFormat(request_id, model, req.logprobs, llm.tokenizer)
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
        k = (req.top_logprobs or 0) if req.logprobs else None
        # None (OpenAI's chat default) lets the engine generate up to max_model_len.
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        params = sampling(req, max_tokens, k)
        request_id, stream = await submit("chatcmpl", prompt_ids, params, req.cache_salt)
        fmt = ChatFormat(request_id, model, k, tokenizer)
        return await respond(fmt, stream, req, raw)

    async def respond(fmt: Any, stream: Any, req: Any, raw: Request) -> Response:
        hold = max((len(s) for s in ([req.stop] if isinstance(req.stop, str) else req.stop or [])), default=1) - 1
        if req.stream:
            events = sse_events(fmt, stream, hold, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            final = await last_output(stream, raw)
        except RequestAborted as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        finally:
            stream.abort()
        if final is None:  # nobody is listening; nginx's "client closed request"
            return error_response(499, "client disconnected")
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

    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    return app


# ---- command line ------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # positional MODEL and every engine flag, straight from EngineConfig
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="Address to listen on (default: 127.0.0.1, loopback only; 0.0.0.0 exposes the server).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) clients use in the `model` field (default: the model dir's name).")
    g.add_argument("--api-key", default=os.environ.get("SPARSESERVE_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on /v1 (default: $SPARSESERVE_API_KEY, else none).")
    g.add_argument("--max-request-body-bytes", type=int, default=ServerConfig.max_request_body_bytes,
                   help="Larger request bodies get 413 (default: %(default)s).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted "
                        "(default: %(default)s).")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of uvicorn (default: %(default)s).")


def run_server(args: argparse.Namespace) -> None:
    import uvicorn

    from sparseserve.engine.engine import LLMEngine

    engine = LLMEngine.from_kwargs(**engine_kwargs_from_args(args))
    config = ServerConfig(served_model_names=tuple(args.served_model_name or [engine.model_name]),
                          api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes)
    app = build_app(AsyncLLMEngine(engine), config)
    effective = {**dataclasses.asdict(engine.config), "max_model_len": engine.max_model_len,
                 "num_kv_blocks": engine.get_stats().num_blocks_total, "host": args.host, "port": args.port,
                 "served_model_names": list(config.served_model_names), "api_key": "set" if args.api_key else "none",
                 "max_request_body_bytes": config.max_request_body_bytes, "shutdown_timeout": args.shutdown_timeout}
    logger.info("effective config: %s", json.dumps(effective, default=str))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    # uvicorn handles SIGINT/SIGTERM: stop accepting, wait up to the timeout for in-flight
    # requests, then run the lifespan shutdown, which aborts what is left.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)


main = run_server  # `sparseserve serve` dispatches to the module's main(args)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """Run `app` with uvicorn in a background thread on a free port; yields its base URL.
    For tests and harnesses that need a real socket (streaming, disconnects, the openai client)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))  # bound before the thread starts, so the port cannot be taken meanwhile
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("server thread died during startup")
            threading.Event().wait(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
