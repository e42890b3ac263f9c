"""Reads in flight: cancellation, close, synchronous submission, and event-loop responsiveness."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.experts import ExpertLocation
from colibri_aio.io import ExpertReader, ReaderClosedError
from colibri_aio.io.pool import BufferPool
from colibri_aio.bench.locations import bench_locations
from support import requires_uring

pytestmark = requires_uring

FILE_NBYTES = 48 << 20
EXPERT_NBYTES = 1 << 20


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inflight") / "experts.bin"
    path.write_bytes(np.random.default_rng(11).bytes(FILE_NBYTES))
    return path


def locations(count: int, seed: int, expert_nbytes: int = EXPERT_NBYTES) -> list[ExpertLocation]:
    return bench_locations(FILE_NBYTES, expert_nbytes, count, "rand", np.random.default_rng(seed))


def exact(path: Path, loc: ExpertLocation, weights) -> bool:
    with open(path, "rb", buffering=0) as f:
        return all(t.data.tobytes() == os.pread(f.fileno(), r.nbytes, r.offset)
                   for t, r in zip((weights.gate, weights.up, weights.down), loc.ranges))


async def collect_loop_errors() -> list[dict]:
    """Errors raised in loop callbacks (a slot released too early would show up here)."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    return errors


@pytest.mark.parametrize("backend", ["uring", "pread"])
async def test_cancelled_reads_keep_their_slots_until_the_kernel_is_done(model_file: Path, backend: str) -> None:
    errors = await collect_loop_errors()
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=4, backend=backend)
    try:
        futures = [reader.start(loc, slot) for slot, loc in enumerate(locations(4, seed=1))]
        in_flight_at_cancel = reader.in_flight   # submitted when start() returned: no loop turn needed
        for future in futures:
            future.cancel()
        assert in_flight_at_cancel == 4, "the reads were not in flight when cancelled: the test proved nothing"
        # Cancelled, yet the slots of unfinished reads are still the kernel's, and refused.
        busy = [s for s in range(4) if reader.in_kernel(s)]
        assert len(busy) == reader.in_flight > 0
        with pytest.raises(RuntimeError, match="in flight"):
            reader.start(locations(1, seed=2)[0], busy[0])
        await reader.drained()
        assert not any(reader.in_kernel(s) for s in range(4))
        # Late completions wrote nothing into the slots now serving other experts.
        fresh = locations(4, seed=2)
        got = await asyncio.gather(*(reader.start(loc, slot) for slot, loc in enumerate(fresh)))
        for loc, weights in zip(fresh, got):
            assert exact(model_file, loc, weights)
    finally:
        await reader.aclose()
    assert errors == []


@pytest.mark.parametrize("backend", ["uring", "pread", "mmap"])
async def test_close_drains_reads_in_flight(model_file: Path, backend: str) -> None:
    errors = await collect_loop_errors()
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=6, backend=backend)
    futures = [reader.start(loc, slot) for slot, loc in enumerate(locations(6, seed=3))]
    waiters = [asyncio.ensure_future(f) for f in futures]
    await reader.aclose()
    assert reader.in_flight == 0 and not any(reader.in_kernel(s) for s in range(6))
    # Every waiter hears that the reader closed; none is handed bytes from a closed pool.
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, ReaderClosedError) for r in results), results
    assert errors == []


async def test_reads_reach_the_kernel_before_start_returns(model_file: Path) -> None:
    """Compute that follows start() without yielding to the loop overlaps the reads: they are already submitted."""
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=8, backend="uring")
    try:
        reactor = reader._backend.reactor
        submits = reactor.submits
        futures = [reader.start(loc, slot) for slot, loc in enumerate(locations(8, seed=4))]
        assert reactor.in_flight == 3 * 8 and reactor.queued == 0   # three ranges per expert, all in the ring
        assert reactor.submits == submits + 8                         # one io_uring_submit per expert
        time.sleep(0.2)  # "compute": the loop does not run, the disk does
        async with asyncio.timeout(10):
            await asyncio.gather(*futures)
    finally:
        await reader.aclose()


