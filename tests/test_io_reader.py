"""ExpertReader on a file of random bytes: every backend returns exactly what os.pread returns,
fallbacks engage when io_uring or its registration is refused, and faults are named."""
from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import structlog.testing
from gguf import GGMLQuantizationType

from colibri_aio.errors import ExpertReadError, ModelFormatError, UserError
from colibri_aio.experts import ExpertLocation
from colibri_aio.io import ExpertReader, ModelFileChangedError, ReaderClosedError
from colibri_aio.bench.locations import byte_range, random_locations
from colibri_aio.io import ring as ring_module
from colibri_aio.io.ring import Ring
from colibri_aio.io.uring import UringReactor
from support import requires_uring

pytestmark = requires_uring

BACKENDS = ["uring", "pread", "mmap"]
FILE_NBYTES = 6 << 20


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """Random bytes on the repo-or-/tmp file system (ext4 here, so O_DIRECT works)."""
    path = tmp_path / "experts.bin"
    path.write_bytes(np.random.default_rng(7).bytes(FILE_NBYTES + 123))  # not a multiple of 4096
    return path


def mixed_locations(size: int, count: int, seed: int = 0) -> list[ExpertLocation]:
    """Q8_0 and F32 experts at random offsets: GGUF's 32-byte alignment and odd offsets too."""
    rng = np.random.default_rng(seed)
    locs = random_locations(size, count // 2, rng, GGMLQuantizationType.Q8_0, (64, 256))
    locs += random_locations(size, count // 4, rng, GGMLQuantizationType.F32, (32, 64), offset_align=1)
    locs += random_locations(size, count - len(locs), rng, GGMLQuantizationType.Q8_0, (32, 96), offset_align=4096)
    return locs


def assert_exact(path: Path, loc: ExpertLocation, weights) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for tensor, rng in zip((weights.gate, weights.up, weights.down), loc.ranges):
            assert tensor.ggml_type == rng.ggml_type and tensor.shape == rng.shape
            assert tensor.data.tobytes() == os.pread(fd, rng.nbytes, rng.offset)
    finally:
        os.close(fd)


async def read_all_and_check(reader: ExpertReader, path: Path, locs: list[ExpertLocation]) -> None:
    """Every slot busy at once: one worker per slot reads its share of ``locs`` into it."""
    async def worker(slot: int) -> None:
        for loc in locs[slot::reader.n_slots]:
            assert_exact(path, loc, await reader.start(loc, slot))
    async with asyncio.timeout(30):
        await asyncio.gather(*(worker(slot) for slot in range(reader.n_slots)))
    assert reader.in_flight == 0 and not any(reader.in_kernel(s) for s in range(reader.n_slots))


def largest(locs: list[ExpertLocation]) -> int:
    return max(loc.nbytes for loc in locs)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
async def test_reads_are_byte_exact(model_file: Path, backend: str) -> None:
    locs = mixed_locations(FILE_NBYTES, 60)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=5, backend=backend)
    try:
        assert reader.backend == ("uring" if backend == "auto" else backend)
        assert reader.backend_reason
        await read_all_and_check(reader, model_file, locs)
        assert reader.stats.reads == len(locs)
        assert reader.stats.bytes == sum(loc.nbytes for loc in locs)
    finally:
        await reader.aclose()


async def test_auto_uses_o_direct_io_uring_here(model_file: Path) -> None:
    reader = await ExpertReader.open(model_file, 1 << 20, n_slots=2)
    try:
        assert (reader.backend, reader.registered, reader.direct) == ("uring", False, True)
        assert "unregistered" in reader.backend_reason
    finally:
        await reader.aclose()


async def test_registered_buffers_when_asked(model_file: Path) -> None:
    locs = mixed_locations(FILE_NBYTES, 12)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=3, register=True)
    try:
        assert (reader.backend, reader.registered) == ("uring", True) and "registered" in reader.backend_reason
        await read_all_and_check(reader, model_file, locs)
    finally:
        await reader.aclose()


async def test_punted_reads_are_byte_exact(model_file: Path) -> None:
    """IOSQE_ASYNC changes who issues a read, never its bytes."""
    locs = mixed_locations(FILE_NBYTES, 24)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=4, backend="uring", punt=True)
    try:
        await read_all_and_check(reader, model_file, locs)
        assert reader.stats.reads == len(locs)
    finally:
        await reader.aclose()


