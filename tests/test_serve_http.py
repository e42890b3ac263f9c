"""The OpenAI-compatible server, driven as its users drive it: the official ``openai`` client and raw HTTP.

Each server is a real ``python -m colibri_aio serve`` process on 127.0.0.1
(a free port) with the shipped model.
"""
from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri_aio.serve.launch import ServerProcess

KEY = "test-key-1234"
# The shipped model rarely ends a text by itself; these biases make sure it never does, for long replies.
NO_END = {"0": -100, "2": -100}
HELLO = [{"role": "system", "content": "You explain Python."}, {"role": "user", "content": "What is a list?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--api-key", KEY, "--max-queue", "2") as s:
        yield s
    # SIGTERM: uvicorn stops gracefully, the engine closes, then the CLI's status for SIGTERM; nothing else said.
    assert s.stop() == 143, "".join(s.log)
    assert not any("Traceback" in line or "error" in line.lower() for line in s.log), "".join(s.log)


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerProcess]:
    """No API key, and no room to wait: a second request while one generates gets 429."""
    with ServerProcess("--max-queue", "0") as s:
        yield s


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _http(server: ServerProcess, key: str | None = KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def _metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. ``colibri_expert_lookups_total{result=missed}``."""
    with _http(server) as h:
        text = h.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# --- shapes ---------------------------------------------------------------------------------------------------------

def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["colibri-tiny-q8_0.gguf"]
    assert client.models.retrieve("colibri-tiny-q8_0.gguf").id == "colibri-tiny-q8_0.gguf"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion_has_openai_shape_and_usage(client: openai.OpenAI, server: ServerProcess) -> None:
    r = client.chat.completions.create(model="any", messages=HELLO, max_tokens=8, temperature=0, logit_bias=NO_END)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "colibri-tiny-q8_0.gguf"
    assert abs(r.created - time.time()) < 600
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    with _http(server) as h:
        prompt = h.post("/tokenize", json={"messages": HELLO}).json()
    assert r.usage.prompt_tokens == prompt["count"]
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == prompt["count"] + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_carries_the_same_text_as_the_whole_response(client: openai.OpenAI) -> None:
    args = dict(model="m", messages=HELLO, max_tokens=12, temperature=0, logit_bias=NO_END)
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_whole_and_token_id_prompt(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model="m", prompt="The list type", max_tokens=10, temperature=0, logit_bias=NO_END)
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    text = whole.choices[0].text
    assert text and whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert streamed == text
    with _http(server) as h:
        ids = h.post("/tokenize", json={"content": "The list type"}).json()["tokens"]
    assert client.completions.create(**{**args, "prompt": ids}).choices[0].text == text


def test_completions_default_to_16_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="The dict type", temperature=0, logit_bias=NO_END)
    assert r.usage.completion_tokens == 16


# --- parameters -----------------------------------------------------------------------------------------------------

def test_logprobs_are_the_models_log_probabilities(client: openai.OpenAI) -> None:
    from colibri_aio.engine.engine import Engine
    import asyncio

    r = client.completions.create(model="m", prompt="The list type", max_tokens=6, temperature=0, logprobs=3,
                                  logit_bias=NO_END)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        best = max(top, key=top.get)
        assert best == token and top[best] == value  # greedy: the chosen token is the most likely
        assert len(top) == 3 and value <= 0

    async def teacher_forced() -> np.ndarray:
        async with await Engine.open(None, io="pread") as engine:
            prompt = engine.prompt_ids("The list type")
            chosen = engine.tokenizer.encode(r.choices[0].text, parse_special=False)
            logits = await engine.logits(prompt + chosen)
            rows = logits[len(prompt) - 1: len(prompt) - 1 + len(chosen)].astype(np.float64)
            rows -= rows.max(axis=1, keepdims=True)
            return (rows - np.log(np.exp(rows).sum(axis=1, keepdims=True)))[np.arange(len(chosen)), chosen]

    expected = asyncio.run(teacher_forced())
    assert len(expected) == len(lp.token_logprobs)
    np.testing.assert_allclose(lp.token_logprobs, expected, atol=1e-3)


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, logit_bias=NO_END)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token and bytes(c.bytes).decode() == c.token


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    args = dict(model="m", prompt="The list type", max_tokens=24, temperature=0, logit_bias=NO_END)
    text = client.completions.create(**args).choices[0].text
    words = text.split()
    stop = words[len(words) // 2]
    r = client.completions.create(**args, stop=[stop, "never-produced"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop   # vLLM's field: which stop string ended it
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert streamed[-1].choices[0].model_extra["stop_reason"] == stop
    chat = client.chat.completions.create(model="m", messages=HELLO, max_tokens=4, temperature=0)
    assert chat.choices[0].model_extra["stop_reason"] is None


def test_same_seed_same_text_other_seed_other_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.chat.completions.create(model="m", messages=HELLO, max_tokens=16, temperature=1.0, top_p=1.0,
                                              seed=seed, logit_bias=NO_END, extra_body={"top_k": 0, "min_p": 0.0},
                                              ).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_logit_bias_and_penalties_change_the_choice(client: openai.OpenAI, server: ServerProcess) -> None:
    args = dict(model="m", prompt="The list type", max_tokens=1, temperature=0, logprobs=1)
    plain = client.completions.create(**args).choices[0].logprobs.tokens[0]
    with _http(server) as h:
        (plain_id,) = h.post("/tokenize", json={"content": plain, "add_special": False}).json()["tokens"]
    banned = client.completions.create(**args, logit_bias={str(plain_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain
    # "The list type" + its greedy continuation, repeated: a frequency penalty makes the repeat unlikely.
    text = client.completions.create(model="m", prompt="The list type", max_tokens=8, temperature=0,
                                     logit_bias=NO_END).choices[0].text
    rep = dict(model="m", prompt=("The list type" + text) * 3, max_tokens=8, temperature=0, logit_bias=NO_END)
    free = client.completions.create(**rep).choices[0].text
    penalised = client.completions.create(**rep, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert penalised != free


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": -5}, "seed"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stop": 5}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour"),
    ({"mirostat": 2}, "mirostat"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_invalid_parameter_is_a_400_naming_it(server: ServerProcess, body: dict, param: str) -> None:
    with _http(server) as h:
        r = h.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_fields_that_change_nothing_here_are_accepted_and_unknown_ones_refused(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=2, user="u1", store=False,
                                       metadata={"k": "v"}, service_tier="auto", extra_body={"audio": None})
    assert r.choices[0].finish_reason in ("length", "stop")
    # The client's own reply object sent back as the next turn's assistant message.
    turn2 = [*HELLO, r.choices[0].message.model_dump(), {"role": "user", "content": "And a tuple?"}]
    assert client.chat.completions.create(model="m", messages=turn2, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=2, extra_body={"frobnicate": [1]})
    assert err.value.body["param"] == "frobnicate" and err.value.body["message"] == "frobnicate: unknown field"


def test_bad_parameter_through_the_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=2, top_p=7)
    assert err.value.body["param"] == "top_p"


def test_prompt_longer_than_the_context_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="the list type " * 300, max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.body["param"] == "prompt"


# --- auth, errors, raw HTTP -----------------------------------------------------------------------------------------

def test_wrong_or_missing_key_is_401(server: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with _http(server, key=None) as h:
        r = h.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert h.get("/health").status_code == 200  # health stays public


def test_no_key_set_accepts_any_key(open_server: ServerProcess) -> None:
    for key in ("anything", "sk-other"):
        c = openai.OpenAI(base_url=open_server.base_url, api_key=key, max_retries=0)
        assert c.models.list().data


def test_errors_are_openai_json(server: ServerProcess) -> None:
    with _http(server) as h:
        missing = h.get("/v1/nothing-here")
        wrong_method = h.get("/v1/chat/completions")
        not_json = h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        not_object = h.post("/v1/completions", json=[1, 2])
    assert (missing.status_code, wrong_method.status_code, not_json.status_code, not_object.status_code) == \
        (404, 405, 400, 400)
    for r in (missing, wrong_method, not_json, not_object):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_sse_framing(server: ServerProcess) -> None:
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True, "logit_bias": NO_END}
    with _http(server) as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert raw.endswith("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def test_tokenize_and_detokenize_round_trip(server: ServerProcess) -> None:
    with _http(server) as h:
        t = h.post("/tokenize", json={"content": "The list type ü", "with_pieces": True}).json()
        ids = [p["id"] for p in t["tokens"]]
        assert t["count"] == len(ids) and t["max_model_len"] == 256
        assert h.post("/detokenize", json={"tokens": ids}).json()["content"] == "The list type ü"
        assert h.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_metrics_in_prometheus_text(client: openai.OpenAI, server: ServerProcess) -> None:
    before = _metrics(server)
    r = client.completions.create(model="m", prompt="The list type", max_tokens=5, temperature=0, logit_bias=NO_END)
    after = _metrics(server)
    assert after["colibri_generated_tokens_total"] - before["colibri_generated_tokens_total"] == 5
    assert after["colibri_prompt_tokens_total"] + after["colibri_prompt_tokens_cached_total"] - \
        before["colibri_prompt_tokens_total"] - before["colibri_prompt_tokens_cached_total"] == r.usage.prompt_tokens
    assert after["colibri_time_to_first_token_seconds_count"] == before["colibri_time_to_first_token_seconds_count"] + 1
    assert after["colibri_requests_total{endpoint=/v1/completions,status=200}"] >= 1
    for name in ("colibri_queue_waiting", "colibri_engine_busy", "colibri_expert_hit_rate", "colibri_io_bytes_total",
                 "colibri_decode_tokens_per_second", "colibri_last_request_decode_tokens_per_second",
                 "colibri_prefetch_on", "colibri_expert_lookups_total{result=missed}", "colibri_rss_bytes"):
        assert name in after, name
    assert 0 <= after["colibri_expert_hit_rate"] <= 1
    assert any(k.startswith("colibri_prefetch_info{") for k in after)
    if any(k.startswith("colibri_disk_") for k in after):  # the model's file sits on a block device
        assert any(k.startswith("colibri_disk_utilization{") for k in after)
        assert any(k.startswith("colibri_disk_reads_per_second{") for k in after)


# --- KV reuse, the line, disconnects --------------------------------------------------------------------------------

def test_next_chat_turn_reports_cached_prompt_tokens(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, temperature=0,
                                           logit_bias=NO_END)
    turn2 = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a tuple?"}]
    second = client.chat.completions.create(model="m", messages=turn2, max_tokens=4, temperature=0,
                                            logit_bias=NO_END)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    again = client.chat.completions.create(model="m", messages=turn2, max_tokens=4, temperature=0,
                                           logit_bias=NO_END, extra_body={"cache_prompt": False})
    assert again.usage.prompt_tokens_details.cached_tokens == 0


LONG = {"prompt": "The list type", "max_tokens": 250, "temperature": 0, "logit_bias": NO_END}


def _wait_idle(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with _http(server) as h:
        while h.get("/health").json()["busy"]:
            assert time.monotonic() < deadline, "the engine never became idle"
            time.sleep(0.02)


def test_health_and_metrics_answer_while_a_generation_runs(server: ServerProcess) -> None:
    _wait_idle(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool, _http(server) as probe:
        with _http(server) as h:
            generation = pool.submit(h.post, "/v1/completions", json=LONG)
            seen = []
            while not generation.done():
                health, metrics = probe.get("/health", timeout=5), probe.get("/metrics", timeout=5)
                seen.append((health.status_code, metrics.status_code, health.json()["busy"],
                             "colibri_engine_busy 1.0" in metrics.text))
            assert generation.result().json()["usage"]["completion_tokens"] == 250
    assert all(h == 200 and m == 200 for h, m, _, _ in seen)
    assert any(busy and metric_busy for _, _, busy, metric_busy in seen), seen


def test_disconnect_cancels_the_generation(server: ServerProcess) -> None:
    _wait_idle(server)
    before = _metrics(server)["colibri_generated_tokens_total"]
    with _http(server) as h:
        r = h.send(h.build_request("POST", "/v1/completions", json={**LONG, "stream": True}), stream=True)
        assert r.status_code == 200
        next(r.iter_lines())
        r.close()  # the client goes away after the first chunk
    _wait_idle(server)
    generated = _metrics(server)["colibri_generated_tokens_total"] - before
    assert generated < 200, f"{generated} tokens: the generation ran on after the client left"
    r = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0).completions.create(
        model="m", prompt="The list type", max_tokens=3)
    assert r.usage.completion_tokens == 3  # the engine serves the next request


def test_disconnect_cancels_a_whole_response_too(server: ServerProcess) -> None:
    _wait_idle(server)
    before = _metrics(server)["colibri_generated_tokens_total"]
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    with socket.create_connection((host, int(port))) as raw, _http(server) as probe:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                    b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while not probe.get("/health").json()["busy"]:
            assert time.monotonic() < deadline
    _wait_idle(server)  # the socket closed above: the client is gone
    generated = _metrics(server)["colibri_generated_tokens_total"] - before
    assert generated < 200, f"{generated} tokens: the generation ran on after the client left"


def test_full_line_answers_429_with_retry_after(open_server: ServerProcess) -> None:
    """No room to wait: of requests sent together, one generates and the others get 429 at once."""
    _wait_idle(open_server)

    def one(_: int) -> httpx.Response:
        with _http(open_server, key=None) as h:
            return h.post("/v1/completions", json=LONG)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(one, range(6)))
    busy = [r for r in answers if r.status_code == 429]
    done = [r for r in answers if r.status_code == 200]
    assert len(busy) + len(done) == 6 and busy and done
    assert all(r.json()["usage"]["completion_tokens"] == 250 for r in done)
    for r in busy:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
    # The official client turns it into RateLimitError (after its own retries, here none).
    client = openai.OpenAI(base_url=open_server.base_url, api_key="x", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda _: _outcome(lambda: client.completions.create(model="m", **LONG)), range(2)))
    assert sorted(outcomes) == ["ok", "rate limited"]


def _outcome(call) -> str:
    try:
        call()
        return "ok"
    except openai.RateLimitError:
        return "rate limited"


def test_concurrent_clients_each_get_a_full_answer_or_429(server: ServerProcess) -> None:
    _wait_idle(server)

    def one(i: int) -> tuple[int, str | None]:
        with _http(server) as h:
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"question {i}"}],
                                                     "max_tokens": 20, "temperature": 0, "logit_bias": NO_END})
        return r.status_code, (r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(status == 429 or (status, reason) == (200, "length") for status, reason in results), results
    assert sum(status == 200 for status, _ in results) >= 3  # one generating and two waiting at least
    with _http(server) as h:
        assert h.get("/health").json() == {"status": "ok", "busy": False, "generating": 0, "slots": 1, "waiting": 0}


def test_a_parallel_server_decodes_its_clients_together_with_their_answers_alone() -> None:
    """--parallel 4: four streaming clients at once each get the answer one client gets alone, none waits for a
    place, and /metrics shows the batched steps."""
    with ServerProcess("--parallel", "4", "--max-queue", "0") as s:
        def one(i: int) -> str:
            with _http(s, key=None) as h:
                r = h.post("/v1/completions", json={"prompt": f"question {i}", "max_tokens": 16, "temperature": 0,
                                                    "logit_bias": NO_END})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

        alone = [one(i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(one, range(4)))
        with _http(s, key=None) as h:
            health = h.get("/health").json()
        metrics = _metrics(s)
    assert together == alone
    assert health == {"status": "ok", "busy": False, "generating": 0, "slots": 4, "waiting": 0}
    assert metrics["colibri_sequence_slots"] == 4 and metrics["colibri_batch_steps_total"] > 0


def test_slots_are_saved_and_restored_through_the_api(tmp_path) -> None:
    """POST /slots/{id}?action=save|restore as llama-server: a completion's slot saved, restored into the other
    slot of a fresh server, and the same request answered from it with the prompt found cached."""
    body = {"prompt": "The list type", "max_tokens": 8, "temperature": 0, "logit_bias": NO_END}
    with ServerProcess("--parallel", "2", "--slot-save-path", str(tmp_path)) as s, _http(s, key=None) as h:
        first = h.post("/v1/completions", json=body).json()
        saved = h.post("/slots/0?action=save", json={"filename": "a.slot"})
        assert saved.status_code == 200, saved.text
        assert saved.json()["n_saved"] > 0 and saved.json()["n_written"] == (tmp_path / "a.slot").stat().st_size
        for path, payload, status in [("/slots/0?action=save", {"filename": "../x"}, 400),
                                      ("/slots/0?action=drop", {"filename": "a.slot"}, 400),
                                      ("/slots/5?action=restore", {"filename": "a.slot"}, 400),
                                      ("/slots/1?action=restore", {"filename": "missing.slot"}, 400)]:
            r = h.post(path, json=payload)
            assert r.status_code == status and r.json()["error"]["message"], (path, r.text)
    with ServerProcess("--parallel", "2", "--slot-save-path", str(tmp_path)) as s, _http(s, key=None) as h:
        restored = h.post("/slots/1?action=restore", json={"filename": "a.slot"})
        assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"]
        again = h.post("/v1/completions", json=body).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with ServerProcess() as s, _http(s, key=None) as h:
        r = h.post("/slots/0?action=save", json={"filename": "a.slot"})
        assert r.status_code == 400 and "--slot-save-path" in r.json()["error"]["message"]


# --- user mistakes --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["serve", "--model", "no-such-model.gguf"], "no-such-model.gguf"),
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--slot-save-path", "/no/such/folder"], "--slot-save-path"),
    (["serve", "--parallel", "0"], "--parallel"),
    (["serve", "--host", "256.1.1.1"], "cannot listen"),
    (["chat", "--model", "no-such-model.gguf"], "no-such-model.gguf"),
    (["chat", "--top-p", "7"], "top-p"),
])
def test_a_user_mistake_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    from support import run_cli

    r = run_cli(*args, "--port", "0") if args[0] == "serve" else run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


def test_a_port_in_use_is_refused(server: ServerProcess) -> None:
    from support import run_cli

    port = server.url.rsplit(":", 1)[1]
    r = run_cli("serve", "--port", port)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1:" + port in r.stderr


def test_ctrl_c_stops_the_server_cleanly_during_a_generation() -> None:
    with ServerProcess("--max-queue", "0") as s:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_post_quietly, s, {**LONG, "stream": True})
            with _http(s, key=None) as probe:
                deadline = time.monotonic() + 30
                while not probe.get("/health").json()["busy"] and time.monotonic() < deadline:
                    time.sleep(0.01)
            status = s.stop(signal.SIGINT)
            answer.result()
    assert status == 130, "".join(s.log)
    assert not any("Traceback" in line for line in s.log), "".join(s.log)


def _post_quietly(server: ServerProcess, body: dict) -> None:
    """A streamed request whose connection may end early (the server is stopping)."""
    try:
        with _http(server, key=None) as h, h.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass
