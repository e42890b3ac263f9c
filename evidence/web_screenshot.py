"""Screenshots of the web page for evidence/: the page during a reply, after a few replies gave the telemetry
charts some history, and the page refusing a wrong API key.

    python evidence/web_screenshot.py evidence/web_page_STAMP.png evidence/web_key_refused_STAMP.png

A real ``serve`` of the shipped model and Debian's chromium (/usr/bin/chromium) through Playwright, as in
tests/test_web_page.py.
"""
from __future__ import annotations

import sys
import time

from playwright.sync_api import expect, sync_playwright

from colibri_aio.serve.launch import ServerProcess

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPTS = ["What is a list?", "Explain dictionaries", "How do generators work?", "Tell me about Python lists"]


def reply_shot(out: str) -> None:
    with ServerProcess() as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{server.url}/?telemetry=0.5")
        expect(page.locator("#model-name")).to_have_text("colibri-tiny-q8_0.gguf")
        for text in PROMPTS[:-1]:             # replies to the end, each a new chat: history for the charts
            page.locator("#new-chat").click()
            page.locator("#prompt").fill(text)
            page.locator("#prompt").press("Enter")
            expect(page.locator(".message.assistant .meta")).not_to_have_text("", timeout=60_000)
            page.wait_for_timeout(1500)      # an idle gap between replies
        page.locator("#new-chat").click()
        page.locator("#prompt").fill(PROMPTS[-1])
        page.locator("#prompt").press("Enter")
        page.wait_for_timeout(1200)           # mid-reply
        page.screenshot(path=out)
        browser.close()


def key_shot(out: str) -> None:
    with ServerProcess("--api-key", "the-right-key") as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 500})
        page.goto(f"{server.url}/")
        page.locator("#api-key").fill("a-wrong-key")
        page.locator("#api-key").press("Enter")
        expect(page.locator("#status")).to_have_text("The API key was refused (401): check it and try again.")
        time.sleep(0.3)
        page.screenshot(path=out)
        browser.close()


if __name__ == "__main__":
    reply_shot(sys.argv[1])
    key_shot(sys.argv[2])
