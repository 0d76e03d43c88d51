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
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from sparseserve.config import parse_size
from sparseserve.engine.async_engine import AsyncLLMEngine, RequestAborted
from sparseserve.entrypoints.cli import add_engine_args, engine_kwargs_from_args
from sparseserve.entrypoints.http_server import ClientLimits, DrainingServer, uvicorn_config
from sparseserve.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    invalid_unicode,
    random_id,
)
from sparseserve.entrypoints.serving import (
    ChatFormat,
    CompletionFormat,
    Prompts,
    PromptsStream,
    last_output,
    sse_events,
)
from sparseserve.entrypoints.tool_parsers import TOOL_PARSERS
from sparseserve.entrypoints.tools import (
    fallback_messages,
    message_dicts,
    parser_name,
    plan_tools,
    template_renders_tools,
)
from sparseserve.metrics import CONTENT_TYPE, ServerMetrics
from sparseserve.models.loader import resolve_model_dir
from sparseserve.sampling_params import ParameterError, SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers


class ErrorJSONResponse(JSONResponse):
    """JSON that encodes whatever a message quotes back: a string the client sent may hold a lone surrogate."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return ErrorJSONResponse(body.model_dump(), status_code=status, headers=headers)


# Back-pressure (async_engine.RequestStream): unread tokens a stream may queue (memory per token: README).
MAX_UNREAD_STREAM_TOKENS = 256

# The server closes the connection after these (the rest of the request was not read, or it is going away).
CLOSE = {"Connection": "close"}


def _opt(default: Any, help: str) -> Any:
    """A server option: its flag's help lives with the field (add_cli_args reads it)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    api_key: tuple[str, ...] | str | None = None  # any one of them is accepted; a str is one key
    max_request_body_bytes: int = 16 * 1024 * 1024
    metrics_require_api_key: bool = False  # /metrics behind the API key too
    disable_fastapi_docs: bool = False  # no /openapi.json (/docs and /redoc are never served)
    engine_watchdog_timeout: float = 60.0  # /health is 503 when a step takes longer (s)
    enable_prompt_tokens_details: bool = _opt(
        False,
        "Report usage.prompt_tokens_details.cached_tokens (off: it "
        "tells a client whether anyone sent the same prefix before).",
    )
    cache_salt_source: str = _opt(
        "request",
        "Whose prompts share prefix-cache blocks: request (those with the "
        "same cache_salt field, or none), api-key (only those of the same API key) or "
        "header:NAME (only those with the same value of header NAME).",
    )
    tool_call_parser: str = _opt(
        "auto",
        "How chat outputs are read for tool calls with tool_choice auto: hermes "
        "(<tool_call> blocks: Qwen2.5, Qwen3), llama3_json (Llama 3.1/3.2's JSON), or auto "
        "(hermes when the chat template writes <tool_call>, else llama3_json).",
    )

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):
            object.__setattr__(self, "api_key", (self.api_key,))
        if self.api_key is not None and (not self.api_key or not all(self.api_key)):
            raise ValueError("--api-key: keys must be non-empty")
        source = self.cache_salt_source
        if source not in ("request", "api-key") and not (source.startswith("header:") and source[7:].strip()):
            raise ValueError(f"--cache-salt-source must be request, api-key or header:NAME, got {source!r}")
        if source == "api-key" and self.api_key is None:
            raise ValueError("--cache-salt-source api-key needs --api-key")
        if self.tool_call_parser != "auto" and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be auto or one of {TOOL_PARSERS.names()}, got {self.tool_call_parser!r}"
            )


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
                await error_response(
                    500, f"Internal server error: {type(e).__name__}", type="internal_error", code=500
                )(scope, receive, send)
            elif not finished:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_doc(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# What the OpenAPI document lists for the /v1 routes (FastAPI alone lists 200 and 422).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error_doc(
        "Invalid request: malformed JSON, a field of the wrong type, a value out of range, a prompt "
        "too long, a duplicated Authorization header."
    ),
    401: _error_doc("Missing or wrong API key."),
    404: _error_doc("Unknown model."),
    413: _error_doc("Request body too large."),
    503: _error_doc("Shutting down, or the request was aborted by a shutdown or an engine failure."),
}


