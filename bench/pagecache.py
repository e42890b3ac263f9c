"""The page cache, for benchmarks that start cold."""
from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache() -> bool:
    """Write back and drop the page cache so that the next run starts cold; False where not permitted (not
    root, a container's read-only /proc)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
