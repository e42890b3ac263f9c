"""An exclusive hold of a lock file around each timed run, on a machine benchmarks share."""
from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock: Path | None) -> Iterator[None]:
    """Hold ``lock`` exclusively for the ``with`` body; None: hold nothing.

    Benchmarks take it per run, not for their whole length, so that others'
    work runs between runs and every timed run sees a quiet machine. The hold
    is taken by the ``flock`` command (a helper process that keeps it until
    told to let go), so that a site's own ``flock`` on ``PATH`` (one that, say,
    keeps shared takers from starving a waiting benchmark) governs it too.
    """
    if lock is None:
        yield
        return
    holder = subprocess.Popen(["flock", "-x", str(lock), "sh", "-c", "echo held; read _"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            raise RuntimeError(f"could not lock {lock} (flock exited {holder.wait()})")
        yield
    finally:
        holder.stdin.close()  # `read` ends: the helper exits and the lock is released
        holder.wait()
