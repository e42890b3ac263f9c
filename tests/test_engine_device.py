"""The device monitor: /proc/diskstats parsed and differenced as iostat does, one reader per engine."""
from __future__ import annotations

import asyncio

import pytest

from colibri_aio.engine.device import DeviceMonitor, between, device_delta, parse_diskstats


DISKSTATS_BEFORE = """ 254       0 vda 1000 10 200000 500 20 0 80 4 0 800 900 0 0 0 0 0 0
 254       1 vda1 990 10 199000 490 20 0 80 4 0 790 890
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
"""
DISKSTATS_AFTER = """ 254       0 vda 1100 10 204096 800 20 0 80 4 3 1250 2900 0 0 0 0 0 0
"""


def test_diskstats_parse_and_iostat_delta() -> None:
    before, after = parse_diskstats(DISKSTATS_BEFORE), parse_diskstats(DISKSTATS_AFTER)
    assert set(before) == {"vda", "vda1", "loop0"} and before["vda1"].reads == 990
    s = device_delta(before["vda"], after["vda"], 10.0, 10.5)
    assert s.util == pytest.approx(0.9)              # 450 ms busy of 500
    assert s.r_await_ms == pytest.approx(3.0)        # 300 ms over 100 reads
    assert s.aqu_sz == pytest.approx(4.0)            # 2000 ms queue time over 500 ms
    assert s.read_bps == pytest.approx(4096 * 512 / 0.5)
    assert s.reads == 100 and after["vda"].in_flight == 3
    with pytest.raises(ValueError):
        device_delta(before["vda"], after["vda"], 1.0, 1.0)


def test_monitor_reads_its_device_and_hands_deltas_on() -> None:
    texts = iter([DISKSTATS_BEFORE, DISKSTATS_AFTER])
    monitor = DeviceMonitor("vda", source=lambda: next(texts))
    first, second = monitor.read(), monitor.read()
    assert first is not None and second is not None and first.counters.reads == 1000
    assert between(None, second) is None and between(second, first) is None  # nothing, or time ran back
    s = between(first, second)
    assert s is not None and s.reads == 100 and s.end == second.t
    assert DeviceMonitor("nvme0n1", source=lambda: DISKSTATS_AFTER).read() is None


async def test_monitor_feeds_one_sample_per_period() -> None:
    texts = iter([DISKSTATS_BEFORE, DISKSTATS_AFTER] + [DISKSTATS_AFTER] * 100)
    samples: list = []
    monitor = DeviceMonitor("vda", samples.append, period=0.001, source=lambda: next(texts))
    task = asyncio.create_task(monitor.run())
    while len(samples) < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert samples[0].reads == 100 and samples[1].reads == 0   # the second interval saw no reads
