"""The benchmarks' exclusive hold (bench.lock): held for the body only, released on errors too."""
from __future__ import annotations

import fcntl
import sys
from pathlib import Path

import pytest

from colibri_aio.bench.lock import exclusive

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def is_held(path: Path) -> bool:
    """True when another open file description holds an flock on ``path``."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_the_lock_is_held_during_the_body_and_released_after(tmp_path: Path) -> None:
    lock = tmp_path / "cpu.lock"
    with exclusive(lock):
        assert is_held(lock)
    assert not is_held(lock)


def test_released_when_the_body_raises(tmp_path: Path) -> None:
    lock = tmp_path / "cpu.lock"
    with pytest.raises(RuntimeError):
        with exclusive(lock):
            raise RuntimeError("run failed")
    assert not is_held(lock)


def test_bench_scale_takes_the_shared_hold() -> None:
    """bench_scale's --lock goes through the same hold as the other benchmarks (so a site's flock governs it)."""
    sys.path.insert(0, str(TOOLS))
    import bench_scale

    assert bench_scale.exclusive is exclusive
