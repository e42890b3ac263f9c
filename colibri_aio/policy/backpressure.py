"""When speculative reads may use the disk: a sans-I/O backpressure controller.

Prefetch does not create bandwidth, it reorders it: on a disk that demand
reads (or another process) already keep busy, a prefetch can delay a read
the model is waiting for. The controller watches the reads the engine issues
(and, where the model's device is known, ``/proc/diskstats`` samples) in
fixed windows of time and calls the disk saturated when one of these holds
in a window:

1. ``demand-busy``: demand reads alone kept the disk busy (at least one in
   flight) ``busy_high`` of the window;
2. ``device-busy``: the device was ``busy_high`` utilised while no prefetch
   of ours was in flight — demand reads or another process fill it;
3. ``demand-peak``: demand bytes per second of the window reached
   ``peak_high`` of the disk's measured rate (the most bytes per busy second
   any earlier window achieved);
4. ``slow-reads``: the disk time per byte of our reads (busy time / bytes)
   rose to ``latency_high`` times its unloaded baseline, learned online as a
   low quantile of past windows. Busy time per byte does not grow with our
   own queue depth on a disk whose bandwidth is flat in queue depth, so what
   raises it is contention from outside.

The disk stops counting as saturated only after ``min_dwell`` seconds in
which every window showed headroom (busy, utilisation and bandwidth below
the lower thresholds, time per byte below ``latency_low`` times baseline):
two thresholds plus a dwell time, so it does not flap. Without saturation,
prefetch is on.

A saturated disk does not by itself mean prefetch delays the model: where a
contended device shares its bandwidth by reads in flight, prefetch wins a
bigger share, and precise predictions are reads the model makes anyway
(evidence/prefetch_20261129T192601Z.md: saturated, off 1.90 and on 2.23
tok/s). So while saturated the controller measures instead of assuming: a
trial alternates prefetch per decode step (off, on, off, on ...) for
``trial_steps`` steps per arm, pairs each off-step with the on-step after it,
and keeps prefetch off only if the median of on/off step time exceeds
``1 + trial_margin``. The verdict holds ``hold_steps`` decode steps; then, if
the disk is still saturated, another trial. Decode steps come from
:meth:`BackpressureController.step`; a trial whose steps never come (a long
prefill, or a caller that does not report steps) keeps its current arm.
``trial_steps=0`` turns trials off: saturation then turns prefetch off.

Independently of the state, a prefetch cap bounds prefetch reads and bytes in
flight, so a demand read never queues behind more than the cap.

Events in: :meth:`~BackpressureController.submitted` / :meth:`~BackpressureController.completed`
for every read, :meth:`~BackpressureController.step` per forward pass,
:meth:`~BackpressureController.device` per device sample; decision out:
:meth:`~BackpressureController.may_prefetch`. The scheduler policy
(:mod:`colibri_aio.policy.scheduler`) is its only caller in the engine.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np


ReadKind = Literal["demand", "prefetch"]
Mode = Literal["auto", "on", "off"]


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """The model's device over one interval of ``interval`` seconds ending at ``end``, as ``iostat -x``
    reports it (made from ``/proc/diskstats`` by :mod:`colibri_aio.engine.device`)."""

    end: float
    interval: float
    util: float       # fraction of the interval with at least one I/O in flight (0..1)
    r_await_ms: float  # mean read latency; 0 when there were no reads
    aqu_sz: float      # mean number of requests queued or in service
    read_bps: float    # bytes read per second
    reads: int


@dataclass(frozen=True, slots=True)
class BackpressureConfig:
    """Thresholds of the controller; times in seconds, fractions in 0..1."""

    window: float = 0.25
    busy_high: float = 0.90
    busy_low: float = 0.70
    peak_high: float = 0.90
    peak_low: float = 0.70
    latency_high: float = 3.0
    latency_low: float = 1.5
    min_dwell: float = 1.0
    baseline_quantile: float = 0.10
    baseline_windows: int = 256
    min_window_reads: int = 4            # fewer completions give no time-per-byte sample
    max_prefetch_reads: int = 4
    max_prefetch_bytes: int | None = None
    # The detectors see a busy disk, not whether prefetch delays the model: on a contended
    # device more reads in flight can win a bigger share (evidence/prefetch_20261129T192601Z.md:
    # saturated, on 2.23 vs off 1.90 tok/s, and the detectors chose off). So saturation starts
    # a trial: prefetch alternates per decode step, trial_steps steps per arm (adjacent steps
    # see the same contention on a noisy shared machine). 0: no trial, saturation turns it off.
    trial_steps: int = 4
    # Decode steps a verdict holds before the next trial while saturation lasts: half a
    # trial runs the worse arm, so trials must be rare compared with the steps they steer.
    hold_steps: int = 48
    # Off must beat on by more than this fraction of step time: a tie keeps prefetch on,
    # the state without saturation, since then guesses do not delay the model's reads.
    trial_margin: float = 0.0

    def __post_init__(self) -> None:
        if self.trial_steps < 0 or self.hold_steps < 0 or self.trial_margin < 0:
            raise ValueError("trial_steps, hold_steps and trial_margin must be >= 0")


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one closed window measured."""

    start: float
    end: float
    demand_busy: float        # fraction of the window with a demand read in flight
    prefetch_busy: float
    busy: float               # fraction with any read of ours in flight
    reads: int                # completions in the window
    bytes: int                # bytes of completed reads, shared among windows by time overlap
    demand_bytes: int
    time_per_byte: float | None
    latency_ratio: float | None  # time_per_byte / baseline
    device_util: float | None
    peak_bps: float           # the disk's measured rate: highest bytes per busy second of earlier windows

    @property
    def demand_bps(self) -> float:
        return self.demand_bytes / (self.end - self.start)


