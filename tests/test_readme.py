"""The README's Python examples run as written, and its two set-up commands are the ones CI runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLES = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_python_example_runs(code: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_ci_runs_the_readme_commands() -> None:
    setup = README.split("## Set up", 1)[1].split("##", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    for c in commands:
        assert c.strip() in ci