def _stream_doc(model: Any) -> dict[int | str, dict[str, Any]]:
    sse = {
        "schema": {
            "type": "string",
            "description": "Server-sent events: `data: <chunk JSON>` lines, an error "
            "event if the request fails, then `data: [DONE]`.",
        }
    }
    return {
        200: {
            "model": model,
            "description": "The completion; with `stream: true`, server-sent events.",
            "content": {"text/event-stream": sse},
        },
        **ERROR_RESPONSES,
    }


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


# Declares the scheme in the OpenAPI document; check_api_key reads the header itself.
BEARER = HTTPBearer(auto_error=False, description="Required when the server runs with --api-key.")


def one_header(request: Request, name: str) -> str | None:
    """The value of a header that must appear at most once (a second copy could be read differently by a proxy)."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise APIError(400, f"The request has {len(values)} {name} headers; send one.", code="duplicate_header")
    return values[0] if values else None


def check_api_key(request: Request, _: Any = Security(BEARER)) -> None:
    """'Authorization: Bearer KEY', the scheme in any case (RFC 9110); the comparison takes constant time and
    looks at every key. The key's index goes to request.state.api_key_index (cache_salt_source api-key)."""
    keys = config_of(request).api_key
    if keys is None:
        return
    scheme, _, given = (one_header(request, "Authorization") or "").strip().partition(" ")
    given_bytes = given.strip().encode()
    matches = [hmac.compare_digest(given_bytes, key.encode()) for key in keys]
    if not (any(matches) and scheme.lower() == "bearer"):
        raise APIError(
            401,
            "Invalid or missing API key (send 'Authorization: Bearer <key>').",
            type="authentication_error",
            code="invalid_api_key",
        )
    request.state.api_key_index = matches.index(True)


def cache_salt(request: Request, salt: str | None) -> str | None:
    """The request's cache_salt under --cache-salt-source: with api-key or header:NAME, the tenant's digest
    comes first, so no two tenants share a block whatever cache_salt they send (docs/prefix_cache.md)."""
    if salt == "":
        raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt")
    source = config_of(request).cache_salt_source
    if source == "request":
        return salt
    if source == "api-key":
        tenant = "key:" + config_of(request).api_key[request.state.api_key_index]  # type: ignore[index]
    else:
        name = source[len("header:") :]
        value = one_header(request, name)
        if value is None:
            raise APIError(
                400, f"The {name} header is required (the server isolates prefix caches by it).", code="missing_header"
            )
        tenant = "header:" + value
    digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()
    return digest if salt is None else f"{digest}:{salt}"


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
        raise APIError(
            404,
            f"The model '{name}' does not exist; served: {list(config.served_model_names)}.",
            param="model",
            code="model_not_found",
        )
    return name


def check_unicode(req: Any) -> None:
    param = invalid_unicode(req.model_dump(exclude_defaults=True))
    if param is not None:
        raise APIError(
            400,
            f"{param} is not valid Unicode (it holds a lone UTF-16 surrogate).",
            param=param,
            code="invalid_unicode",
        )


def sampling(engine: AsyncLLMEngine, req: Any, max_tokens: int | None, logprobs: int | None, **extra: Any) -> Any:
    # More than max_num_seqs sequences could never run in one batch: one bound, one message for every n.
    limit = min(engine.engine.config.scheduler_config.max_num_seqs, SamplingParams.MAX_N)
    if not 1 <= req.n <= limit:
        raise APIError(400, f"n must be an integer in [1, {limit}], got {req.n}", param="n")
    try:
        return req.sampling_params(max_tokens, logprobs, **extra)
    except ParameterError as e:
        raise APIError(400, str(e), param=e.param) from None


async def check_constraint(engine: AsyncLLMEngine, params: SamplingParams, param: str | None) -> None:
    """Compiles the output's constraint off the event loop and the engine's thread (cached: the engine's compile
    is then a lookup); an invalid one is a 400 naming the request's field."""
    if params.structured_outputs is None:
        return
    from sparseserve.structured import structured_backend

    try:
        await asyncio.to_thread(lambda: structured_backend(engine.engine).compile(params.structured_outputs))
    except ParameterError as e:
        raise APIError(400, str(e), param=param or e.param) from None


