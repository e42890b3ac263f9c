"""The web page in a real headless browser: Debian's chromium driven by Playwright for Python (no browser is
downloaded: Playwright launches /usr/bin/chromium, which .ci/run installs where it can).

Each server is a real ``python -m colibri_aio serve`` process with the shipped model. The page is used as a
person uses it, with the keyboard: type, Enter sends, the Stop button, the key form.
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import rewrite_gguf

from colibri_aio.models import DEFAULT_MODEL, default_model_path
from colibri_aio.serve.launch import ServerProcess

# Debian's chromium; CHROMIUM_PATH names another build of Chromium (another distribution's path).
CHROMIUM = Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
KEY = "web-key-5678"
# What keeps a headless browser from reaching anything but the server under test and from needing a GPU or a
# sandbox it cannot have in a container.
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
    pytest.skip(f"no browser: {CHROMIUM} is not installed (apt-get install chromium; .ci/run does when it is root)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"the page's scripts failed: {errors}"


def _samples(page, chart: str) -> int:
    return int(page.get_attribute(f"#{chart}", "data-samples") or 0)


def _until(page, check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``check`` from here until it holds (the page's Content-Security-Policy, which the test keeps, forbids
    the string evaluation page.wait_for_function would use)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        page.wait_for_timeout(100)


def test_chat_streams_stops_and_the_telemetry_charts_move_meanwhile(page, tmp_path: Path) -> None:
    # The shipped model with room for a long reply: its own context (256 positions) would end a reply within a
    # second on a fast machine, before the test could press Stop on it.
    model = rewrite_gguf(default_model_path(), tmp_path / DEFAULT_MODEL, keys={"qwen3moe.context_length": 2048})
    with ServerProcess("--model", str(model)) as server:
        page.goto(f"{server.url}/?telemetry=0.2")                        # samples 5 a second
        playwright_api.expect(page.locator("#telemetry-state")).to_have_text("live, one sample every 0.2 s")
        playwright_api.expect(page.locator("#model-name")).to_have_text("colibri-tiny-q8_0.gguf")
        playwright_api.expect(page.locator("#key-form")).to_be_hidden()   # no key set: none asked for
        # The first telemetry sample arrives within an interval of opening the page.
        _until(page, lambda: _samples(page, "chart-tps") >= 1, "the first telemetry sample")
        prompt = page.locator("#prompt")
        playwright_api.expect(prompt).to_be_focused()                     # ready to type on load
        prompt.type("Tell me about Python lists")
        prompt.press("Enter")                                             # Enter sends
        answer = page.locator(".message.assistant .content").last
        _until(page, lambda: len((answer.text_content() or "").strip()) > 20, "streamed text", 30)
        playwright_api.expect(page.locator("#stop")).to_be_enabled()
        playwright_api.expect(page.locator("#send")).to_be_disabled()
        first_text = answer.text_content()
        # While the reply streams, new samples arrive and one of them counts generated tokens.
        before = _samples(page, "chart-tps")
        _until(page, lambda: _samples(page, "chart-tps") >= before + 2, "two samples during the reply")
        label = page.get_attribute("#chart-tps", "aria-label")
        assert label is not None and label.startswith("Tokens per second: tok/s ")
        assert float(label.rsplit(" ", 1)[1]) > 0, label
        hits = page.get_attribute("#chart-hits", "aria-label")
        assert hits is not None and "pinned" in hits and "cached" in hits and "prefetched" in hits
        assert len(answer.text_content()) > len(first_text)                # the text grew meanwhile
        playwright_api.expect(page.locator("#stop")).to_be_enabled()     # still streaming: the stop is ours
        page.locator("#stop").click()
        playwright_api.expect(page.locator("#status")).to_have_text("stopped")
        playwright_api.expect(page.locator(".message.assistant .meta").last).to_have_text("stopped")
        playwright_api.expect(page.locator("#send")).to_be_enabled()
        playwright_api.expect(page.locator("#stop")).to_be_disabled()
        stopped_text = answer.text_content()
        assert stopped_text and len(stopped_text) > 20
        page.wait_for_timeout(1500)
        assert answer.text_content() == stopped_text                       # nothing arrives after the stop
        # The server let go of the generation: its one slot is free again.
        _until(page, lambda: "sequences0/1" in (page.text_content("#readout") or ""), "the slot set free")
        # ... and generates no more: the engine's token count stands still over the next samples.
        counted = page.text_content("#readout") or ""
        page.wait_for_timeout(1000)
        assert page.text_content("#readout").split("tokens since start")[1] == counted.split("tokens since start")[1]
        # The conversation is kept in the browser: a reload shows it again.
        page.reload()
        playwright_api.expect(page.locator(".message.user .content")).to_have_text("Tell me about Python lists")
        playwright_api.expect(page.locator(".message.assistant .content")).to_have_text(stopped_text)


def test_a_wrong_key_is_refused_on_the_page_and_the_right_one_lets_it_in(page) -> None:
    with ServerProcess("--api-key", KEY) as server:
        page.goto(f"{server.url}/")                                       # the page loads without the key
        playwright_api.expect(page.locator("#key-form")).to_be_visible()
        playwright_api.expect(page.locator("#status")).to_have_text("This server needs an API key.")
        key = page.locator("#api-key")
        playwright_api.expect(key).to_be_focused()
        key.type("not-the-key")
        key.press("Enter")
        playwright_api.expect(page.locator("#status")).to_have_text(
            "The API key was refused (401): check it and try again.")
        playwright_api.expect(page.locator("#model-name")).to_have_text("not connected")
        assert _samples(page, "chart-tps") == 0                           # no telemetry without the key
        key.fill(KEY)
        key.press("Enter")
        playwright_api.expect(page.locator("#model-name")).to_have_text("colibri-tiny-q8_0.gguf")
        playwright_api.expect(page.locator("#key-form")).to_be_hidden()
        _until(page, lambda: _samples(page, "chart-tps") >= 1, "telemetry with the key")


def test_thinking_is_shown_apart_and_the_settings_go_with_the_request(page, tmp_path: Path) -> None:
    import json

    import httpx
    from test_serve_tools import with_template

    # A fixture with DeepSeek-R1's real template: its prompt opens <think>, so every reply starts thinking; the
    # server closes the thinking span after 12 tokens.
    model = with_template("deepseek2_q8_0.gguf", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", tmp_path)
    with ServerProcess("--model", str(model), "--ctx", "1024", "--reasoning-budget", "12") as server:
        page.goto(f"{server.url}/")
        playwright_api.expect(page.locator("#model-name")).to_have_text(model.name)
        page.locator("#settings summary").press("Enter")                 # the settings open from the keyboard
        page.locator("#system-prompt").fill("You answer briefly.")
        page.locator("#temperature").fill("0")
        page.locator("#max-tokens").fill("40")
        page.locator("#max-tokens").press("Tab")                           # the change is kept on leaving
        page.locator("#prompt").fill("Why is the sky blue?")
        with page.expect_request("**/v1/chat/completions") as sent:
            page.locator("#prompt").press("Enter")
        body = json.loads(sent.value.post_data or "{}")
        assert body["messages"] == [{"role": "system", "content": "You answer briefly."},
                                    {"role": "user", "content": "Why is the sky blue?"}]
        assert (body["temperature"], body["max_tokens"], body["stream"]) == (0, 40, True)
        assert "top_p" not in body                                         # left empty: the model's default
        playwright_api.expect(page.locator("#send")).to_be_enabled(timeout=60_000)
        meta = page.locator(".message.assistant .meta").text_content() or ""
        assert meta.startswith("40 tokens in ") and meta.endswith("finish: length"), meta
        # The same request as a whole reply: the page showed its thinking and its answer, each in its place.
        whole = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                           json={k: body[k] for k in ("messages", "temperature", "max_tokens")}).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"]
        assert page.locator(".message.assistant .reasoning-text").text_content() == message["reasoning_content"]
        assert page.locator(".message.assistant .content").text_content() == message["content"]
        playwright_api.expect(page.locator(".message.assistant .reasoning")).to_be_visible()
        # The settings are kept for the next visit.
        page.reload()
        playwright_api.expect(page.locator("#system-prompt")).to_have_value("You answer briefly.")
        playwright_api.expect(page.locator("#max-tokens")).to_have_value("40")


def test_every_control_is_reached_with_tab_in_reading_order(page) -> None:
    with ServerProcess() as server:
        page.goto(f"{server.url}/")
        playwright_api.expect(page.locator("#model-name")).to_have_text("colibri-tiny-q8_0.gguf")
        page.locator("#prompt").fill("Hello")
        page.locator("#prompt").press("Enter")
        playwright_api.expect(page.locator("#send")).to_be_enabled(timeout=60_000)
        page.locator("#new-chat").focus()
        seen = []
        for _ in range(7):
            focused = page.locator(":focus")
            seen.append(focused.get_attribute("id", timeout=2000) or focused.get_attribute("class")
                        or focused.text_content())
            page.keyboard.press("Tab")
        # New chat, the conversation and its delete button, Settings, the messages (to scroll them), the message
        # box, Send (Stop is disabled while nothing streams, so it is skipped).
        assert seen == ["new-chat", "open", "delete", "Settings", "messages", "prompt", "send"], seen
        page.keyboard.press("Shift+Tab")
        page.keyboard.press("Shift+Tab")
        playwright_api.expect(page.locator("#prompt")).to_be_focused()
