"""The io_uring binding over the raw system calls: setup, every read opcode the reactor uses, wrap-around, errors."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.io import ring as R
from support import requires_uring

pytestmark = requires_uring


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(11).bytes(1 << 20)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


@pytest.fixture(params=["plain", "atomics"])
def ordering(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of ordering the ring's head and tail: plain (x86's TSO) and libatomic's acquire/release."""
    if request.param == "atomics":
        if R._libatomic_lib() is None:
            pytest.skip("libatomic.so.1 is not installed")
        monkeypatch.setattr(R, "FORCE_ATOMICS", True)
    return request.param


def aligned(nbytes: int) -> tuple[mmap.mmap, int]:
    """Page-aligned anonymous memory and its address."""
    mem = mmap.mmap(-1, nbytes)
    anchor = ctypes.c_char.from_buffer(mem)
    address = ctypes.addressof(anchor)
    del anchor
    return mem, address


def run(ring: R.Ring, count: int) -> dict[int, int]:
    """Submit what is prepared, wait for ``count`` completions, return them by user_data."""
    ring.submit(wait=count)
    got: dict[int, int] = {}
    while len(got) < count:
        got.update(ring.completions())
        if len(got) < count:
            ring.submit(wait=1)
    return got


def test_self_test_passes_here() -> None:
    assert "a read checked" in R.self_test()


def test_readv_read_fixed_and_readv_fixed_deliver_the_file_bytes(data_file: tuple[Path, bytes], ordering: str) -> None:
    path, data = data_file
    ring = R.Ring(16)
    mem, base = aligned(1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        ring.register_buffers([(base, 1 << 20)])
        readv = R.Iovecs(2)
        readv.point(0, base, 4096)
        readv.point(1, base + 8192, 100)
        assert ring.prep(R.IORING_OP_READV, fd, readv.address, 2, 4096, 1)
        assert ring.prep(R.IORING_OP_READ_FIXED, fd, base + 65536, 5000, 12345, 2, buf_index=0)
        ops = ring.supported_ops()
        fixedv = R.Iovecs(2)
        fixedv.point(0, base + 200_000, 3000)
        fixedv.point(1, base + 300_000, 7000)
        if R.IORING_OP_READV_FIXED in ops:
            assert ring.prep(R.IORING_OP_READV_FIXED, fd, fixedv.address, 2, 777, 3, buf_index=0)
        got = run(ring, 3 if R.IORING_OP_READV_FIXED in ops else 2)
        assert got[1] == 4096 + 100 and got[2] == 5000
        assert mem[:4096] == data[4096:8192] and mem[8192:8292] == data[8192:8292]
        assert mem[65536:65536 + 5000] == data[12345:12345 + 5000]
        if R.IORING_OP_READV_FIXED in ops:
            assert got[3] == 10000
            assert mem[200_000:203_000] == data[777:3777] and mem[300_000:307_000] == data[3777:10777]
    finally:
        os.close(fd)
        ring.close()
        mem.close()


def test_the_rings_wrap_around_many_times(data_file: tuple[Path, bytes], ordering: str) -> None:
    """A 4-entry ring through 1000 reads: indices past 2**k and the CQ head must wrap with the mask."""
    path, data = data_file
    ring = R.Ring(4)
    assert ring.entries == 4
    fd = os.open(path, os.O_RDONLY)
    bufs = [ctypes.create_string_buffer(512) for _ in range(4)]
    iovecs = [R.Iovecs(1) for _ in range(4)]
    try:
        done = 0
        token = 0
        while done < 1000:
            batch = []
            for i in range(4):
                iovecs[i].point(0, ctypes.addressof(bufs[i]), 512)
                offset = (token * 4099) % (len(data) - 512)
                assert ring.prep(R.IORING_OP_READV, fd, iovecs[i].address, 1, offset, token)
                batch.append((i, offset, token))
                token += 1
            assert not ring.prep(R.IORING_OP_NOP, -1, 0, 0, 0, 99)  # full: no fifth SQE
            got = run(ring, 4)
            for i, offset, t in batch:
                assert got[t] == 512 and bufs[i].raw == data[offset:offset + 512]
            done += 4
    finally:
        os.close(fd)
        ring.close()


def test_a_failed_read_completes_with_minus_errno() -> None:
    ring = R.Ring(4)
    buf = ctypes.create_string_buffer(64)
    iov = R.Iovecs(1)
    iov.point(0, ctypes.addressof(buf), 64)
    r, w = os.pipe()
    os.close(r)
    os.close(w)  # a closed descriptor
    try:
        ring.prep(R.IORING_OP_READV, r, iov.address, 1, 0, 7)
        assert run(ring, 1) == {7: -errno.EBADF}
    finally:
        ring.close()


def test_registering_more_than_memlock_allows_is_an_oserror_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = R.Ring(4)
    try:
        with pytest.raises(OSError):
            ring.register_buffers([(0, 1 << 20)])  # address 0 is no one's memory: EFAULT
    finally:
        ring.close()
    ring.close()  # idempotent


def test_an_architecture_it_does_not_know_is_refused_before_any_system_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R.platform, "machine", lambda: "pdp11")
    assert "pdp11" in str(R.unsupported_reason())
    with pytest.raises(OSError) as err:
        R.Ring(4)
    assert err.value.errno == errno.ENOSYS


def test_without_libatomic_a_weakly_ordered_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(R, "_libatomic_lib", lambda: None)
    assert "libatomic" in str(R.unsupported_reason())


def test_no_library_binary_is_involved() -> None:
    """The binding is Python over syscall(2): the only shared object it loads is the C library."""
    import colibri_aio.io.ring as module
    assert Path(module.__file__).suffix == ".py"
    source = Path(module.__file__).read_text()
    assert "import liburing" not in source
