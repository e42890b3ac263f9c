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
