"""Memory limits from fake /proc and cgroup trees (v1 and v2)."""
from __future__ import annotations

from pathlib import Path

from colibri_aio.engine.memory import cgroup_memory_limit, memory_limits, peak_rss_bytes, rss_bytes

MEMINFO = "MemTotal:       24683652 kB\nMemFree:  1000 kB\nMemAvailable:   22467552 kB\nHugePages_Total: 0\n"


def _tree(tmp: Path, cgroup: str, files: dict[str, str]) -> Path:
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/meminfo").write_text(MEMINFO)
    (tmp / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        p = tmp / "sys/fs/cgroup" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp


def test_v1_limit_is_the_tightest_ancestor(tmp_path: Path) -> None:
    root = _tree(tmp_path, "4:memory:/jobs/bench\n0::/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/jobs/memory.limit_in_bytes": "8589934592\n",
        "memory/jobs/bench/memory.limit_in_bytes": "17179869184\n",
    })
    limit, source = cgroup_memory_limit(root)
    assert limit == 8 << 30 and source.endswith("jobs/memory.limit_in_bytes")
    m = memory_limits(root)
    assert m.total == 24683652 * 1024 and m.usable == 8 << 30


def test_v1_unlimited_is_none(tmp_path: Path) -> None:
    root = _tree(tmp_path, "4:memory:/a\n", {"memory/a/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_memory_limit(root)[0] is None
    assert memory_limits(root).usable == 22467552 * 1024


def test_v2_memory_max(tmp_path: Path) -> None:
    root = _tree(tmp_path, "0::/user/job\n", {
        "cgroup.controllers": "cpu memory\n", "user/memory.max": "max\n", "user/job/memory.max": "1073741824\n"})
    assert cgroup_memory_limit(root)[0] == 1 << 30


def test_rss_is_plausible() -> None:
    assert 10 << 20 < rss_bytes() <= peak_rss_bytes()
