"""``serve`` under the requests an attacker sends, on loopback, bounded in count and time.

One real ``python -m colibri_aio serve`` process (the shipped model, no API key, so the Host check is on) gets,
while a well-behaved client streams a long answer and another thread polls ``/health``: a 64 MiB body (declared,
and chunked without a length), 10 000 messages, 10 000 stop strings, a body and a head trickled byte by byte,
a cross-origin ``text/plain`` form post, a wrong Host, a ``logit_bias`` key that only looks like a number, JSON
nested 100 000 deep. Each is answered with its status; ``/health`` keeps answering (p99 < 100 ms) and the stream
ends intact. Then SIGTERM mid-stream: the stream ends with a ``shutting_down`` error event, a request waiting in
the line gets 503 ``shutting_down``.
"""
from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from colibri_aio.serve.launch import ServerProcess

NO_END = {"0": -100, "2": -100}   # the shipped model never ends a text by itself with these
READ_TIMEOUT_S = 2.0
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--max-queue", "2", "--read-timeout", str(READ_TIMEOUT_S)) as s:
        yield s


class HealthProbe:
    """Polls ``/health`` from its own thread and keeps every answer's latency."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.failures = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as h:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                r = h.get("/health")
                self.latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    self.failures.append(r.status_code)
                time.sleep(0.005)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _status(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:100]
    return int(raw.split(b" ", 2)[1])


def _read_answer(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` (with nothing more to say) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _stream(server: ServerProcess, body: dict, headers: dict[str, str] | None = None) -> list[str]:
    """The data lines of a streamed answer."""
    with httpx.Client(base_url=server.url, timeout=60) as h, \
            h.stream("POST", "/v1/completions", json=body, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


# --- one attack each: its status --------------------------------------------------------------------------------

def declared_64_mib(server: ServerProcess) -> int:
    """Content-Length 64 MiB: 413 at once, before the body is read."""
    with socket.create_connection(_address(server)) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (64 << 20) + b"x" * 65536)
        return _status(_read_answer(c, 10))


def chunked_64_mib(server: ServerProcess) -> int:
    """64 MiB sent chunked, without a length: 413 once the 16 MiB limit is passed, and the rest is not read."""
    sent = 0
    with socket.create_connection(_address(server)) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")

        def send_all() -> None:
            nonlocal sent
            piece = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
            try:
                for _ in range(64):
                    c.sendall(piece)
                    sent += 1 << 20
            except OSError:  # the server answered and closed
                pass

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        status = _status(_read_answer(c, 20))
        c.close()
        sender.join(20)
    assert sent < 48 << 20, f"{sent >> 20} MiB went in before the refusal"
    return status


def many(field: str, value: object) -> Callable[[ServerProcess], int]:
    def send(server: ServerProcess) -> int:
        with httpx.Client(base_url=server.url, timeout=30) as h:
            r = h.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, field: value})
        assert r.status_code != 400 or r.json()["error"]["param"] == field, r.text
        return r.status_code
    return send


def trickled_body(server: ServerProcess) -> int:
    """A body of 1000 bytes sent a byte every 0.1 s: cut off with 408 after the read timeout."""
    with socket.create_connection(_address(server)) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        answer = b""
        c.settimeout(0.1)
        try:
            while time.monotonic() - t0 < 3 * READ_TIMEOUT_S:
                c.sendall(b" ")
                try:
                    if chunk := c.recv(65536):
                        answer += chunk
                    else:
                        break
                except TimeoutError:
                    continue
        except OSError:
            pass
        answer += _read_answer(c, 2)
        assert time.monotonic() - t0 < 3 * READ_TIMEOUT_S, "the trickled body was not cut off"
    return _status(answer)


def trickled_head(server: ServerProcess) -> int:
    """Headers sent a byte every 0.1 s: the connection is closed after the read timeout (no answer: 0)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" + b"X-Slow: " + b"a" * 1000
    with socket.create_connection(_address(server)) as c:
        t0 = time.monotonic()
        closed = False
        try:
            for byte in head:
                c.sendall(bytes([byte]))
                time.sleep(0.1)
                if time.monotonic() - t0 > 3 * READ_TIMEOUT_S:
                    break
        except OSError:
            closed = True
        closed = closed or _closed_within(c, 1)
        elapsed = time.monotonic() - t0
    assert closed and elapsed < 3 * READ_TIMEOUT_S, f"the trickled head held the connection {elapsed:.1f} s"
    return 0


def huge_head(server: ServerProcess) -> int:
    """A header of 1 MiB: refused (400) once the head passes 64 KiB, and the connection closed."""
    with socket.create_connection(_address(server)) as c:
        try:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except OSError:  # closed before all of it went in
            pass
        return _status(_read_answer(c, 10))


def cross_origin_form(server: ServerProcess) -> int:
    """What a page elsewhere can send without a preflight: a text/plain form post."""
    with httpx.Client(base_url=server.url, timeout=30) as h:
        return h.post("/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 2}),
                      headers={"Content-Type": "text/plain", "Origin": "http://evil.example"}).status_code


def wrong_host(server: ServerProcess) -> int:
    """A DNS-rebinding page: the server's address under the attacker's name."""
    with httpx.Client(base_url=server.url, timeout=30) as h:
        return h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"Host": "rebind.evil.example"}).status_code


