"""Run ``python -m colibri_aio serve`` as a child process on a free loopback port (for tests and tools).

    with ServerProcess("--max-queue", "4") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from colibri_aio import settings

READY = re.compile(r"\[serving \S+ at (http://\S+)/v1 ")


class ServerProcess:
    """A ``serve`` child on 127.0.0.1, port 0 (the kernel picks a free one); its stderr is kept in ``log``."""

    def __init__(self, *args: str, host: str = "127.0.0.1", start_timeout: float = 300.0,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.args: Sequence[str] = [sys.executable, "-m", "colibri_aio", "serve", "--host", host, "--port", "0", *args]
        self.start_timeout, self.env, self.cwd = start_timeout, env, cwd
        self.log: list[str] = []
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    @property
    def base_url(self) -> str:
        """The OpenAI API root, e.g. ``http://127.0.0.1:41234/v1``."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> "ServerProcess":
        env = settings.child_environment({"PYTHONUNBUFFERED": "1", **(self.env or {})})
        self._proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=self.cwd)
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not self._ready.wait(0.05):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start:\n" + "".join(self.log))
        return self

    def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            self.log.append(line)
            m = READY.search(line)
            if m and not self._ready.is_set():
                self.url = m.group(1)
                self._ready.set()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit status (killed after ``timeout`` seconds)."""
        proc = self._proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
