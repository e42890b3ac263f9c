"""Files the user names for output (``--out``, ``--stats-json``): refused before any work, and a failed write
names the option and the file."""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO

from colibri_aio.errors import UserError


def check_writable(path: Path, option: str) -> None:
    """Refuse an output path before any work is done, rather than after it."""
    folder = path.parent
    if path.is_dir():
        raise UserError(f"{option} {path}: is a folder")
    if not folder.is_dir():
        raise UserError(f"{option} {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{option} {path}: cannot write there (permission denied)")


class _OutFile(io.TextIOWrapper):
    """A text file the user named for output. A write, flush or close that fails (a full disk, a quota) is a
    :class:`UserError` naming the option and the file: the OS error itself names neither."""

    def __init__(self, path: Path, option: str) -> None:
        self._what = f"{option} {path}"
        super().__init__(open(path, "wb"), encoding="utf-8")  # noqa: SIM115 - closed with this wrapper

    def _failed(self, exc: OSError) -> UserError:
        return UserError(f"{self._what}: cannot write ({exc.strerror or exc})")

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:
            raise self._failed(exc) from None


def open_out(path: Path, option: str) -> IO[str]:
    """``path`` opened for writing UTF-8 text, after :func:`check_writable`; every failure is a UserError."""
    check_writable(path, option)
    try:
        return _OutFile(path, option)
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot write ({exc.strerror})") from None
