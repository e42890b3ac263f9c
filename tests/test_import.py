"""Importing the package sets no global state: the host's logging stays as it was."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host", ["", "structlog.configure(processors=[structlog.processors.JSONRenderer()])\n"],
                         ids=["unconfigured", "configured by the host"])
def test_import_leaves_the_structlog_configuration_as_it_was(host: str) -> None:
    r = _run("import structlog\n" + host +
             "before, configured = structlog.get_config(), structlog.is_configured()\n"
             "import colibri_aio, colibri_aio.engine.engine, colibri_aio.cli.main\n"
             "assert structlog.is_configured() == configured, 'importing colibri_aio configured structlog'\n"
             "assert structlog.get_config() == before, 'importing colibri_aio changed the structlog configuration'\n")
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


def test_the_library_is_quiet_unless_configured() -> None:
    """A script that configures nothing sees the library's warnings on stderr and nothing of its
    informational events (structlog's own default would print those to stdout)."""
    r = _run("from colibri_aio.logs import get_logger\n"
             "log = get_logger('colibri_aio.t')\n"
             "log.info('placement', io='uring')\n"
             "log.warning('history not saved', path='/nope')\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "history not saved" in r.stderr and "path=/nope" in r.stderr
    assert "placement" not in r.stderr


def test_the_library_follows_a_host_configuration() -> None:
    r = _run("import structlog\n"
             "structlog.configure(processors=[structlog.processors.JSONRenderer()])\n"
             "from colibri_aio.logs import get_logger\n"
             "get_logger('colibri_aio.t').info('placement', io='uring')\n")
    assert r.returncode == 0, r.stderr
    assert '"event": "placement"' in r.stdout and '"io": "uring"' in r.stdout
