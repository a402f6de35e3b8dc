"""The OpenAI-compatible HTTP server: routes, auth, errors, and the request pipeline.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (and ``GET``/``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``), ``/v1/embeddings``, ``/v1/models``;
vLLM's ``/classify``, ``/score`` and ``/rerank`` (also under ``/v1``; ``/v2/rerank``),
``/tokenize``, ``/detokenize``, ``/version`` and ``/ping``; ``/health`` and ``/metrics``.

Every completion request: validate (pydantic; 400) -> check the model name (404) -> render the
chat template and tokenize -> check prompt + max_tokens against ``max_model_len`` (400) -> one
Generate call per sequence on the decode workers -> detokenize, stop strings -> a JSON body or
SSE events.

A client that disconnects gets its gRPC calls cancelled (the workers abort the requests): while
a response is being prepared, a watcher on the ASGI ``receive`` channel cancels the handler; once
streaming, :class:`~baton_gateway.streaming.SSEResponse` does the same.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import baton
from baton_engine.errors import InvalidRequestError
from baton_gateway.auth import ApiKeyMiddleware
from baton_gateway.chat import ChatDefaults, tokenizer_config
from baton_gateway.classification import classification_request
from baton_gateway.client import WorkerPool
from baton_gateway.embeddings import embedding_request
from baton_gateway.errors import GatewayError, bad_request, error_response
from baton_gateway.metrics import GatewayMetrics
from baton_gateway.pipeline import Pipeline, RequestIds
from baton_gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    tokenize_request,
)
from baton_gateway.responses_api import ResponsesRequest
from baton_gateway.scoring import RerankRequest, ScoreRequest
from baton_gateway.streaming import SSEResponse

logger = logging.getLogger(__name__)

# Not an HTTP status a client will see (it has gone): nginx's "client closed request".
_CLIENT_CLOSED = 499
_Body = TypeVar("_Body")


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser pages may call the API (vLLM's defaults: any origin, method and header,
    without credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class GatewayConfig:
    decode_addrs: tuple[str, ...] = ()
    prefill_addrs: tuple[str, ...] = ()
    kvstore_address: str | None = None  # find workers there and route by its prefix index
    remote_prefill_threshold: int = 256  # uncached prompt tokens above which prefill is remote
    # prefill locally rather than wait longer than this in the prefill worker's queue (None: never)
    max_remote_prefill_wait_ms: float | None = None
    model: str | None = None  # the model the tokenizer comes from; None: the default model
    served_model_name: str | None = None  # None: the decode worker's model name
    served_model_aliases: tuple[str, ...] = ()  # other names requests may give the model
    api_key: str | None = None
    max_model_len: int | None = None  # None: the decode worker's
    connect_timeout_s: float = 120.0
    tool_call_parser: str | None = None  # None: "auto" tool choice is refused
    chat_template: str | None = None  # None: the model's
    chat_template_kwargs: dict[str, Any] | None = None  # --default-chat-template-kwargs
    chat_template_content_format: str = "auto"  # --chat-template-content-format
    exclude_tools_when_tool_choice_none: bool = False  # --exclude-tools-when-tool-choice-none
    force_include_usage: bool = False  # --enable-force-include-usage
    trust_request_chat_template: bool = False  # requests may bring their own template
    response_role: str = "assistant"  # chat messages' role after a generation prompt
    reasoning_parser: str | None = None  # None: chat outputs are all content
    # Sampling params for requests that leave them unset (the model's generation config).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    cors: CorsPolicy = CorsPolicy()
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids
    request_id_headers: bool = False  # --enable-request-id-headers
    max_stored_responses: int = 256  # Responses API answers kept (store=true)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING; here also BATON_ALLOW_RUNTIME_LORA_UPDATING)
    runtime_lora_updating: bool = False
    tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's flag)
    # POST /reset_prefix_cache, /sleep, /wake_up, /collective_rpc, GET /is_sleeping (vLLM's,
    # behind its VLLM_SERVER_DEV_MODE; here also BATON_SERVER_DEV_MODE): unguarded by
    # --api-key, as there, so off by default
    dev_mode: bool = False
    # vLLM's --middleware: import paths of ASGI middleware classes or HTTP middleware functions,
    # wrapped around the routes (and the API key check) in order, the last outermost (inside
    # CORS)
    middleware: tuple[str, ...] = ()


def load_middleware(path: str) -> Any:
    """The ASGI middleware class, or ``@app.middleware("http")`` function (``async def
    f(request, call_next)``), at the import path ``module.name`` (vLLM's ``--middleware``).
    Raises InvalidRequestError."""
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise InvalidRequestError(f"--middleware {path!r} is not an import path (module.name)")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise InvalidRequestError(f"--middleware {path!r} cannot be imported: {e}") from e
    if not (inspect.isclass(found) or inspect.iscoroutinefunction(found)):
        raise InvalidRequestError(
            f"--middleware {path!r} must be a class (ASGI middleware) or an async function "
            f"(HTTP middleware), not a {type(found).__name__}"
        )
    return found


def _json(status: int, body: Any) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status)


def _query_bool(query: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean query parameter, spelled as FastAPI (pydantic) takes one; else a 400."""
    value = query.get(name)
    if value is None:
        return default
    spelled = value.strip().lower()
    if spelled in ("1", "true", "t", "yes", "y", "on"):
        return True
    if spelled in ("0", "false", "f", "no", "n", "off"):
        return False
    raise GatewayError(400, f"{name} must be true or false, not {value!r}", name)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """vLLM-like text for pydantic errors, and the first offending parameter."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", param


REQUEST_ID_HEADER = "X-Request-Id"


class RequestIdMiddleware:
    """``--enable-request-id-headers``: every response carries ``X-Request-Id``, the request's
    own or a new one. A new one is left in the request's state (``request_id``), for the
    response's ``id`` when the body names none. Pure ASGI, so streamed responses pass
    untouched."""

    _NAME = REQUEST_ID_HEADER.lower().encode()

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == self._NAME), None)
        if value is None:
            value = uuid.uuid4().hex.encode()
            scope.setdefault("state", {})["request_id"] = value.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (self._NAME, value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


# A UTF-16 surrogate, escaped (\\udXXX: only these make json.loads produce one) or in raw
# bytes (which it decodes with "surrogatepass"): the cheap test before the exact one.
_MAYBE_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` (parsed JSON) holds a surrogate without its pair: not
    Unicode, which tokenizers, protobuf and JSON encoders refuse deep inside the gateway."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class _CheckedRequest(Request):
    """A request whose JSON body holds only valid Unicode (else a 400, for every route)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            parsed = json.loads(body)
            if _MAYBE_SURROGATE.search(body) and _has_lone_surrogate(parsed):
                raise HTTPException(
                    400,
                    "the request's JSON holds a lone UTF-16 surrogate (an escape \\ud800-\\udfff "
                    "without its pair): it is not valid Unicode",
                )
            self._json = parsed
        return self._json


class _CheckedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_CheckedRequest(request.scope, request.receive))

        return checked


