"""An exclusive hold of a lock file around each timed run, on a machine benchmarks share."""
from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock: Path | None) -> Iterator[None]:
    """Hold ``lock`` exclusively (flock) for the ``with`` body; None: hold nothing.

    Benchmarks take it per run, not for their whole length, so that others'
    work runs between runs and every timed run sees a quiet machine.
    """
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
