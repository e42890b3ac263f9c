"""``GET /v1/telemetry/stream``: the engine's live telemetry as Server-Sent Events, one event per interval.

Each event is one JSON object: the figures ``run --stats`` prints for the
interval just ended (:meth:`colibri_aio.cli.telemetry.Interval.row`: tok/s,
expert hit rate split pinned/cached/prefetched, disk r/s, MB/s and %util
from ``/proc/diskstats``, reads in flight, prefetch state and its reason,
sequence slots, batch size, RSS) with the interval's expert lookups, the request line (waiting, capacity,
generating) and the engine's cumulative counters. Device figures are
``null`` where the model is on no block device: nothing is made up.

Every connection samples on its own (its own previous counters and disk
snapshot), so two pages watching at different intervals do not disturb each
other, and a client that goes away stops its sampling (sse-starlette cancels
the generator on disconnect). The stream ends when the server stops
(``Service.stopping``), so an open page does not hold up a shutdown.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from colibri_aio.cli.telemetry import Interval
from colibri_aio.engine.device import Snapshot, between
from colibri_aio.serve.errors import APIError

if TYPE_CHECKING:
    from colibri_aio.engine.engine import Engine
    from colibri_aio.engine.line import RequestLine

PATH = "/v1/telemetry/stream"
DEFAULT_INTERVAL_S = 1.0        # run --stats-interval's default: the same cadence as the terminal's telemetry
MIN_INTERVAL_S = 0.2            # closer samples only show the sampling noise (and cost the loop a stats read each)
MAX_INTERVAL_S = 60.0


def parse_interval(text: str | None) -> float:
    """The ``interval`` query parameter in seconds (default :data:`DEFAULT_INTERVAL_S`); a 400 naming it when it is
    not a number within [MIN_INTERVAL_S, MAX_INTERVAL_S]."""
    if text is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:  # also refuses nan and inf
        raise APIError(400, f"interval must be a number of seconds in [{MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}], "
                            f"got {text!r}", param="interval")
    return value


class TelemetrySampler:
    """One client's view: each :meth:`sample` is the interval since the previous one."""

    def __init__(self, engine: Engine, line: RequestLine) -> None:
        self.engine, self.line = engine, line
        self._disk: Snapshot | None = engine.device.read() if engine.device is not None else None
        self._last = engine.stats()

    def sample(self) -> dict[str, Any]:
        """The figures of the interval since the previous sample (or since this sampler began)."""
        now = self.engine.stats()
        device = None
        if self.engine.device is not None:
            before, self._disk = self._disk, self.engine.device.read()
            device = between(before, self._disk)
        interval = Interval(self._last, now, device)
        lookups = now.lookups - self._last.lookups  # 0: the hit shares of the row are 0 for want of lookups
        self._last = now
        line = self.line
        return {"t": now.t, "seconds": interval.seconds, **interval.row(), "lookups": lookups,
                "device": self.engine.device.device if self.engine.device is not None else None,
                "queue": {"waiting": line.waiting, "capacity": line.max_waiting, "generating": line.holders,
                          "slots": line.capacity},
                "engine": now.as_dict()}


async def events(sampler: TelemetrySampler, interval: float, stopping: asyncio.Event) -> AsyncIterator[dict[str, str]]:
    """SSE events of ``sampler`` every ``interval`` seconds until ``stopping`` is set (the server's shutdown)."""
    while not stopping.is_set():
        try:
            await asyncio.wait_for(stopping.wait(), interval)
        except TimeoutError:
            pass
        if stopping.is_set():
            return
        yield {"event": "telemetry", "data": json.dumps(sampler.sample(), separators=(",", ":"))}
