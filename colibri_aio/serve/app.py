"""The HTTP application: OpenAI-compatible routes in front of one engine.

Every generation takes its turn in the :class:`RequestLine` (429 with
Retry-After when the line is full), then runs on the engine's own thread;
this loop only moves pieces to clients, so ``/health`` and ``/metrics``
answer while a token is computed. A client that goes away, whether waiting
or generating, gives up its place or cancels its generation, and the engine
is handed on only once its reads have drained.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from pathlib import Path
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

from prometheus_client import Counter
from pydantic import Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from colibri_aio import __version__
from colibri_aio.errors import ExpertReadError, UserError
from colibri_aio.logs import get_logger
from colibri_aio.serve import anthropic, page, telemetry_stream
from colibri_aio.serve.errors import APIError
from colibri_aio.serve.metrics import CONTENT_TYPE, ServerMetrics
from colibri_aio.engine.line import RequestLine
from colibri_aio.serve.guard import Limits, RequestGuard
from colibri_aio.serve.requests import (MAX_MESSAGES, MAX_TOKEN_IDS, ChatRequest, CompletionRequest, Message, _Body,
                                       _Generation, at_most, load_json, parse_json)
from colibri_aio.serve.responses import ChatShape, CompletionShape
from colibri_aio.serve.chat_flow import plan_chat, template_messages
from colibri_aio.serve.runs import ClientGone, Run, error_for, open_run, until_disconnect  # noqa: F401 (re-exported)
from colibri_aio.serve.session import ContextFull, GenerationCancelled, GenerationRequest, Session

log = get_logger("colibri_aio.serve")
T = TypeVar("T")
PUBLIC_PATHS = frozenset({"/health"})
SSE_SEP = "\n"  # events end with a blank line, fields with "\n" (not sse-starlette's default "\r\n")


class Service:
    """What the routes share: the session, the line in front of it, metrics, the model's id, the key."""

    def __init__(self, session: Session, *, max_queue: int = 16, api_key: str | None = None,
                 model_id: str | None = None, slot_save_path: Path | None = None,
                 reasoning_budget: int | None = None) -> None:
        self.session = session
        self.line = RequestLine(max_queue, capacity=session.engine.engine.plan.parallel)
        self.metrics = ServerMetrics(session.engine.engine, self.line)
        self.api_key = api_key
        self.model_id = model_id or session.model_name
        self.started = int(time.time())
        self.slot_save_path = slot_save_path
        self.reasoning_budget = reasoning_budget
        # Set when the server stops: long-lived streams that no generation ends (the telemetry) end on it.
        self.stopping = asyncio.Event()


def build_app(service: Service, limits: Limits | None = None) -> Starlette:
    """The ASGI application serving ``service``; ``limits``: on the request's Host, Content-Type and body (default:
    :class:`Limits`' sizes, any Host)."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/slots/{slot:int}", slot_action, methods=["POST"]),
        Route(telemetry_stream.PATH, telemetry, methods=["GET"]),
        *page.routes(),                                             # the web page: /, /web/*
        *anthropic.routes(anthropic.ChatPath(open=open_chat, read_json=_json)),  # /v1/messages, …/count_tokens
    ]
    handlers: dict[Any, Callable[..., Any]] = {
        APIError: _api_error, HTTPException: _http_error, ContextFull: _context_full, UserError: _user_error,
        ExpertReadError: _read_error, GenerationCancelled: _cancelled, Exception: _api_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.service = service
    app.add_middleware(RequestGuard, limits=limits or Limits(),   # inside the key check: no stranger's body is read
                       respond=error_response_for)
    app.add_middleware(BearerAuth, api_key=service.api_key)
    app.add_middleware(CountRequests, requests=service.metrics.requests)  # added last: outermost, so it counts 401s too
    return app


# --- generation routes -------------------------------------------------------------------------------------------

async def chat_completions(request: Request) -> Response:
    service: Service = request.app.state.service
    body: ChatRequest = await _parsed(request, ChatRequest)
    run = await open_chat(request, service, body)
    if isinstance(run, Response):
        return run
    return await _answer(run, body)


async def open_chat(request: Request, service: Service, body: ChatRequest) -> ChatRun | Response:
    """A chat request's turn, prompt (tools, reasoning options) and grammar; its generation started."""
    def prepare() -> tuple[GenerationRequest, ChatShape]:
        plan = plan_chat(service.session, body, default_budget=service.reasoning_budget)
        gen = _generation(service.session, plan.ids, body, body.token_budget(), body.logprobs_count(), "messages",
                          constraint=plan.constraint, special=plan.special)
        return gen, ChatShape(service.model_id, service.session.tokenizer, plan.parser)

    return await open_run(request, service, prepare, with_logprobs=body.logprobs)


