"""Test isolation: usage histories go to a temporary cache directory, never ~/.cache.

Each test's cache starts with the native probes' verdicts of this machine
(:mod:`colibri_aio.probes`), made once per session in children as in a real
first run, so that the engines and CLI runs of hundreds of tests do not each
probe again; tests of the probes themselves start from an empty folder.
"""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

# A test run started in the background by a shell without job control inherits SIGINT ignored, and every
# process it starts would too: the Ctrl-C tests would see their signal dropped. Ignored signals survive
# exec, handled ones are reset to the default there, so a handler here gives the children the usual Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def _probe_verdicts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding this machine's probe verdicts."""
    from colibri_aio import probes

    home = tmp_path_factory.mktemp("xdg-probes")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    try:
        for backend in probes.PROBES:
            probes.verdict(backend)
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before
    return home / "colibri_aio" / "probes"


@pytest.fixture(autouse=True)
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                        _probe_verdicts: Path, request: pytest.FixtureRequest) -> None:
    home = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    if "no_probe_verdicts" not in request.keywords and _probe_verdicts.is_dir():
        shutil.copytree(_probe_verdicts, home / "colibri_aio" / "probes")