async def submit(
    engine: AsyncLLMEngine,
    prefix: str,
    prompt: str | list[int],
    params: Any,
    prompt_param: str,
    cache_salt: str | None = None,
) -> tuple[str, Any]:
    llm = engine.engine
    request_id = random_id(prefix)
    if isinstance(prompt, str):  # tokenized here (off the event loop) to check the context length
        if not prompt:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        prompt = await asyncio.to_thread(llm.tokenizer.encode, prompt)
    if params.max_tokens is not None and len(prompt) + params.max_tokens > llm.max_model_len:
        # vLLM refuses what it cannot finish; the prompt is at fault when not even one token fits after it
        raise APIError(
            400,
            f"This model's maximum context length (max_model_len) is {llm.max_model_len} tokens; "
            f"the request asks for {len(prompt) + params.max_tokens} ({len(prompt)} in the prompt, "
            f"{params.max_tokens} to generate).",
            param=prompt_param if len(prompt) >= llm.max_model_len else "max_tokens",
        )
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
    return ModelList(
        data=[ModelCard(id=name, max_model_len=max_model_len) for name in config_of(raw).served_model_names]
    )


@v1_router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw: Request) -> ModelCard:
    if model_id not in config_of(raw).served_model_names:
        raise APIError(
            404,
            f"The model '{model_id}' does not exist.",
            param="model",
            code="model_not_found",
            type="not_found_error",
        )
    return ModelCard(id=model_id, max_model_len=engine_of(raw).engine.max_model_len, root=model_id)


@v1_router.post("/v1/completions", dependencies=[Depends(check_accepting)], responses=_stream_doc(CompletionResponse))
async def create_completion(req: CompletionRequest, raw: Request) -> Response:
    engine = engine_of(raw)
    check_unicode(req)
    model = check_model(config_of(raw), req.model)
    tokenizer = engine.engine.tokenizer
    try:
        prompts = req.prompts()  # each its own n choices
    except ParameterError as e:
        raise APIError(400, str(e), param=e.param) from None
    echo_only = req.echo and req.max_tokens == 0  # vLLM's: the prompt alone (one token generated and dropped)
    max_tokens = 1 if echo_only else 16 if req.max_tokens is None else req.max_tokens
    params = sampling(engine, req, max_tokens, req.logprobs, prompt_logprobs=req.logprobs if req.echo else None)
    await check_constraint(engine, params, req.constraint_param())
    salt = cache_salt(raw, req.cache_salt)
    ids = [p if isinstance(p, list) else await asyncio.to_thread(tokenizer.encode, p) for p in prompts]
    submitted: list[tuple[str, Any]] = []
    try:
        for p in ids:
            submitted.append(await submit(engine, "cmpl", p, params, "prompt", salt))
    except BaseException:
        for _, stream in submitted:  # all or nothing
            stream.abort()
        raise
    texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if req.echo else []
    info = Prompts(texts, ids, params.n)
    fmt = CompletionFormat(
        submitted[0][0],
        model,
        req.logprobs,
        tokenizer,
        config_of(raw).enable_prompt_tokens_details,
        info,
        req.echo,
        echo_only,
    )
    return await respond(fmt, PromptsStream([s for _, s in submitted], info), req, raw)


@v1_router.post(
    "/v1/chat/completions", dependencies=[Depends(check_accepting)], responses=_stream_doc(ChatCompletionResponse)
)
async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    engine = engine_of(raw)
    check_unicode(req)
    model = check_model(config_of(raw), req.model)
    tokenizer = engine.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"The model '{model}' has no chat template; use /v1/completions.", param="messages")
    try:
        k = req.logprobs_k()
        plan = plan_tools(
            req.tools, req.tool_choice, req.parallel_tool_calls, parser_name(config_of(raw).tool_call_parser, tokenizer)
        )
    except ParameterError as e:
        raise APIError(400, str(e), param=e.param) from None
    messages = message_dicts(req.messages)
    tools = None
    if plan is not None:  # a template that does not write the tools gets them in a system message (tools.py)
        if await asyncio.to_thread(template_renders_tools, tokenizer):
            tools = plan.tools
        else:
            messages, plan.template_tools = fallback_messages(messages, plan.tools), False
    try:
        text = await asyncio.to_thread(
            tokenizer.apply_chat_template,
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
        )
    except (TemplateError, ValueError, TypeError) as e:  # a template may refuse a conversation (roles out of order)
        raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from None
    prompt_ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    if max_tokens is None:  # the model's generation_config.json default, else up to max_model_len (OpenAI's)
        max_tokens = raw.app.state.default_max_tokens
    tool_constraint = plan.constraint if plan is not None else None
    params = sampling(engine, req, max_tokens, k, structured_outputs=tool_constraint)
    await check_constraint(engine, params, "tools" if tool_constraint is not None else req.constraint_param())
    salt = cache_salt(raw, req.cache_salt)
    request_id, stream = await submit(engine, "chatcmpl", prompt_ids, params, "messages", salt)
    fmt = ChatFormat(request_id, model, k, tokenizer, config_of(raw).enable_prompt_tokens_details, plan)
    return await respond(fmt, stream, req, raw)