@dataclass(slots=True)
class _Read:
    kind: ReadKind
    nbytes: int
    start: float
    end: float | None = None


@dataclass(slots=True)
class BackpressureCounters:
    """Telemetry: what the controller saw and did."""

    windows: int = 0
    turned_off: int = 0
    turned_on: int = 0
    seconds_off: float = 0.0
    demand_reads: int = 0
    demand_bytes: int = 0
    prefetch_reads: int = 0
    prefetch_bytes: int = 0
    aborted_reads: int = 0        # completed with ok=False (failed or cancelled)
    refused_by_state: int = 0     # may_prefetch said no because prefetch was off
    refused_by_cap: int = 0       # may_prefetch said no because of the in-flight cap
    decode_steps: int = 0         # decode steps timed by step()
    trials: int = 0               # trials started (saturation while trials are on)
    trial_verdict_on: int = 0
    trial_verdict_off: int = 0
    # The saturation rule behind each trial (or, with trial_steps=0, each switch off).
    # turned_off/turned_on count changes of the decided state, not a trial's arms.
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Trial:
    """One online A/B while saturated: decode steps alternate off, on, off, on ..."""

    cause: str                # the saturation that started it
    arm_steps: int            # pairs to collect
    next_step: int = 0        # index of the next decode step: even runs off, odd runs on
    off: tuple[int, float] | None = None       # the last off-step (index, seconds), awaiting its on-step
    pairs: list[tuple[float, float]] = field(default_factory=list)   # (off, on) seconds

    @property
    def done(self) -> bool:
        return len(self.pairs) >= self.arm_steps

    def record(self, index: int, seconds: float) -> None:
        """Decode step ``index`` took ``seconds``; an on-step pairs with the off-step just before it.

        A step without a time (the last before a prefill) leaves its pair
        incomplete, and the trial runs on until it has ``arm_steps`` pairs.
        """
        if index % 2 == 0:
            self.off = (index, seconds)
        elif self.off is not None and self.off[0] == index - 1:
            self.pairs.append((self.off[1], seconds))
            self.off = None

    def progress(self, index: int) -> str:
        """Which step of the trial ``index`` is, as "3/8" (counting complete pairs)."""
        return f"{2 * len(self.pairs) + index % 2 + 1}/{2 * self.arm_steps}"

    def verdict(self, margin: float) -> tuple[bool, str]:
        """Whether prefetch should be on, and why: off only if on-steps are slower by more than ``margin``."""
        off, on = (np.array(x) for x in zip(*self.pairs))
        keep_on = float(np.median(on / off)) <= 1.0 + margin
        return keep_on, (f"trial: on {np.median(on) * 1e3:.0f} ms/step vs off {np.median(off) * 1e3:.0f} ms "
                         f"(median of {len(self.pairs)} pairs) -> {'on' if keep_on else 'off'}")


