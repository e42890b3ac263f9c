"""The model's block device, watched through ``/proc/diskstats`` the way iostat does: one monitor per engine.

:class:`DeviceMonitor` is the only reader of ``/proc/diskstats``: its loop
hands the scheduler policy one :class:`~colibri_aio.policy.backpressure.DeviceSample`
per period, and telemetry reads the same monitor at its own interval ends.
Parsing and the delta between two snapshots are pure functions. The fields
(Documentation/admin-guide/iostats.rst) after major, minor and name are:
reads completed, reads merged, sectors read, ms reading, writes completed,
writes merged, sectors written, ms writing, I/Os in progress, ms doing I/O
(io_ticks), weighted ms doing I/O (time_in_queue), then discard and flush
fields on newer kernels, which we do not need. Sectors are 512 bytes.

Derived like ``iostat -x``: ``util`` = Δio_ticks / Δt, ``r_await`` =
Δms_reading / Δreads, ``aqu_sz`` = Δtime_in_queue / Δt, ``read_bps`` =
Δsectors_read × 512 / Δt. On virtual disks util saturates well before the
device does, so the backpressure controller trusts util only together with
its own measurements.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from colibri_aio.policy.backpressure import DeviceSample

SECTOR = 512
PERIOD = 0.25  # seconds between samples: the backpressure controller's window


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """One device's cumulative counters from one ``/proc/diskstats`` line."""

    reads: int
    sectors_read: int
    ms_reading: int
    writes: int
    in_flight: int
    io_ticks_ms: int
    time_in_queue_ms: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A device's counters read at monotonic time ``t``."""

    counters: DiskCounters
    t: float


def parse_diskstats(text: str) -> dict[str, DiskCounters]:
    """Counters of every device in a ``/proc/diskstats`` text, by device name."""
    out: dict[str, DiskCounters] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 14:
            continue
        v = [int(x) for x in f[3:14]]
        out[f[2]] = DiskCounters(reads=v[0], sectors_read=v[2], ms_reading=v[3], writes=v[4],
                                 in_flight=v[8], io_ticks_ms=v[9], time_in_queue_ms=v[10])
    return out


def device_delta(before: DiskCounters, after: DiskCounters, start: float, end: float) -> DeviceSample:
    """iostat-style load between two snapshots taken at monotonic times ``start`` and ``end``."""
    dt = end - start
    if dt <= 0:
        raise ValueError("snapshots must be taken at increasing times")
    ms = dt * 1000.0
    reads = after.reads - before.reads
    return DeviceSample(
        end=end, interval=dt,
        util=min(1.0, (after.io_ticks_ms - before.io_ticks_ms) / ms),
        r_await_ms=(after.ms_reading - before.ms_reading) / reads if reads > 0 else 0.0,
        aqu_sz=(after.time_in_queue_ms - before.time_in_queue_ms) / ms,
        read_bps=(after.sectors_read - before.sectors_read) * SECTOR / dt,
        reads=reads,
    )


def between(before: Snapshot | None, after: Snapshot | None) -> DeviceSample | None:
    """The load from one snapshot to a later one; None when either is missing or no time passed."""
    if before is None or after is None or after.t <= before.t:
        return None
    return device_delta(before.counters, after.counters, before.t, after.t)


def read_diskstats(path: str = "/proc/diskstats") -> str:
    """The current ``/proc/diskstats`` text ('' where the file does not exist)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return ""


def device_of(path: str | os.PathLike[str]) -> str | None:
    """The block device (whole disk, not partition) holding ``path``, or ``None``.

    ``None`` for files on overlay, tmpfs or network filesystems, whose st_dev
    names no block device: the controller then runs on its own measurements.
    """
    dev = os.stat(path).st_dev
    sys_dir = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.isdir(sys_dir):
        return None
    real = os.path.realpath(sys_dir)
    # A partition's sysfs directory sits inside its disk's and has a "partition" file.
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


class DeviceMonitor:
    """Reads one block device's counters; :meth:`run` feeds ``on_sample`` every ``period`` seconds."""

    def __init__(self, device: str, on_sample: Callable[[DeviceSample], None] | None = None, *,
                 period: float = PERIOD, source: Callable[[], str] = read_diskstats) -> None:
        self.device, self.period = device, period
        self._on_sample = on_sample
        self._source = source

    @classmethod
    def for_path(cls, path: str | os.PathLike[str], on_sample: Callable[[DeviceSample], None] | None = None,
                 ) -> "DeviceMonitor | None":
        """A monitor of the disk holding ``path``; None where the file system names no block device."""
        device = device_of(path)
        return None if device is None else cls(device, on_sample)

    def read(self) -> Snapshot | None:
        """The device's counters now (None if the device is absent from ``/proc/diskstats``)."""
        counters = parse_diskstats(self._source()).get(self.device)
        return None if counters is None else Snapshot(counters, time.perf_counter())

    async def run(self) -> None:
        """Sample every ``period`` seconds and hand each interval's load to ``on_sample``, until cancelled."""
        last = self.read()
        while True:
            await asyncio.sleep(self.period)
            now = self.read()
            sample = between(last, now)
            if sample is not None and self._on_sample is not None:
                self._on_sample(sample)
            last = now if now is not None else last
