"""BackpressureController against a fake disk: idle, slow, saturated, recovery, contention,
out-of-order completions, cancellation; the prefetch cap; stale-prefetch triage; diskstats."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import pytest

from colibri_aio.policy.backpressure import (
    BackpressureConfig,
    BackpressureController,
    PendingPrefetch,
    triage_prefetches,
)
from colibri_aio.policy.diskstats import DeviceSample, DiskstatsSampler, device_delta, parse_diskstats

MB = 1 << 20


@dataclass
class FakeDisk:
    """A disk whose bandwidth is flat in queue depth: requests are served one after another at
    ``bandwidth`` bytes/s, each finishing ``latency`` s after its transfer; ``share`` is the part
    of the bandwidth left to us by another reader (1 = none), changeable over time."""

    bandwidth: float
    latency: float = 0.0001
    free_at: float = 0.0
    contention: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, share)

    def share(self, t: float) -> float:
        return next((s for a, b, s in self.contention if a <= t < b), 1.0)

    def complete_time(self, now: float, nbytes: int) -> float:
        start = max(now, self.free_at)
        self.free_at = start + nbytes / (self.bandwidth * self.share(start))
        return self.free_at + self.latency


@dataclass
class Engine:
    """Drives the controller like the engine would: demand reads every ``period`` s, then up to
    ``prefetch_per_period`` prefetches if the controller allows them; completions fed in time order."""

    ctl: BackpressureController
    disk: FakeDisk
    nbytes: int = 1 * MB
    posthoc: bool = False   # report each read once it is over, through on_read/allows_prefetch
    log: list[tuple[float, bool]] = field(default_factory=list)

    def submit(self, kind: str, t: float, events: list, order: int) -> None:
        done = self.disk.complete_time(t, self.nbytes)
        ticket = (kind, t) if self.posthoc else self.ctl.submitted(kind, self.nbytes, t)
        heapq.heappush(events, (done, order, ticket))

    def complete(self, ticket, done: float, in_flight: int) -> None:
        if self.posthoc:
            kind, submitted = ticket
            self.ctl.on_read(kind, self.nbytes, submitted, done, in_flight)
        else:
            self.ctl.completed(ticket, done)

    def allowed(self, t: float) -> bool:
        if self.posthoc:   # the scheduler applies its own cap in this mode
            return self.ctl.allows_prefetch(t)
        return self.ctl.may_prefetch(self.nbytes, t)

    def run(self, until: float, period: float, demand_at: "callable", prefetch_per_period: int = 2,
            start: float = 0.0) -> None:
        events: list[tuple[float, int, int]] = []   # (time, order, ticket) of completions
        t, order = start, 0
        while t < until:
            while events and events[0][0] <= t:
                done, _, ticket = heapq.heappop(events)
                self.complete(ticket, done, len(events))
            for _ in range(demand_at(t)):
                self.submit("demand", t, events, order)
                order += 1
            for _ in range(prefetch_per_period):
                if self.allowed(t):
                    self.submit("prefetch", t, events, order)
                    order += 1
            self.log.append((t, self.ctl.prefetch_on))
            t = round(t + period, 9)
        for done, _, ticket in sorted(events):
            self.complete(ticket, done, 0)

    def switches(self) -> int:
        return sum(a[1] != b[1] for a, b in zip(self.log, self.log[1:]))

    def first_change_after(self, t0: float, state: bool) -> float | None:
        return next((t for t, on in self.log if t >= t0 and on == state), None)


CFG = BackpressureConfig(window=0.1, min_dwell=0.5, max_prefetch_reads=4)


def test_idle_disk_keeps_prefetch_on() -> None:
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=1000 * MB))
    eng.run(until=5.0, period=0.05, demand_at=lambda t: 2)         # 2 MB / 50 ms: 4% busy
    assert all(on for _, on in eng.log)
    assert eng.ctl.counters.turned_off == 0 and eng.ctl.counters.prefetch_reads > 0


def test_prefetch_keeping_the_disk_busy_is_not_saturation() -> None:
    # Prefetches (capped at 4 in flight) fill the disk; demand needs it 10% of the time. Busy, yet
    # demand reads have room: prefetch stays on, and the cap is what bounds their wait.
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=100 * MB))
    eng.run(until=3.0, period=0.01, demand_at=lambda t: 1 if round(t * 100) % 10 == 0 else 0,
            prefetch_per_period=1)
    assert all(on for _, on in eng.log)
    assert eng.ctl.last.busy > 0.95 and eng.ctl.last.demand_busy < CFG.busy_low
    assert eng.ctl.counters.refused_by_cap > 0


def test_slow_disk_with_room_keeps_prefetch_on() -> None:
    # 1 MB every 100 ms on a 20 MB/s disk: 50% busy with demand reads, slow but not saturated.
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=20 * MB))
    eng.run(until=5.0, period=0.1, demand_at=lambda t: 1, prefetch_per_period=0)
    assert all(on for _, on in eng.log) and eng.ctl.counters.turned_off == 0


@pytest.mark.parametrize("posthoc", [False, True], ids=["tickets", "on_read"])
def test_same_load_on_a_slower_disk_saturates_with_demand_reads(posthoc: bool) -> None:
    # 2 MB every 100 ms on a 15 MB/s disk: demand alone needs 133% of the time.
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=15 * MB), posthoc=posthoc)
    eng.run(until=3.0, period=0.1, demand_at=lambda t: 2)
    assert not eng.ctl.prefetch_on
    assert eng.ctl.reason.startswith("demand-busy")
    assert eng.ctl.counters.reasons == {"demand-busy": 1}
    off_at = eng.first_change_after(0.0, False)
    assert off_at is not None and off_at <= 0.5


@pytest.mark.parametrize("posthoc", [False, True], ids=["tickets", "on_read"])
def test_recovery_after_hysteresis_without_flapping(posthoc: bool) -> None:
    # Demand alone keeps the disk 100% busy for 2 s, then 10%: off once, on once, dwell respected.
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=100 * MB), posthoc=posthoc)
    eng.run(until=5.0, period=0.01, demand_at=lambda t: 1 if t < 2.0 or round(t * 100) % 10 == 0 else 0,
            prefetch_per_period=0)
    c = eng.ctl.counters
    assert (c.turned_off, c.turned_on) == (1, 1) and eng.switches() == 2
    on_again = eng.first_change_after(2.0, True)
    assert on_again is not None and 2.5 <= on_again <= 2.8   # min_dwell 0.5 s after the load dropped
    assert eng.ctl.prefetch_on and eng.ctl.reason.startswith("headroom")


def test_short_lulls_shorter_than_the_dwell_do_not_resume() -> None:
    # Bursts keeping the disk 100% busy for 0.4 s, then idle lulls of 0.2 s: a lull never lasts
    # min_dwell (0.5 s), so prefetch stays off instead of flapping with the bursts.
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=100 * MB))
    eng.run(until=6.0, period=0.01, demand_at=lambda t: 1 if (t % 0.6) < 0.4 else 0, prefetch_per_period=0)
    assert eng.ctl.counters.turned_off == 1 and eng.ctl.counters.turned_on == 0
    assert eng.switches() == 1


def test_load_between_the_thresholds_keeps_the_state() -> None:
    # Demand keeps the disk ~80% busy: below busy_high (stays on), above busy_low.
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=100 * MB))
    eng.run(until=4.0, period=0.01, demand_at=lambda t: 1 if round(t * 100) % 5 != 0 else 0,
            prefetch_per_period=0)
    assert eng.switches() == 0 and eng.ctl.prefetch_on
    assert 0.7 < eng.ctl.last.demand_busy < 0.9


@pytest.mark.parametrize("posthoc", [False, True], ids=["tickets", "on_read"])
def test_contention_from_another_reader_slows_reads_and_stops_prefetch(posthoc: bool) -> None:
    # Demand keeps the disk 15% busy; from t=3 to t=6 another process takes 75% of the
    # bandwidth: our reads take 4x as long per byte, yet demand alone stays under busy_high.
    disk = FakeDisk(bandwidth=100 * MB, contention=[(3.0, 6.0, 0.25)])
    eng = Engine(BackpressureController(CFG), disk, nbytes=150_000, posthoc=posthoc)
    eng.run(until=9.0, period=0.01, demand_at=lambda t: 1, prefetch_per_period=0)
    assert eng.ctl.last.demand_busy < CFG.busy_low
    assert eng.ctl.counters.reasons.get("slow-reads") == 1
    off_at = eng.first_change_after(3.0, False)
    assert off_at is not None and off_at < 4.0
    assert eng.ctl.prefetch_on and eng.first_change_after(6.0, True) >= 6.5


def test_device_busy_without_prefetch_stops_prefetch() -> None:
    ctl = BackpressureController(CFG)
    t = 0.0
    for i in range(20):  # no reads of ours; the device is busy with someone else's
        ctl.device(DeviceSample(end=t + 0.1, interval=0.1, util=0.97, r_await_ms=4, aqu_sz=8,
                                read_bps=2e9, reads=100))
        t += 0.1
        ctl.update(t)
    assert not ctl.prefetch_on and ctl.reason.startswith("device-busy")


def test_forced_modes_never_switch() -> None:
    for mode, expect in (("on", True), ("off", False)):
        eng = Engine(BackpressureController(CFG, mode=mode), FakeDisk(bandwidth=15 * MB))
        eng.run(until=2.0, period=0.1, demand_at=lambda t: 2)
        assert all(on is expect for _, on in eng.log)


def test_out_of_order_completions_count_busy_time_once() -> None:
    ctl = BackpressureController(BackpressureConfig(window=0.25, min_window_reads=1), start=0.0)
    a = ctl.submitted("demand", 4 * MB, 0.0)
    b = ctl.submitted("demand", 1 * MB, 0.05)
    p = ctl.submitted("prefetch", 1 * MB, 0.06)
    ctl.completed(b, 0.10)        # the later, smaller read finishes first
    ctl.completed(p, 0.12)
    ctl.completed(a, 0.20)
    ctl.update(0.25)
    w = ctl.last
    assert w.demand_busy == pytest.approx(0.20 / 0.25)
    assert w.prefetch_busy == pytest.approx(0.06 / 0.25)
    assert w.busy == pytest.approx(0.20 / 0.25)
    assert (w.reads, w.bytes, w.demand_bytes) == (3, 6 * MB, 5 * MB)
    assert ctl.prefetch_in_flight == (0, 0)


def test_read_spanning_windows_counts_busy_in_each() -> None:
    ctl = BackpressureController(BackpressureConfig(window=0.1), start=0.0)
    r = ctl.submitted("demand", MB, 0.05)
    ctl.update(0.1)
    assert ctl.last.demand_busy == pytest.approx(0.5)     # still in flight at the boundary
    ctl.completed(r, 0.15)
    ctl.update(0.2)
    assert ctl.last.demand_busy == pytest.approx(0.5)
    assert ctl.last.bytes == MB // 2      # half the read's time fell in this window


def test_prefetch_cap_bounds_reads_in_flight() -> None:
    ctl = BackpressureController(BackpressureConfig(max_prefetch_reads=2, max_prefetch_bytes=3 * MB))
    tickets = [ctl.submitted("prefetch", MB, 0.0) for _ in range(2)]
    assert not ctl.may_prefetch(MB, 0.0) and ctl.counters.refused_by_cap == 1
    ctl.completed(tickets[0], 0.01)
    assert ctl.may_prefetch(MB, 0.01)
    assert not ctl.may_prefetch(3 * MB, 0.01)              # 1 MB in flight + 3 MB > 3 MB


def test_cancellation_mid_prefetch_frees_the_cap_and_delivers_no_bytes() -> None:
    ctl = BackpressureController(BackpressureConfig(window=0.1, max_prefetch_reads=1), start=0.0)
    t = ctl.submitted("prefetch", MB, 0.0)
    assert not ctl.may_prefetch(MB, 0.01)
    ctl.completed(t, 0.03, ok=False)                       # cancelled: reaped without data
    assert ctl.prefetch_in_flight == (0, 0) and ctl.may_prefetch(MB, 0.03)
    ctl.update(0.1)
    assert ctl.last.bytes == 0 and ctl.last.prefetch_busy == pytest.approx(0.3)
    assert ctl.counters.aborted_reads == 1 and ctl.counters.prefetch_bytes == 0
    with pytest.raises(ValueError):
        ctl.completed(t, 0.2)


def test_triage_of_prefetches_against_the_current_layer() -> None:
    pending = [PendingPrefetch(3, 1, 10, submitted=False), PendingPrefetch(3, 1, 11, submitted=True),
               PendingPrefetch(3, 2, 12, submitted=False), PendingPrefetch(3, 2, 13, submitted=True),
               PendingPrefetch(3, 3, 14, submitted=False), PendingPrefetch(2, 5, 15, submitted=False)]
    t = triage_prefetches(3, 2, pending)
    assert [p.expert for p in t.cancel] == [10, 15]
    assert [p.expert for p in t.demote] == [11]
    assert [p.expert for p in t.promote] == [12]
    assert [p.expert for p in t.keep] == [13, 14]


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


def test_sampler_yields_deltas_of_its_device() -> None:
    sampler = DiskstatsSampler("vda")
    assert sampler.sample(DISKSTATS_BEFORE, 10.0) is None         # nothing to compare with yet
    s = sampler.sample(DISKSTATS_AFTER, 10.5)
    assert s is not None and s.util == pytest.approx(0.9) and s.end == 10.5
    assert DiskstatsSampler("nvme0n1").sample(DISKSTATS_AFTER, 11.0) is None


def test_telemetry_names_state_and_reason() -> None:
    eng = Engine(BackpressureController(CFG), FakeDisk(bandwidth=15 * MB))
    eng.run(until=1.0, period=0.1, demand_at=lambda t: 2)
    t = eng.ctl.telemetry()
    assert t["prefetch"] == "off" and t["reason"].startswith("demand-busy") and t["turned_off"] == 1
    assert t["last_window"]["demand_busy"] >= CFG.busy_high
