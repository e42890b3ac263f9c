"""Native code is tried in a child process before the engine runs it.

A signal inside a native library (SIGILL for an instruction the CPU lacks,
SIGSEGV, SIGSYS from a seccomp filter that kills) cannot be caught in the
process it hits: the process is gone. So before the engine first uses a
compiled backend on a machine, a child runs that backend's self-test; if the
child dies or fails, the engine falls back (pread for the io_uring reader,
NumPy for the kernels) with one warning line saying what failed and why.

Verdicts are kept under ``$XDG_CACHE_HOME/colibri_aio/probes/``, one file per
(backend, CPU signature from CPUID, architecture, Python, library version,
kernel release), so a probe costs nothing on later runs and is made again
whenever any of those changes: another CPU behind the same home directory,
an emulator, an upgraded library. A passing or a fatal verdict is kept, and
so is a refusal whose error says it follows from what the key holds
(``keep_verdict``: ggml built for an instruction this CPU lacks). Any other
failure (ENOSYS, EPERM from a sandbox, an import shadowed by ``PYTHONPATH``)
is not: it says more about this moment than about this machine, and a run
that meets it falls back as well. ``doctor`` probes afresh.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from colibri_aio import __version__, cpu
from colibri_aio.cachefiles import cache_dir, set_aside, write_atomic
from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.probes")

PROBE_TIMEOUT_S = 180.0  # a self-test takes well under a second natively; an emulated CPU is ~50x slower
KEPT_FAILURE = 3  # the child's exit status for a refusal that follows from the key (``keep_verdict`` on the error)
# The child says first which CPU it ran on: under an emulator (qemu-user runs only the process it was given,
# not its children) a child runs on the host's CPU, and its verdict would say nothing of the emulated one.
_CHILD = """\
import importlib, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a probe that dies leaves no core file behind
from colibri_aio import cpu
print(cpu.signature(), flush=True)
module, _, function = sys.argv[1].partition(":")
kept_failure = int(sys.argv[2])
try:
    print(getattr(importlib.import_module(module), function)())
