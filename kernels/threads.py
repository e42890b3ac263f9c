"""The kernels' worker threads: one pool shared by every backend.

A kernel call runs on the calling thread plus ``get_num_threads() - 1`` pool
workers (NumPy releases the GIL). ``COLIBRI_KERNEL_THREADS`` sets the count
(default 2, the cores of the machines this was tuned on): an engine sets it
from its settings when it opens; otherwise it is read when first asked for,
not at import.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from colibri_aio.settings import Settings

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_num_threads: int | None = None  # from the settings on first use


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (the caller plus ``n - 1`` pool workers) for every kernel call."""
    global _pool, _num_threads
    if n < 1:
        raise ValueError(f"kernel thread count must be >= 1, got {n}")
    with _lock:
        old, _pool, _num_threads = _pool, None, n
    if old is not None:
        old.shutdown(wait=True)


def get_num_threads() -> int:
    """The number of threads a kernel call uses."""
    global _num_threads
    if _num_threads is None:
        _num_threads = Settings.read().kernel_threads
    return _num_threads


def workers() -> ThreadPoolExecutor:
    """The pool of ``get_num_threads() - 1`` workers, made on first use."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, get_num_threads() - 1), thread_name_prefix="colibri-kernel")
        return _pool


def limit_blas_threads(n: int) -> None:
    """Run BLAS calls (NumPy's OpenBLAS, MKL, ...) on ``n`` threads from now on, in this process.

    Called when an engine starts rather than by setting OPENBLAS_NUM_THREADS at
    import: importing the package must not change the environment, and the
    limit works even if NumPy was loaded first. Without threadpoolctl, nothing
    changes.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=n, user_api="blas")
