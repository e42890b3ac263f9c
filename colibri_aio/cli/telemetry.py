"""Live telemetry in the spirit of ``iostat -x``: one line per interval for the
model's device and for the engine, a header that repeats, JSON lines on request,
and one summary line at the end.

Device columns come from ``/proc/diskstats`` deltas (r/s, rMB/s, rareq-sz,
r_await, aqu-sz, %util), read through the engine's own device monitor;
engine columns from the engine's own counters (:class:`EngineStats`), the
same numbers the API exposes.

On a terminal the default is not the table but a :class:`StatusLine`: the few
figures that matter, redrawn in place on the terminal's last row, which the
generated text (on stdout, the same terminal) never reaches.
"""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from colibri_aio.engine.device import Snapshot, between
from colibri_aio.engine.stats import EngineStats
from colibri_aio.policy.backpressure import DeviceSample

if TYPE_CHECKING:
    from colibri_aio.engine.engine import Engine

MB = 1e6


@dataclass(frozen=True, slots=True)
class Interval:
    """What happened between two :class:`EngineStats` (and on the device meanwhile)."""

    start: EngineStats
    end: EngineStats
    device: DeviceSample | None

    @property
    def seconds(self) -> float:
        return max(self.end.t - self.start.t, 1e-9)

    def _d(self, name: str) -> float:
        return getattr(self.end, name) - getattr(self.start, name)

    def row(self) -> dict[str, Any]:
        """The interval's figures, named like the columns."""
        dev = self.device
        lookups = sum(self._d(n) for n in ("pinned_hits", "cached_hits", "prefetch_hits", "misses"))
        share = (lambda n: 100.0 * self._d(n) / lookups) if lookups else (lambda n: 0.0)
        return {
            "r/s": dev.reads / dev.interval if dev else None,
            "rMB/s": dev.read_bps / MB if dev else None,
            "rareq-sz": dev.read_bps * dev.interval / dev.reads / 1024 if dev and dev.reads else 0.0 if dev else None,
            "r_await": dev.r_await_ms if dev else None,
            "aqu-sz": dev.aqu_sz if dev else None,
            "%util": 100.0 * dev.util if dev else None,
            "tok/s": (self._d("generated_tokens") + self._d("prompt_tokens")) / self.seconds,
            "hit%": share("pinned_hits") + share("cached_hits") + share("prefetch_hits"),
            "pin%": share("pinned_hits"),
            "lru%": share("cached_hits"),
            "pre%": share("prefetch_hits"),
            "miss/s": self._d("misses") / self.seconds,
            "ourMB/s": self._d("io_bytes") / MB / self.seconds,
            "pf": ("on" if self.end.prefetch_on else "off"),
            "pf-why": self.end.prefetch_reason,
            "pf-prec%": 100.0 * self.end.lookahead_precision,
            "wasteMB": self._d("prefetch_wasted_bytes") / MB,
            "infl": self.end.reads_in_flight,
            "slots": f"{self.end.slots_used}/{self.end.slots_total}",
            "seqs": f"{self.end.sequences_busy}/{self.end.sequences_total}",
            "batch": self._d("batch_rows") / self._d("batch_steps") if self._d("batch_steps") else None,
            "union": self._d("batch_union") / self._d("batch_union_blocks") if self._d("batch_union_blocks") else None,
            "RSS_MB": self.end.rss / MB,
        }


COLUMNS = ("r/s", "rMB/s", "rareq-sz", "r_await", "aqu-sz", "%util", "tok/s", "hit%", "pin%", "lru%", "pre%",
           "miss/s", "ourMB/s", "pf", "pf-prec%", "wasteMB", "infl", "slots", "seqs", "batch", "union", "RSS_MB",
           "pf-why")
WIDTHS = {"pf": 3, "slots": 9, "seqs": 5, "batch": 5, "union": 5, "pf-why": 0}


def _cell(name: str, value: Any) -> str:
    width = WIDTHS.get(name, max(7, len(name)))
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.1f}" if abs(value) < 1e5 else f"{value:.3g}"
    else:
        text = str(value)
    return text.rjust(width) if width else text


def header() -> str:
    return "  ".join((c.rjust(WIDTHS.get(c, max(7, len(c)))) if WIDTHS.get(c, 1) else c) for c in COLUMNS)


def format_row(row: dict[str, Any]) -> str:
    return "  ".join(_cell(c, row.get(c)) for c in COLUMNS)


def status_text(interval: Interval) -> str:
    """The figures of an interval a person follows live, in one short line."""
    row, end = interval.row(), interval.end
    util = "" if row["%util"] is None else f" (disk {row['%util']:.0f}% busy)"
    return (f"{end.generated_tokens} tok | {row['tok/s']:.1f} tok/s | expert hit {row['hit%']:.0f}% | "
            f"read {row['ourMB/s']:.1f} MB/s{util} | prefetch {row['pf']} | slots {row['slots']} | "
            f"RSS {row['RSS_MB']:.0f} MB")


