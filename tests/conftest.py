"""Test isolation: usage histories go to a temporary cache directory, never ~/.cache."""
from __future__ import annotations

import signal

import pytest

# A test run started in the background by a shell without job control inherits SIGINT ignored, and every
# process it starts would too: the Ctrl-C tests would see their signal dropped. Ignored signals survive
# exec, handled ones are reset to the default there, so a handler here gives the children the usual Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