class BackpressureController:
    """Decides, from read events and device samples, whether prefetch may run now."""

    def __init__(self, config: BackpressureConfig | None = None, *, mode: Mode = "auto",
                 start: float | None = None) -> None:
        """``start``: the clock reading windows count from (default: the first event's time)."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"unknown prefetch mode {mode!r}")
        self.config = config or BackpressureConfig()
        self.mode = mode
        self.counters = BackpressureCounters()
        self.last: WindowStats | None = None
        self._on = mode != "off"
        self._decided_on = self._on     # the state outside a trial's arms
        self._reason = {"auto": "start", "on": "forced on", "off": "forced off"}[mode]
        self._window_start: float | None = start
        self._saturated = False
        self._saturated_at: float = 0.0 if start is None else start
        self._headroom_since: float | None = start
        self._cause = ""                # the last saturation reason
        self._trial: _Trial | None = None
        self._hold_left = 0             # decode steps the last verdict still holds
        self._pass_start: float | None = None
        self._pass_decode = False
        self._pass_arm: tuple[_Trial, int] | None = None   # (trial, step index) of the pass in progress
        self._reads: dict[int, _Read] = {}
        self._next_ticket = 0
        self._samples: list[DeviceSample] = []
        self._costs: deque[float] = deque(maxlen=self.config.baseline_windows)
        self._peak_bps = 0.0
        self._prefetch_in_flight = 0
        self._prefetch_bytes_in_flight = 0

    # --- state ---------------------------------------------------------------------

    @property
    def prefetch_on(self) -> bool:
        """Whether prefetch is on now; during a trial, the arm of the current decode step."""
        return self._on

    @property
    def reason(self) -> str:
        """Why the state is what it is, in a few words for telemetry."""
        return self._reason

    @property
    def baseline(self) -> float | None:
        """Unloaded disk time per byte: a low quantile of past windows (None until learned)."""
        if len(self._costs) < 4:
            return None
        return float(np.quantile(np.fromiter(self._costs, float), self.config.baseline_quantile))

    @property
    def prefetch_in_flight(self) -> tuple[int, int]:
        """Prefetch reads and bytes submitted and not yet completed."""
        return self._prefetch_in_flight, self._prefetch_bytes_in_flight

    def telemetry(self) -> dict[str, Any]:
        """State, reason, counters and the last window, as plain data for stats lines and logs."""
        return {"prefetch": "on" if self._on else "off", "mode": self.mode, "reason": self._reason,
                "baseline_s_per_byte": self.baseline, **asdict(self.counters),
                "last_window": None if self.last is None else asdict(self.last)}

    # --- events ----------------------------------------------------------------------

    def submitted(self, kind: ReadKind, nbytes: int, now: float) -> int:
        """A read was submitted; returns the ticket to pass to :meth:`completed`."""
        self.update(now)
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self._reads[ticket] = _Read(kind, nbytes, now)
        if kind == "prefetch":
            self._prefetch_in_flight += 1
            self._prefetch_bytes_in_flight += nbytes
        return ticket

    def completed(self, ticket: int, now: float, *, ok: bool = True) -> None:
        """The read with ``ticket`` was reaped (in any order). ``ok=False``: failed or cancelled.

        An aborted read still occupied the disk while in flight, so it counts
        toward busy time, but its bytes do not count as delivered.
        """
        self.update(now)
        r = self._reads.get(ticket)
        if r is None or r.end is not None:
            raise ValueError(f"read {ticket} is unknown or already completed")
        r.end = now
        if r.kind == "prefetch":
            self._prefetch_in_flight -= 1
            self._prefetch_bytes_in_flight -= r.nbytes
        if not ok:
            r.nbytes = 0
            self.counters.aborted_reads += 1
        c = self.counters
        if r.kind == "demand":
            c.demand_reads, c.demand_bytes = c.demand_reads + ok, c.demand_bytes + r.nbytes
        else:
            c.prefetch_reads, c.prefetch_bytes = c.prefetch_reads + ok, c.prefetch_bytes + r.nbytes

    def step(self, now: float, positions: int, sequences: int = 1) -> None:
        """A forward pass over ``positions`` positions of ``sequences`` sequences begins at ``now``.

        A decode step (one position) lasts until the next pass begins, and is
        timed only if that pass is a decode step too: a prefill chunk is no
        decode step, and neither is the last step before one, whose time may
        hold a gap (the next prompt). While saturated in auto mode, decode
        steps drive the trial and the hold; forced modes only time them.
        """
        self.update(now)
        arm, self._pass_arm = self._pass_arm, None
        decode = positions == sequences       # one position of each sequence
        if decode and self._pass_decode and self._pass_start is not None and now > self._pass_start:
            self.counters.decode_steps += 1
            if arm is not None and arm[0] is self._trial:   # not a trial abandoned since
                arm[0].record(arm[1], now - self._pass_start)
        self._pass_start, self._pass_decode = now, decode
        if decode and self.mode == "auto" and self._saturated and self.config.trial_steps > 0:
            self._advance()

    def device(self, sample: DeviceSample) -> None:
        """An iostat-style sample of the model's device."""
        self._samples.append(sample)

    def may_prefetch(self, nbytes: int, now: float) -> bool:
        """Whether a prefetch read of ``nbytes`` may be submitted now (state and cap)."""
        self.update(now)
        if not self._on:
            self.counters.refused_by_state += 1
            return False
        cfg = self.config
        over_bytes = (cfg.max_prefetch_bytes is not None
                      and self._prefetch_bytes_in_flight + nbytes > cfg.max_prefetch_bytes)
        if self._prefetch_in_flight >= cfg.max_prefetch_reads or over_bytes:
            self.counters.refused_by_cap += 1
            return False
        return True

    def update(self, now: float) -> bool:
        """Close every window that ended by ``now`` and decide; returns whether prefetch is on."""
        w = self.config.window
        if self._window_start is None:
            self._window_start = self._saturated_at = self._headroom_since = now
        while self._window_start + w <= now:
            if self._idle_since_window_start():
                self._skip_idle(now)
                break
            self._close(self._window_start, self._window_start + w)
            self._window_start += w
        return self._on

    # --- windows ---------------------------------------------------------------------

    def _idle_since_window_start(self) -> bool:
        return not self._reads and not self._samples

    def _skip_idle(self, now: float) -> None:
        """No reads and no samples: close one long idle window up to the last boundary before ``now``."""
        assert self._window_start is not None
        w = self.config.window
        # At least one window: update() saw one end by now, and the division may round below 1.
        n = max(1, int((now - self._window_start) // w))
        end = self._window_start + n * w
        self._close(self._window_start, end)
        self._window_start = end

    def _close(self, t0: float, t1: float) -> None:
        stats = self._measure(t0, t1)
        self.counters.windows += 1
        self.last = stats
        if self.mode == "auto":
            self._decide(stats)
        if not self._on:
            self.counters.seconds_off += t1 - t0
        self._prune(t1)

    def _measure(self, t0: float, t1: float) -> WindowStats:
        span = t1 - t0
        demand = [r for r in self._reads.values() if r.kind == "demand"]
        prefetch = [r for r in self._reads.values() if r.kind == "prefetch"]
        done = [r for r in self._reads.values() if r.end is not None and t0 <= r.end < t1]
        # Time per byte and rates use completed reads only, each read's bytes shared among the
        # windows it overlapped, so a read cut by a window boundary counts in neither the busy
        # time nor the bytes of a window that closed while it was in flight.
        finished = [r for r in self._reads.values() if r.end is not None]
        nbytes = sum(_bytes_in(r, t0, t1) for r in finished)
        demand_bytes = sum(_bytes_in(r, t0, t1) for r in finished if r.kind == "demand")
        finished_busy = _busy_time(finished, t0, t1)
        busy_s = _busy_time(self._reads.values(), t0, t1)
        cost = finished_busy / nbytes if len(done) >= self.config.min_window_reads and nbytes else None
        baseline, peak = self.baseline, self._peak_bps  # both from earlier windows only
        if cost is not None:
            self._costs.append(cost)
            self._peak_bps = max(self._peak_bps, 1.0 / cost)
        return WindowStats(
            start=t0, end=t1,
            demand_busy=_busy_time(demand, t0, t1) / span,
            prefetch_busy=_busy_time(prefetch, t0, t1) / span,
            busy=busy_s / span, reads=len(done), bytes=round(nbytes), demand_bytes=round(demand_bytes),
            time_per_byte=cost,
            latency_ratio=cost / baseline if cost is not None and baseline else None,
            device_util=self._device_util(t0, t1),
            peak_bps=peak,
        )

    def _device_util(self, t0: float, t1: float) -> float | None:
        """Interval-weighted mean util of the samples that ended inside the window."""
        inside = [s for s in self._samples if t0 < s.end <= t1]
        if not inside:
            return None
        return sum(s.util * s.interval for s in inside) / sum(s.interval for s in inside)

    def _prune(self, t1: float) -> None:
        self._reads = {t: r for t, r in self._reads.items() if r.end is None or r.end >= t1}
        self._samples = [s for s in self._samples if s.end > t1]

    # --- decisions -------------------------------------------------------------------

    def _saturation(self, s: WindowStats) -> str | None:
        """The first saturation rule the window meets, as a reason string; None if none."""
        cfg = self.config
        if s.demand_busy >= cfg.busy_high:
            return f"demand-busy: demand reads kept the disk busy {s.demand_busy:.0%} of the window"
        if s.device_util is not None and s.device_util >= cfg.busy_high and s.prefetch_busy == 0.0:
            return f"device-busy: device {s.device_util:.0%} utilised with no prefetch in flight"
        if s.peak_bps > 0 and s.demand_bytes and s.demand_bps >= cfg.peak_high * s.peak_bps:
            return f"demand-peak: demand reads at {s.demand_bps / s.peak_bps:.0%} of the peak rate"
        if s.latency_ratio is not None and s.latency_ratio >= cfg.latency_high:
            return f"slow-reads: disk time per byte {s.latency_ratio:.1f}x the unloaded baseline"
        return None

    def _has_headroom(self, s: WindowStats) -> bool:
        cfg = self.config
        return (s.demand_busy <= cfg.busy_low
                and (s.device_util is None or s.device_util <= cfg.busy_low)
                and (s.peak_bps == 0 or s.demand_bps <= cfg.peak_low * s.peak_bps)
                and (s.latency_ratio is None or s.latency_ratio <= cfg.latency_low))

    def _decide(self, s: WindowStats) -> None:
        saturated = self._saturation(s)
        if saturated is not None:
            self._headroom_since, self._cause = None, saturated
            if not self._saturated:
                self._saturated, self._saturated_at = True, s.end
                if self.config.trial_steps > 0:
                    self._begin_trial()
                else:
                    self._count_rule(saturated)
                    self._switch(False, saturated)
            return
        if not self._has_headroom(s):
            self._headroom_since = None  # between the thresholds: keep the state, restart the dwell
            return
        if self._headroom_since is None:
            self._headroom_since = s.start
        if (self._saturated and s.end - self._headroom_since >= self.config.min_dwell
                and s.end - self._saturated_at >= self.config.min_dwell):
            self._saturated, self._trial = False, None
            self._switch(True, f"headroom for {s.end - self._headroom_since:.2f}s")

    def _switch(self, on: bool, reason: str) -> None:
        """Set the decided state; count a change of it (a trial's arms are no change)."""
        if on != self._decided_on:
            if on:
                self.counters.turned_on += 1
            else:
                self.counters.turned_off += 1
        self._on = self._decided_on = on
        self._reason = reason

    def _count_rule(self, reason: str) -> None:
        rule = reason.split(":", 1)[0]
        self.counters.reasons[rule] = self.counters.reasons.get(rule, 0) + 1

    # --- trials ----------------------------------------------------------------------

    def _begin_trial(self) -> None:
        """Saturated: measure whether prefetch delays decode steps; its arms start at the next step."""
        self._trial = _Trial(self._cause, self.config.trial_steps)
        self.counters.trials += 1
        self._count_rule(self._cause)
        self._reason = f"trial 0/{2 * self.config.trial_steps} (saturated: {self._cause})"

    def _advance(self) -> None:
        """A decode step begins while saturated: conclude a finished trial, hold, or run the next arm."""
        if self._trial is not None and self._trial.done:
            on, why = self._trial.verdict(self.config.trial_margin)
            if on:
                self.counters.trial_verdict_on += 1
            else:
                self.counters.trial_verdict_off += 1
            self._trial, self._hold_left = None, self.config.hold_steps
            self._switch(on, why)
        if self._trial is None:
            if self._hold_left > 0:
                self._hold_left -= 1
                return
            self._begin_trial()
        trial = self._trial
        assert trial is not None
        index, trial.next_step = trial.next_step, trial.next_step + 1
        self._on = index % 2 == 1
        self._pass_arm = (trial, index)
        self._reason = f"trial {trial.progress(index)} (saturated: {trial.cause})"


def _bytes_in(r: _Read, t0: float, t1: float) -> float:
    """The share of a completed read's bytes that falls in [t0, t1), by time overlap."""
    assert r.end is not None
    if r.end <= r.start:
        return float(r.nbytes) if t0 <= r.end < t1 else 0.0
    overlap = min(r.end, t1) - max(r.start, t0)
    return r.nbytes * max(0.0, overlap) / (r.end - r.start)


def _busy_time(reads: Iterable[_Read], t0: float, t1: float) -> float:
    """Length of the union of the reads' in-flight intervals clipped to [t0, t1).

    A read still in flight is busy until t1.
    """
    spans = sorted((max(r.start, t0), min(t1 if r.end is None else r.end, t1)) for r in reads)
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total
