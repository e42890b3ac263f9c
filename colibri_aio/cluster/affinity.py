"""Which replica serves a request: a chat's next turn goes where its KV prefix is.

Each replica runs one engine with one KV cache, and the engine reuses the
longest prefix of the previous request's tokens (``colibri_aio.serve``). So
the replica that will hold a conversation's tokens when a request's turn
comes is the one whose *last routed* request belonged to that conversation:
requests run in the order they were routed, and each overwrites the cache.

The conversation key (:func:`conversation_key`) is the ``X-Session-ID``
header when the client sends one; otherwise, for a chat, a hash of the
conversation's opening — its messages up to and including the first user
message. Clients of the OpenAI API send the whole history with every turn,
so the opening is the same in every turn of one conversation and needs no
cooperation from the client; and turn n+1's prompt starts with turn n's
prompt and reply, which is exactly what the engine can reuse. Two
conversations with the same opening share a key: they share that prefix too,
and the load rule below keeps them from piling onto one replica. A text
completion has no key unless the header gives one.

:class:`ReplicaChooser` is sans-I/O: it is told which replicas are live and
when a request starts and ends, and answers where the next one goes. Each
replica takes ``per_replica`` generation requests at a time (one generating,
the rest waiting in its line); a request goes to the replica holding its key
when that one has room and is no busier than the least busy; otherwise to the
least busy, ties to the replica whose cache holds the oldest conversation
(so a new conversation does not evict a recent one). When every line is full
it raises :class:`NoRoom` (HTTP 429), when no replica is live
:class:`NoReplica` (HTTP 503).
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SESSION_HEADER = "x-session-id"
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"   # Anthropic's: the system prompt is a field beside the messages


def conversation_key(path: str, body: Any, session: str | None = None) -> str | None:
    """The conversation a request belongs to (see the module's docstring); None: route by load alone."""
    if session:
        return "session:" + session
    if path not in (CHAT_PATH, MESSAGES_PATH) or not isinstance(body, Mapping):
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    opening: list[Any] = [{"role": "system", "content": body["system"]}] if body.get("system") is not None else []
    for message in messages:
        opening.append(message)
        if isinstance(message, Mapping) and message.get("role") == "user":
            break
    digest = hashlib.sha256(json.dumps(opening, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return "chat:" + digest[:32]


class NoRoom(Exception):
    """Every live replica's line is full: come back in ``retry_after`` seconds (HTTP 429)."""

    def __init__(self, in_flight: int, retry_after: int) -> None:
        self.in_flight, self.retry_after = in_flight, retry_after
        super().__init__(f"the server is busy: every replica's line is full ({in_flight} requests in flight); "
                         f"retry in {retry_after} s")


class NoReplica(Exception):
    """No replica is live (all starting or restarting): HTTP 503."""


@dataclass(frozen=True)
class Choice:
    """Where a request goes, and why: ``holder`` (its cache ends with this conversation) or ``least_busy``."""

    replica: str
    reason: str


@dataclass
class _Replica:
    load: int = 0                  # generation requests routed here and not finished
    tail: str | None = None        # key of the last request routed here: what its cache will hold
    last_routed: int = 0           # when (a counter) it was last routed a request; 0: never


class ReplicaChooser:
    """Chooses a replica for each generation request (see the module's docstring)."""

    def __init__(self, per_replica: int) -> None:
        if per_replica < 1:
            raise ValueError("per_replica must be >= 1")
        self.per_replica = per_replica
        self._replicas: dict[str, _Replica] = {}
        self._clock = 0
        self._mean_s = 1.0  # how long a request takes end to end, for Retry-After; learnt from finished ones

    @property
    def replicas(self) -> list[str]:
        return sorted(self._replicas)

    @property
    def in_flight(self) -> int:
        return sum(r.load for r in self._replicas.values())

    @property
    def capacity(self) -> int:
        return self.per_replica * len(self._replicas)

    def load(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return r.load if r is not None else 0

    def set_replicas(self, live: Iterable[str]) -> None:
        """The live replicas now: new ones start empty, gone ones are forgotten (their requests fail on their own)."""
        live = set(live)
        for gone in set(self._replicas) - live:
            del self._replicas[gone]
        for new in live - set(self._replicas):
            self._replicas[new] = _Replica()

    def assign(self, key: str | None) -> Choice:
        """Route one request with conversation ``key`` and count it on its replica until :meth:`finished`."""
        if not self._replicas:
            raise NoReplica("no replica is running (they may be starting or restarting)")
        room = {rid: r for rid, r in self._replicas.items() if r.load < self.per_replica}
        if not room:
            raise NoRoom(self.in_flight, self.retry_after())
        least = min(r.load for r in room.values())
        holder = next((rid for rid, r in room.items() if key is not None and r.tail == key), None)
        if holder is not None and room[holder].load <= least:
            choice = Choice(holder, "holder")
        else:
            # Least busy; among equals, the one whose cache holds the oldest conversation (then by id).
            rid = min((rid for rid, r in room.items() if r.load == least),
                      key=lambda rid: (room[rid].last_routed, rid))
            choice = Choice(rid, "least_busy")
        self._clock += 1
        r = self._replicas[choice.replica]
        r.load, r.tail, r.last_routed = r.load + 1, key, self._clock
        return choice

    def finished(self, replica: str, seconds: float | None = None) -> None:
        """A request on ``replica`` ended (answered, refused, failed or abandoned); ``seconds``: how long it took."""
        r = self._replicas.get(replica)
        if r is not None and r.load > 0:
            r.load -= 1
        if seconds is not None:
            self._mean_s = 0.8 * self._mean_s + 0.2 * max(seconds, 0.0)

    def forget(self, replica: str) -> None:
        """The replica's cache no longer holds what was routed to it (it failed a request or restarted)."""
        r = self._replicas.get(replica)
        if r is not None:
            r.tail = None

    def retry_after(self) -> int:
        """Whole seconds until a place is likely free: about one request's time, when every line is full."""
        return max(1, min(3600, math.ceil(self._mean_s)))