def deep_json(server: ServerProcess) -> int:
    with httpx.Client(base_url=server.url, timeout=30) as h:
        return h.post("/v1/completions", content=b"[" * 100_000,
                      headers={"Content-Type": "application/json"}).status_code


ATTACKS: dict[str, tuple[Callable[[ServerProcess], int], int]] = {
    "64 MiB declared": (declared_64_mib, 413),
    "64 MiB chunked": (chunked_64_mib, 413),
    "10 000 messages": (many("messages", MSG * 10_000), 400),
    "10 000 stop strings": (many("stop", [f"s{i}" for i in range(10_000)]), 400),
    "10 000 logit_bias entries": (many("logit_bias", {str(i): 1 for i in range(10_000)}), 400),
    "logit_bias key '²'": (many("logit_bias", {"²": 1}), 400),
    "an unknown field": (many("frobnicate", 1), 400),
    "trickled body": (trickled_body, 408),
    "trickled head": (trickled_head, 0),
    "a 1 MiB header": (huge_head, 400),
    "cross-origin text/plain": (cross_origin_form, 415),
    "wrong Host": (wrong_host, 421),
    "deep JSON": (deep_json, 400),
}


def test_each_attack_gets_its_status_while_health_and_a_stream_go_on(server: ServerProcess) -> None:
    good = {"prompt": "The list type", "max_tokens": 80, "temperature": 0, "logit_bias": NO_END, "stream": True,
            "stream_options": {"include_usage": True}}
    alone = _stream(server, good)
    # Four attackers at a time beside the stream (all twelve at once on two CPUs measure the CPUs).
    with HealthProbe(server.url) as probe, concurrent.futures.ThreadPoolExecutor(1) as streamer, \
            concurrent.futures.ThreadPoolExecutor(4) as attackers:
        stream = streamer.submit(_stream, server, good)
        answers = {name: attackers.submit(attack, server) for name, (attack, _) in ATTACKS.items()}
        statuses = {name: future.result(timeout=40) for name, future in answers.items()}
        together = stream.result(timeout=40)
    assert statuses == {name: status for name, (_, status) in ATTACKS.items()}
    assert together[-1] == "[DONE]" and json.loads(together[-2])["usage"]["completion_tokens"] == 80
    assert _same_text(together, alone), "the stream was disturbed"
    assert not probe.failures and len(probe.latencies) > 20
    print(f"/health p99 {probe.p99() * 1e3:.1f} ms, max {max(probe.latencies) * 1e3:.1f} ms over {len(probe.latencies)} polls")
    assert probe.p99() < 0.100, f"/health p99 {probe.p99() * 1e3:.0f} ms over {len(probe.latencies)} polls"


def _same_text(a: list[str], b: list[str]) -> bool:
    """Two streams of the same request carry the same text (ids and timings differ)."""
    def text(events: list[str]) -> str:
        return "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])
    return text(a) == text(b)


def test_a_full_line_refuses_before_rendering_and_sigterm_ends_a_stream_with_shutting_down() -> None:
    """The line holds two generating (a stream and a whole answer, --parallel 2) and one waiting: a fourth request
    gets 429 at once, before its prompt (3.6 MB, seconds of template and tokenizer) is rendered. Then SIGTERM: the
    stream ends with a shutting_down event, the whole answer and the waiting request get 503 shutting_down."""
    long = {"prompt": "The list type", "max_tokens": 250, "temperature": 0, "logit_bias": NO_END}
    huge = {"messages": [{"role": "user", "content": "The list type holds items in order. " * 100_000}]}
    s = ServerProcess("--parallel", "2", "--max-queue", "1").start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as h, concurrent.futures.ThreadPoolExecutor(2) as pool, \
                h.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            whole = pool.submit(httpx.post, f"{s.url}/v1/completions", json=long, timeout=60)
            _until(lambda: h.get("/health").json()["generating"] == 2, "the whole answer never started")
            waiting = pool.submit(httpx.post, f"{s.url}/v1/completions", json=long, timeout=60)
            _until(lambda: h.get("/health").json()["waiting"] == 1, "the third request never waited")
            t0 = time.monotonic()
            full = h.post("/v1/chat/completions", json=huge)
            assert full.status_code == 429 and time.monotonic() - t0 < 2.0, (full.status_code, time.monotonic() - t0)
            s._proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            cut, refused = whole.result(timeout=30), waiting.result(timeout=30)
        assert json.loads(first.removeprefix("data: "))["choices"]
        error = json.loads(rest[-1])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error", rest[-1]
        assert "[DONE]" not in rest
        for answer in (cut, refused):
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down", answer.text
    finally:
        status = s.stop()
    assert status == 143, "".join(s.log)
    assert not any("Traceback" in line for line in s.log), "".join(s.log)


def _until(condition: Callable[[], bool], failure: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


def test_idle_connections_past_the_limit_are_refused_then_cut_off() -> None:
    """--max-connections 3: three connections that send nothing fill the server (a request gets 503) until the
    read timeout closes them; then it answers again."""
    with ServerProcess("--max-connections", "3", "--read-timeout", str(READ_TIMEOUT_S)) as s:
        idle = [socket.create_connection(_address(s)) for _ in range(3)]
        try:
            time.sleep(0.2)
            assert httpx.get(f"{s.url}/health", timeout=10).status_code == 503
            assert all(_closed_within(c, 3 * READ_TIMEOUT_S) for c in idle)
            assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        finally:
            for c in idle:
                c.close()