async def test_o_direct_refused_falls_back_to_buffered(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def tmpfs_like_open(path, flags, *args):  # tmpfs before Linux 6.6 refused O_DIRECT like this
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", tmpfs_like_open)
    locs = mixed_locations(FILE_NBYTES, 12)
    with structlog.testing.capture_logs() as logs:
        reader = await ExpertReader.open(model_file, largest(locs), n_slots=3, backend="uring")
    try:
        assert reader.direct is False
        assert "refuses O_DIRECT" in reader.file.direct_reason
        await read_all_and_check(reader, model_file, locs)
    finally:
        await reader.aclose()
    notices = [e for e in logs if e["log_level"] == "warning" and "O_DIRECT refused" in e["event"]]
    assert notices and notices[0]["path"] == str(model_file)


async def test_tmpfs_reads_are_exact_whatever_it_says_about_o_direct() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm tmpfs on this machine")
    path = shm / f"colibri-io-test-{os.getpid()}.bin"
    path.write_bytes(np.random.default_rng(3).bytes(1 << 20))
    try:
        locs = mixed_locations(1 << 20, 8, seed=3)
        reader = await ExpertReader.open(path, largest(locs), n_slots=2, backend="uring")
        try:
            await read_all_and_check(reader, path, locs)
        finally:
            await reader.aclose()
    finally:
        path.unlink()


async def test_registration_refused_falls_back_to_unregistered_reads(
        model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(ring, buffers):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(Ring, "register_buffers", refuse)
    locs = mixed_locations(FILE_NBYTES, 20)
    with structlog.testing.capture_logs() as logs:
        reader = await ExpertReader.open(model_file, largest(locs), n_slots=4, register=True)
    assert any(e["log_level"] == "warning" and "registration refused" in e["event"] for e in logs)
    try:
        assert (reader.backend, reader.registered) == ("uring", False)
        assert "unregistered" in reader.backend_reason and "ENOMEM" in reader.backend_reason
        await read_all_and_check(reader, model_file, locs)
    finally:
        await reader.aclose()


_NO_IPC_LOCK_SCRIPT = """
import asyncio, os, sys
import numpy as np
from colibri_aio.io import ExpertReader
from colibri_aio.bench.locations import random_locations
path = sys.argv[1]
async def main():
    locs = random_locations(os.path.getsize(path), 16, np.random.default_rng(5), shape=(64, 256))
    reader = await ExpertReader.open(path, max(l.nbytes for l in locs), n_slots=64, register=True)
    fd = os.open(path, os.O_RDONLY)
    for loc in locs:
        weights = await reader.start(loc, 0)
        for t, r in zip((weights.gate, weights.up, weights.down), loc.ranges):
            assert t.data.tobytes() == os.pread(fd, r.nbytes, r.offset)
    print(reader.backend, reader.registered)
    await reader.aclose()
asyncio.run(main())
"""


def test_registration_refused_without_cap_ipc_lock(model_file: Path) -> None:
    """A real refusal: drop CAP_IPC_LOCK and cap RLIMIT_MEMLOCK below the pool size."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to drop CAP_IPC_LOCK")
    cmd = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--",
           sys.executable, "-c",
           "import resource, sys, runpy; resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536)); "
           "sys.argv = sys.argv[1:]; exec(sys.argv[0])", _NO_IPC_LOCK_SCRIPT, str(model_file)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["uring", "False"], done.stdout + done.stderr
    assert "registration refused" in done.stdout + done.stderr


async def test_io_uring_setup_failure_falls_back_to_pread(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_io_uring(*args):  # what a seccomp filter or an old kernel says to io_uring_setup
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(ring_module, "_syscall", no_io_uring)
    locs = mixed_locations(FILE_NBYTES, 20)
    with structlog.testing.capture_logs() as logs:
        reader = await ExpertReader.open(model_file, largest(locs), n_slots=4, backend="auto")
    assert any(e["log_level"] == "warning" and "pread" in e["event"] for e in logs)
    try:
        assert reader.backend == "pread"
        assert "io_uring cannot be set up" in reader.backend_reason and "ENOSYS" in reader.backend_reason
        await read_all_and_check(reader, model_file, locs)
    finally:
        await reader.aclose()
    with pytest.raises(UserError, match="io_uring cannot be set up"):
        await ExpertReader.open(model_file, largest(locs), n_slots=4, backend="uring")


async def test_unknown_backend_and_missing_file_are_user_errors(model_file: Path) -> None:
    with pytest.raises(UserError, match="unknown I/O backend"):
        await ExpertReader.open(model_file, 1 << 20, 1, backend="aio")
    with pytest.raises(UserError, match="no such file"):
        await ExpertReader.open(model_file.with_name("missing.gguf"), 1 << 20, 1)


def inject_eio(monkeypatch: pytest.MonkeyPatch, backend: str, bad_offset: int) -> None:
    """Make the read that starts at ``bad_offset`` fail with EIO, as a failing disk would."""
    if backend == "uring":
        deliver = UringReactor._deliver

        def failing_deliver(self, request, res):
            if request.offset == bad_offset:
                res = -errno.EIO
            return deliver(self, request, res)

        monkeypatch.setattr(UringReactor, "_deliver", failing_deliver)
    else:
        preadv = os.preadv

        def failing_preadv(fd, buffers, offset, *args):
            if offset == bad_offset:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return preadv(fd, buffers, offset, *args)

        monkeypatch.setattr(os, "preadv", failing_preadv)


@pytest.mark.parametrize("backend", ["uring", "pread"])
async def test_io_error_names_file_offset_and_expert(model_file: Path, backend: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bad = ExpertLocation(7, 42, byte_range(8192 + 96, 5000), byte_range(65536, 4096), byte_range(200_000, 3000))
    good = mixed_locations(FILE_NBYTES, 6)
    inject_eio(monkeypatch, backend, bad_offset=65536)
    reader = await ExpertReader.open(model_file, 1 << 20, n_slots=3, backend=backend)
    try:
        with pytest.raises(ExpertReadError) as caught:
            await reader.start(bad, 1)
        err = caught.value
        assert (err.path, err.offset, err.length, err.layer, err.expert) == (str(model_file), 65536, 4096, 7, 42)
        assert "EIO" in str(err) and str(model_file) in str(err) and "expert 42" in str(err)
        assert not reader.in_kernel(1) and reader.stats.errors == 1  # the failed read's slot is free again
        await read_all_and_check(reader, model_file, good)  # and the reader still works
    finally:
        await reader.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_short_read_is_named(model_file: Path, backend: str) -> None:
    size = model_file.stat().st_size
    past_end = ExpertLocation(3, 9, byte_range(4096, 4096), byte_range(size - 1000, 1000), byte_range(size - 500, 800))
    reader = await ExpertReader.open(model_file, 1 << 20, n_slots=2, backend=backend)
    try:
        with pytest.raises(ExpertReadError, match="short read") as caught:
            await reader.start(past_end, 1)
        assert (caught.value.offset, caught.value.layer, caught.value.expert) == (size - 500, 3, 9)
        assert reader.in_flight == 0 and not reader.in_kernel(1)
    finally:
        await reader.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_file_changed_after_open_is_refused(model_file: Path, backend: str) -> None:
    locs = mixed_locations(FILE_NBYTES // 2, 4)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=2, backend=backend)
    try:
        await read_all_and_check(reader, model_file, locs)
        os.truncate(model_file, FILE_NBYTES // 2)
        with pytest.raises(ModelFileChangedError) as caught:
            await reader.start(locs[0], 0)
        assert isinstance(caught.value, ModelFormatError)
        message = str(caught.value)
        assert "\n" not in message and "changed since it was opened" in message and str(model_file) in message
    finally:
        await reader.aclose()


async def test_rewritten_file_same_size_is_refused(model_file: Path) -> None:
    reader = await ExpertReader.open(model_file, 1 << 20, n_slots=1)
    try:
        st = model_file.stat()
        os.utime(model_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(ModelFileChangedError, match="mtime"):
            await reader.start(mixed_locations(FILE_NBYTES, 1)[0], 0)
    finally:
        await reader.aclose()


async def test_reads_after_close_are_refused(model_file: Path) -> None:
    reader = await ExpertReader.open(model_file, 1 << 20, n_slots=1)
    await reader.aclose()
    with pytest.raises(ReaderClosedError):
        reader.start(mixed_locations(FILE_NBYTES, 1)[0], 0)
    await reader.aclose()  # closing twice is harmless


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_slot_is_refused_while_its_read_is_in_flight(model_file: Path, backend: str) -> None:
    loc, other = mixed_locations(FILE_NBYTES, 2)
    reader = await ExpertReader.open(model_file, 1 << 20, n_slots=2, backend=backend)
    try:
        first = reader.start(loc, 0)
        assert reader.in_kernel(0) and reader.in_flight == 1
        with pytest.raises(RuntimeError, match="slot 0 still has a read in flight"):
            reader.start(other, 0)
        with pytest.raises(ValueError, match="slot 2 is not one of"):
            reader.start(other, 2)
        assert_exact(model_file, loc, await first)
        assert not reader.in_kernel(0)
        assert_exact(model_file, other, await reader.start(other, 0))  # the slot is free again
    finally:
        await reader.aclose()


async def test_an_mmap_batch_reports_each_expert_and_a_bad_one_alone(model_file: Path) -> None:
    """One batch of the mmap reader (one advice, then each expert in turn): every good expert byte-exact and
    at its place in the mapping, the one past the end refused by name, the others unharmed."""
    size = model_file.stat().st_size
    locs = mixed_locations(FILE_NBYTES, 12)
    past_end = ExpertLocation(3, 9, byte_range(4096, 4096), byte_range(size - 1000, 1000), byte_range(size - 500, 800))
    items = [(loc, slot) for slot, loc in enumerate(locs)]
    items.insert(5, (past_end, len(locs)))
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=len(items), backend="mmap")
    try:
        futures = reader.start_many(items)
        async with asyncio.timeout(30):
            await asyncio.wait(futures)
        base, = reader.mapped_addresses()
        for (loc, _), future in zip(items, futures):
            if loc is past_end:
                with pytest.raises(ExpertReadError, match="short read"):
                    future.result()
                continue
            weights = future.result()
            assert_exact(model_file, loc, weights)
            assert [t.data.ctypes.data for t in (weights.gate, weights.up, weights.down)] == \
                [base + r.offset for r in loc.ranges]
        assert reader.in_flight == 0 and reader.stats.reads == len(locs)
    finally:
        await reader.aclose()


async def test_closing_the_mmap_reader_ends_a_batch_without_reading_the_rest(model_file: Path) -> None:
    locs = mixed_locations(FILE_NBYTES, 40)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=len(locs), backend="mmap")
    futures = reader.start_many([(loc, slot) for slot, loc in enumerate(locs)])
    async with asyncio.timeout(30):
        await reader.aclose()                       # at once: the batch's worker stops between experts
    assert reader.in_flight == 0 and all(f.done() for f in futures)
    for loc, f in zip(locs, futures):               # each expert either read whole or refused, none lost
        if f.exception() is None:
            assert_exact(model_file, loc, f.result())
        else:
            assert isinstance(f.exception(), (ExpertReadError, ReaderClosedError))


def _hold_every_read_but(reader: ExpertReader, free: ExpertLocation, read: list) -> threading.Event:
    """Make the mmap reader's workers stop before every expert but ``free`` until the returned event is set;
    each expert a worker starts on is appended to ``read``."""
    held, real = threading.Event(), reader._backend._fault_in

    def fault_in(loc: ExpertLocation):
        read.append(loc)
        if loc is not free:
            held.wait(30)
        return real(loc)

    reader._backend._fault_in = fault_in
    return held


async def let_go_then_all_exact(held: threading.Event, path: Path, locs: list[ExpertLocation], futures) -> None:
    """Let the held workers go on; each future then gives its expert's exact bytes."""
    held.set()
    async with asyncio.timeout(30):
        for loc, f in zip(locs, futures):
            assert_exact(path, loc, await f)


async def test_an_mmap_demand_read_does_not_wait_behind_other_batches(model_file: Path) -> None:
    """Both workers of the mmap reader busy with batches nobody waits for (a warm fill, a read-ahead): a demand
    read (``urgent``) is still brought in, by its own worker, before either batch moves on."""

    locs = mixed_locations(FILE_NBYTES, 7)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=len(locs), backend="mmap")
    demand_loc = locs[-1]
    held = _hold_every_read_but(reader, demand_loc, [])
    try:
        background = [*reader.start_many([(locs[i], i) for i in range(3)]),
                      *reader.start_many([(locs[i], i) for i in range(3, 6)])]
        demand, = reader.start_many([(demand_loc, 6)], urgent=True)
        async with asyncio.timeout(20):
            weights = await demand
        assert_exact(model_file, demand_loc, weights)
        assert not any(f.done() for f in background)
        await let_go_then_all_exact(held, model_file, locs, background)
    finally:
        held.set()
        await reader.aclose()


async def test_a_queued_mmap_read_promoted_is_read_at_once_and_only_once(model_file: Path) -> None:
    """An expert queued in a batch nobody waited for, promoted when the model comes to wait for it: the demand
    worker reads it while the batch is held, its batch's worker skips it, and it is reported exactly once."""

    locs = mixed_locations(FILE_NBYTES, 8)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=len(locs), backend="mmap")
    promoted_loc, read = locs[7], []
    held = _hold_every_read_but(reader, promoted_loc, read)
    try:
        futures = [*reader.start_many([(locs[i], i) for i in range(4)]),
                   *reader.start_many([(locs[i], i) for i in range(4, 8)])]   # the promoted one queued last
        reader.promote(7)
        reader.promote(7)                                                        # twice: still one read
        async with asyncio.timeout(20):
            assert_exact(model_file, promoted_loc, await futures[7])
        assert not any(f.done() for f in futures[:7])
        held.set()
        async with asyncio.timeout(30):
            for loc, f in zip(locs, futures):
                assert_exact(model_file, loc, await f)
        assert sum(loc is promoted_loc for loc in read) == 1 and reader.stats.reads == len(locs)
    finally:
        held.set()
        await reader.aclose()


