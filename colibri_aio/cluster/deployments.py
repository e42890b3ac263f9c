"""The Ray Serve application: engine replicas behind one gateway.

    EngineReplica x N  — one engine each (its own placement, ``--replica-cpus``
                         CPUs reserved and as many kernel threads), running
                         ``colibri_aio.serve``'s application on the requests the
                         gateway relays (:func:`~colibri_aio.cluster.tunnel.exchange`)
    Gateway x 1        — the HTTP ingress (:mod:`~colibri_aio.cluster.gateway`)

Ray Serve's HTTP proxy hands every request to the gateway; the gateway calls
a replica through a deployment handle, whose router (:class:`PinnedRouter`)
sends it to the replica the gateway chose. Ray restarts a replica whose
process dies; the requests it held end with an error at once (Ray reports
the death to the handle), and new requests go to the replicas that run.

:func:`build` makes the application from a :class:`ClusterConfig`;
``colibri_aio.ray_app`` exposes it to ``serve run``.
"""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from colibri_aio.cluster.gateway import Gateway, ReplicaFailed, build_gateway_app
from colibri_aio.serve.guard import HostAllowList, Limits
from colibri_aio.cluster.board import board
from colibri_aio.cluster.router import ROUTE_TO, PinnedRouter
from colibri_aio.cluster.tunnel import HTTPRequest, Part, answer_as
from colibri_aio.errors import UserError

APP_NAME = "colibri"
# Calls a replica takes besides its generation requests (/health, /metrics, /v1/models, /tokenize), so that
# a replica whose line is full still answers them.
LIGHT_CALLS = 8
LOGGING = {"log_level": "WARNING", "enable_access_log": False}


@dataclass(frozen=True)
class ClusterConfig:
    """What ``serve --ray`` and ``serve run colibri_aio.ray_app:build key=value ...`` take."""

    model: str | None = None             # GGUF path on every node (None: the shipped model)
    replicas: int = 2
    replica_cpus: float = 1.0            # CPUs Ray reserves for each replica; its kernel threads
    max_queue: int = 16                  # requests that may wait at each replica while one generates
    api_key: str | None = None
    model_id: str | None = None          # the model id to report (None: the file name)
    open_options: dict[str, Any] = field(default_factory=dict)  # Engine.open's placement options
    health_check_period_s: float = 2.0   # how often Ray checks a replica (a dead one is replaced after this)
    host: str = "127.0.0.1"              # the address the gateway listens on: with no key, the Host names answered

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise UserError(f"--replicas must be >= 1, got {self.replicas}")
        if not self.replica_cpus > 0:
            raise UserError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.max_queue < 0:
            raise UserError(f"--max-queue must be >= 0, got {self.max_queue}")

    @property
    def per_replica(self) -> int:
        """Generation requests one replica takes at once: ``parallel`` generating together (its sequence slots,
        1 unless the placement options say), ``max_queue`` waiting."""
        return int(self.open_options.get("parallel", 1)) + self.max_queue

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "ClusterConfig":
        """From ``serve run``'s ``key=value`` arguments (strings): the fields above; other keys are placement
        options of :meth:`Engine.open` (``ram_budget=8G``, ``io=pread``, ``n_ctx=2048``, ...)."""
        known = {f.name: f for f in fields(cls)}
        given: dict[str, Any] = {"open_options": {}}
        for key, value in args.items():
            if key in ("replicas", "max_queue"):
                given[key] = _number(key, value, int)
            elif key in ("replica_cpus", "health_check_period_s"):
                given[key] = _number(key, value, float)
            elif key in known and key != "open_options":
                given[key] = value
            else:
                integral = key in ("n_ctx", "cache_per_layer", "parallel")
                given["open_options"][key] = _number(key, value, int) if integral else value
        return cls(**given)