class StatusLine:
    """One line of status on a terminal, redrawn in place, that never lands in the text.

    When the text goes to the same terminal (``shares_screen``), the last row
    is taken out of the scrolling region (``ESC [ top ; bottom r``) and the
    status is drawn there between a cursor save and restore, so the text
    scrolls above it and the two never touch; the region is given back at
    :meth:`close`. Otherwise (the text goes to a file or a pipe) the status
    is simply rewritten with a carriage return. Nothing is drawn on a
    terminal with fewer than 3 rows.
    """

    def __init__(self, term: IO[str], *, shares_screen: bool) -> None:
        self.term, self.shares_screen = term, shares_screen
        self.rows = 0
        self.shown = False

    def _size(self) -> os.terminal_size | None:
        try:
            size = os.get_terminal_size(self.term.fileno())
        except (OSError, ValueError):
            return None
        return size if size.lines >= 3 and size.columns >= 10 else None

    def start(self) -> None:
        """Take the last row for the status; call at the start of a line, before any text is written."""
        size = self._size()
        if not self.shares_screen or size is None:
            return
        # Room first (a new line, which scrolls if the cursor is on the last row), then the
        # region without the last row; setting a region homes the cursor, so it is saved
        # before and restored after, and moved up onto the line just made.
        self.term.write(f"\n\0337\033[1;{size.lines - 1}r\0338\033[1A")
        self.term.flush()
        self.rows = size.lines

    def show(self, text: str) -> None:
        size = self._size()
        if size is None or (self.shares_screen and not self.rows):
            return
        text = text[: size.columns - 1]
        if not self.shares_screen:
            self.term.write(f"\r\033[K{text}")
        else:
            if size.lines != self.rows:  # resized: move the reserved row to the new bottom
                self.rows = size.lines
                self.term.write(f"\0337\033[1;{self.rows - 1}r\0338")
            self.term.write(f"\0337\033[{self.rows};1H\033[2K{text}\0338")
        self.term.flush()
        self.shown = True

    def close(self) -> None:
        """Clear the status and give the terminal its whole height back."""
        if self.shares_screen and self.rows:
            self.term.write(f"\0337\033[r\033[{self.rows};1H\033[2K\0338")
            self.rows = 0
        elif self.shown:
            self.term.write("\r\033[K")
        self.term.flush()
        self.shown = False


class Telemetry:
    """Samples an engine every ``interval`` seconds and writes iostat-style lines, a status line
    and/or JSON lines."""

    HEADER_EVERY = 20

    def __init__(self, engine: "Engine", *, interval: float = 1.0, out: IO[str] | None = None,
                 json_out: IO[str] | None = None, status: StatusLine | None = None) -> None:
        self.engine, self.interval, self.out, self.json_out, self.status = engine, interval, out, json_out, status
        self._device: Snapshot | None = None
        self._lines = 0
        self.intervals: list[Interval] = []

    def _device_sample(self) -> DeviceSample | None:
        """The device's load since the previous call (the engine's monitor reads the counters)."""
        if self.engine.device is None:
            return None
        before, self._device = self._device, self.engine.device.read()
        return between(before, self._device)

    async def run(self, stop: asyncio.Event) -> None:
        """Emit one line per interval until ``stop`` is set (then one last partial interval)."""
        self._device_sample()
        last = self.engine.stats()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass
            last = self._emit_since(last)
        # stop may be set just after an interval's sample was taken: the tokens since then still count.
        self._emit_since(last)

    def _emit_since(self, last: EngineStats) -> EngineStats:
        """Emit the interval from ``last`` to now (unless no time passed); the new start."""
        now = self.engine.stats()
        if now.t - last.t < 1e-3:
            return last
        self.emit(Interval(last, now, self._device_sample()))
        return now

    def emit(self, interval: Interval) -> None:
        self.intervals.append(interval)
        row = interval.row()
        if self.status is not None:
            self.status.show(status_text(interval))
        if self.out is not None:
            if self._lines % self.HEADER_EVERY == 0:
                print(header(), file=self.out, flush=True)
            print(format_row(row), file=self.out, flush=True)
        if self.json_out is not None:
            self.json_out.write(json.dumps({"t": interval.end.t, "seconds": interval.seconds, **row,
                                            "engine": interval.end.as_dict()}) + "\n")
            self.json_out.flush()
        self._lines += 1


def summary_line(s: EngineStats, finish: str | None = None) -> str:
    """Prefill and decode tok/s, hit rate, GB read, peak RSS, and why the text ended: the run in one line."""
    pp = s.prompt_tokens / s.prefill_s if s.prefill_s else 0.0
    tg = s.generated_tokens / s.decode_s if s.decode_s else 0.0
    end = f" | finish: {finish}" if finish else ""
    return (f"[prefill {s.prompt_tokens} tok {pp:.1f} tok/s | decode {s.generated_tokens} tok {tg:.1f} tok/s | "
            f"expert hit {s.hit_rate:.1%} (pinned {s.pinned_hits}, cached {s.cached_hits}, prefetched "
            f"{s.prefetch_hits}, missed {s.misses}) | read {s.io_bytes / 1e9:.3f} GB | peak RSS "
            f"{s.peak_rss / 2**20:.0f} MiB{end}]")
