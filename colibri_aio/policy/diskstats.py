"""Device load from ``/proc/diskstats``, computed the way iostat does.

Parsing and the delta between two snapshots are pure functions; only
:func:`read_diskstats` and :func:`device_of` touch the system. The fields
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

import os
from dataclasses import dataclass

SECTOR = 512


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
class DeviceSample:
    """A device's load over one interval of ``interval`` seconds ending at ``end``."""

    end: float
    interval: float
    util: float       # fraction of the interval with at least one I/O in flight (0..1)
    r_await_ms: float  # mean read latency; 0 when there were no reads
    aqu_sz: float      # mean number of requests queued or in service
    read_bps: float    # bytes read per second
    reads: int


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


class DiskstatsSampler:
    """Turns successive ``/proc/diskstats`` texts into samples of one device (no I/O itself)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._prev: tuple[DiskCounters, float] | None = None

    def sample(self, text: str, now: float) -> DeviceSample | None:
        """The load since the previous call; ``None`` on the first call or if the device is absent."""
        counters = parse_diskstats(text).get(self.device)
        if counters is None:
            return None
        prev, self._prev = self._prev, (counters, now)
        if prev is None or now <= prev[1]:
            return None
        return device_delta(prev[0], counters, prev[1], now)