def ticker_lag(loop_factory, model_file: Path) -> tuple[float, float, int]:
    """A 10 ms ticker on the loop while rounds of 32 reads of 4 MiB are in flight, for ~1 s.

    Returns the p99 of the ticker's lateness (wall clock), the p99 of the CPU
    time the loop thread spent per tick interval (our own blocking, whatever
    else runs on the machine) and the most reads seen in flight at once.
    """
    async def main() -> tuple[float, float, int]:
        locs = bench_locations(FILE_NBYTES, 4 << 20, 32, "rand", np.random.default_rng(8))
        reader = await ExpertReader.open(model_file, 4 << 20, n_slots=32, backend="uring")
        lags: list[float] = []
        busy: list[float] = []
        peak = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                wall, cpu = time.perf_counter(), time.thread_time()
                await asyncio.sleep(0.010)
                lags.append(time.perf_counter() - wall - 0.010)
                busy.append(time.thread_time() - cpu)

        try:
            # One round first: the pool's pages are populated by the reads that first land in them
            # (io/pool.py), and on a machine whose memory is fragmented the kernel may compact memory
            # for those huge pages inside the submitting call. That is a one-time cost of a fresh
            # pool, not of reads in flight, which is what the ticker measures.
            await asyncio.gather(*(reader.start(loc, slot) for slot, loc in enumerate(locs)))
            tick = asyncio.create_task(ticker())
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                round_ = [reader.start(loc, slot) for slot, loc in enumerate(locs)]
                peak = max(peak, reader.in_flight)
                await asyncio.gather(*round_)
            stop.set()
            await tick
        finally:
            await reader.aclose()
        return float(np.percentile(lags, 99)), float(np.percentile(busy, 99)), peak

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_event_loop_stays_responsive_with_32_reads_of_4mib_in_flight(model_file: Path, loop_kind: str) -> None:
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    # The machine is shared: another tenant can delay any process's wake-up, and the kernel
    # can charge the loop thread for its own work (reclaim, compaction) at any moment. So
    # one ~1 s attempt of three must find a quiet moment in which both the loop's own CPU
    # per tick and the ticker's wall-clock lateness stay under 20 ms at p99. A loop that
    # blocks on every round of reads (a round lasts a few ticks) fails all three.
    attempts = []
    for _ in range(3):
        lag_p99, busy_p99, peak = ticker_lag(factory, model_file)
        assert peak == 32
        attempts.append((round(lag_p99 * 1e3, 1), round(busy_p99 * 1e3, 1)))
        if lag_p99 <= 0.020 and busy_p99 <= 0.020:
            break
    else:
        pytest.fail(f"p99 ticker lag and loop CPU per tick (ms) in each attempt: {attempts}")


async def test_in_flight_reads_are_bounded_by_ring_size_and_bytes(model_file: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from colibri_aio.io.uring import UringReactor

    peaks = {"reads": 0, "bytes": 0}
    prepare = UringReactor._prepare

    def watched_prepare(self, sqe, request) -> None:
        prepare(self, sqe, request)
        peaks["reads"] = max(peaks["reads"], len(self._table))
        peaks["bytes"] = max(peaks["bytes"], self._inflight_bytes)

    monkeypatch.setattr(UringReactor, "_prepare", watched_prepare)
    locs = locations(12, seed=9)  # 36 kernel reads of ~350 KiB
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=12, backend="uring",
                                     ring_entries=8, max_inflight_bytes=1 << 20)
    try:
        got = await asyncio.gather(*(reader.start(loc, slot) for slot, loc in enumerate(locs)))
        for loc, weights in zip(locs, got):
            assert exact(model_file, loc, weights)
    finally:
        await reader.aclose()
    assert 2 <= peaks["reads"] <= 8
    assert peaks["bytes"] <= 1 << 20


async def test_reactor_reaps_every_completion_behind_coalesced_wakeups(model_file: Path) -> None:
    """Many completions, few eventfd wake-ups: each wake-up must drain the whole queue or reads hang."""
    from colibri_aio.io.uring import RingRead, UringReactor

    pool = BufferPool(4096, 64)
    reactor = UringReactor.create(entries=64)
    results: dict[int, int] = {}
    fd = os.open(model_file, os.O_RDONLY)
    wakeups = 0
    on_wake = reactor._on_wake

    def counted_wake() -> None:
        nonlocal wakeups
        wakeups += 1
        on_wake()

    loop = asyncio.get_running_loop()
    loop.remove_reader(reactor._eventfd)
    loop.add_reader(reactor._eventfd, counted_wake)
    try:
        reactor.submit(*(RingRead(fd, ((slot.address, 4096),), slot.index * 8192, None,
                                  lambda res, i=slot.index: results.__setitem__(i, res)) for slot in pool.slots))
        time.sleep(0.3)  # the loop looks away while all 64 complete: their wake-ups coalesce
        async with asyncio.timeout(10):
            await reactor.drained()
        assert sorted(results) == list(range(64)) and set(results.values()) == {4096}
        assert wakeups <= 2
        for slot in pool.slots:
            assert bytes(slot.view[:4096]) == os.pread(fd, 4096, slot.index * 8192)
    finally:
        await reactor.aclose()
        os.close(fd)
        pool.close()


async def test_room_a_completion_frees_goes_to_queued_reads_before_its_callback_runs(model_file: Path) -> None:
    """The device's queue is refilled from the completion itself, not after the waiter's callback (or task) ran."""
    from colibri_aio.io.uring import RingRead, UringReactor

    pool = BufferPool(1 << 20, 3)
    reactor = UringReactor.create(entries=8, max_inflight_bytes=1 << 20)  # room for one read at a time
    fd = os.open(model_file, os.O_RDONLY)
    seen: list[tuple[int, int, int]] = []  # (read, in flight, queued) as each callback runs

    def on_complete(index: int, res: int) -> None:
        assert res == 1 << 20
        seen.append((index, reactor.in_flight, reactor.queued))

    try:
        reactor.submit(*(RingRead(fd, ((slot.address, 1 << 20),), slot.index << 21, None,
                                  lambda res, i=slot.index: on_complete(i, res)) for slot in pool.slots))
        assert (reactor.in_flight, reactor.queued) == (1, 2)
        async with asyncio.timeout(10):
            await reactor.drained()
        # When read 0's callback runs, read 1 is already the kernel's, and so on down the queue.
        assert seen == [(0, 1, 1), (1, 1, 0), (2, 0, 0)]
        for slot in pool.slots:
            assert bytes(slot.view[:1 << 20]) == os.pread(fd, 1 << 20, slot.index << 21)
    finally:
        await reactor.aclose()
        os.close(fd)
        pool.close()
