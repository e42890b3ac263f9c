"""The HTTP front of a cluster of replicas: admission, routing, relaying, and every replica's health and metrics.

The gateway speaks the same API as ``serve`` and answers little itself:

- ``POST /v1/chat/completions`` and ``/v1/completions``: the request's
  conversation key picks a replica (:mod:`~colibri_aio.cluster.affinity`);
  429 with Retry-After when every replica's line is full, 503 when none is
  running. The replica's answer is relayed as it comes, streams included.
- ``GET /health``: every replica's ``/health`` with its id, process and load;
  ``status`` is "ok" when as many replicas as the deployment asks for run and
  answer, else "degraded" (503 when none answers).
- ``GET /metrics``: the gateway's own counters and every replica's metrics,
  each replica's series labelled ``replica``.
- anything else (``/v1/models``, ``/tokenize``, a wrong route) goes to any
  replica, which answers as ``serve`` does.

A replica that fails while answering (its process died, or it cannot be
reached) ends that request with a clear error, never a hang: a 503 with the
OpenAI error shape if nothing was sent yet, else — in a stream — a last
``data: {"error": ...}`` event, as ``serve`` ends a stream that fails.
The replicas are reached through :class:`Replicas`, so the gateway runs the
same over Ray Serve (:mod:`~colibri_aio.cluster.deployments`) and in tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from colibri_aio.cluster.affinity import SESSION_HEADER, NoReplica, NoRoom, ReplicaChooser, conversation_key
from colibri_aio.cluster.tunnel import REPLICA_HEADER, Head, HTTPRequest, Part
from colibri_aio.serve import page
from colibri_aio.serve.app import BearerAuth, ClientGone, CountRequests, sse_frame, until_disconnect
from colibri_aio.serve.guard import Limits, RequestGuard
from colibri_aio.serve.errors import APIError
from colibri_aio.serve.metrics import CONTENT_TYPE

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class ReplicaFailed(Exception):
    """The replica serving a request died or could not be reached before its answer was complete."""


class Replicas(Protocol):
    """How the gateway reaches its replicas."""

    def live(self) -> list[str]:
        """Ids of the replicas that run now."""

    def exchange(self, replica: str | None, request: HTTPRequest) -> AsyncIterator[Part]:
        """Send ``request`` to ``replica`` (None: any) and yield the answer's parts; raises :class:`ReplicaFailed`.

        Closing the iteration early cancels the request on the replica."""

    async def describe(self, replica: str) -> dict[str, Any]:
        """What the replica says about itself: ``replica`` (its id), ``pid``, ``host``, ``node``, ``engine``,
        ``cpus``."""


class Gateway:
    """The gateway's state: the replicas, the chooser, the metrics, the API key.

    ``/health`` and ``/metrics`` ask the replicas one after the other, not at
    once: Ray Serve gives every call made while serving one request that
    request's internal id, and its router tracks pending calls by that id, so
    concurrent calls from one request can leave one of them never routed.
    """

    def __init__(self, replicas: Replicas, *, per_replica: int, expected: int = 1, api_key: str | None = None,
                 fan_out_timeout: float = 5.0, limits: Limits | None = None) -> None:
        self.replicas = replicas
        self.limits = limits or Limits()  # the same bounds on Host, Content-Type and body as a replica's own
        self.expected = expected  # replicas the deployment asks for: fewer live is "degraded"
        self.chooser = ReplicaChooser(per_replica)
        self.api_key = api_key
        self.fan_out_timeout = fan_out_timeout
        self.metrics = GatewayMetrics(self.chooser)
        self._described: dict[str, dict[str, Any]] = {}

    def sync(self) -> None:
        """Take the live replicas as the chooser's (called before each decision)."""
        self.chooser.set_replicas(self.replicas.live())

    async def ask(self, replica: str | None, method: str, path: str) -> tuple[Head, bytes]:
        """A small request to one replica (or any): its head and whole body, within the fan-out timeout."""
        async def collect() -> tuple[Head, bytes]:
            head, body = None, b""
            async with contextlib.aclosing(self.replicas.exchange(replica, HTTPRequest(method, path))) as parts:  # type: ignore[type-var]
                async for part in parts:
                    if isinstance(part, Head):
                        head = part
                    else:
                        body += part
            if head is None:
                raise ReplicaFailed("the replica sent no answer")
            return head, body

        return await asyncio.wait_for(collect(), self.fan_out_timeout)

    async def described(self, replica: str) -> dict[str, Any]:
        if replica not in self._described:
            self._described[replica] = await asyncio.wait_for(self.replicas.describe(replica), self.fan_out_timeout)
        return self._described[replica]