async def _parse(request: Request, parse: Callable[[Any], _Body]) -> _Body:
    """A body whose model depends on its fields (``messages`` or not), as FastAPI would
    have validated it: pydantic's errors, or a bad JSON body, become a 400."""
    try:
        return parse(await request.json())
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    except ValueError as e:  # not JSON
        raise RequestValidationError([{"loc": ("body",), "msg": f"invalid JSON: {e}"}]) from e


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (its ``finally`` blocks cancel
    the gRPC calls) and answer 499 to no one."""
    handler = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
            with suppress(asyncio.CancelledError):
                await handler
    if handler.cancelled():
        return Response(status_code=_CLIENT_CLOSED)
    return handler.result()


class _AppState:
    """What the routes use; set at startup (lifespan), before any request is served."""

    pipeline: Pipeline
    http: httpx.AsyncClient  # fetches the workers' metrics


def create_app(config: GatewayConfig, tokenizer: Any) -> FastAPI:
    """The ASGI app. Connecting to the workers happens at startup (lifespan), which fails if
    they do not answer within ``config.connect_timeout_s``."""
    state = _AppState()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        kvstore = None
        if config.kvstore_address:
            from baton_kvstore.client import KVStoreClient

            kvstore = KVStoreClient(config.kvstore_address)

        def on_decision(decision: str) -> None:  # requests (so decisions) come after startup
            state.pipeline.metrics.record_decision(decision)

        pool = WorkerPool(
            config.decode_addrs,
            config.prefill_addrs,
            kvstore=kvstore,
            remote_prefill_threshold=config.remote_prefill_threshold,
            max_remote_prefill_wait_s=(
                None
                if config.max_remote_prefill_wait_ms is None
                else config.max_remote_prefill_wait_ms / 1000
            ),
            on_decision=on_decision,
        )
        http = httpx.AsyncClient()
        try:
            info = await pool.connect(config.connect_timeout_s)
            name = config.served_model_name or info.model
            max_model_len = config.max_model_len or info.max_model_len
            if max_model_len > info.max_model_len:
                logger.warning(
                    "--max-model-len %d exceeds the decode worker's %d; using the worker's",
                    max_model_len,
                    info.max_model_len,
                )
                max_model_len = info.max_model_len
            metrics = GatewayMetrics(name)
            state.http = http
            state.pipeline = Pipeline(
                pool,
                tokenizer,
                name,
                max_model_len,
                info.vocab_size,
                metrics,
                tool_parser=config.tool_call_parser,
                chat=ChatDefaults(
                    config.chat_template,
                    dict(config.chat_template_kwargs or {}),
                    config.chat_template_content_format,
                    config.exclude_tools_when_tool_choice_none,
                ),
                force_include_usage=config.force_include_usage,
                response_role=config.response_role,
                reasoning_parser=config.reasoning_parser,
                generation_defaults=config.generation_defaults,
                tokens_as_ids=config.tokens_as_ids,
                max_stored_responses=config.max_stored_responses,
                lora_modules=dict(info.lora_modules),
                labels=info.labels,
                model_aliases=config.served_model_aliases,
                eos_token_ids=info.eos_token_ids,
                trust_request_chat_template=config.trust_request_chat_template,
            )
            logger.info("serving %s (max_model_len %d) via %s", name, max_model_len,
                        ", ".join(f"{w.role} {w.addr}" for w in pool.workers))  # fmt: skip
            yield
        finally:
            if hasattr(state, "pipeline"):
                await state.pipeline.close()
            await pool.close()
            await http.aclose()

    app = FastAPI(title="Baton", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = _CheckedRoute

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return _json(exc.status, exc.to_response())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _json(400, error_response(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _json(exc.status_code, error_response(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _json(500, error_response(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.pipeline.pool.healthy else 503)

    # vLLM's: SageMaker's health check, either method.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> JSONResponse:
        return _json(200, VersionResponse(version=baton.__version__))

    @app.get("/metrics")
    async def metrics() -> Response:
        pipeline = state.pipeline
        workers = pipeline.pool.workers
        urls = {w.addr: w.info.metrics_url if w.info else "" for w in workers}
        body = await pipeline.metrics.scrape(state.http, urls, {w.addr: w.role for w in workers})
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[ModelCard]:
        pipeline = state.pipeline
        name, max_len = pipeline.model_name, pipeline.max_model_len
        cards = [  # every name the model is served under, as vLLM lists them
            ModelCard(id=alias, root=name, max_model_len=max_len)
            for alias in (name, *pipeline.model_aliases)
        ]
        cards += [  # the LoRA adapters, as vLLM lists them
            ModelCard(id=lora, root=path, parent=name, max_model_len=max_len)
            for lora, path in pipeline.lora_modules.items()
        ]
        return cards

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return _json(200, ModelList(data=model_cards()))

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (names may hold slashes)
    async def model(model: str) -> JSONResponse:
        for card in model_cards():
            if card.id == model:
                return _json(200, card)
        raise GatewayError(404, f"The model `{model}` does not exist.", param="model")

    def request_ids(request: Request) -> RequestIds:
        return RequestIds(
            request.headers.get(REQUEST_ID_HEADER), getattr(request.state, "request_id", None)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        work = state.pipeline.chat(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        work = state.pipeline.completion(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        work = state.pipeline.responses(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.get("/v1/responses/{response_id}")
    async def get_response(
        response_id: str, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        if stream:
            return SSEResponse(state.pipeline.response_events(response_id, starting_after))
        return _json(200, state.pipeline.stored_response(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        return _json(200, await state.pipeline.cancel_response(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        return _json(200, await state.pipeline.delete_response(response_id))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await _parse(request, embedding_request)
        work = state.pipeline.embeddings(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/pooling")
    async def pooling(request: Request) -> Response:
        body = await _parse(request, embedding_request)
        work = state.pipeline.pooling(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(request: Request) -> Response:
        body = await _parse(request, classification_request)
        work = state.pipeline.classify(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        work = state.pipeline.score(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        work = state.pipeline.score(body, request_ids(request))
        return await _cancel_on_disconnect(request, work)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one route (vLLM's): the first endpoint, in vLLM's order, whose request
        the body is serves it."""
        body = await _parse(request, lambda data: data)
        pipeline = state.pipeline
        routes: list[tuple[Callable[[Any], Any], Callable[..., Awaitable[Response]]]] = [
            (ChatCompletionRequest.model_validate, pipeline.chat),
            (CompletionRequest.model_validate, pipeline.completion),
            (embedding_request, pipeline.embeddings),
            (classification_request, pipeline.classify),
            (ScoreRequest.model_validate, pipeline.score),
            (RerankRequest.model_validate, pipeline.score),
        ]
        # (a model embeds or classifies, not both)
        del routes[2 if pipeline.labels else 3]
        for parse, serve in routes:
            try:
                parsed = parse(body)
            except ValidationError:
                continue
            return await _cancel_on_disconnect(request, serve(parsed, request_ids(request)))
        raise bad_request(
            "cannot find an endpoint for the request: its body is none of a chat completion's, "
            "a completion's, an embedding's or classification's, a score's or a rerank's"
        )

    @app.get("/load")
    async def load() -> JSONResponse:
        """vLLM's: the requests the gateway is serving now."""
        return JSONResponse({"server_load": state.pipeline.metrics.num_running})

    if config.tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            """vLLM's (``--enable-tokenizer-info-endpoint``): the tokenizer's class and
            configuration, and the chat template requests get."""
            return JSONResponse(tokenizer_config(tokenizer, config.chat_template))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return _json(200, state.pipeline.tokenize(await _parse(request, tokenize_request)))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return _json(200, state.pipeline.detokenize(body))

    if config.runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            await state.pipeline.load_lora_adapter(body.lora_name, body.lora_path)
            text = f"Success: LoRA adapter '{body.lora_name}' added successfully."
            return Response(text, media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            await state.pipeline.unload_lora_adapter(body.lora_name)
            text = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
            return Response(text, media_type="text/plain")

    # vLLM's, for workers run with --profiler-config (the others refuse: a 400)
    @app.post("/start_profile")
    async def start_profile() -> Response:
        await state.pipeline.pool.profile(True)
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        await state.pipeline.pool.profile(False)
        return Response(status_code=200)

    if config.dev_mode:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            missed = await state.pipeline.pool.reset_prefix_cache()
            if missed:
                raise GatewayError(
                    409,
                    f"The prefix cache was not reset on {', '.join(missed)}: requests or KV "
                    "leases hold blocks there (or it stopped answering). Retry when idle.",
                )
            return Response(status_code=200)

        # vLLM's sleep mode (workers run with --enable-sleep-mode): every worker sleeps or none
        @app.post("/sleep")
        async def sleep(request: Request) -> Response:
            level = request.query_params.get("level", "1")
            if not level.isdigit():
                raise GatewayError(400, f"level must be 0, 1 or 2, not {level!r}", "level")
            await state.pipeline.pool.sleep(int(level), request.query_params.get("mode", "abort"))
            return Response(status_code=200)

        # vLLM's pause_generation: requests wait (accepted) until /resume
        @app.post("/pause")
        async def pause(request: Request) -> JSONResponse:
            query = request.query_params
            mode = query.get("mode", "abort")
            if _query_bool(query, "wait_for_inflight_requests", False):  # (vLLM's older form)
                mode = "wait"
            await state.pipeline.pool.pause(mode, _query_bool(query, "clear_cache", True))
            return JSONResponse({"status": "paused"})

        @app.post("/resume")
        async def resume() -> JSONResponse:
            await state.pipeline.pool.resume()
            return JSONResponse({"status": "resumed"})

        @app.get("/is_paused")
        async def is_paused() -> JSONResponse:
            return JSONResponse({"is_paused": await state.pipeline.pool.is_paused()})

        @app.post("/wake_up")
        async def wake_up(request: Request) -> Response:
            await state.pipeline.pool.wake_up(request.query_params.getlist("tags"))
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> JSONResponse:
            return JSONResponse({"is_sleeping": await state.pipeline.pool.is_sleeping()})

        # vLLM's, for its level-2 sequence: {"method": "reload_weights"} (the one served here)
        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict) or "method" not in body:
                raise GatewayError(400, "Missing 'method' in request body", "method")
            method, args, kwargs = body["method"], body.get("args"), body.get("kwargs")
            if method != "reload_weights" or args or kwargs:
                raise GatewayError(
                    400,
                    f"collective_rpc({method!r}) with these arguments is not supported: Baton's "
                    "workers answer only 'reload_weights' (no arguments)",
                    "method",
                )
            ranks = await state.pipeline.pool.reload_weights()
            return JSONResponse({"results": [None] * ranks})

    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.request_id_headers:  # (outside the key check: a 401 has an id too)
        app.add_middleware(RequestIdMiddleware)
    for middleware in map(load_middleware, config.middleware):
        if inspect.isclass(middleware):
            app.add_middleware(cast(Any, middleware))
        else:
            app.middleware("http")(middleware)
    # Added last, so outermost: a preflight is answered before the API key is checked, and
    # error responses carry the CORS headers too.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.cors.allowed_origins,
        allow_methods=config.cors.allowed_methods,
        allow_headers=config.cors.allowed_headers,
        allow_credentials=config.cors.allow_credentials,
    )
    return app
