"""How much memory this process may use: RAM, the cgroup limit (v1 and v2), and RSS.

Every reader takes a ``root`` so tests can point it at a fake ``/proc`` and
``/sys/fs/cgroup`` tree.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as a huge page-aligned number rather than "max".
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """RAM the machine has, RAM available now, and the tightest cgroup limit (None: no limit)."""

    total: int
    available: int
    cgroup_limit: int | None
    cgroup_source: str  # which file set the limit, or why there is none

    @property
    def usable(self) -> int:
        """What a budget may assume: available RAM, capped by the cgroup limit."""
        return self.available if self.cgroup_limit is None else min(self.available, self.cgroup_limit)


def meminfo(root: Path = Path("/")) -> dict[str, int]:
    """/proc/meminfo as bytes."""
    out: dict[str, int] = {}
    for line in (root / "proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """This process's (v2 unified path, v1 memory-controller path) from /proc/self/cgroup."""
    v2 = v1 = None
    for line in (root / "proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _tightest(base: Path, cgroup: str, filename: str) -> tuple[int | None, str]:
    """The smallest limit on the way from ``cgroup`` up to the root of the hierarchy."""
    best: tuple[int | None, str] = (None, "no limit")
    parts = [p for p in cgroup.split("/") if p]
    for depth in range(len(parts), -1, -1):
        f = base.joinpath(*parts[:depth], filename)
        limit = _read_limit(f)
        if limit is not None and (best[0] is None or limit < best[0]):
            best = (limit, str(f))
    return best


def cgroup_memory_limit(root: Path = Path("/")) -> tuple[int | None, str]:
    """(limit in bytes or None, the file it came from or why none applies). v2 first, then v1."""
    try:
        v2, v1 = _cgroup_paths(root)
    except OSError:
        return None, "no /proc/self/cgroup"
    fs = root / "sys/fs/cgroup"
    found: list[tuple[int, str]] = []
    if v2 is not None and (fs / "cgroup.controllers").exists():
        limit, src = _tightest(fs, v2, "memory.max")
        if limit is not None:
            found.append((limit, src))
    if v1 is not None:
        limit, src = _tightest(fs / "memory", v1, "memory.limit_in_bytes")
        if limit is not None:
            found.append((limit, src))
    return min(found) if found else (None, "no cgroup memory limit")


def memory_limits(root: Path = Path("/")) -> MemoryLimits:
    info = meminfo(root)
    limit, source = cgroup_memory_limit(root)
    return MemoryLimits(info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0)), limit, source)


def rss_bytes() -> int:
    """Resident set size of this process now (0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    ru_maxrss (KiB on Linux) is updated by the kernel lazily, so it can trail
    the current RSS for a moment; the larger of the two is the true peak so far.
    """
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes())
