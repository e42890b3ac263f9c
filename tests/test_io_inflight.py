"""Reads in flight: cancellation, close, the streaming ExpertSource, and event-loop responsiveness."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.errors import ExpertReadError
from colibri_aio.experts import ExpertLocation
from colibri_aio.io import ExpertReader, ReaderClosedError, SlotState, StreamingExpertSource
from colibri_aio.io.pool import BufferPool
from colibri_aio.bench.locations import bench_locations, byte_range

pytest.importorskip("liburing")

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


def watch_slot_releases(monkeypatch: pytest.MonkeyPatch, reader: ExpertReader) -> list[str]:
    """Record every release of a slot the kernel may still be writing into."""
    violations: list[str] = []
    release = BufferPool.release

    def checked_release(pool: BufferPool, slot) -> None:
        if slot.state is SlotState.KERNEL:
            violations.append(f"slot {slot.index} released in the kernel's hands")
        backend = reader._backend
        reactor = getattr(backend, "reactor", None)
        if reactor is not None:
            for request in reactor._table.values():
                if slot.address <= request.address < slot.address + slot.nbytes:
                    violations.append(f"slot {slot.index} released with a read still in the ring")
        release(pool, slot)

    monkeypatch.setattr(BufferPool, "release", checked_release)
    return violations


async def collect_loop_errors() -> list[dict]:
    """Errors raised in loop callbacks (a slot released too early would show up here)."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    return errors


@pytest.mark.parametrize("backend", ["uring", "pread"])
async def test_cancelled_reads_keep_their_slots_until_the_kernel_is_done(
        model_file: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    errors = await collect_loop_errors()
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=4, backend=backend)
    violations = watch_slot_releases(monkeypatch, reader)
    try:
        tasks = [asyncio.create_task(reader.read(loc)) for loc in locations(6, seed=1)]
        await asyncio.sleep(0)   # the tasks take slots and queue their reads
        await asyncio.sleep(0)   # the reads are submitted
        in_flight_at_cancel = reader.in_flight
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert in_flight_at_cancel > 0, "no read was in flight when cancelled: the test proved nothing"
        # Cancelled, yet the slots of unfinished reads are still the kernel's.
        kernel_held = reader.pool.count(SlotState.KERNEL)
        assert reader.pool.available + kernel_held == reader.pool.n_slots
        assert kernel_held == reader.in_flight
        await reader.drained()
        assert reader.pool.available == reader.pool.n_slots
        # Late completions wrote nothing into slots now serving other experts.
        fresh = locations(8, seed=2)
        leases = await asyncio.gather(*(reader.read(loc) for loc in fresh[:4]))
        for loc, lease in zip(fresh, leases):
            assert exact(model_file, loc, lease.weights)
            lease.release()
    finally:
        await reader.aclose()
    assert violations == [] and errors == []


@pytest.mark.parametrize("backend", ["uring", "pread", "mmap"])
async def test_close_drains_reads_in_flight(model_file: Path, backend: str) -> None:
    errors = await collect_loop_errors()
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=6, backend=backend)
    locs = locations(8, seed=3)  # more reads than slots: two wait for a slot
    tasks = [asyncio.create_task(reader.read(loc)) for loc in locs]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await reader.aclose()
    assert reader.in_flight == 0
    if reader.pool is not None:
        assert reader.pool.count(SlotState.KERNEL) == 0
    # Every waiter hears that the reader closed; none is handed bytes from a closed pool.
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ReaderClosedError) for r in results), results
    assert errors == []


async def test_stream_yields_every_expert_once_and_returns_every_slot(model_file: Path) -> None:
    locs = locations(8, seed=4)
    table = {(0, loc.expert): loc for loc in locs}
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=3)
    source = StreamingExpertSource(reader, table)
    try:
        seen = []
        async with source.stream(0, [7, 2, 5, 0, 1]) as stream:
            async for expert, weights in stream:
                assert exact(model_file, table[(0, expert)], weights)
                assert reader.pool.available + reader.pool.count(SlotState.KERNEL) <= 2  # one is ours
                seen.append(expert)
        assert sorted(seen) == [0, 1, 2, 5, 7]
        assert reader.pool.available == 3
    finally:
        await source.aclose()


