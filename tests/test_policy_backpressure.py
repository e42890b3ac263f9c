"""BackpressureController against a fake disk: idle, slow, saturated, recovery, contention,
out-of-order completions, cancellation; the prefetch cap; trials on a fake clock of decode
steps."""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from colibri_aio.policy.backpressure import BackpressureConfig, BackpressureController, DeviceSample, _Trial

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
    log: list[tuple[float, bool]] = field(default_factory=list)

    def submit(self, kind: str, t: float, events: list, order: int) -> None:
        done = self.disk.complete_time(t, self.nbytes)
        heapq.heappush(events, (done, order, self.ctl.submitted(kind, self.nbytes, t)))

    def run(self, until: float, period: float, demand_at: "callable", prefetch_per_period: int = 2,
            start: float = 0.0) -> None:
        events: list[tuple[float, int, int]] = []   # (time, order, ticket) of completions
        t, order = start, 0
        while t < until:
            while events and events[0][0] <= t:
                done, _, ticket = heapq.heappop(events)
                self.ctl.completed(ticket, done)
            for _ in range(demand_at(t)):
                self.submit("demand", t, events, order)
                order += 1
            for _ in range(prefetch_per_period):
                if self.ctl.may_prefetch(self.nbytes, t):
                    self.submit("prefetch", t, events, order)
                    order += 1
            self.log.append((t, self.ctl.prefetch_on))
            t = round(t + period, 9)
        for done, _, ticket in sorted(events):
            self.ctl.completed(ticket, done)

    def switches(self) -> int:
        return sum(a[1] != b[1] for a, b in zip(self.log, self.log[1:]))

    def first_change_after(self, t0: float, state: bool) -> float | None:
        return next((t for t, on in self.log if t >= t0 and on == state), None)


CFG = BackpressureConfig(window=0.1, min_dwell=0.5, max_prefetch_reads=4)
# The detectors alone: saturation turns prefetch off (these tests send no decode steps).
NO_TRIAL = replace(CFG, trial_steps=0)


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


def test_same_load_on_a_slower_disk_saturates_with_demand_reads() -> None:
    # 2 MB every 100 ms on a 15 MB/s disk: demand alone needs 133% of the time.
    eng = Engine(BackpressureController(NO_TRIAL), FakeDisk(bandwidth=15 * MB))
    eng.run(until=3.0, period=0.1, demand_at=lambda t: 2)
    assert not eng.ctl.prefetch_on
    assert eng.ctl.reason.startswith("demand-busy")
    assert eng.ctl.counters.reasons == {"demand-busy": 1}
    off_at = eng.first_change_after(0.0, False)
    assert off_at is not None and off_at <= 0.5


def test_recovery_after_hysteresis_without_flapping() -> None:
    # Demand alone keeps the disk 100% busy for 2 s, then 10%: off once, on once, dwell respected.
    eng = Engine(BackpressureController(NO_TRIAL), FakeDisk(bandwidth=100 * MB))
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
    eng = Engine(BackpressureController(NO_TRIAL), FakeDisk(bandwidth=100 * MB))
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


def test_contention_from_another_reader_slows_reads_and_stops_prefetch() -> None:
    # Demand keeps the disk 15% busy; from t=3 to t=6 another process takes 75% of the
    # bandwidth: our reads take 4x as long per byte, yet demand alone stays under busy_high.
    disk = FakeDisk(bandwidth=100 * MB, contention=[(3.0, 6.0, 0.25)])
    eng = Engine(BackpressureController(NO_TRIAL), disk, nbytes=150_000)
    eng.run(until=9.0, period=0.01, demand_at=lambda t: 1, prefetch_per_period=0)
    assert eng.ctl.last.demand_busy < CFG.busy_low
    assert eng.ctl.counters.reasons.get("slow-reads") == 1
    off_at = eng.first_change_after(3.0, False)
    assert off_at is not None and off_at < 4.0
    assert eng.ctl.prefetch_on and eng.first_change_after(6.0, True) >= 6.5


def test_device_busy_without_prefetch_stops_prefetch() -> None:
    ctl = BackpressureController(NO_TRIAL)
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


# --- trials: decode steps on a fake clock ----------------------------------------------------

TRIAL = replace(CFG, trial_steps=4, hold_steps=6)
SATURATED = 0.97   # device util: the device-busy rule (no prefetch of ours is ever in flight here)
IDLE = 0.10