@router.get(
    "/health",
    responses={503: _error_doc("Shutting down, the engine failed for good, or its loop is stuck in one step.")},
)
async def health(raw: Request) -> Response:
    """200 while the engine serves; 503 while it shuts down, once it failed for good (a tensor-parallel rank is
    gone), or when its loop has work but has not completed a step for longer than --engine-watchdog-timeout (a
    load balancer should then restart it)."""
    engine, timeout = engine_of(raw), config_of(raw).engine_watchdog_timeout
    if not engine.accepting:
        return error_response(503, not_accepting(engine), type="service_unavailable", code=503)
    if (failure := engine.failure) is not None:
        reason = failure.split("\n", 1)[0]  # a worker's traceback stays in the log
        message = f"The engine has failed and must be restarted: {reason}"
        return error_response(503, message, type="service_unavailable", code=503)
    stuck = engine.seconds_without_progress()
    if stuck > timeout:
        return error_response(
            503,
            f"The engine loop has not completed a step for {stuck:.0f} s (--engine-watchdog-timeout {timeout:g}).",
            type="service_unavailable",
            code=503,
        )
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
    # 400 like OpenAI and vLLM, not FastAPI's 422: the schema's checks and the value checks are one kind of error
    return error_response(400, f"Invalid request: {detail}", param=params[0] or None, code="invalid_value")


async def on_http_error(_: Request, e: HTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), type=kind, headers=e.headers)  # 405 keeps its Allow


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without the 422 it lists for every route with a body (this server answers 400)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema.get("paths", {}).values():
            for op in operations.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
    return app.openapi_schema  # type: ignore[return-value]


