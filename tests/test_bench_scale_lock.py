"""bench_scale's exclusive hold: the lock, and the writer-preferring gate around it."""
from __future__ import annotations

import fcntl
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

from bench_scale import exclusive  # noqa: E402


def is_held(path: Path) -> bool:
    """True when another open file description holds an flock on ``path``."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_gate_and_lock_are_held_during_the_hold_and_released_after(tmp_path: Path) -> None:
    lock, gate = tmp_path / "cpu.lock", tmp_path / "gate.lock"
    with exclusive(lock, gate):
        assert is_held(lock)
        assert is_held(gate)
    assert not is_held(lock)
    assert not is_held(gate)


def test_without_a_gate_only_the_lock_is_held(tmp_path: Path) -> None:
    lock, gate = tmp_path / "cpu.lock", tmp_path / "gate.lock"
    gate.touch()
    with exclusive(lock):
        assert is_held(lock)
        assert not is_held(gate)


def test_released_when_the_body_raises(tmp_path: Path) -> None:
    lock, gate = tmp_path / "cpu.lock", tmp_path / "gate.lock"
    with pytest.raises(RuntimeError):
        with exclusive(lock, gate):
            raise RuntimeError("run failed")
    assert not is_held(lock)
    assert not is_held(gate)


def test_no_lock_holds_nothing(tmp_path: Path) -> None:
    gate = tmp_path / "gate.lock"
    with exclusive(None, gate):
        assert not gate.exists()