def _number(key: str, value: Any, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise UserError(f"{key} must be a number, got {value!r}") from None


# --- the engine replica --------------------------------------------------------------------------------------------

class EngineReplica:
    """One engine and ``colibri_aio.serve``'s application in front of it."""

    def __init__(self, config: ClusterConfig) -> None:
        from colibri_aio.engine.sync import SyncEngine
        from colibri_aio.kernels.threads import set_num_threads
        from colibri_aio.serve.app import Service, build_app
        from colibri_aio.serve.session import Session

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.cpus = config.replica_cpus
        set_num_threads(max(1, int(self.cpus)))  # the kernels stay within the CPUs Ray reserved
        options = dict(config.open_options)
        if options.get("ram_budget") is None:
            options["ram_budget"] = replica_budget(self.cpus)
        self.engine = SyncEngine.open(config.model, **options)
        self.service = Service(Session(self.engine), max_queue=config.max_queue, model_id=config.model_id)
        self.app = build_app(self.service)  # no API key here: the gateway checks it, and only it reaches us

    async def exchange(self, request: HTTPRequest, route_to: str | None = None) -> AsyncIterator[Part]:
        """Serve one relayed request (``route_to`` is the router's, not ours)."""
        async with contextlib.aclosing(answer_as(self.replica, self.app, request)) as parts:
            async for part in parts:
                yield part

    def describe(self, route_to: str | None = None) -> dict[str, Any]:
        return {"replica": self.replica, "pid": os.getpid(), "host": socket.gethostname(),
                "node": ray.get_runtime_context().get_node_id(),
                "cpus": self.cpus, "engine": self.engine.describe()}

    def check_health(self) -> None:
        if self.engine.closed:
            raise RuntimeError("the engine is closed")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # reads drained, usage history saved


def replica_budget(cpus: float) -> int:
    """A replica's default memory budget: the engine's default share of usable RAM, times its share of the
    node's CPUs (two one-CPU replicas on a two-CPU node get half each, not the whole machine twice)."""
    from colibri_aio.engine.memory import memory_limits
    from colibri_aio.engine.plan import DEFAULT_BUDGET_SHARE

    share = min(1.0, cpus / (os.cpu_count() or 1))
    return int(memory_limits().usable * DEFAULT_BUDGET_SHARE * share)


# --- the gateway ---------------------------------------------------------------------------------------------------

class RayReplicas:
    """The engine replicas as the gateway reaches them: a deployment handle and the router's board."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self.board = board(handle.app_name, handle.deployment_name)

    def live(self) -> list[str]:
        return self.board.replicas()

    async def exchange(self, replica: str | None, request: HTTPRequest) -> AsyncIterator[Part]:
        stream = self.handle.options(stream=True).exchange.remote(request, **{ROUTE_TO: replica})
        try:
            async for part in stream:
                yield part
        except RayError as exc:  # the replica died, is unreachable, or failed outside the application
            raise ReplicaFailed(_first_line(exc)) from None
        finally:
            stream.cancel()  # a no-op once the stream has ended

    async def describe(self, replica: str) -> dict[str, Any]:
        try:
            return await self.handle.describe.remote(**{ROUTE_TO: replica})
        except RayError as exc:
            raise ReplicaFailed(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0] if text else ''}".rstrip(": ")


class GatewayIngress:
    """The HTTP ingress: :mod:`~colibri_aio.cluster.gateway` over the engine replicas."""

    def __init__(self, engine: DeploymentHandle, config: ClusterConfig) -> None:
        hosts = None if config.api_key else HostAllowList.for_server(config.host)
        self.gateway = Gateway(RayReplicas(engine), per_replica=config.per_replica, expected=config.replicas,
                               api_key=config.api_key, limits=Limits(hosts=hosts))

    async def __serve_build_asgi_app__(self) -> Any:
        # One call through the handle makes its router, which then hears of every replica (the board).
        await self.gateway.replicas.handle.describe.remote()
        return build_gateway_app(self.gateway)


def build(config: ClusterConfig) -> serve.Application:
    """The application: the gateway bound to ``config.replicas`` engine replicas."""
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.replica_cpus},
        max_ongoing_requests=config.per_replica + LIGHT_CALLS,
        request_router_config=RequestRouterConfig(request_router_class=PinnedRouter),
        health_check_period_s=config.health_check_period_s, graceful_shutdown_timeout_s=10,
        max_constructor_retry_count=3, logging_config=LOGGING)
    gateway = serve.deployment(
        serve.ingress()(GatewayIngress), name="Gateway", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000, logging_config=LOGGING)
    return gateway.bind(engine.bind(config), config)

