"""What the block device saw during a measurement: requests, their size, and how many were in flight.

``/sys/block/<disk>/stat`` counts, per device, completed read requests
(after the block layer has split and merged them), sectors read, and the sum
over time of the requests in flight (``time_in_queue``, ms). Two snapshots
around a measurement give what ``iostat -x`` calls ``r/s``, ``rareq-sz`` and
``aqu-sz``: how many requests one of our reads became, how large they were,
and how deep the device's queue was on average. The counters are the whole
device's, so other processes' I/O during the window is counted too.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SECTOR = 512  # /sys/block stat counts 512-byte sectors whatever the device's block size


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """One snapshot of a block device's read counters."""

    when: float            # perf_counter at the snapshot
    reads: int             # completed read requests
    merges: int            # reads merged into a neighbour before dispatch
    sectors: int           # 512-byte sectors read
    read_ms: int           # ms read requests spent from issue to completion, summed over requests
    busy_ms: int           # ms with at least one request in flight (io_ticks)
    queue_ms: int          # ms x requests in flight (time_in_queue), reads and writes
    writes: int            # completed write requests (others' writes pollute a read benchmark)


def disk_of(path: Path) -> Path | None:
    """The ``/sys/block/<disk>`` directory of the whole disk holding ``path``, or None (no sysfs, a tmpfs)."""
    st = os.stat(path)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        node = node.resolve(strict=True)
    except OSError:
        return None
    if not (node / "stat").is_file():
        return None
    # A partition's counters sit beside its disk's; the queue (and its limits) is the disk's.
    return node.parent if (node / "partition").is_file() else node


def snapshot(disk: Path) -> DiskCounters:
    """The device's counters now."""
    fields = [int(x) for x in (disk / "stat").read_text().split()]
    return DiskCounters(time.perf_counter(), reads=fields[0], merges=fields[1], sectors=fields[2],
                        read_ms=fields[3], writes=fields[4], busy_ms=fields[9], queue_ms=fields[10])


def between(before: DiskCounters, after: DiskCounters) -> dict[str, Any]:
    """iostat-like figures for the window between two snapshots."""
    elapsed = max(after.when - before.when, 1e-9)
    reads = after.reads - before.reads
    nbytes = (after.sectors - before.sectors) * SECTOR
    out: dict[str, Any] = {
        "seconds": elapsed,
        "requests": reads,
        "merges": after.merges - before.merges,
        "writes": after.writes - before.writes,
        "request_kib": nbytes / max(reads, 1) / 1024,                         # rareq-sz
        "queue_depth": (after.queue_ms - before.queue_ms) / 1e3 / elapsed,    # aqu-sz
        "utilisation": (after.busy_ms - before.busy_ms) / 1e3 / elapsed,      # %util / 100
        # the queue's depth while it was not empty: ramp-up, start-up and drain do not dilute it
        "depth_busy": (after.queue_ms - before.queue_ms) / max(after.busy_ms - before.busy_ms, 1),
        "request_ms": (after.read_ms - before.read_ms) / max(reads, 1),       # r_await
        "gbps": nbytes / elapsed / 1e9,
    }
    # Little's law: bytes the device holds in flight on average while busy.
    out["inflight_mib"] = out["depth_busy"] * out["request_kib"] / 1024
    return out


def queue_limits(disk: Path) -> dict[str, Any]:
    """The queue limits that decide how one read is cut into requests."""
    out: dict[str, Any] = {"disk": disk.name}
    for name in ("max_sectors_kb", "max_hw_sectors_kb", "max_segments", "max_segment_size", "nr_requests",
                 "logical_block_size", "scheduler", "rotational"):
        try:
            text = (disk / "queue" / name).read_text().strip()
        except OSError:
            continue
        out[name] = int(text) if text.isdigit() else text
    return out