async def completions(request: Request) -> Response:
    service: Service = request.app.state.service
    body: CompletionRequest = await _parsed(request, CompletionRequest)
    prompt = body.prompt

    def prepare() -> tuple[GenerationRequest, CompletionShape]:
        ids = (service.session.text_ids(prompt) if isinstance(prompt, str)
               else _checked_ids(prompt, service.session.vocab_size))
        gen = _generation(service.session, ids, body, body.token_budget(), body.logprobs, "prompt")
        return gen, CompletionShape(service.model_id, service.session.tokenizer)

    run = await open_run(request, service, prepare, with_logprobs=body.logprobs is not None)
    if isinstance(run, Response):
        return run
    return await _answer(run, body)


def _checked_ids(ids: list[int], vocab_size: int, field: str = "prompt") -> list[int]:
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise APIError(400, f"{field}: token ids must be in [0, {vocab_size})", param=field)
    return ids


def _generation(session: Session, ids: list[int], body: _Generation, budget: int | None, logprobs: int | None,
                prompt_field: str, **options: Any) -> GenerationRequest:
    try:
        return session.request(ids, max_tokens=budget, sampling=body.sampling(session.defaults, session.vocab_size),
                               stop=body.stops(), logprobs=logprobs, reuse=body.cache_prompt, **options)
    except ContextFull as exc:
        raise APIError(400, str(exc), param=prompt_field, code="context_length_exceeded") from None


async def _answer(run: Run, body: _Generation) -> Response:
    """The run's answer: an SSE stream ending with ``[DONE]`` (or an error event), or the whole object."""
    if body.stream:
        return EventSourceResponse(_sse(run, body.include_usage()), sep=SSE_SEP, background=BackgroundTask(run.cancel))
    try:
        return JSONResponse(await run.whole())
    except ClientGone:
        return Response(status_code=499)


async def _sse(run: Run, include_usage: bool) -> AsyncIterator[dict[str, str]]:
    async for chunk in run.chunks(include_usage):
        yield _data(chunk)
        if "error" in chunk:
            return
    yield {"data": "[DONE]"}


def _data(obj: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}


def sse_frame(obj: dict[str, Any]) -> bytes:
    """One SSE event carrying ``obj``, framed as the streams of this server frame theirs."""
    return ServerSentEvent(**_data(obj), sep=SSE_SEP).encode()


ChatRun = Run  # what open_chat starts: whole() or chunks() give the chat.completion answer


# --- other routes ------------------------------------------------------------------------------------------------

def _model_card(service: Service) -> dict[str, Any]:
    return {"id": service.model_id, "object": "model", "created": service.started, "owned_by": "colibri-aio",
            "meta": {"n_ctx": service.session.n_ctx, "vocab_size": service.session.vocab_size,
                     "colibri_aio": __version__}}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.service)]})


async def get_model(request: Request) -> Response:
    service: Service = request.app.state.service
    if request.path_params["model"] != service.model_id:
        raise APIError(404, f"the model {request.path_params['model']!r} does not exist; this server has "
                            f"{service.model_id!r}", param="model", code="model_not_found")
    return JSONResponse(_model_card(service))


async def health(request: Request) -> Response:
    line = request.app.state.service.line
    return JSONResponse({"status": "ok", "busy": line.busy, "generating": line.holders, "slots": line.capacity,
                         "waiting": line.waiting})


async def telemetry(request: Request) -> Response:
    """The engine's telemetry as SSE, one event every ``?interval=S`` seconds (:mod:`.telemetry_stream`)."""
    service: Service = request.app.state.service
    interval = telemetry_stream.parse_interval(request.query_params.get("interval"))
    sampler = telemetry_stream.TelemetrySampler(service.session.engine.engine, service.line)
    return EventSourceResponse(telemetry_stream.events(sampler, interval, service.stopping), sep=SSE_SEP,
                               headers={"Cache-Control": "no-store"})


async def metrics(request: Request) -> Response:
    service: Service = request.app.state.service
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)


class TokenizeRequest(_Body):
    IGNORED = frozenset({"model"})             # vLLM's clients name the model; this server has one

    content: str | None = None                 # llama-server's name
    prompt: str | None = None                  # vLLM's name
    # Rendered with the chat template first.
    messages: Annotated[list[Message], at_most(MAX_MESSAGES), Field(min_length=1)] | None = None
    add_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    IGNORED = frozenset({"model"})

    tokens: Annotated[list[int], at_most(MAX_TOKEN_IDS)] = Field(default_factory=list)