def build_gateway_app(gateway: Gateway) -> Starlette:
    """The gateway's ASGI application."""
    routes = [*(Route(p, generation, methods=["POST"]) for p in GENERATION_PATHS),
              Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              *page.routes(),  # the web page; its telemetry stream is forwarded to a replica like any other GET
              Route("/{path:path}", forward, methods=METHODS)]
    app = Starlette(routes=routes, exception_handlers={APIError: _api_error})
    app.state.gateway = gateway
    app.add_middleware(RequestGuard, limits=gateway.limits)  # inside the key check: no stranger's body is read
    app.add_middleware(BearerAuth, api_key=gateway.api_key)
    app.add_middleware(CountRequests, requests=gateway.metrics.requests)  # outermost: counts 401s and 429s too
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _request_of(request: Request) -> HTTPRequest:
    # Hop-by-hop and length headers are the gateway's business; the replica's application sees the rest.
    skip = {b"host", b"connection", b"content-length", b"transfer-encoding", b"keep-alive"}
    headers = tuple((k, v) for k, v in request.scope["headers"] if k.lower() not in skip)
    return HTTPRequest(request.method, request.url.path, request.scope.get("query_string", b""), headers,
                       await request.body())


# --- routes --------------------------------------------------------------------------------------------------------

async def generation(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    forwarded = await _request_of(request)
    try:
        parsed = json.loads(forwarded.body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = None  # the replica answers 400 as serve does
    key = conversation_key(forwarded.path, parsed, forwarded.header(SESSION_HEADER))
    gateway.sync()
    try:
        choice = gateway.chooser.assign(key)
    except NoRoom as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) from None
    except NoReplica as exc:
        raise APIError(503, str(exc), code="no_replica", headers={"Retry-After": "5"}) from None
    gateway.metrics.routed.labels(choice.reason).inc()
    return Relay(gateway, forwarded, choice.replica, counted=True)


async def forward(request: Request) -> Response:
    return Relay(request.app.state.gateway, await _request_of(request), None, counted=False)


async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.sync()
    reports = [await _replica_health(gateway, r) for r in gateway.chooser.replicas]
    answered = [r for r in reports if r["status"] == "ok"]
    body = {"status": "ok" if len(answered) == len(reports) >= gateway.expected else "degraded",
            "busy": any(r["busy"] for r in answered), "waiting": sum(r["waiting"] for r in answered),
            "replicas": reports}
    return JSONResponse(body, status_code=200 if answered else 503)


async def _replica_health(gateway: Gateway, replica: str) -> dict[str, Any]:
    report: dict[str, Any] = {"replica": replica, "load": gateway.chooser.load(replica)}
    try:
        head, body = await gateway.ask(replica, "GET", "/health")
        report.update(await gateway.described(replica))
        report.update(json.loads(body))
        report["replica"] = head.header(REPLICA_HEADER) or replica  # who answered, should routing have moved it
    except (ReplicaFailed, TimeoutError, json.JSONDecodeError) as exc:
        report.update(status="unreachable", busy=False, waiting=0, error=str(exc) or exc.__class__.__name__)
    return report


async def metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.sync()
    replicas = gateway.chooser.replicas
    scraped = {}
    for replica in replicas:
        try:
            head, body = await gateway.ask(replica, "GET", "/metrics")
        except (ReplicaFailed, TimeoutError):
            gateway.metrics.scrape_failures.inc()
            continue
        scraped[head.header(REPLICA_HEADER) or replica] = body.decode()
    return Response(merged_metrics(gateway.metrics.registry, scraped), media_type=CONTENT_TYPE)


# --- relaying ------------------------------------------------------------------------------------------------------

class Relay(Response):
    """The replica's answer, relayed as it comes; ``counted``: a generation the chooser counts until it ends."""

    def __init__(self, gateway: Gateway, request: HTTPRequest, replica: str | None, *, counted: bool) -> None:
        self.gateway, self.request, self.replica, self.counted = gateway, request, replica, counted
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        try:
            await until_disconnect(receive, self._relay(scope, receive, send))
        except ClientGone:
            pass  # closing the relay cancelled the request on the replica
        finally:
            if self.counted and self.replica is not None:
                self.gateway.chooser.finished(self.replica, time.perf_counter() - start)

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        head: Head | None = None
        try:
            async with contextlib.aclosing(  # type: ignore[type-var]  # leaving early cancels it on the replica
                    self.gateway.replicas.exchange(self.replica, self.request)) as parts:
                async for part in parts:
                    if isinstance(part, Head):
                        head = part
                        await send({"type": "http.response.start", "status": part.status,
                                    "headers": list(part.headers)})
                    else:
                        await send({"type": "http.response.body", "body": part, "more_body": True})
        except ReplicaFailed as exc:
            self.gateway.metrics.replica_failures.inc()
            if self.replica is not None:
                self.gateway.chooser.forget(self.replica)
            error = APIError(503, f"the replica serving this request failed: {exc}", code="replica_failed",
                             headers={"Retry-After": "1"})
            if head is None:
                await error.response()(scope, receive, send)
                return
            if head.is_event_stream:
                await send({"type": "http.response.body", "body": sse_frame(error.body()), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --- metrics -------------------------------------------------------------------------------------------------------

class GatewayMetrics:
    """The gateway's own series: requests by endpoint and status, routing reasons, replica failures, load."""

    def __init__(self, chooser: ReplicaChooser) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("colibri_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.routed = Counter("colibri_gateway_routed", "Generation requests routed, by reason: holder (the "
                              "replica whose KV cache holds the conversation) or least_busy", ["reason"], registry=r)
        self.replica_failures = Counter("colibri_gateway_replica_failures",
                                        "Requests ended early because their replica failed", registry=r)
        self.scrape_failures = Counter("colibri_gateway_scrape_failures",
                                       "Replica /metrics scrapes that failed or timed out", registry=r)
        r.register(_ChooserCollector(chooser))


class _ChooserCollector(Collector):
    def __init__(self, chooser: ReplicaChooser) -> None:
        self.chooser = chooser

    def collect(self) -> Iterator[Metric]:
        c = self.chooser
        yield GaugeMetricFamily("colibri_gateway_replicas", "Replicas running", value=len(c.replicas))
        yield GaugeMetricFamily("colibri_gateway_in_flight", "Generation requests at the replicas (generating or "
                                "waiting)", value=c.in_flight)
        yield GaugeMetricFamily("colibri_gateway_capacity", "Generation requests the replicas take at once "
                                "(replicas x (1 + max queue))", value=c.capacity)


def merged_metrics(own: CollectorRegistry, per_replica: dict[str, str]) -> bytes:
    """The gateway's series and every replica's (Prometheus text), each replica's labelled ``replica``.

    Series of one name from several sources become one family (one HELP and TYPE).
    """
    families: dict[str, Metric] = {}

    def add(family: Metric, extra: dict[str, str]) -> None:
        merged = families.get(family.name)
        if merged is None:
            merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        for s in family.samples:
            merged.add_sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)

    for family in own.collect():
        add(family, {})
    for replica, text in sorted(per_replica.items()):
        for family in text_string_to_metric_families(text):
            add(family, {"replica": replica})

    class _Merged(Collector):
        def collect(self) -> Iterator[Metric]:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