@dataclass
class Decode:
    """Decode steps on a fake clock: a step lasts ``seconds(prefetch_on)``; meanwhile the device
    reports ``util(t)`` every 50 ms, so every 100 ms window has a sample."""

    ctl: BackpressureController
    seconds: Callable[[bool], float]
    util: Callable[[float], float] = lambda t: SATURATED
    t: float = 0.0
    log: list[tuple[float, bool, bool]] = field(default_factory=list)  # (start, prefetch_on, may_prefetch)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.ctl.step(self.t, 1)
            on = self.ctl.prefetch_on
            self.log.append((self.t, on, self.ctl.may_prefetch(MB, self.t)))
            self.elapse(self.seconds(on))

    def prefill(self, seconds: float) -> None:
        self.ctl.step(self.t, 64)
        self.elapse(seconds)

    def elapse(self, seconds: float) -> None:
        end = round(self.t + seconds, 9)
        while self.t < end:
            dt = min(0.05, round(end - self.t, 9))
            self.t = round(self.t + dt, 9)
            self.ctl.device(DeviceSample(end=self.t, interval=dt, util=self.util(self.t), r_await_ms=4,
                                         aqu_sz=8, read_bps=2e9, reads=10))

    def arms(self, start: int, stop: int) -> list[bool]:
        return [on for _, on, _ in self.log[start:stop]]


def steps_taking(on_s: float, off_s: float) -> Callable[[bool], float]:
    return lambda on: on_s if on else off_s


@pytest.mark.parametrize(("on_s", "off_s", "margin", "verdict"), [
    (0.20, 0.25, 0.0, True), (0.25, 0.20, 0.0, False),
    (0.21, 0.20, 0.10, True),      # on 5% slower, within the margin
    (0.23, 0.20, 0.10, False),     # on 15% slower
])
def test_trial_verdict_is_the_median_step_time_ratio(on_s: float, off_s: float, margin: float,
                                                     verdict: bool) -> None:
    d = Decode(BackpressureController(replace(TRIAL, trial_margin=margin), start=0.0), steps_taking(on_s, off_s))
    d.run(1)                        # windows up to the next step saturate; the trial begins there
    d.run(8)
    assert d.arms(1, 9) == [False, True] * 4
    d.run(1)                        # the step after the trial's last one starts under the verdict
    c = d.ctl.counters
    assert (c.trials, c.trial_verdict_on, c.trial_verdict_off) == (1, int(verdict), int(not verdict))
    assert d.ctl.prefetch_on is verdict
    assert d.ctl.reason == (f"trial: on {on_s * 1e3:.0f} ms/step vs off {off_s * 1e3:.0f} ms (median of 4 pairs)"
                            f" -> {'on' if verdict else 'off'}")
    assert c.reasons == {"device-busy": 1} and c.turned_off == int(not verdict) and c.turned_on == 0


def test_a_tie_or_a_loss_within_the_margin_keeps_prefetch_on() -> None:
    # Exact binary fractions: the rule's boundary, not float noise, decides.
    assert _Trial("x", 4, pairs=[(0.5, 0.5)] * 4).verdict(0.0)[0] is True
    slower = _Trial("x", 4, pairs=[(0.5, 0.625)] * 3 + [(0.5, 0.25)])   # median ratio 1.25
    assert slower.verdict(0.25)[0] is True and slower.verdict(0.125)[0] is False


def test_verdict_on_keeps_prefetch_on_through_the_hold_then_trials_again() -> None:
    d = Decode(BackpressureController(TRIAL, start=0.0), steps_taking(0.20, 0.25))
    d.run(1 + 8 + 6 + 2)
    assert d.arms(9, 15) == [True] * 6       # the hold: hold_steps decode steps
    assert d.arms(15, 17) == [False, True]   # still saturated: the next trial
    c = d.ctl.counters
    assert (c.trials, c.trial_verdict_on, c.trial_verdict_off) == (2, 1, 0)
    assert (c.turned_off, c.turned_on) == (0, 0) and c.reasons == {"device-busy": 2}
    assert d.ctl.reason.startswith("trial 2/8 (saturated: device-busy")


def test_verdict_off_holds_prefetch_off_then_trials_again() -> None:
    d = Decode(BackpressureController(TRIAL, start=0.0), steps_taking(0.25, 0.20))
    d.run(1 + 8 + 6 + 8 + 1)
    assert d.arms(9, 15) == [False] * 6
    assert d.arms(15, 23) == [False, True] * 4
    assert d.arms(23, 24) == [False]          # the second verdict: off again, no new switch
    c = d.ctl.counters
    assert (c.trials, c.trial_verdict_on, c.trial_verdict_off) == (2, 0, 2)
    assert (c.turned_off, c.turned_on) == (1, 0)


def test_headroom_after_a_verdict_of_off_turns_prefetch_on_after_the_dwell() -> None:
    d = Decode(BackpressureController(replace(TRIAL, hold_steps=48), start=0.0), steps_taking(0.25, 0.20),
               util=lambda t: SATURATED if t < 2.5 else IDLE)
    d.run(1 + 8 + 12)
    assert d.log[9][0] == pytest.approx(2.05) and d.arms(9, 12) == [False] * 3   # verdict off at t = 2.05
    back_on = next(t for t, on, _ in d.log[9:] if on)
    assert 3.0 <= back_on <= 3.2                  # the device went idle at 2.5; min_dwell is 0.5 s
    assert all(on for t, on, _ in d.log if t >= back_on)
    c = d.ctl.counters
    assert (c.turned_off, c.turned_on, c.trials) == (1, 1, 1)
    assert d.ctl.reason.startswith("headroom")