except Exception as exc:
    if not getattr(exc, "keep_verdict", False):
        raise
    print(f"{type(exc).__module__}.{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(kept_failure)
"""


@dataclass(frozen=True, slots=True)
class Probe:
    """A native backend and the self-test (``module:function``, returning one line) that proves it runs here."""

    name: str          # what the warning calls it: "io_uring binding", "ggml library"
    target: str
    package: str | None = None  # the distribution whose version is part of the cache key
    kernel_bound: bool = False  # whether the kernel release is part of the key (io_uring is the kernel's)


PROBES: dict[str, Probe] = {
    "io_uring": Probe("io_uring binding", "colibri_aio.io.ring:self_test", kernel_bound=True),
    "ggml": Probe("ggml library", "colibri_aio.kernels.ggml_cpu:self_test", package="ggml-python"),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a probe found: ``ok`` with the self-test's line, or the reason the backend cannot run here."""

    backend: str
    ok: bool
    detail: str
    fatal: bool = False   # the child died by a signal (kept: it will die again on this machine)
    kept_failure: bool = False  # a refusal that follows from what the key holds (CPU, build): kept too
    proven: bool = True   # False when the probe could not judge (it timed out, or ran on another CPU): never kept
    cached: bool = False  # read from the cache instead of probed in this process's lifetime

    def line(self) -> str:
        """``<name> <detail>`` (``io_uring binding died with SIGILL in a probe: ...``), as warnings print it."""
        return f"{PROBES[self.backend].name} {self.detail}" if self.backend in PROBES else self.detail


@functools.cache
def _library_version(probe: Probe) -> str:
    if probe.package is None:
        return f"colibri-aio {__version__}"
    try:
        version = importlib.metadata.version(probe.package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
    # The shared libraries' sizes and times: a rebuild of the same version (another CMAKE_ARGS) is another build.
    module = probe.target.partition(":")[0]
    spec = importlib.util.find_spec(probe.package.replace("-python", "").replace("-", "_"))
    files: list[str] = []
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            for entry in sorted(Path(folder).rglob("*.so*")):
                st = entry.stat()
                files.append(f"{entry.name}:{st.st_size}:{int(st.st_mtime)}")
    return f"{probe.package} {version} {module} {' '.join(files)}"


def cache_key(backend: str) -> str:
    """Everything a verdict depends on, as one string."""
    probe = PROBES[backend]
    parts = [backend, probe.target, cpu.signature(), platform.machine(), platform.python_version(),
             _library_version(probe)]
    if probe.kernel_bound:
        parts.append(os.uname().release)
    return "|".join(parts)


def _cache_path(backend: str, key: str) -> Path:
    return cache_dir("probes") / f"{backend}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def run_child(backend: str, target: str, timeout: float = PROBE_TIMEOUT_S) -> Verdict:
    """Run ``target`` in a fresh interpreter and judge how it ended."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, target, str(KEPT_FAILURE)], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        return Verdict(backend, False, f"was not proven: its probe did not finish in {timeout:.0f} s", proven=False)
    except OSError as exc:
        return Verdict(backend, False, f"was not proven: its probe could not start ({exc})", proven=False)
    lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    if lines and lines[0] != cpu.signature():
        return Verdict(backend, False, "was not proven: its probe ran on another CPU than this process "
                                       "(under an emulator?)", proven=False)
    if done.returncode < 0:
        return Verdict(backend, False, f"died with {_signal_name(-done.returncode)} in a probe"
                                       f"{_signal_cause(-done.returncode)}", fatal=True)
    if not lines:
        return Verdict(backend, False, f"was not proven: its probe printed nothing ({_last(done.stderr)})",
                       proven=False)
    if done.returncode != 0:
        return Verdict(backend, False, f"failed in a probe ({_last(done.stderr) or f'exit {done.returncode}'})",
                       kept_failure=done.returncode == KEPT_FAILURE)
    return Verdict(backend, True, lines[-1] if len(lines) > 1 else "ran in a probe")


def _last(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal_cause(number: int) -> str:
    if number != signal.SIGILL:
        return ""
    if "avx512f" not in cpu.flags() and cpu.is_x86_64():
        return ": this CPU lacks AVX-512"
    return ": it uses an instruction this CPU lacks"


_seen: dict[str, Verdict] = {}  # verdicts of this process, by cache file


def verdict(backend: str, *, fresh: bool = False) -> Verdict:
    """Whether ``backend`` (a key of :data:`PROBES`) can run here: from the cache, else from a probe now.

    ``fresh=True`` probes even when a verdict is cached (and replaces it), once per process: a second
    fresh ask in the same process gets what the first probe found.
    """
    key = cache_key(backend)
    path = _cache_path(backend, key)
    seen = _seen.get(str(path))
    if seen is not None and (not fresh or not seen.cached):
        return seen
    if not fresh:
        cached = _read(path, key)
        if cached is not None:
            _seen[str(path)] = cached
            return cached
    found = run_child(backend, PROBES[backend].target)
    if found.proven and (found.ok or found.fatal or found.kept_failure):
        _write(path, key, found)
    _seen[str(path)] = found  # one probe per process, whatever it found
    return found


def _read(path: Path, key: str) -> Verdict | None:
    try:
        data = json.loads(path.read_bytes())
        if data["key"] != key:
            return None
        return Verdict(data["backend"], bool(data["ok"]), str(data["detail"]), bool(data["fatal"]), cached=True)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        try:
            aside = set_aside(path)
            log.warning("damaged probe verdict set aside; probing again", path=str(path), moved_to=str(aside),
                        error=f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
        return None


def _write(path: Path, key: str, found: Verdict) -> None:
    data = {"key": key, "backend": found.backend, "ok": found.ok, "detail": found.detail, "fatal": found.fatal}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1).encode())
    except OSError as exc:  # a cache that cannot be written only costs the probe again next run
        log.info("probe verdict not cached", path=str(path), error=str(exc))


_warned: set[str] = set()


def reported(backend: str) -> None:
    """Someone (``doctor``) has shown this backend's verdict already: no fallback warning repeats it."""
    _warned.add(backend)


def warn_fallback(found: Verdict, fallback: str) -> None:
    """The one warning line of a fallback: ``<name> <detail>; <fallback>`` (once per process and backend)."""
    if found.backend in _warned:
        return
    _warned.add(found.backend)
    log.warning(f"{found.line()}; {fallback}")
