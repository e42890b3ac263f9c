"""The web page's routes over plain HTTP: what is public with an API key set (only reading the page), the
telemetry stream's events and their figures, and the guard still in front of both.

Each server is a real ``python -m colibri_aio serve`` process with the shipped model.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from colibri_aio.serve.launch import ServerProcess

KEY = "route-key-9012"
PAGE = {"/": "text/html", "/web/app.js": "text/javascript", "/web/charts.js": "text/javascript",
        "/web/style.css": "text/css"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    with ServerProcess("--api-key", KEY) as s:
        yield s


def _events(client: httpx.Client, url: str, n: int, **kw: object) -> list[dict]:
    """The first ``n`` telemetry events of the stream at ``url``."""
    found: list[dict] = []
    with client.stream("GET", url, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                assert name == "telemetry"
                found.append(json.loads(line.split(":", 1)[1]))
                if len(found) == n:
                    return found
    return found


def test_the_page_loads_without_the_key_and_nothing_else_does(keyed: ServerProcess) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for path, media in PAGE.items():
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(media), path
            assert "script-src 'self'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"
            assert c.head(path).status_code == 200
        assert 'src="/web/app.js"' in c.get("/").text
        # Not public: another method on the page's path, a file that is not one of the page's, the telemetry.
        assert c.post("/", json={}).status_code == 401
        assert c.get("/web/index.html").status_code == 401
        assert c.get("/web/../app.py").status_code == 401
        assert c.get("/v1/telemetry/stream").status_code == 401
        assert c.get("/v1/telemetry/stream", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_telemetry_stream_sends_the_engine_figures_at_the_interval(keyed: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        events = _events(c, "/v1/telemetry/stream?interval=0.3", 3, headers=auth)
        assert len(events) == 3
        for e in events:
            assert 0.2 < e["seconds"] < 2.0
            for name in ("tok/s", "hit%", "pin%", "lru%", "pre%", "rMB/s", "%util", "infl", "pf", "pf-why",
                         "seqs", "RSS_MB"):
                assert name in e, name
            assert e["queue"] == {"waiting": 0, "capacity": 16, "generating": 0, "slots": 1}
            assert e["lookups"] == 0 and e["tok/s"] == 0.0                # idle: nothing looked up, nothing made
            assert e["RSS_MB"] > 0 and e["engine"]["rss"] > 0
        assert events[0]["t"] < events[1]["t"] < events[2]["t"]
    # A generation shows in the samples taken meanwhile: their lookups add up to the engine's counters.
    during: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.stream("GET", f"{keyed.url}/v1/telemetry/stream?interval=0.2", headers=auth, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    during.append(json.loads(line[5:]))
                    if done.is_set() and len(during) >= 3:
                        return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    deadline = time.monotonic() + 10
    while not during and time.monotonic() < deadline:  # a first sample before the reply: the reply may be quick
        time.sleep(0.02)
    r = httpx.post(f"{keyed.url}/v1/chat/completions", headers=auth, timeout=120,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64})
    assert r.status_code == 200
    done.set()
    watcher.join(30)
    assert len(during) >= 3
    first, last = during[0]["engine"], during[-1]["engine"]
    kinds = ("pinned_hits", "cached_hits", "prefetch_hits", "misses")
    assert sum(e["lookups"] for e in during[1:]) == sum(last[k] - first[k] for k in kinds) > 0
    assert max(e["tok/s"] for e in during) > 0


@pytest.mark.parametrize("interval", ["0", "0.05", "61", "nan", "fast"])
def test_an_interval_out_of_range_is_a_400_naming_it(keyed: ServerProcess, interval: str) -> None:
    r = httpx.get(f"{keyed.url}/v1/telemetry/stream", params={"interval": interval},
                  headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"


def test_without_a_key_the_host_guard_still_stands_in_front_of_the_page() -> None:
    with ServerProcess() as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.get("/").status_code == 200                                  # the page's own origin passes
        assert c.get("/", headers={"Host": "rebound.example"}).status_code == 421
        assert c.get("/v1/telemetry/stream", headers={"Host": "rebound.example"}).status_code == 421
        assert c.get("/web/missing.js").status_code == 404
        assert len(_events(c, "/v1/telemetry/stream?interval=0.2", 1)) == 1  # no key set: open like the API


def test_an_open_telemetry_stream_does_not_hold_up_a_shutdown() -> None:
    with ServerProcess() as s:
        got: list[dict] = []
        ended = threading.Event()

        def watch() -> None:
            with httpx.stream("GET", f"{s.url}/v1/telemetry/stream?interval=0.2", timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        got.append(json.loads(line[5:]))
            ended.set()                                                 # the server ended the stream

        threading.Thread(target=watch, daemon=True).start()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got, "no telemetry event"
        t0 = time.monotonic()
        assert s.stop() == 143                                          # SIGTERM: the usual exit status
        assert time.monotonic() - t0 < 5      # not the 10 s uvicorn gives open requests before it cuts them
        assert ended.wait(5)


def test_a_built_wheel_carries_the_page(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(root)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("colibri_aio-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    # The page's module, imported from the unpacked wheel (not this tree), finds every file it serves.
    code = ("import sys, colibri_aio.serve.page as p; assert p.__file__.startswith(sys.argv[1]), p.__file__; "
            "print(sorted(len(p._read(name)) > 100 for name, _ in p.ASSETS.values()))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], capture_output=True, text=True,
                       cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[True, True, True, True]"
