"""StreamingExpertSource: every routed expert read from disk, handed over in completion order.

No cache and no prefetch (those belong to the scheduler): ``stream`` submits
all of a layer's reads at once and yields each expert as its bytes land. The
slot of the expert just yielded goes back to the pool when the consumer asks
for the next one; if the consumer stops early or is cancelled, reads still in
flight finish in the kernel and their slots then return to the pool.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from colibri_aio.experts import ExpertLocation, ExpertWeights
from colibri_aio.io.reader import ExpertReader, SlotLease

Locations = Mapping[tuple[int, int], ExpertLocation] | Callable[[int, int], ExpertLocation]


class ExpertStream:
    """An async iterator of ``(expert, weights)``; use ``async with`` (or ``aclose``) to stop early."""

    def __init__(self, reader: ExpertReader, locations: Sequence[ExpertLocation]) -> None:
        self._pending: dict[asyncio.Task[SlotLease], int] = {
            asyncio.create_task(reader.read(loc)): loc.expert for loc in locations}
        self._ready: list[asyncio.Task[SlotLease]] = []
        self._current: SlotLease | None = None
        self._closed = False

    def __aiter__(self) -> "ExpertStream":
        return self

    async def __anext__(self) -> tuple[int, ExpertWeights]:
        self._release_current()
        if self._closed or not (self._pending or self._ready):
            raise StopAsyncIteration
        try:
            if not self._ready:
                done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                self._ready.extend(done)
            task = self._ready.pop()
            expert = self._pending.pop(task)
            lease = task.result()
        except BaseException:
            self._abandon()
            raise
        self._current = lease
        return expert, lease.weights

    def _release_current(self) -> None:
        if self._current is not None:
            self._current.release()
            self._current = None

    def _abandon(self) -> None:
        """Stop now: release what we hold, cancel waiting reads; leases that still arrive go straight back."""
        self._closed = True
        self._release_current()
        self._ready.clear()
        for task in self._pending:
            if not task.done():
                task.cancel()
            task.add_done_callback(_drop_lease)

    async def aclose(self) -> None:
        """Stop early and wait until every read this stream started is over."""
        tasks = list(self._pending)
        self._abandon()
        self._pending.clear()
        if tasks:
            await asyncio.wait(tasks)

    async def __aenter__(self) -> "ExpertStream":
        return self

    def __del__(self) -> None:
        # An ``async for`` left with ``break`` and no ``aclose``: do not strand slots.
        if not self._closed and (self._pending or self._current is not None):
            try:
                self._abandon()
            except RuntimeError:
                pass  # the loop is already closed; nothing is in flight any more

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _drop_lease(task: asyncio.Task[SlotLease]) -> None:
    """A read the consumer no longer wants: release its lease, swallow its error."""
    if task.cancelled():
        return
    if task.exception() is None:
        task.result().release()


class StreamingExpertSource:
    """An ExpertSource that reads every requested expert through an ExpertReader."""

    def __init__(self, reader: ExpertReader, locations: Locations, *, owns_reader: bool = True) -> None:
        self.reader = reader
        self._locate = locations if callable(locations) else (lambda layer, expert: locations[(layer, expert)])
        self._owns_reader = owns_reader

    def stream(self, layer: int, experts: Sequence[int]) -> ExpertStream:
        """Submit reads for all of ``experts`` now; iterate to receive them as they complete."""
        return ExpertStream(self.reader, [self._locate(layer, e) for e in experts])

    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """Predictions are not acted on here: this source reads only what is asked (prefetch is the scheduler's)."""

    def step(self, positions: int) -> None:
        """Nothing here is steered by step times (the backpressure controller is the scheduler's)."""

    async def aclose(self) -> None:
        """Close the reader (if this source owns it) once its in-flight reads are drained."""
        if self._owns_reader:
            await self.reader.aclose()