def test_headroom_during_a_trial_ends_it_without_a_verdict() -> None:
    d = Decode(BackpressureController(TRIAL, start=0.0), steps_taking(0.20, 0.25),
               util=lambda t: SATURATED if t < 0.6 else IDLE)
    d.run(1 + 8)
    # Idle from 0.6 s; the dwell (0.5 s) ends before the step at 1.1 s, the trial's fifth.
    assert d.arms(1, 5) == [False, True, False, True] and d.arms(5, 9) == [True] * 4
    c = d.ctl.counters
    assert (c.trials, c.trial_verdict_on, c.trial_verdict_off, c.turned_on) == (1, 0, 0, 0)
    assert d.ctl.reason.startswith("headroom")


def test_arms_alternate_step_by_step_and_the_gate_follows_them() -> None:
    d = Decode(BackpressureController(TRIAL, start=0.0), steps_taking(0.20, 0.25))
    d.run(1 + 8)
    assert [(on, may) for _, on, may in d.log[1:9]] == [(False, False), (True, True)] * 4
    assert d.ctl.counters.refused_by_state == 4


def test_cap_still_applies_on_a_trial_on_step() -> None:
    ctl = BackpressureController(replace(TRIAL, max_prefetch_reads=1), start=0.0)
    d = Decode(ctl, steps_taking(0.20, 0.25))
    d.run(2)                                  # step 1: the trial's first off-step
    ctl.step(d.t, 1)                          # step 2: on
    ctl.submitted("prefetch", MB, d.t)
    assert ctl.prefetch_on and not ctl.may_prefetch(MB, d.t) and ctl.counters.refused_by_cap == 1


def test_prefill_and_the_first_step_give_no_step_times() -> None:
    ctl = BackpressureController(TRIAL, start=0.0)
    for t, positions, timed in [(0.0, 1, 0), (0.1, 1, 1), (0.2, 64, 1), (0.5, 64, 1), (0.8, 1, 1), (0.9, 1, 2),
                                (1.0, 1, 3)]:
        ctl.step(t, positions)
        assert ctl.counters.decode_steps == timed, t


def test_a_prefill_inside_a_trial_keeps_the_arm_and_breaks_only_its_pair() -> None:
    d = Decode(BackpressureController(TRIAL, start=0.0), steps_taking(0.20, 0.25))
    d.run(1 + 3)                              # trial steps: off, on, off
    d.prefill(1.0)                            # the off-step before it is not timed
    assert not d.ctl.prefetch_on              # a pass of several positions keeps the arm
    d.run(7)                                  # on (unpaired), then three more pairs
    assert d.arms(4, 11) == [True] + [False, True] * 3
    assert d.ctl.counters.trial_verdict_on == 0
    d.run(1)
    assert d.ctl.counters.trial_verdict_on == 1 and d.ctl.reason.endswith("(median of 4 pairs) -> on")


def test_without_steps_a_trial_keeps_its_arm() -> None:
    d = Decode(BackpressureController(TRIAL, start=0.0), steps_taking(0.20, 0.25))
    d.elapse(2.0)                             # saturated, but no decode step comes
    assert d.ctl.update(d.t) and d.ctl.counters.trials == 1
    assert d.ctl.reason.startswith("trial 0/8 (saturated: device-busy")


def test_no_trials_turns_prefetch_off_on_saturation() -> None:
    d = Decode(BackpressureController(replace(TRIAL, trial_steps=0), start=0.0), steps_taking(0.20, 0.25))
    d.run(12)
    assert d.arms(0, 1) == [True] and d.arms(1, 12) == [False] * 11
    c = d.ctl.counters
    assert (c.trials, c.turned_off, c.reasons) == (0, 1, {"device-busy": 1})
    assert d.ctl.reason.startswith("device-busy") and c.decode_steps == 11


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_modes_ignore_steps(mode: str) -> None:
    d = Decode(BackpressureController(TRIAL, mode=mode, start=0.0), steps_taking(0.20, 0.25))
    d.run(30)
    assert d.arms(0, 30) == [mode == "on"] * 30
    assert d.ctl.counters.trials == 0 and d.ctl.reason == f"forced {mode}"


def test_trial_settings_must_not_be_negative() -> None:
    with pytest.raises(ValueError):
        BackpressureConfig(hold_steps=-1)


def test_telemetry_names_state_and_reason() -> None:
    eng = Engine(BackpressureController(NO_TRIAL), FakeDisk(bandwidth=15 * MB))
    eng.run(until=1.0, period=0.1, demand_at=lambda t: 2)
    t = eng.ctl.telemetry()
    assert t["prefetch"] == "off" and t["reason"].startswith("demand-busy") and t["turned_off"] == 1
    assert t["last_window"]["demand_busy"] >= CFG.busy_high
