"""Importing the package sets no global state: the host's logging stays as it was."""
from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_leaves_structlog_unconfigured() -> None:
    r = _run("import structlog\n"
             "before = structlog.get_config()\n"
             "import colibri_aio, colibri_aio.engine.engine, colibri_aio.cli.main\n"
             "assert not structlog.is_configured(), 'importing colibri_aio configured structlog'\n"
             "assert structlog.get_config() == before, 'importing colibri_aio changed the structlog configuration'\n")
    assert r.returncode == 0, r.stderr


def test_import_keeps_the_host_configuration() -> None:
    r = _run("import structlog\n"
             "structlog.configure(processors=[structlog.processors.JSONRenderer()])\n"
             "mine = structlog.get_config()\n"
             "import colibri_aio\n"
             "assert structlog.get_config() == mine\n")
    assert r.returncode == 0, r.stderr


def test_the_command_line_configures_logging_to_stderr() -> None:
    r = _run("import structlog, colibri_aio\n"
             "colibri_aio.configure_logging()\n"
             "structlog.get_logger('t').warning('to stderr')\n"
             "structlog.get_logger('t').info('filtered out')\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "to stderr" in r.stderr and "filtered out" not in r.stderr


def test_the_runtime_never_imports_the_benchmarks() -> None:
    r = _run("import sys, colibri_aio, colibri_aio.engine.engine, colibri_aio.engine.placement\n"
             "assert not [m for m in sys.modules if m.startswith('colibri_aio.bench')]\n")
    assert r.returncode == 0, r.stderr