async def test_stream_stopped_early_or_cancelled_leaks_nothing(model_file: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    errors = await collect_loop_errors()
    locs = locations(8, seed=5)
    table = {(1, loc.expert): loc for loc in locs}
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=8)
    violations = watch_slot_releases(monkeypatch, reader)
    source = StreamingExpertSource(reader, table)
    try:
        async with source.stream(1, range(8)) as stream:
            async for _expert, _weights in stream:
                break  # the rest are still in flight or unconsumed
        await reader.drained()
        assert reader.pool.available == 8

        started = asyncio.Event()

        async def consumer() -> None:
            async for _expert, _weights in source.stream(1, range(8)):
                started.set()
                await asyncio.sleep(3600)  # stuck in compute; then cancelled

        task = asyncio.create_task(consumer())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await reader.drained()
        await asyncio.sleep(0)
        assert reader.pool.available == 8
    finally:
        await source.aclose()
    assert violations == [] and errors == []


async def test_stream_surfaces_a_read_error_and_releases_the_rest(model_file: Path) -> None:
    locs = locations(4, seed=6)
    broken = ExpertLocation(2, 99, byte_range(0, 4096), byte_range(FILE_NBYTES - 100, 4096), byte_range(8192, 4096))
    table = {(2, loc.expert): loc for loc in locs} | {(2, 99): broken}
    reader = await ExpertReader.open(model_file, EXPERT_NBYTES, n_slots=5)
    source = StreamingExpertSource(reader, table)
    try:
        with pytest.raises(ExpertReadError, match="expert 99"):
            async with source.stream(2, [0, 1, 99, 2, 3]) as stream:
                async for _expert, _weights in stream:
                    pass
        await reader.drained()
        await asyncio.sleep(0)
        assert reader.pool.available == 5
    finally:
        await source.aclose()


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

        async def one(loc: ExpertLocation) -> None:
            (await reader.read(loc)).release()

        try:
            tick = asyncio.create_task(ticker())
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                round_ = asyncio.gather(*(one(loc) for loc in locs))
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                peak = max(peak, reader.in_flight)
                await round_
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
    # The machine is shared: another tenant can delay any process's wake-up. The
    # loop's own CPU per tick is ours alone and must stay low on every attempt;
    # wall-clock lateness gets three ~1 s attempts to find a quiet moment.
    attempts = []
    for _ in range(3):
        lag_p99, busy_p99, peak = ticker_lag(factory, model_file)
        assert peak == 32
        assert busy_p99 <= 0.020, f"the loop itself was busy {busy_p99 * 1e3:.1f} ms per tick (p99)"
        attempts.append(lag_p99)
        if lag_p99 <= 0.020:
            break
    assert min(attempts) <= 0.020, f"p99 ticker lag per attempt: {[round(a * 1e3, 1) for a in attempts]} ms"


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
        leases = await asyncio.gather(*(reader.read(loc) for loc in locs))
        for loc, lease in zip(locs, leases):
            assert exact(model_file, loc, lease.weights)
            lease.release()
    finally:
        await reader.aclose()
    assert 2 <= peaks["reads"] <= 8
    assert peaks["bytes"] <= 1 << 20


async def test_reactor_reaps_every_completion_behind_coalesced_wakeups(model_file: Path) -> None:
    """Many completions, few eventfd wake-ups: each wake-up must drain the whole queue or reads hang."""
    from colibri_aio.io.uring import UringReactor

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
        for slot in pool.slots:
            reactor.submit(fd, slot.address, 4096, slot.index * 8192, None,
                           lambda res, i=slot.index: results.__setitem__(i, res))
        await asyncio.sleep(0)  # the batch goes to the kernel
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
        for slot in pool.slots:
            slot.state = SlotState.LEASED
        pool.close()