def generation_max_new_tokens(model: str | None) -> int | None:
    """`max_new_tokens` of the model's generation_config.json: the default output length of a request that
    sets none, as in vLLM (the embedded model's keeps a chat from running to max_model_len)."""
    try:
        with open(resolve_model_dir(model) / "generation_config.json") as f:
            value = json.load(f).get("max_new_tokens")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The app of one engine: the module's routers, its state in `app.state`, the error handlers, middleware."""
    if engine.metrics is None:
        engine.metrics = ServerMetrics(lambda: engine.stats, config.served_model_names[0])
    # No Swagger UI or ReDoc: FastAPI's pages load their scripts from a public CDN. /openapi.json stays.
    app = FastAPI(
        title="SparseServe",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None if config.disable_fastapi_docs else "/openapi.json",
    )
    app.openapi = functools.partial(openapi_schema, app)  # type: ignore[method-assign]
    app.state.engine = engine
    app.state.server_config = config
    app.state.default_max_tokens = generation_max_new_tokens(engine.engine.config.model_config.model)
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
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to listen on (default: 127.0.0.1, loopback only; 0.0.0.0 exposes the server).",
    )
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) clients use in the `model` field (default: the model dir's name).",
    )
    env_key = os.environ.get("SPARSESERVE_API_KEY")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=[env_key] if env_key else None,
        help="Require 'Authorization: Bearer KEY' on /v1 with one of these keys (default: "
        "$SPARSESERVE_API_KEY, else none).",
    )
    g.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="Require the API key on /metrics too (default: /metrics is open, like vLLM's).",
    )
    g.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="Serve no OpenAPI document (/openapi.json; default: served). /docs and /redoc are never "
        "served: their pages load scripts from a public CDN.",
    )
    for name in ("enable_prompt_tokens_details", "cache_salt_source", "tool_call_parser"):
        f = next(f for f in dataclasses.fields(ServerConfig) if f.name == name)
        flag, help = "--" + name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            g.add_argument(flag, action="store_true", help=help)
        else:
            g.add_argument(flag, default=f.default, help=help)
    g.add_argument(
        "--max-request-body-bytes",
        type=parse_size,
        default=ServerConfig.max_request_body_bytes,
        help="Larger request bodies get 413; sizes like 16MiB work (default: %(default)s).",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds in-flight requests get to finish after SIGINT/SIGTERM; those still running then end "
        "with an error event (streams) or a 503 (default: %(default)s).",
    )
    g.add_argument(
        "--max-unread-stream-tokens",
        type=int,
        default=MAX_UNREAD_STREAM_TOKENS,
        help="A stream whose client leaves more than this many tokens of output unread is aborted, its "
        "KV blocks freed: a stream's queued output stays bounded (default: %(default)s).",
    )
    g.add_argument(
        "--engine-watchdog-timeout",
        type=float,
        default=ServerConfig.engine_watchdog_timeout,
        help="/health answers 503 when the engine loop has work but has not completed a step for this "
        "many seconds (default: %(default)s).",
    )
    limits = ClientLimits()
    g.add_argument(
        "--timeout-header-read",
        type=float,
        default=limits.header_timeout,
        help="Seconds a client has to send a request's headers, from their first byte (or the "
        "connection's opening); then 408 and the connection is closed (default: %(default)s).",
    )
    g.add_argument(
        "--timeout-body-read",
        type=float,
        default=limits.body_timeout,
        help="Seconds a client has to send a request's body once its headers arrived; then 408 and the "
        "connection is closed (default: %(default)s).",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=limits.keep_alive_timeout,
        help="Seconds an idle kept-alive connection stays open (uvicorn's; default: %(default)s).",
    )
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=limits.max_connections,
        help="Most connections open at once; requests on connections beyond get 503 (default: %(default)s).",
    )
    g.add_argument(
        "--max-pending-connections-per-client",
        type=int,
        default=limits.max_pending_per_client,
        help="Most connections one client address holds without a whole request (opening, sending a "
        "request, idle between requests); one more closes its oldest such connection, so no client "
        "takes every slot; 0: no limit. Behind a reverse proxy every client is the proxy's address "
        "(default: %(default)s).",
    )
    g.add_argument(
        "--socket-send-buffer-bytes",
        type=parse_size,
        default=None,
        help="Send buffers of each connection (the kernel's SO_SNDBUF and the server's write buffer), "
        "e.g. 256KiB: what a client that stops reading leaves queued before back-pressure reaches "
        "its request (default: the kernel's autotuning, up to net.ipv4.tcp_wmem's maximum, and 64 "
        "KiB).",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn (default: %(default)s).",
    )


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this machine can connect."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_limits_from_args(args: argparse.Namespace) -> ClientLimits:
    return ClientLimits(
        header_timeout=args.timeout_header_read,
        body_timeout=args.timeout_body_read,
        max_connections=args.limit_concurrency,
        keep_alive_timeout=args.timeout_keep_alive,
        max_pending_per_client=args.max_pending_connections_per_client or None,
        send_buffer_bytes=args.socket_send_buffer_bytes,
    )


def run_server(args: argparse.Namespace) -> None:
    from sparseserve.engine.engine import LLMEngine

    # Checked before the engine loads (seconds to minutes); the model's name is filled in after.
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [""]),
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        metrics_require_api_key=args.metrics_require_api_key,
        disable_fastapi_docs=args.disable_fastapi_docs,
        engine_watchdog_timeout=args.engine_watchdog_timeout,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        cache_salt_source=args.cache_salt_source,
        tool_call_parser=args.tool_call_parser,
    )
    engine = LLMEngine.from_kwargs(**engine_kwargs_from_args(args))
    if not args.served_model_name:
        config = dataclasses.replace(config, served_model_names=(engine.model_name,))
    async_engine = AsyncLLMEngine(engine, max_unread_tokens=args.max_unread_stream_tokens)
    app = build_app(async_engine, config)
    limits = client_limits_from_args(args)
    effective = {
        **dataclasses.asdict(engine.config),
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.get_stats().num_blocks_total,
        "host": args.host,
        "port": args.port,
        **dataclasses.asdict(config),
        "api_key": "set" if args.api_key else "none",
        **dataclasses.asdict(limits),
        "shutdown_timeout": args.shutdown_timeout,
    }
    logger.info("effective config: %s", json.dumps(effective, default=str))
    if not is_loopback(args.host) and not args.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    server = DrainingServer(
        uvicorn_config(app, args.host, args.port, limits, args.uvicorn_log_level), async_engine, args.shutdown_timeout
    )
    server.run()


main = run_server  # `sparseserve serve` dispatches to the module's main(args)