async def tokenize(request: Request) -> Response:
    service: Service = request.app.state.service
    body: TokenizeRequest = await _parsed(request, TokenizeRequest)
    tok = service.session.tokenizer
    if body.messages is not None:
        chat = template_messages(ChatRequest(messages=body.messages))
        ids = await run_in_threadpool(service.session.chat_ids, chat)
    else:
        text = body.content if body.content is not None else body.prompt
        if text is None:
            raise APIError(400, "content: give the text to tokenize (or prompt, or messages)", param="content")
        ids = await run_in_threadpool(lambda: tok.encode(text, parse_special=True, add_special=body.add_special))
    tokens: list[Any] = ids
    if body.with_pieces:
        tokens = [{"id": i, "piece": tok.token_bytes(i).decode("utf-8", errors="replace")} for i in ids]
    return JSONResponse({"tokens": tokens, "count": len(ids), "max_model_len": service.session.n_ctx})


async def detokenize(request: Request) -> Response:
    service: Service = request.app.state.service
    body: DetokenizeRequest = await _parsed(request, DetokenizeRequest)
    _checked_ids(body.tokens or [0], service.session.vocab_size, "tokens")
    return JSONResponse({"content": await run_in_threadpool(service.session.tokenizer.decode, body.tokens)})


async def _json(request: Request) -> Any:
    """The body as JSON, decoded on a worker thread so that a large one does not hold up the loop (``/health``,
    the streams); its size and pace were bounded by :class:`RequestGuard`."""
    return await run_in_threadpool(load_json, await request.body())


async def _parsed(request: Request, model: type[T]) -> T:
    """The body validated as ``model`` (:func:`parse_json`) on a worker thread."""
    return await run_in_threadpool(parse_json, model, await request.body())


class SlotFile(_Body):
    filename: str


async def slot_action(request: Request) -> Response:
    """llama-server's ``POST /slots/{id}?action=save|restore`` with ``{"filename": ...}``: a sequence slot's KV
    cache and token ids to or from a file of ``--slot-save-path`` (a bare file name: no folders)."""
    service: Service = request.app.state.service
    action = request.query_params.get("action")
    if action not in ("save", "restore"):
        raise APIError(400, f"action must be save or restore, got {action!r}", param="action")
    if service.slot_save_path is None:
        raise APIError(400, "slot files are off: start the server with --slot-save-path DIR", code="not_supported")
    body: SlotFile = await _parsed(request, SlotFile)
    name = body.filename
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise APIError(400, f"filename must be a bare file name, got {name!r}", param="filename")
    slot, path = request.path_params["slot"], service.slot_save_path / name
    engine = service.session.engine
    t0 = time.perf_counter()
    if action == "save":
        written = await run_in_threadpool(engine.save_slot, path, slot)
        return JSONResponse({"id_slot": slot, "filename": name, "n_saved": engine.engine.net.slots[slot].n_past,
                             "n_written": written, "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})
    restored = await run_in_threadpool(engine.restore_slot, path, slot)
    return JSONResponse({"id_slot": slot, "filename": name, "n_restored": restored, "n_read": path.stat().st_size,
                         "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})


# --- errors ------------------------------------------------------------------------------------------------------

async def _api_error(request: Request, exc: Exception) -> Response:
    return error_for(exc).response()


_user_error = _context_full = _read_error = _cancelled = _api_error


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response_for(request.url.path, APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                                                         headers=dict(exc.headers or {})))


def error_response_for(path: str, error: APIError) -> Response:
    """``error`` in the shape of the API ``path`` belongs to: Anthropic's on /v1/messages, else OpenAI's."""
    return anthropic.error_response(error) if anthropic.is_messages_path(path) else error.response()


# --- middleware --------------------------------------------------------------------------------------------------

class BearerAuth:
    """``Authorization: Bearer KEY`` on every route but ``/health`` and reading the web page (GET of its files: the
    page asks for the key, so it must load without it) when a key is set (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and self._digest is not None and scope["path"] not in PUBLIC_PATHS
                and not page.is_public(scope["method"], scope["path"])):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" and b"x-api-key" in headers:  # how Anthropic's clients send the key
                scheme, token = b"bearer", headers[b"x-api-key"]
            # Digests of equal length: the comparison's time says nothing about the key.
            if not (scheme.lower() == b"bearer"
                    and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)):
                error = APIError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response_for(scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountRequests:
    """Counts answered requests by route and status (in ``requests``, labelled endpoint and status) for ``/metrics``."""

    ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                        "/detokenize", telemetry_stream.PATH, *page.PAGE_PATHS, *anthropic.PATHS})

    def __init__(self, app: ASGIApp, requests: Counter) -> None:
        self.app, self.requests = app, requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = scope["path"] if scope["path"] in self.ROUTES else "other"
            self.requests.labels(path, str(status or 499)).inc()
