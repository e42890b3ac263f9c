"""Many streams on one engine: sequence slots, chunked prefill and one decode step for every stream.

An engine opened with ``parallel=N`` holds N sequences, each in a slot of
the net with its own KV cache. A generation takes a slot, prefills its
prompt in chunks of :data:`~colibri_aio.arch.layers.PREFILL_CHUNK`
positions, picks its first token and joins the decoding streams. One task,
:meth:`Batcher.run`, steps all of them together with
:meth:`~colibri_aio.arch.layers.MoETransformer.decode_batch`: each layer's
union of chosen experts is read once and multiplied for every row routed to
it, and the trunk and the output head are read once per step instead of
once per stream. A step's logits equal each stream's logits alone, bit for
bit, so batching changes speed, never tokens.

The net computes one thing at a time (a prefill chunk or a decode step),
under one lock that hands it out in arrival order: a prompt that arrives
while others decode costs them at most one chunk per step, and never waits
for them to finish.

Which slot a request gets is :func:`choose_slot`'s (pure) choice: the free
slot holding the longest prefix of its prompt (a chat's next turn finds its
conversation), else the one unused longest.
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from colibri_aio.arch.layers import PREFILL_CHUNK, MoETransformer
from colibri_aio.engine.line import RequestLine
from colibri_aio.engine.streams import Decoding, GenerationPiece
from colibri_aio.errors import EngineBusyError
from colibri_aio.text.sampling import TokenPicker

if TYPE_CHECKING:
    from colibri_aio.engine.engine import Engine


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def cached_prefix(net: MoETransformer, ids: Sequence[int]) -> int:
    """How many leading ``ids`` the net's current slot holds and can continue from, short of the last (its
    logits start generation); 0 when the common prefix ends before what a sliding window still holds."""
    n = min(len(ids) - 1, common_prefix(ids, net.ids))
    return net.resumable(n) if n > 0 else 0


def choose_slot(ids: Sequence[int], held: Sequence[Sequence[int]], free: Sequence[bool],
                last_used: Sequence[int]) -> int | None:
    """The slot a prompt ``ids`` should take: among the ``free`` ones, the one whose ``held`` ids share the
    longest prefix with it, the least recently used (``last_used``, a clock) among equals; None when no slot
    is free."""
    best: tuple[int, int] | None = None
    choice = None
    for index, (had, ok) in enumerate(zip(held, free)):
        if not ok:
            continue
        key = (common_prefix(ids, had), -last_used[index])
        if best is None or key > best:
            best, choice = key, index
    return choice


@dataclass(slots=True)
class BatchStats:
    """The batcher's counters: decode steps and the rows they carried, the last step's rows and, over steps
    of several rows, the distinct experts each MoE block read (the union of its rows' choices)."""

    steps: int = 0
    rows: int = 0
    last_rows: int = 0
    union_sum: int = 0
    union_count: int = 0


class _Stream:
    """One generation that has a slot: its decoding state and the queue its pieces wait in."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.decoding: Decoding | None = None
        self.pending = -1                 # the token the next step feeds
        self.queue: asyncio.Queue[GenerationPiece | BaseException] = asyncio.Queue()
        self.left = False


class Batcher:
    """The slots of a parallel engine and the task that decodes them together (module docstring)."""

    def __init__(self, engine: Engine, net: MoETransformer) -> None:
        self.engine, self.net = engine, net
        n = len(net.slots)
        self.free = [True] * n
        self.last_used = [0] * n
        self._clock = 0
        self.line = RequestLine(max_waiting=sys.maxsize, capacity=n)   # a place per slot, the rest wait in order
        self.lock = asyncio.Lock()        # the net: one prefill chunk or decode step at a time, in order
        self.active: dict[int, _Stream] = {}
        self._wake = asyncio.Event()
        self.stats = BatchStats()
        self._closed: BaseException | None = None

    @property
    def n_slots(self) -> int:
        return len(self.free)

    @property
    def busy(self) -> int:
        """Slots held by a generation (prefilling or decoding)."""
        return self.free.count(False)

    # --- slots -------------------------------------------------------------------------------------

    async def acquire(self, ids: Sequence[int], *, wait: bool = True) -> int:
        """A free slot for prompt ``ids`` (see :func:`choose_slot`), after those waiting before; with ``wait``
        False, :class:`EngineBusyError` at once when every slot is taken."""
        self._check_open()
        if not wait and (self.line.busy or self.line.waiting):
            raise EngineBusyError(f"all {self.n_slots} sequence slots are generating "
                                  f"(wait=True queues; --parallel sets how many)")
        await self.line.acquire()
        index = choose_slot(ids, [s.ids for s in self.net.slots], self.free, self.last_used)
        assert index is not None, "a place in the line is a free slot"
        self.free[index] = False
        return index

    def release(self, index: int) -> None:
        """Slot ``index`` is free again (its KV cache kept for a prompt that shares its prefix)."""
        if self.free[index]:
            return
        self.free[index] = True
        self._clock += 1
        self.last_used[index] = self._clock
        self.line.release()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RuntimeError("the engine is closed") from self._closed

    # --- one generation ---------------------------------------------------------------------------

    async def generate(self, ids: list[int], max_tokens: int, stop: Sequence[str], pick: TokenPicker,
                       logprobs: int | None, reuse: bool, *, wait: bool = True,
                       special: bool = False) -> AsyncIterator[GenerationPiece]:
        """A generation on a slot of its own: chunked prefill, then its pieces from the shared decode steps."""
        index = await self.acquire(ids, wait=wait)
        stream = _Stream(index)
        try:
            cached, logits, prefill_s = await self._prefill(index, ids, reuse)
            self.engine.count_prompt(len(ids) - cached, cached, prefill_s)
            stream.decoding = Decoding(self.engine.tokenizer, ids, max_tokens, stop, pick, logprobs, cached,
                                       prefill_s, self.engine.count_token, special=special)
            piece = stream.decoding.piece(logits)
            yield piece
            if piece.finish_reason is not None:
                return
            self._check_open()
            stream.pending = int(piece.token)  # type: ignore[arg-type]
            self.active[index] = stream
            self._wake.set()
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._leave(stream)
            if not self.active and not self.lock.locked() and self._closed is None:
                await self.engine.source.settle()   # idle: no read left in flight

    async def _prefill(self, index: int, ids: list[int], reuse: bool) -> tuple[int, np.ndarray, float]:
        """Prompt ``ids`` into slot ``index`` chunk by chunk, each chunk under the lock (decode steps of the
        other streams go between); (leading tokens found cached, the last logits, seconds)."""
        t0 = time.perf_counter()
        net = self.net
        async with self.lock:
            net.use(index)
            cached = cached_prefix(net, ids) if reuse else 0
            net.rewind(cached)
        logits: np.ndarray | None = None
        # The chunks fall where a prefill of the whole prompt puts them (layers.MoETransformer.prefill), so
        # the bits are those of a prompt prefilled alone.
        for start in range(cached, len(ids), PREFILL_CHUNK):
            # A chunk whose experts all hit never suspends: let the decode task queue for the net first.
            await asyncio.sleep(0)
            async with self.lock:
                net.use(index)
                logits = await net.forward(ids[start: start + PREFILL_CHUNK])
                if start + PREFILL_CHUNK >= len(ids):
                    net.checkpoint()   # a recurrent state cannot be wound back: keep the prompt's
        assert logits is not None, "a prompt leaves at least its last token to compute"
        return cached, logits, time.perf_counter() - t0

    def _leave(self, stream: _Stream) -> None:
        """``stream`` ends (finished, closed or failed): out of the decode set, its slot free. A step under way
        that carries it still completes it (the lock keeps its slot's next owner out until then)."""
        stream.left = True
        if self.active.get(stream.index) is stream:
            del self.active[stream.index]
        self.release(stream.index)

    async def teacher_forced(self, ids: Sequence[int], logits: str, *, wait: bool = True) -> np.ndarray:
        """``net.prefill`` of ``ids`` from an empty context on a slot of its own (``Engine.logits``/``prefill``)."""
        index = await self.acquire(ids, wait=wait)
        try:
            async with self.lock:
                self.net.use(index)
                self.net.reset()
                return await self.net.prefill(ids, logits=logits)  # type: ignore[arg-type]
        finally:
            self.release(index)

    # --- the decode loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Step every decoding stream together until the engine closes; a failed step fails its streams."""
        try:
            while True:
                if not self.active:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
                # Steps whose experts all hit never suspend: let the loop serve what waits on it.
                await asyncio.sleep(0)
        except BaseException as exc:
            self._closed = exc
            for stream in list(self.active.values()):
                stream.queue.put_nowait(RuntimeError("the engine is closed") if isinstance(
                    exc, asyncio.CancelledError) else exc)
            self.line.fail_waiting(RuntimeError("the engine is closed"))
            raise

    async def _step(self) -> None:
        async with self.lock:
            streams = [s for s in self.active.values() if not s.left]
            if not streams:
                return
            t0 = time.perf_counter()
            self.net.step_unions = []   # the graphs' step fills it; a step of another path leaves it empty
            try:
                logits = await self.net.decode_batch([(s.index, s.pending) for s in streams])
            except Exception as exc:   # an I/O fault, a non-finite value: the streams of this step end with it
                for s in streams:
                    self.active.pop(s.index, None)
                    s.queue.put_nowait(exc)
                return
            unions = list(self.net.step_unions)
        for s, row in zip(streams, logits):
            if s.left:
                continue
            assert s.decoding is not None
            piece = s.decoding.piece(row)
            s.queue.put_nowait(piece)
            if piece.finish_reason is None:
                s.pending = int(piece.token)  # type: ignore[arg-type]
            else:
                self.active.pop(s.index, None)
        self.engine.decode_s += time.perf_counter() - t0
        self._count(len(streams), unions if len(streams) > 1 else [])

    def _count(self, rows: int, unions: list[int]) -> None:
        st = self.stats
        st.steps += 1
        st.rows += rows
        st.last_rows = rows
        if unions:
            st.union_sum += sum(unions)
            st.union_count += len(unions)
