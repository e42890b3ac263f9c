"""Files the engine keeps for itself under ``$XDG_CACHE_HOME/colibri_aio`` (``~/.cache`` without XDG).

A cache file never blocks a run: it is written atomically (a reader never
sees half a file), and one that turns out damaged is moved aside to
``<name>.bad`` so that the next run starts afresh and the bytes stay for a
look. The usage history (:mod:`colibri_aio.engine.history`) and the
tokenizer cache (:mod:`colibri_aio.text.cache`) live here.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from colibri_aio import settings


def cache_dir(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/colibri_aio/<parts...>`` (``~/.cache/colibri_aio/...`` without XDG); not created."""
    return Path(settings.cache_home(), "colibri_aio", *parts)


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def set_aside(path: Path) -> Path:
    """Move a damaged cache file to ``<name>.bad`` (replacing an older one) and return where; OSError if it cannot."""
    aside = path.with_name(path.name + ".bad")
    os.replace(path, aside)
    return aside
