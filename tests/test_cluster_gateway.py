"""The gateway and the tunnel without Ray: two replicas in this process, each ``serve``'s application on an engine
of its own, reached through the same tunnel the Ray replicas use. A replica "fails" the way Ray reports a death
to the gateway: its exchange raises :class:`ReplicaFailed` partway.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri_aio.cluster.gateway import Gateway, ReplicaFailed, build_gateway_app
from colibri_aio.cluster.tunnel import REPLICA_HEADER, HTTPRequest, Part, answer_as, exchange
from colibri_aio.engine.sync import SyncEngine
from colibri_aio.serve.app import Service, build_app
from colibri_aio.serve.guard import HostAllowList, Limits
from colibri_aio.serve.session import Session

NO_END = {"0": -100, "2": -100}
HELLO = [{"role": "system", "content": "You explain Python."}, {"role": "user", "content": "What is a list?"}]
LONG = {"prompt": "The list type", "max_tokens": 200, "temperature": 0, "logit_bias": NO_END}


class LocalReplicas:
    """Replicas in this process; ``failing[id] = n``: that replica's exchanges fail after ``n`` parts."""

    def __init__(self, services: dict[str, Service]) -> None:
        self.services = services
        self.apps = {rid: build_app(s) for rid, s in services.items()}
        self.failing: dict[str, int] = {}

    def live(self) -> list[str]:
        return sorted(self.apps)

    async def exchange(self, replica: str | None, request: HTTPRequest) -> AsyncIterator[Part]:
        rid = replica if replica in self.apps else self.live()[0]
        fail_after = self.failing.get(rid)
        async with contextlib.aclosing(answer_as(rid, self.apps[rid], request)) as parts:
            sent = 0
            async for part in parts:
                if fail_after is not None and sent >= fail_after:
                    raise ReplicaFailed(f"ActorDiedError: replica {rid} died")
                yield part
                sent += 1

    async def describe(self, replica: str) -> dict[str, Any]:
        return {"replica": replica, "pid": os.getpid(), "host": "here", "node": "here", "cpus": 1.0, "engine": "e"}

    async def idle(self, timeout: float = 30.0) -> None:
        """Wait until no replica generates or has a request waiting."""
        async with asyncio.timeout(timeout):
            while any(s.line.busy or s.line.waiting for s in self.services.values()):
                await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[SyncEngine]]:
    opened = [SyncEngine.open(None, io="pread") for _ in range(2)]
    yield opened
    for e in opened:
        e.close()


def _gateway(engines: list[SyncEngine], max_queue: int = 1, api_key: str | None = None) -> tuple[Gateway, LocalReplicas]:
    services = {rid: Service(Session(e), max_queue=max_queue) for rid, e in zip(("r1", "r2"), engines)}
    replicas = LocalReplicas(services)
    return Gateway(replicas, per_replica=1 + max_queue, expected=2, api_key=api_key), replicas


def _client(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_gateway_app(gateway)), base_url="http://gw",
                             timeout=120)


async def test_a_next_turn_goes_to_the_replica_holding_the_conversation(engines: list[SyncEngine]) -> None:
    gateway, _ = _gateway(engines)
    async with _client(gateway) as http:
        replies = {}
        for topic in ("a list", "a dict"):
            msgs = [HELLO[0], {"role": "user", "content": f"What is {topic}?"}]
            r = await http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                               "logit_bias": NO_END})
            replies[topic] = (msgs, r.json(), r.headers[REPLICA_HEADER])
        assert replies["a list"][2] != replies["a dict"][2]  # the second conversation took the idle replica
        for msgs, first, replica in replies.values():
            turn2 = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "And then?"}]
            r = await http.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 4, "temperature": 0,
                                                               "logit_bias": NO_END})
            assert r.headers[REPLICA_HEADER] == replica
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert gateway.chooser.in_flight == 0