def test_madvise_without_the_gil_populates_and_names_a_refusal(model_file: Path) -> None:
    """io.madvise: MADV_POPULATE_READ through libc brings a mapping's pages in (the bytes read through the
    mapping are the file's), and a refused call (an address that is not page-aligned) is an OSError with
    the call's errno, as mmap.madvise's would be."""
    import mmap as mmap_module

    from colibri_aio.io.backends import MADV_POPULATE_READ
    from colibri_aio.io.madvise import address_of, madvise

    with open(model_file, "rb") as f, mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_READ) as mapped:
        base = address_of(mapped)
        try:
            madvise(base, 1 << 20, MADV_POPULATE_READ)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                pytest.skip("a kernel older than 5.14: no MADV_POPULATE_READ (the reader touches pages instead)")
            raise
        assert mapped[:1 << 20] == model_file.read_bytes()[:1 << 20]
        with pytest.raises(OSError) as refused:
            madvise(base + 1, 4096, MADV_POPULATE_READ)
        assert refused.value.errno == errno.EINVAL


async def test_a_warm_batch_is_advised_one_window_ahead_of_its_worker(model_file: Path, monkeypatch) -> None:
    """A batch nobody waits for soon (``background``: the warm start's) is advised a window at a time, each
    window once the worker has begun the one before: while the worker is held on its first expert, only the
    first two windows are queued at the device, not the whole batch; every expert still arrives exact."""
    from colibri_aio.io import backends

    locs = random_locations(FILE_NBYTES, 10, np.random.default_rng(3), GGMLQuantizationType.Q8_0, (64, 256))
    monkeypatch.setattr(backends, "BACKGROUND_LEAD", 2 * locs[0].nbytes)  # windows of one expert
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=len(locs), backend="mmap")
    advised: list[int] = []
    real_advise = reader._backend._advise

    def advise(spans):
        advised.append(len(spans))
        real_advise(spans)

    reader._backend._advise = advise
    held = _hold_every_read_but(reader, None, [])
    try:
        futures = reader.start_many([(loc, slot) for slot, loc in enumerate(locs)], background=True)
        async with asyncio.timeout(20):
            while len(advised) < 2:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the advisor had time to run ahead, were it not paced
        assert len(advised) == 2
        await let_go_then_all_exact(held, model_file, locs, futures)
    finally:
        held.set()
        await reader.aclose()


async def test_an_mmap_batch_whose_worker_fails_ends_every_read_it_left(model_file: Path, monkeypatch) -> None:
    """A fault in the mmap reader's own batch code (not the disk's) ends each expert of the batch as a failed
    read naming it, instead of leaving its waiters waiting forever."""
    from colibri_aio.io.backends import MmapBackend

    def broken(self, jobs, loop, pace) -> None:
        raise RuntimeError("a fault of the batch code")

    monkeypatch.setattr(MmapBackend, "_fault_in_each", broken)
    locs = mixed_locations(FILE_NBYTES, 6)
    reader = await ExpertReader.open(model_file, largest(locs), n_slots=len(locs), backend="mmap")
    try:
        for urgent, background in ((True, False), (False, False), (False, True)):
            futures = reader.start_many([(loc, slot) for slot, loc in enumerate(locs)], urgent, background)
            async with asyncio.timeout(20):
                for loc, future in zip(locs, futures):
                    with pytest.raises(ExpertReadError, match=f"expert {loc.expert}.*a fault of the batch code"):
                        await future
        assert reader.in_flight == 0
    finally:
        await reader.aclose()
