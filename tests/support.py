"""Shared test helpers: fixture paths and a way to run the CLI as a user would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ORACLE = FIXTURES / "oracle"


def fixture(name: str) -> Path:
    path = FIXTURES / name
    if not path.exists():
        pytest.fail(f"missing fixture {path}; regenerate with fixtures/make_fixtures.py")
    return path


def oracle_ids() -> list[list[int]]:
    return json.loads((ORACLE / "ids.json").read_text())["sequences"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m colibri_aio ARGS`` in a subprocess, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "colibri_aio", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=FIXTURES.parent)


def main_in_process(*args: str) -> tuple[int, str, str]:
    """``python -m colibri_aio ARGS`` run by :func:`colibri_aio.cli.main.main` in this process:
    (exit status, stdout, stderr). Faster than a subprocess; logging is configured back afterwards."""
    import contextlib
    import io

    import structlog

    from colibri_aio.cli.main import main

    # Encoded as a process's streams are (UTF-8; strict on stdout, escapes on stderr), so text
    # that could not be printed fails here as it would in a terminal or a pipe.
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    saved = structlog.get_config()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
    finally:
        structlog.configure(**saved)
    return status, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()
