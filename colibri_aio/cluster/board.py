"""The replicas of each deployment as this process's request routers last heard of them.

A Ray Serve router runs in the process of the handle that uses it, and hears
from Ray which replicas run; the gateway reads the same board to know them.
"""
from __future__ import annotations

import threading


class ReplicaBoard:
    """The replicas of one deployment that run now, as its router last heard (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    def set(self, ids: set[str]) -> None:
        with self._lock:
            self._ids = set(ids)

    def discard(self, replica: str) -> None:
        with self._lock:
            self._ids.discard(replica)

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._ids)


_boards: dict[tuple[str, str], ReplicaBoard] = {}
_boards_lock = threading.Lock()


def board(app: str, deployment: str) -> ReplicaBoard:
    """The board of ``deployment`` in ``app`` in this process (made on first use)."""
    with _boards_lock:
        return _boards.setdefault((app, deployment), ReplicaBoard())
