"""Drive mutants through worker processes: a per-action timeout, a memory cap, and a peak-RSS reading per case.

The parent sends case keys (``fixture/seed-index``) to a worker over its
stdin; the worker builds the mutant itself (the same key gives the same bytes),
runs :func:`gguf_fuzz.cases.run_actions` on it in-process and reports each
action's start and the case's outcomes as JSON lines on a pipe of its own. An
action that does not finish within the timeout is a hang: the worker is
killed and a fresh one takes the next case. Before each case the worker resets
its peak RSS (``/proc/self/clear_refs``) and reads it back after
(``VmHWM``), so each case's peak is its own; an address-space limit
(``RLIMIT_AS``) turns a runaway allocation into a failure instead of a
swapping machine.
"""
from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
ROOT = TOOLS.parent
TESTS = ROOT / "tests"


@dataclass(slots=True)
class CaseResult:
    """One mutant's outcomes (or the action that hung), its mutations and its peak RSS in bytes."""

    key: str
    kinds: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    outcomes: list[dict] = field(default_factory=list)
    hang: str | None = None
    crash: str | None = None   # the worker died without a report (killed by a signal, ...)
    peak_rss: int = 0
    rss_before: int = 0
    size: int = 0

    @property
    def failed(self) -> bool:
        from gguf_fuzz.cases import GOOD

        return self.hang is not None or self.crash is not None or any(o["cls"] not in GOOD for o in self.outcomes)


def case_keys(fixtures: Sequence[Path], cases: int, seed: int, first: int = 0) -> Iterator[tuple[Path, str]]:
    """Keys ``first`` .. ``cases - 1``, round-robin over the fixtures."""
    for i in range(first, cases):
        path = fixtures[i % len(fixtures)]
        yield path, f"{path.name}/{seed}-{i}"


def describe(fixture: Path, key: str) -> tuple[list[str], list[str]]:
    """The mutation kinds and notes of a case (rebuilt from its key, for a case whose worker did not report)."""
    from gguf_fuzz.layout import read_layout
    from gguf_fuzz.mutate import mutate

    mutant = mutate(fixture.read_bytes(), read_layout(fixture), key)
    return list(mutant.kinds), list(mutant.notes)


# ---------------------------------------------------------------- worker side

def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the worker's life so far
        pass


def worker_main(result_fd: int, work: str, kernels: str | None, address_space: int,
                render_seconds: float | None) -> None:
    """Serve cases from stdin until it closes, writing mutants in ``work``; report on ``result_fd``."""
    sys.path[:0] = [str(TOOLS), str(TESTS)]
    import colibri_aio.cli.doctor as doctor
    import colibri_aio.text.chat_template as chat_template
    from gguf_fuzz.cases import run_actions
    from gguf_fuzz.layout import read_layout
    from gguf_fuzz.mutate import mutate

    doctor.PROBE_SECONDS = 0.02  # the read-speed probe is not under test; the reads it makes are
    if render_seconds is not None:
        chat_template.MAX_RENDER_SECONDS = render_seconds
    if address_space:
        resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + address_space, resource.RLIM_INFINITY))
    out = os.fdopen(result_fd, "w", buffering=1)
    layouts: dict[str, tuple[bytes, object]] = {}
    for line in sys.stdin:
        fixture, key = json.loads(line)
        if fixture not in layouts:
            layouts[fixture] = (Path(fixture).read_bytes(), read_layout(Path(fixture)))
        raw, lay = layouts[fixture]
        mutant = mutate(raw, lay, key)
        path = Path(work) / "mutant.gguf"
        path.write_bytes(mutant.data)
        rss_before = _status("VmRSS")
        _reset_peak()

        def started(action: str) -> None:
            out.write(json.dumps({"event": "start", "action": action}) + "\n")

        outcomes = run_actions(path, Path(work), kernels, started)
        out.write(json.dumps({"event": "done", "key": key, "kinds": list(mutant.kinds), "notes": list(mutant.notes),
                              "outcomes": [o.as_dict() for o in outcomes], "peak_rss": _status("VmHWM"),
                              "rss_before": rss_before, "size": len(mutant.data)}) + "\n")
        path.unlink()


# ---------------------------------------------------------------- parent side

class Worker:
    """One worker process, the pipe it reports on, and the file its stderr goes to."""

    def __init__(self, work: Path, kernels: str | None, address_space: int, nice: int,
                 render_seconds: float | None) -> None:
        read_fd, write_fd = os.pipe()
        code = ("import sys; sys.path.insert(0, %r); from gguf_fuzz.campaign import worker_main; "
                "worker_main(%d, %r, %r, %d, %r)" % (str(TOOLS), write_fd, str(work), kernels, address_space,
                                                    render_seconds))
        self.stderr_path = work / "worker.err"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=err, pass_fds=(write_fd,), text=True,
                                         cwd=ROOT, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        os.close(write_fd)
        self.fd = read_fd
        self.buf = b""

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-500:]

    def send(self, fixture: Path, key: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([str(fixture), key]) + "\n")
        self.proc.stdin.flush()

    def event(self, timeout: float) -> dict | None:
        """The next report line, or None if none came within ``timeout`` seconds (or the worker died)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        elif self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()
        os.close(self.fd)


def run_case(worker: Worker, fixture: Path, key: str, timeout: float) -> tuple[CaseResult, bool]:
    """One case on ``worker``; returns the result and whether the worker must be replaced."""
    worker.send(fixture, key)
    action = "start"
    while True:
        ev = worker.event(timeout)
        if ev is None:
            kinds, notes = describe(fixture, key)
            if worker.proc.poll() is None:
                return CaseResult(key, kinds, notes, hang=action), True
            crash = f"worker exited with {worker.proc.returncode} during {action}: {worker.stderr_tail()}"
            return CaseResult(key, kinds, notes, crash=crash), True
        if ev["event"] == "start":
            action = ev["action"]
            continue
        return CaseResult(key, kinds=ev["kinds"], notes=ev["notes"], outcomes=ev["outcomes"], peak_rss=ev["peak_rss"],
                          rss_before=ev["rss_before"], size=ev["size"]), False


def run_campaign(fixtures: Sequence[Path], cases: int, *, seed: int = 0, first: int = 0, timeout: float = 60.0,
                 kernels: str | None = None, address_space: int = 4 << 30, nice: int = 0,
                 render_seconds: float | None = None,
                 report: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Run mutants ``first`` .. ``cases - 1`` of ``fixtures`` (round-robin) through one worker at a time.

    ``timeout``: seconds one action may take before the case counts as a hang;
    ``address_space``: the worker's RLIMIT_AS above its size at start (0: none);
    ``render_seconds``: the chat template's time limit in the worker (None: the engine's).
    """
    results: list[CaseResult] = []
    worker: Worker | None = None
    work = tempfile.TemporaryDirectory(prefix="gguf-fuzz-")
    try:
        for fixture, key in case_keys(fixtures, cases, seed, first):
            if worker is None:
                worker = Worker(Path(work.name), kernels, address_space, nice, render_seconds)
            result, replace = run_case(worker, fixture, key, timeout)
            if replace:
                worker.close(kill=True)
                worker = None
            results.append(result)
            if report is not None:
                report(result)
    finally:
        if worker is not None:
            worker.close()
        work.cleanup()
    return results