async def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event(engines: list[SyncEngine]) -> None:
    gateway, replicas = _gateway(engines)
    replicas.failing = {"r1": 4, "r2": 4}
    async with _client(gateway) as http:
        r = await http.post("/v1/completions", json={**LONG, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert r.status_code == 200 and events[0].startswith("data: {")
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "replica_failed" and "died" in error["message"]
        assert "data: [DONE]" not in events
        replicas.failing = {"r1": 0, "r2": 0}  # before any answer: a 503 in the OpenAI shape
        r = await http.post("/v1/completions", json=LONG)
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
        assert r.headers["retry-after"] == "1"
        metrics = (await http.get("/metrics")).text
    assert "colibri_gateway_replica_failures_total 2.0" in metrics
    assert gateway.chooser.in_flight == 0
    await replicas.idle()  # the abandoned generations were cancelled on their replicas


async def test_429_only_when_every_replicas_line_is_full(engines: list[SyncEngine]) -> None:
    gateway, _ = _gateway(engines, max_queue=0)  # each replica: one generating, none waiting
    async with _client(gateway) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=LONG) for _ in range(3)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200, 200, 429]
    busy = next(r for r in answers if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1
    assert busy.json()["error"] | {"message": ""} == {"message": "", "type": "rate_limit_error", "param": None,
                                                      "code": "queue_full"}
    assert {r.headers[REPLICA_HEADER] for r in answers if r.status_code == 200} == {"r1", "r2"}


async def test_health_metrics_and_other_routes(engines: list[SyncEngine]) -> None:
    gateway, _ = _gateway(engines, api_key="k")
    async with _client(gateway) as http:
        assert (await http.get("/v1/models")).status_code == 401  # the gateway checks the key
        http.headers["Authorization"] = "Bearer k"
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "colibri-tiny-q8_0.gguf"
        missing = await http.get("/v1/nothing")
        assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
        await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        health = (await http.get("/health", headers={"Authorization": ""})).json()
        text = (await http.get("/metrics")).text
    assert health["status"] == "ok" and not health["busy"] and health["waiting"] == 0
    assert [r["replica"] for r in health["replicas"]] == ["r1", "r2"]
    assert all(r["status"] == "ok" and r["pid"] == os.getpid() for r in health["replicas"])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE colibri_requests_total counter") == 1  # one family from three sources
    requests = {(s.labels.get("replica"), s.labels["endpoint"], s.labels["status"]): s.value
                for s in families["colibri_requests"].samples}
    assert requests[(None, "/v1/models", "401")] == 1 and requests[(None, "/v1/completions", "200")] == 1
    assert sum(v for (r, e, st), v in requests.items() if r and e == "/v1/completions") == 1
    assert {s.labels["replica"] for s in families["colibri_generated_tokens"].samples} == {"r1", "r2"}
    assert families["colibri_gateway_capacity"].samples[0].value == 4


async def test_leaving_an_exchange_early_cancels_the_generation(engines: list[SyncEngine]) -> None:
    replicas = LocalReplicas({"r1": Service(Session(engines[0]), max_queue=1)})
    request = HTTPRequest("POST", "/v1/completions", headers=((b"content-type", b"application/json"),),
                          body=json.dumps({**LONG, "stream": True}).encode())
    before = engines[0].stats().generated_tokens
    async with contextlib.aclosing(exchange(replicas.apps["r1"], request)) as parts:
        head = await anext(parts)
        assert head.status == 200 and head.is_event_stream
        assert b"data: " in await anext(parts)
    await replicas.idle()
    assert engines[0].stats().generated_tokens - before < 100


def test_ray_options_without_ray_and_ray_missing_are_user_mistakes(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from support import main_in_process

    status, _, err = main_in_process("serve", "--replicas", "2")
    assert status == 2 and "--replicas needs --ray" in err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    status, _, err = main_in_process("serve", "--ray", "--port", "0")
    assert status == 2 and "pip install 'colibri-aio[ray]'" in err and len(err.strip().splitlines()) == 1


async def test_the_gateway_bounds_requests_as_a_replica_does(engines: list[SyncEngine]) -> None:
    gateway, _ = _gateway(engines)
    gateway.limits = Limits(max_body=1024, hosts=HostAllowList.for_server("127.0.0.1"))
    app = build_gateway_app(gateway)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                 timeout=60) as client:
        big = await client.post("/v1/completions", json={"prompt": "x" * 4096, "max_tokens": 1})
        assert big.status_code == 413
        form = await client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        assert form.status_code == 415
        foreign = await client.get("/v1/models", headers={"host": "attacker.example"})
        assert foreign.status_code == 421
        ok = await client.post("/v1/completions", json={"prompt": "The list", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


async def test_the_gateway_serves_the_web_page_without_the_key(engines) -> None:
    # (The page's telemetry stream goes to a replica through the catch-all relay, as any GET; it never ends, and
    # httpx's ASGI transport only returns a response once it has ended, so it is not followed here.)
    gateway, _ = _gateway(engines, api_key="k")
    async with _client(gateway) as http:
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "Content-Security-Policy" in page.headers and (await http.get("/web/app.js")).status_code == 200
        assert (await http.get("/v1/telemetry/stream")).status_code == 401   # the API behind the page needs the key
