"""The README's Python examples run as written, and its two set-up commands are the ones CI runs."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLES = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 2


# Examples that talk to `serve` name its default address; they run against a server on a free port.
SERVED = "127.0.0.1:8080"
CURL = re.findall(r"```sh\n(curl .*?)\n```", README, re.S)


@pytest.fixture(scope="module")
def server_address():
    from colibri_aio.serve.launch import ServerProcess

    with ServerProcess() as server:
        yield server.url.removeprefix("http://")


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_python_example_runs(code: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if SERVED in code:
        code = code.replace(SERVED, request.getfixturevalue("server_address"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("command", CURL, ids=[f"curl{i}" for i in range(len(CURL))])
def test_curl_example_gets_an_openai_response(command: str, server_address: str) -> None:
    r = subprocess.run(["bash", "-c", command.replace(SERVED, server_address)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["choices"][0]["message"]["content"]


def test_readme_shows_serve_with_curl_and_openai() -> None:
    assert CURL and any("from openai import OpenAI" in e and SERVED in e for e in EXAMPLES)


def test_ci_runs_the_readme_commands() -> None:
    setup = README.split("## Set up", 1)[1].split("##", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    for c in commands:
        assert c.strip() in ci
