"""``serve --ray`` on a local Ray cluster on 127.0.0.1: two replicas of the shipped model, one CPU each.

One cluster for the module (starting one takes 10-30 s): ``python -m colibri_aio serve --ray`` as a user runs it,
driven with the ``openai`` client and raw HTTP. A replica is killed mid-stream: its requests end with a clear error,
every other request is answered or refused, Ray starts a new replica, and the gateway's counts equal the clients'.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'colibri-aio[ray]')")

from colibri_aio.serve.launch import ServerProcess  # noqa: E402

KEY = "ray-key-1234"
NO_END = {"0": -100, "2": -100}
HELLO = [{"role": "system", "content": "You explain Python."}, {"role": "user", "content": "What is a list?"}]
CPUS = os.cpu_count() or 1
LONG = {"prompt": "The list type", "max_tokens": 250, "temperature": 0, "logit_bias": NO_END}


@pytest.fixture(scope="module")
def cluster() -> Iterator[ServerProcess]:
    with ServerProcess("--ray", "--replicas", "2", "--replica-cpus", "1", "--max-queue", "1", "--api-key", KEY) as s:
        yield s
    assert s.stop() == 143, "".join(s.log[-40:])  # SIGTERM: the cluster stops, then the CLI's status


@pytest.fixture()
def client(cluster: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0, timeout=120)


def _http(cluster: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _health(cluster: ServerProcess) -> dict:
    with _http(cluster) as h:
        return h.get("/health").json()


def _wait(cluster: ServerProcess, ok, what: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = _health(cluster)
        if ok(health):
            return health
        assert time.monotonic() < deadline, f"{what} never happened: {health}"
        time.sleep(0.2)


def _idle(health: dict) -> bool:
    return health["status"] == "ok" and not health["busy"] and all(r["load"] == 0 for r in health["replicas"])


def test_openai_client_against_the_ray_endpoint(client: openai.OpenAI, cluster: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == ["colibri-tiny-q8_0.gguf"]
    whole = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, temperature=0, logit_bias=NO_END)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, temperature=0,
                                                 logit_bias=NO_END, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    text = client.completions.create(model="m", prompt="The list type", max_tokens=5, temperature=0,
                                     logit_bias=NO_END)
    streamed = client.completions.create(model="m", prompt="The list type", max_tokens=5, temperature=0,
                                         logit_bias=NO_END, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=2, top_p=7)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.base_url, api_key="wrong", max_retries=0).models.list()


def test_a_chats_next_turn_reuses_the_kv_cache_of_its_replica(client: openai.OpenAI, cluster: ServerProcess) -> None:
    _wait(cluster, _idle, "an idle cluster")
    firsts = []
    for topic in ("lists", "dicts", "sets", "tuples"):  # four conversations, their turns interleaved
        msgs = [HELLO[0], {"role": "user", "content": f"Explain {topic}."}]
        raw = client.chat.completions.with_raw_response.create(model="m", messages=msgs, max_tokens=6,
                                                               temperature=0, logit_bias=NO_END)
        firsts.append((msgs, raw.parse(), raw.headers["x-colibri-replica"]))
    assert len({replica for _, _, replica in firsts}) == 2  # new conversations spread over both replicas
    # Only the replica's latest conversation is in its cache: the last two conversations, one per replica.
    for msgs, first, replica in firsts[2:]:
        turn2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "Why?"}]
        raw = client.chat.completions.with_raw_response.create(model="m", messages=turn2, max_tokens=4,
                                                               temperature=0, logit_bias=NO_END)
        assert raw.headers["x-colibri-replica"] == replica
        assert raw.parse().usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_429_with_retry_after_only_when_every_replicas_line_is_full(cluster: ServerProcess) -> None:
    _wait(cluster, _idle, "an idle cluster")

    def one(_: int) -> httpx.Response:
        with _http(cluster) as h:
            return h.post("/v1/completions", json=LONG)

    with concurrent.futures.ThreadPoolExecutor(7) as pool:  # room for 2 x (1 generating + 1 waiting)
        answers = list(pool.map(one, range(7)))
    assert sorted(r.status_code for r in answers) == [200] * 4 + [429] * 3
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 250
    assert Counter(r.headers["x-colibri-replica"] for r in answers if r.status_code == 200).most_common()[0][1] == 2


def test_metrics_of_every_replica(cluster: ServerProcess) -> None:
    with _http(cluster) as h:
        text = h.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    replicas = {r["replica"] for r in _health(cluster)["replicas"]}
    assert len(replicas) == 2
    assert {s.labels["replica"] for s in families["colibri_generated_tokens"].samples} == replicas
    assert {s.labels["replica"] for s in families["colibri_expert_hit_rate"].samples} == replicas
    assert families["colibri_gateway_replicas"].samples[0].value == 2
    assert families["colibri_gateway_capacity"].samples[0].value == 4


def test_a_replica_killed_mid_stream(client: openai.OpenAI, cluster: ServerProcess) -> None:
    """The stream on the killed replica ends with an error at once; the rest are answered or refused."""
    before = _wait(cluster, _idle, "an idle cluster")
    pids = {r["replica"]: r["pid"] for r in before["replicas"]}
    with _http(cluster) as h:
        served_before = _front_door_counts(h.get("/metrics").text)
    stream = client.completions.with_raw_response.create(model="m", stream=True, **LONG)
    victim = stream.headers["x-colibri-replica"]

    def other(i: int) -> str:  # concurrent traffic while the replica dies and comes back
        try:
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}],
                                               max_tokens=30, temperature=0, logit_bias=NO_END)
            return "200" if r.choices[0].finish_reason == "length" else "incomplete"
        except openai.RateLimitError:
            return "429"
        except openai.APIStatusError as exc:
            return str(exc.status_code) if exc.code == "replica_failed" else f"unexpected {exc}"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(other, i) for i in range(8)]
        received, t_kill = 0, 0.0
        with pytest.raises(openai.APIError, match="the replica serving this request failed") as err:
            for _ in stream.parse():
                received += 1
                if received == 3:
                    os.kill(pids[victim], signal.SIGKILL)
                    t_kill = time.monotonic()
        ended = time.monotonic() - t_kill
        outcomes = Counter(f.result(timeout=300) for f in others)
    assert ended < 30, f"the stream took {ended:.1f} s to end after the kill"
    assert received < LONG["max_tokens"]
    assert set(outcomes) <= {"200", "429", "503"}, outcomes
    after = _wait(cluster, lambda h: _idle(h) and len(h["replicas"]) == 2, "a replacement replica")
    assert victim not in {r["replica"] for r in after["replicas"]}  # Ray started a new one
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=4, temperature=0, logit_bias=NO_END)
    assert r.usage.completion_tokens == 4
    with _http(cluster) as h:
        served = _front_door_counts(h.get("/metrics").text) - served_before
    # None lost: what the gateway answered is what the clients got (the killed stream was a 200 when it began).
    expected = outcomes + Counter({"200": 2})
    assert {k: v for k, v in served.items() if v} == dict(expected), (served, outcomes)


def _front_door_counts(text: str) -> Counter:
    """Generation requests the gateway answered, by status (its own series: those without a replica label)."""
    counts: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name == "colibri_requests_total" and "replica" not in s.labels
                    and s.labels["endpoint"] in ("/v1/chat/completions", "/v1/completions")):
                counts[s.labels["status"]] += int(s.value)
    return counts


@pytest.mark.parametrize("args,message", [
    (["--model", "no-such-model.gguf"], "no-such-model.gguf"),
    (["--replicas", str(CPUS + 1)], f"need {CPUS + 1} CPUs"),
    (["--replicas", "0"], "--replicas must be >= 1"),
])
def test_a_user_mistake_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    from support import run_cli

    r = run_cli("serve", "--ray", "--port", "0", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_the_serve_run_application_takes_key_value_arguments() -> None:
    from ray import serve

    from colibri_aio import ray_app
    from colibri_aio.cluster.deployments import ClusterConfig

    assert isinstance(ray_app.app, serve.Application)
    config = ClusterConfig.from_args({"replicas": "3", "replica_cpus": "0.5", "max_queue": "4", "ram_budget": "1G",
                                      "n_ctx": "128", "io": "pread"})
    assert (config.replicas, config.replica_cpus, config.per_replica) == (3, 0.5, 5)
    assert config.open_options == {"ram_budget": "1G", "n_ctx": 128, "io": "pread"}
    with pytest.raises(Exception, match="replicas must be a number"):
        ClusterConfig.from_args({"replicas": "many"})
    # A replica of several sequence slots takes as many requests at once as it has slots, and its line.
    assert ClusterConfig.from_args({"parallel": "4", "max_queue": "2"}).per_replica == 6
